"""The fused MLP's kernels on the GPU at the seed shape: tile configurations against cuBLAS plus the compiler's
pointwise pass, bf16 error against float64, and the whole MLP (forward and backward) fused against plain.

    python benchmarks/relu2_mlp.py --out DIR [--tokens 131072] [--width 512] [--hidden 2048]

Writes DIR/relu2_mlp.json and DIR/relu2_mlp.md. Any CUDA machine with Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import alternated_rounds  # noqa: E402

from creditlab.ops import relu2  # noqa: E402
from creditlab.ops import relu2_matmul as rm  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402

# The 128 x 256 x 64 tile with the epilogue in two halves is the only one whose derivative epilogue fits the
# shared memory at three stages (results/relu2_mlp_configs_seed.md has the others; the post tile read before the
# K loop, two programs to a multiprocessor, the loops pipelined apart: results/relu2_mlp_flatten_seed.md).
CONFIGS = [rm.TileConfig(),
           rm.TileConfig(group_m=16),
           rm.TileConfig(block_n=128, stages=4, warps=4, subtiles=1)]


def mlp_problem(description: str):
    """(output folder, (tokens, width, hidden), x, W_fc, W_proj, dy) of one seed micro-batch's MLP in bf16 on the
    GPU, from the command line; None where no CUDA GPU is visible (said in one line)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=131_072)  # one seed micro-batch: 64 x 2,048
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return None
    M, d, m = args.tokens, args.width, args.hidden
    torch.manual_seed(0)
    x = torch.randn(M, d, device="cuda").bfloat16()
    w_fc = (torch.rand(m, d, device="cuda") * 2 - 1).mul(3 ** 0.5 * d ** -0.5).bfloat16()
    w_proj = (torch.randn(d, m, device="cuda") * m ** -0.5).bfloat16()
    dy = (torch.randn(M, d, device="cuda") * 1e-3).bfloat16()
    return out, (M, d, m), x, w_fc, w_proj, dy


def main() -> int:
    problem = mlp_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    out, (M, d, m), x, w_fc, w_proj, dy = problem
    flop = 2 * M * d * m

    @torch.compile
    def plain_forward(x, w):  # what the plain MLP's compiled graph runs: the product, then one pointwise pass
        r = torch.relu(F.linear(x, w))
        return r * r

    @torch.compile
    def plain_dgrad(dy, w, h):  # the product, then the derivative's pointwise pass (reading h)
        return (dy @ w) * (2 * torch.relu(h))

    h = F.linear(x, w_fc)
    post = plain_forward(x, w_fc)
    # bf16 error of each path against float64 arithmetic on the same bf16 inputs (a slice of rows).
    s = slice(0, 8192)
    h64 = x[s].double() @ w_fc.double().t()
    post64 = torch.relu(h64) ** 2
    dh64 = (dy[s].double() @ w_proj.double()) * 2 * torch.relu(h64)
    rows = []

    def record(op, impl, ms, cfg=None, error=None):
        rows.append({"op": op, "impl": impl, "config": None if cfg is None else cfg.__dict__, "ms": ms,
                     "TFLOP_per_s": flop / ms / 1e9, "bf16_rel_err": error})

    record("expand", "cuBLAS product only", cuda_ms(lambda: F.linear(x, w_fc)))
    record("expand", "cuBLAS + compiled ReLU^2 pass", cuda_ms(lambda: plain_forward(x, w_fc)))
    record("dgrad", "cuBLAS product only", cuda_ms(lambda: dy @ w_proj))
    record("dgrad", "cuBLAS + compiled derivative pass", cuda_ms(lambda: plain_dgrad(dy, w_proj, h)))
    for cfg in CONFIGS:
        try:
            record("expand", "kernel, no epilogue", cuda_ms(lambda: rm.matmul(x, w_fc, False, cfg)), cfg)
            record("expand", "kernel + ReLU^2 epilogue", cuda_ms(lambda: rm.relu2_linear(x, w_fc, cfg)), cfg,
                   largest_relative_error(rm.relu2_linear(x, w_fc, cfg)[s], post64))
            record("dgrad", "kernel, no epilogue", cuda_ms(lambda: rm.matmul(dy, w_proj, True, cfg)), cfg)
            record("dgrad", "kernel + derivative epilogue",
                   cuda_ms(lambda: rm.relu2_dgrad(dy, w_proj, post, cfg)), cfg,
                   largest_relative_error(rm.relu2_dgrad(dy, w_proj, post, cfg)[s], dh64))
        except Exception as exc:  # a configuration that does not fit the chip's shared memory, say
            rows.append({"op": "both", "impl": "failed", "config": cfg.__dict__, "error": str(exc)[:300]})

    # The fastest configuration of each epilogue against the default, in alternated rounds (one process, the
    # order reversed every other round), since one sweep's timings drift with the card's clock.
    side_by_side = {}
    for op, impl, default, call in (
            ("expand", "kernel + ReLU^2 epilogue", rm.EXPAND_TILES, lambda c: rm.relu2_linear(x, w_fc, c)),
            ("dgrad", "kernel + derivative epilogue", rm.DGRAD_TILES, lambda c: rm.relu2_dgrad(dy, w_proj, post, c))):
        timed = [r for r in rows if r["op"] == op and r["impl"] == impl]
        best = rm.TileConfig(**min(timed, key=lambda r: r["ms"])["config"])
        if best == default:
            continue
        rounds = alternated_rounds({"default": lambda c=default: call(c), "best": lambda c=best: call(c)})
        per_round = [b / d for b, d in zip(rounds["best"], rounds["default"])]
        side_by_side[op] = {"default": default.__dict__, "best": best.__dict__, "rounds_ms": rounds,
                            "median_ms": {k: statistics.median(v) for k, v in rounds.items()},
                            "best_over_default_per_round": statistics.median(per_round),
                            "range": [min(per_round), max(per_round)]}

    errors = {
        "expand_plain": largest_relative_error(plain_forward(x[s], w_fc), post64),
        "expand_kernel": largest_relative_error(rm.relu2_linear(x[s], w_fc), post64),
        "dgrad_plain": largest_relative_error(plain_dgrad(dy[s], w_proj, h[s]), dh64),
        "dgrad_kernel": largest_relative_error(rm.relu2_dgrad(dy[s], w_proj, post[s]), dh64),
    }

    # The whole MLP, forward and backward, under bf16 autocast, with the expansion's input gradient (native).
    def mlp_plain(x, w1, w2):
        r = torch.relu(F.linear(x, w1))
        return F.linear(r * r, w2)

    def mlp_fused(x, w1, w2):
        return relu2.project_relu2(relu2.expand_relu2(x, w1), w2)

    xs = x.view(64, -1, d).float().requires_grad_(True)
    w1 = w_fc.float().requires_grad_(True)
    w2 = w_proj.float().requires_grad_(True)
    g = dy.view(64, -1, d)
    whole = {}
    for name, fn in (("plain", torch.compile(mlp_plain)), ("fused", torch.compile(mlp_fused))):
        def step(fn=fn):
            with torch.autocast("cuda", torch.bfloat16):
                y = fn(xs, w1, w2)
            y.backward(g)
        whole[name] = cuda_ms(step)
    result = {"shape": {"tokens": M, "width": d, "hidden": m}, "rows": rows, "bf16_rel_err": errors,
              "side_by_side": side_by_side,
              "mlp_fwd_bwd_ms": whole, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# Fused MLP kernels, {M} tokens x {d} -> {m} (bf16, {result['device']}, torch {torch.__version__})",
             "", f"| op | implementation | config ({', '.join(f.name for f in dataclasses.fields(rm.TileConfig))}) "
                 "| ms | TFLOP/s | bf16 error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        c = r["config"]
        cfg = "" if c is None else ", ".join(str(v) for v in c.values())
        if r["impl"] == "failed":
            lines.append(f"| {r['op']} | failed | {cfg} | {r['error']} | | |")
        else:
            err = "" if r["bf16_rel_err"] is None else f"{r['bf16_rel_err']:.2e}"
            lines.append(f"| {r['op']} | {r['impl']} | {cfg} | {r['ms']:.4f} | {r['TFLOP_per_s']:.0f} | {err} |")
    for op, r in side_by_side.items():
        lines += ["", f"{op}, fastest configuration ({', '.join(str(v) for v in r['best'].values())}) against the "
                      f"default ({', '.join(str(v) for v in r['default'].values())}), ten alternated rounds: "
                      f"{r['median_ms']['best']:.4f} against {r['median_ms']['default']:.4f} ms, per round "
                      f"{r['best_over_default_per_round']:.4f} ({r['range'][0]:.4f} .. {r['range'][1]:.4f})"]
    lines += ["", "bf16 max error relative to the float64 result's largest entry:", ""]
    lines += [f"- {k}: {v:.2e}" for k, v in errors.items()]
    lines += ["", f"Whole MLP forward + backward (compiled, autocast): plain {whole['plain']:.3f} ms, "
              f"fused {whole['fused']:.3f} ms ({whole['fused'] / whole['plain']:.3f} x)"]
    write_benchmark(out, "relu2_mlp", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
