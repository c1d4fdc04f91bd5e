"""The teacher's rank-space regression on the GPU at the seed shape: one branch's fit (`rank_space_fit`) with its
token-wise arithmetic in one Triton pass against the compiled op-by-op arithmetic, in time and in bf16 error
against float64.

    python benchmarks/fit_rows.py --out DIR [--tokens 131072] [--width 512] [--rank 32] [--tiles]

Writes DIR/fit_rows.json and DIR/fit_rows.md; `--tiles` also times the kernel alone at several launch shapes
into DIR/fit_rows_tiles.txt. Any CUDA machine with Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab.credit.teacher import RankSpaceFit, rank_space_fit  # noqa: E402
from creditlab.ops import fit_rows  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402


def branch_problem(description: str, extra=None):
    """One branch and micro-batch at the seed shape, from the command line: (args, out folder, tokens, width,
    code width), or None where no CUDA GPU is visible (the caller exits 2). `extra` adds arguments."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=64 * 2048)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    if extra:
        extra(ap)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    return None if out is None else (args, out, args.tokens, args.width, 2 * args.rank)


def main() -> int:
    problem = branch_problem(__doc__.splitlines()[0], lambda ap: ap.add_argument(
        "--tiles", action="store_true", help="time the kernel alone at several launch shapes"))
    if problem is None:
        return 2
    args, out, N, d, r2 = problem
    torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer runs (runtime.py)
    torch.manual_seed(0)
    true = (torch.randn(N, d, device="cuda") * 1e-3).bfloat16()  # a correction's size in the seed runs
    gate = torch.rand(N, r2, device="cuda").bfloat16()
    code = (torch.randn(N, r2, device="cuda") * 1e-2).bfloat16()
    decoder = torch.randn(d, r2, device="cuda") * 0.05
    paths = {"op by op (compiled)": False, "fused": True}
    times, errors = {}, {}
    ref = rank_space_fit(true.double(), gate.double(), code.double(), decoder.double(), 0.5, torch.float64,
                         torch.float64, fused=False)
    for name, fused in paths.items():
        fn = torch.compile(lambda t, g, c, dec, fused=fused: tuple(rank_space_fit(
            t, g, c, dec, 0.5, torch.float32, torch.bfloat16, fused=fused)))
        times[name] = cuda_ms(lambda: fn(true, gate, code, decoder))
        got = fn(true, gate, code, decoder)
        errors[name] = {field: largest_relative_error(a, b) for field, a, b in zip(RankSpaceFit._fields, got, ref)}
    # the kernel's bytes: c read once, gate and code read, gated, code_grad (float32) and gate_grad written
    moved = N * d * 2 + N * r2 * (2 + 2 + 2 + 4 + 2)
    m = decoder.t() @ decoder
    kernel_ms = cuda_ms(lambda: fit_rows.fit_rows(true, gate, code, decoder, m))
    result = {"shape": {"tokens": N, "width": d, "code_width": r2}, "times_ms": times, "kernel_ms": kernel_ms,
              "kernel_tb_per_s": moved / kernel_ms / 1e9, "tiles": dataclasses.asdict(fit_rows.DEFAULT_TILES),
              "bf16_rel_err": errors, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# One branch's rank-space fit, {N} tokens x {d}, code width {r2} (bf16 correction, "
             f"{result['device']}, torch {torch.__version__})", "", "| path | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in times.items()]
    lines += ["", f"The kernel alone: {kernel_ms:.3f} ms, {result['kernel_tb_per_s']:.2f} TB/s of its least bytes "
              f"({moved / 1e6:.0f} MB).", "", "bf16 max error relative to the float64 result's largest entry:", ""]
    lines += [f"- {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()) for name, e in errors.items()]
    write_benchmark(out, "fit_rows", result, lines)
    if args.tiles:
        tiles(true, gate, code, decoder, m, out / "fit_rows_tiles.txt")
    return 0


def tiles(true, gate, code, decoder, m, path: Path) -> None:
    """The kernel alone at each launch shape around the default."""
    base = fit_rows.DEFAULT_TILES
    shapes = [dataclasses.replace(base, rows=rows, warps=warps, block_k=block_k)
              for rows in (32, 64, 128) for warps in (4, 8) for block_k in (64, 128)]
    shapes += [dataclasses.replace(base, tiles=t) for t in (2, 4, 16)]
    shapes += [dataclasses.replace(base, stages=s) for s in (1, 2, 4)]
    lines = []
    for shape in shapes:
        try:
            ms = cuda_ms(lambda: fit_rows.fit_rows(true, gate, code, decoder, m, shape))
            lines.append(f"{dataclasses.asdict(shape)}: {ms:.3f} ms")
        except Exception as error:  # a shape past the chip's shared memory or registers
            lines.append(f"{dataclasses.asdict(shape)}: failed ({type(error).__name__}: {str(error)[:120]})")
        print(lines[-1], flush=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
