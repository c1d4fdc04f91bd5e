"""The embedding tables' backward at the seed shape on the GPU: the compiler's form of autograd's lookups (an
atomic add per element) against the sorted, run-summed kernel (creditlab/embedding.py), alternated in one process.

    python benchmarks/embedding_grad.py --out DIR [--rounds 10]

One micro-batch, 64 x 2,048 token ids, read by the token table and the three value-embedding tables (vocabulary
12,289, width 512, float32 weights, outputs and their gradients in bf16). The ids are drawn two ways: as the
arms benchmark draws them (creditlab.data.SyntheticLoader: runs of a random cyclic order of the vocabulary, so
each id comes about eleven times) and as text repeats them (Zipf's law, exponent 1: the most frequent id about
a tenth of the positions). Each variant's table gradients are checked against float64 index_add first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab.data import SyntheticLoader  # noqa: E402
from creditlab.embedding import lookups  # noqa: E402
from creditlab.kernels import embedding_grad  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402

# (rows, columns, warps) of the kernel's block
CONFIGS = [(64, 128, 4), (64, 128, 2), (64, 128, 8), (32, 128, 4), (64, 256, 4), (64, 256, 8), (32, 256, 4),
           (64, 512, 8), (128, 128, 4), (64, 64, 4)]


def ids_of(kind: str, vocab: int, batch: int, seq: int) -> torch.Tensor:
    if kind == "synthetic":
        return SyntheticLoader(vocab, batch, seq, seed=0).next()[:, :seq].cuda()
    g = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, batch * seq, True, generator=g).view(batch, seq).cuda()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=12_289)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--tables", type=int, default=4)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    torch.manual_seed(0)
    weights = [torch.randn(args.vocab, args.width, device="cuda", requires_grad=True) for _ in range(args.tables)]
    upstream = [torch.randn(args.batch, args.seq, args.width, device="cuda").bfloat16() for _ in weights]
    plain = torch.compile(lambda ids, *ws: lookups(ids, list(ws), torch.bfloat16, fused=False))
    fused = torch.compile(lambda ids, *ws: lookups(ids, list(ws), torch.bfloat16, fused=True))

    def step(fn, ids):
        for w in weights:
            w.grad = None
        torch.autograd.backward(fn(ids, *weights), upstream)

    def forward(fn, ids):
        with torch.no_grad():
            fn(ids, *weights)

    def kernel_only(ids, rows, cols, warps):
        sorted_ids, order = torch.sort(ids.reshape(-1).to(torch.int32))
        return [embedding_grad.embedding_grad(sorted_ids, order, u.reshape(-1, args.width), args.vocab, rows, cols, warps)
                for u in upstream]

    results, lines = {}, [f"# Embedding backward, {args.tables} tables x {args.vocab} x {args.width}, "
                          f"{args.batch} x {args.seq} ids, {torch.cuda.get_device_name()}", ""]
    for kind in ("synthetic", "zipf"):
        ids = ids_of(kind, args.vocab, args.batch, args.seq)
        flat = ids.reshape(-1)
        want = [torch.zeros(args.vocab, args.width, dtype=torch.float64, device="cuda")
                .index_add_(0, flat, u.reshape(-1, args.width).double()) for u in upstream]
        variants = {"compiled autograd (forward + backward)": lambda: step(plain, ids),
                    "fused lookups (forward + backward)": lambda: step(fused, ids),
                    "forward alone": lambda: forward(plain, ids)}
        for rows, cols, warps in CONFIGS:
            variants[f"kernel {rows} x {cols}, {warps} warps (sort + tables)"] = (
                lambda r=rows, c=cols, w=warps: kernel_only(ids, r, c, w))
        errors = {}
        for name, fn in variants.items():
            got = fn()
            if name.startswith("kernel"):
                errors[name] = max(largest_relative_error(g, w) for g, w in zip(got, want))
            elif "backward" in name:
                errors[name] = max(largest_relative_error(w.grad, ref) for w, ref in zip(weights, want))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name].append(cuda_ms(fn, 10, warmup=1))
        base = "compiled autograd (forward + backward)"
        per_round = {name: statistics.median(t / b for t, b in zip(ts, times[base])) for name, ts in times.items()}
        forward_ms = statistics.median(times["forward alone"])
        results[kind] = {"distinct_ids": int(torch.unique(flat).numel()),
                         "largest_id_share": torch.bincount(flat).max().item() / flat.numel(),
                         "variants": {name: {"ms": statistics.median(ts), "per_round_over_compiled": per_round[name],
                                             "error": errors.get(name)} for name, ts in times.items()}}
        r = results[kind]
        lines += [f"## ids {kind}: {r['distinct_ids']} distinct, the most frequent {r['largest_id_share']:.4f} of them",
                  "", "| variant | ms (median of rounds) | backward ms (less the forward) | over compiled autograd, "
                  "per round | largest error / largest entry |", "|---|---|---|---|---|"]
        for name, v in r["variants"].items():
            backward = v["ms"] - forward_ms if "forward + backward" in name else (v["ms"] if name.startswith("kernel")
                                                                                 else None)
            backward_text = "" if backward is None else f"{backward:.4f}"
            error_text = "" if v["error"] is None else f"{v['error']:.1e}"
            lines.append(f"| {name} | {v['ms']:.4f} | {backward_text} | {v['per_round_over_compiled']:.4f} | "
                         f"{error_text} |")
        lines.append("")
    write_benchmark(out, "embedding_grad", {"args": vars(args), "results": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
