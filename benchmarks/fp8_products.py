"""Where the `fp8` source's time goes: one omitted product's input gradient dY W at the seed shape, in bf16 against
its FP8 form piece by piece (dY's amax and cast to e5m2, W's to e4m3 and its transpose, the FP8 product) and whole
(`fp8_input_gradient`, compiled as the training step compiles it). Times by CUDA events, the pieces alternated
round by round; each piece's median over rounds.

    python3 benchmarks/fp8_products.py --out DIR        (any CUDA machine with FP8 tensor cores)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab.config import ModelConfig  # noqa: E402
from creditlab.credit.fp8 import GRADIENT_FP8, WEIGHT_FP8, fp8_input_gradient  # noqa: E402
from creditlab.ops.fp8 import quantize_eager, scaled_mm  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, write_benchmark  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--tokens", type=int, default=64 * 2048, help="tokens of one micro-batch (the seed preset: 64 x 2,048)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    folder = gpu_benchmark_folder(args.out)
    if folder is None:
        return 2
    m = ModelConfig()
    quantize = torch.compile(quantize_eager, dynamic=False)
    whole = torch.compile(fp8_input_gradient, dynamic=False)
    result, lines = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens}, []
    lines += [f"# One input-gradient product dY W at {args.tokens:,} tokens, bf16 against FP8 ({result['device']})", "",
              "| product | bf16 dY W ms | amax+cast dY ms | cast+transpose W ms | FP8 product ms | FP8 whole ms | "
              "whole / bf16 |", "|---|---|---|---|---|---|---|"]
    for name, rows in (("Q/K/V (m = 3d)", 3 * m.width), ("MLP expansion (m = h)", m.mlp_hidden)):
        dy = torch.randn(args.tokens, rows, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(rows, m.width, device="cuda") * m.width ** -0.5
        wb = w.bfloat16()
        g8, gs = quantize(dy, GRADIENT_FP8)
        w8, ws = quantize(w, WEIGHT_FP8)
        w8cm = w8.t().contiguous().t()
        pieces = {"bf16": lambda: dy @ wb, "cast_dy": lambda: quantize(dy, GRADIENT_FP8),
                  "cast_w": lambda: quantize(w, WEIGHT_FP8)[0].t().contiguous(),
                  "fp8_mm": lambda: scaled_mm(g8, w8cm, gs, ws, torch.bfloat16, True),
                  "whole": lambda: whole(dy, w, 1.0, True)}
        times = {k: [] for k in pieces}
        for _ in range(args.rounds):
            for k, fn in pieces.items():
                times[k].append(cuda_ms(fn, repeats=20))
        med = {k: statistics.median(v) for k, v in times.items()}
        result[name] = {"median_ms": med, "rounds_ms": times}
        lines.append(f"| {name} | {med['bf16']:.3f} | {med['cast_dy']:.3f} | {med['cast_w']:.3f} | {med['fp8_mm']:.3f} "
                     f"| {med['whole']:.3f} | {med['whole'] / med['bf16']:.3f} |")
    write_benchmark(folder, "fp8_products", result, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
