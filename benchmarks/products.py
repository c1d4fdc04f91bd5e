"""The seed step's plain products on the GPU: cuBLAS (as the compiled step calls it) against the fused MLP's
persistent Triton kernel with no epilogue, shape by shape, in alternated rounds.

    python benchmarks/products.py --out DIR [--tokens 131072] [--chunk 8192]

The shapes are those of one micro-batch's forward and input-gradient products outside the fused MLP (the
weight-gradient products, whose summed index is the tokens, stay cuBLAS's: the kernel takes A row-major).
B is the weight as stored: (N, K) for a forward product x W^T, (K, N) for an input gradient dy W. For each
shape, each path's milliseconds over ten rounds of five calls, the order reversed every other round; the
kernel's bf16 error against float64 on a slice of rows. Writes DIR/products.json and DIR/products.md; any CUDA
machine with Triton.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import alternated_rounds  # noqa: E402

from creditlab import config  # noqa: E402
from creditlab.ops import relu2_matmul as rm  # noqa: E402
from creditlab.runtime import gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402

KERNEL_TILES = {"128x256": rm.TileConfig(group_m=16),
                "128x128": rm.TileConfig(block_n=128, group_m=16, stages=4, warps=4, subtiles=1)}


def seed_shapes(tokens: int, chunk: int) -> list[tuple[str, int, int, int, bool]]:
    """(name, M, K, N, b_is_kn) of the seed model's plain products of one micro-batch."""
    m = config.load("seed").model
    d, hidden = m.width, m.mlp_hidden
    vocab = m.padded_vocab
    return [("qkv forward", tokens, d, 3 * d, False), ("qkv input gradient", tokens, 3 * d, d, True),
            ("attention out forward", tokens, d, d, False), ("attention out input gradient", tokens, d, d, True),
            ("MLP out forward", tokens, hidden, d, False), ("MLP in input gradient", tokens, hidden, d, True),
            ("head logits (a chunk)", chunk, d, vocab, False), ("head d h (a chunk)", chunk, vocab, d, True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=131_072)  # one seed micro-batch: 64 x 2,048
    ap.add_argument("--chunk", type=int, default=8192)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    torch.manual_seed(0)
    rows = []
    for name, M, K, N, b_is_kn in seed_shapes(args.tokens, args.chunk):
        a = torch.randn(M, K, device="cuda").bfloat16()
        b = (torch.randn(K, N, device="cuda") if b_is_kn else torch.randn(N, K, device="cuda")).mul(K ** -0.5)
        b = b.bfloat16()
        cublas = (lambda: a @ b) if b_is_kn else (lambda: a @ b.t())
        paths = {"cuBLAS": cublas}
        paths.update({f"kernel {t}": (lambda c=c: rm.matmul(a, b, b_is_kn, c)) for t, c in KERNEL_TILES.items()})
        rounds = alternated_rounds(paths)
        medians = {p: statistics.median(ms) for p, ms in rounds.items()}
        flop = 2.0 * M * K * N
        s = slice(0, 4096)
        want = a[s].double() @ (b.double() if b_is_kn else b.double().t())
        errors = {p: largest_relative_error(fn()[s], want) for p, fn in paths.items()}
        per_round = {p: statistics.median(x / c for x, c in zip(rounds[p], rounds["cuBLAS"])) for p in paths}
        rows.append({"product": name, "M": M, "K": K, "N": N, "b_is_kn": b_is_kn, "rounds_ms": rounds,
                     "median_ms": medians, "TFLOP_per_s": {p: flop / ms / 1e9 for p, ms in medians.items()},
                     "over_cublas_per_round": per_round, "bf16_rel_err": errors})
    result = {"rows": rows, "tiles": {t: c.__dict__ for t, c in KERNEL_TILES.items()},
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    paths = ["cuBLAS", *(f"kernel {t}" for t in KERNEL_TILES)]
    lines = [f"# The seed step's plain products ({result['device']}, torch {torch.__version__}, bf16)", "",
             "Ten alternated rounds of five calls; ms and TFLOP/s are medians, 'per round' the kernel's time over "
             "cuBLAS's in the same round (median).", "",
             "| product | M x K x N | " + " | ".join(f"{p} ms (TFLOP/s)" for p in paths) + " | " +
             " | ".join(f"{p} per round" for p in paths[1:]) + " | bf16 error (cuBLAS, kernels) |",
             "|---|---|" + "---|" * (2 * len(paths))]
    for r in rows:
        times = " | ".join(f"{r['median_ms'][p]:.4f} ({r['TFLOP_per_s'][p]:.0f})" for p in paths)
        ratios = " | ".join(f"{r['over_cublas_per_round'][p]:.4f}" for p in paths[1:])
        errs = ", ".join(f"{r['bf16_rel_err'][p]:.1e}" for p in paths)
        lines.append(f"| {r['product']} | {r['M']} x {r['K']} x {r['N']} | {times} | {ratios} | {errs} |")
    write_benchmark(out, "products", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
