"""QK-norm and rotary on the GPU at the seed shape: the fused kernels against the compiled plain arithmetic,
forward and backward, in time and in bf16 error against float64.

    python benchmarks/qk_norm.py --out DIR [--batch 64] [--seq 2048] [--heads 4] [--head-dim 128] [--tiles]

Writes DIR/qk_norm.json and DIR/qk_norm.md; `--tiles` also times each kernel alone at every (tokens per
program, warps) pair into DIR/qk_norm_tiles.txt. Any CUDA machine with Triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab.ops import qk_norm_rotary as kernels  # noqa: E402
from creditlab.model import Rotary, norm  # noqa: E402
from creditlab.ops.qk_norm import qk_norm_rotary  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402



def attention_problem(description: str, extra=None):
    """The seed shape's attention inputs from the command line: (args, out folder, batch, sequence, heads, head
    dimension, the rotation on the GPU), or None where no CUDA GPU is visible (the caller exits 2). `extra` adds
    arguments."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    if extra:
        extra(ap)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return None
    return args, out, args.batch, args.seq, args.heads, args.head_dim, Rotary(args.head_dim, args.seq, 10_000.0).cuda()


def main() -> int:
    problem = attention_problem(__doc__.splitlines()[0], lambda ap: ap.add_argument(
        "--tiles", action="store_true", help="time the kernels alone at every launch shape"))
    if problem is None:
        return 2
    args, out, B, T, H, hd, rot = problem
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * hd, device="cuda").bfloat16().requires_grad_(True)
    grads = [torch.randn(B, T, H, hd, device="cuda").bfloat16() for _ in range(3)]

    def plain(qkv):  # the model's op-by-op path (Attention.plain_qk_norm_rotary)
        q, k, v = qkv.view(B, T, 3, H, hd).unbind(2)
        return rot(norm(q)), rot(norm(k)), v

    def fused(qkv):
        return qk_norm_rotary(qkv, rot.cos, rot.sin, H)

    results, outputs = {}, {}
    for name, fn in (("plain (compiled)", torch.compile(plain)), ("fused", torch.compile(fused))):
        def fwd(fn=fn):
            with torch.no_grad():
                return fn(qkv)

        def fwd_bwd(fn=fn):
            q, k, v = fn(qkv)
            torch.autograd.backward((q, k, v), grads)

        results[name] = {"forward_ms": cuda_ms(fwd), "forward_backward_ms": cuda_ms(fwd_bwd)}
        qkv.grad = None
        q, k, v = fn(qkv)
        outputs[name] = (q.detach(), k.detach(), torch.autograd.grad((q, k, v), qkv, grads)[0])
    # float64 reference on a slice of the batch
    x = qkv.detach()[:4].double().requires_grad_(True)
    rot64 = Rotary(hd, T, 10_000.0).cuda().double()
    q64, k64, v64 = x.view(4, T, 3, H, hd).unbind(2)
    ref = (rot64(norm(q64)), rot64(norm(k64)), v64)
    ref_grad = torch.autograd.grad(ref, x, [g[:4].double() for g in grads])[0]

    def err(got, want):
        return largest_relative_error(got[:4], want)

    errors = {name: {"q": err(o[0], ref[0]), "k": err(o[1], ref[1]), "dqkv": err(o[2], ref_grad)}
              for name, o in outputs.items()}
    moved = qkv.numel() * 2 * 2  # the forward's bytes at the least: read q, k, v and write them
    result = {"shape": {"batch": B, "seq": T, "heads": H, "head_dim": hd}, "times": results,
              "bf16_rel_err": errors, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# QK-norm + rotary, {B} x {T} tokens, {H} x {hd} heads (bf16, {result['device']}, "
             f"torch {torch.__version__})", "", "| path | forward ms | forward + backward ms | forward TB/s |",
             "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['forward_ms']:.3f} | {r['forward_backward_ms']:.3f} | "
                     f"{moved / r['forward_ms'] / 1e9:.2f} |")
    lines += ["", "bf16 max error relative to the float64 result's largest entry:", ""]
    lines += [f"- {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()) for name, e in errors.items()]
    write_benchmark(out, "qk_norm", result, lines)
    if args.tiles:
        tiles(qkv.detach(), grads, rot, H, out / "qk_norm_tiles.txt")
    return 0


def tiles(qkv, grads, rot, heads, path: Path) -> None:
    """Each kernel alone at each (tokens per program, warps), the same for forward and backward."""
    q, k, v, scales = kernels.qk_norm_rotary_forward(qkv, rot.cos, rot.sin, heads)
    kept = kernels.ROWS, kernels.WARPS, kernels.BACKWARD_ROWS, kernels.BACKWARD_WARPS
    lines = []
    try:
        for rows in (8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                kernels.ROWS = kernels.BACKWARD_ROWS = rows
                kernels.WARPS = kernels.BACKWARD_WARPS = warps
                forward = cuda_ms(lambda: kernels.qk_norm_rotary_forward(qkv, rot.cos, rot.sin, heads))
                backward = cuda_ms(lambda: kernels.qk_norm_rotary_backward(*grads, q, k, scales, rot.cos, rot.sin))
                lines.append(f"rows {rows} warps {warps}: forward {forward:.3f} ms backward {backward:.3f} ms")
                print(lines[-1], flush=True)
    finally:
        kernels.ROWS, kernels.WARPS, kernels.BACKWARD_ROWS, kernels.BACKWARD_WARPS = kept
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
