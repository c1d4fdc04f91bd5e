"""One micro-batch of the bf16 head loss on the GPU at the seed shape: the chunk loop as it is against the
loop it replaced, in time, in GPU launches and in error against float64.

    python benchmarks/head_loss.py --out DIR [--tokens 131072] [--width 512] [--vocab 12289] [--chunk 8192]

As it is (`loss.fused_head_loss`): each chunk's d h product is written into its rows of d h, its d W product is
added into the float32 d W by the product itself (cuBLAS with float32 output and d W as the addend), and the
losses are summed once at the end. Before: both products in bf16, d h copied into its rows, d W cast to float32
and added, and two small sums a chunk: four more launches a chunk and d W's round trip. The two are timed
alternately, ten rounds of five calls each. Writes DIR/head_loss.json and DIR/head_loss.md; any CUDA machine.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import CAP, alternated_rounds, errors, head_problem, reference  # noqa: E402

from creditlab import ops  # noqa: E402
from creditlab.ops.loss import fused_head_loss  # noqa: E402
from creditlab.runtime import write_benchmark  # noqa: E402


def earlier_loop(h, weight, targets, vocab, chunk):
    """The loop before: each chunk's products in bf16, d h copied into its rows, d W cast and added, the
    chunk's loss summed and added."""
    n, w = h.shape[0], weight.to(h.dtype)
    grad_h = torch.empty_like(h)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, n, chunk):
        hc = h[start:start + chunk]
        rows, dlogits = ops.softcap_ce_rows(hc @ w.t(), targets[start:start + chunk], vocab, CAP, 1.0 / n)
        total += rows.sum()
        grad_h[start:start + chunk] = dlogits @ w
        grad_w += (dlogits.t() @ hc).to(torch.float32)
    return total / n, grad_h, grad_w


def launches(fn) -> int:
    """GPU kernels, memsets and copies of one call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> int:
    problem = head_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    out, N, d, V, Vp, chunk, h, w, targets = problem
    run = {"as it is": lambda: fused_head_loss(h, w, targets, V, CAP, chunk),
           "before": lambda: earlier_loop(h, w, targets, V, chunk)}
    rounds = alternated_rounds(run)
    differences = [a - b for a, b in zip(rounds["as it is"], rounds["before"])]
    times = {name: statistics.median(ms) for name, ms in rounds.items()}
    counts = {name: launches(fn) for name, fn in run.items()}

    # errors on a slice of the micro-batch (float64 over all of it would take minutes)
    n_err = min(N, 4 * chunk)
    he, te = h[:n_err], targets[:n_err]
    ref = reference(he, w, te, V, chunk)
    errs = {"as it is": errors(fused_head_loss(he, w, te, V, CAP, chunk), ref),
            "before": errors(earlier_loop(he, w, te, V, chunk), ref)}

    result = {"shape": {"tokens": N, "width": d, "vocab": V, "padded_vocab": Vp, "chunk": chunk},
              "ms_per_micro_batch": times, "rounds_ms": rounds, "as_it_is_minus_before_per_round_ms": differences,
              "launches_per_micro_batch": counts, "errors_vs_float64": errs, "error_tokens": n_err,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# The bf16 head loss of one micro-batch: {N} tokens x {d} -> {Vp} (vocabulary {V}), chunk {chunk} "
             f"({result['device']}, torch {torch.__version__})", "",
             "| loop | ms per micro-batch (median of 10 alternated rounds) | GPU launches | loss rel. error | d h | d W |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {times[name]:.3f} | {counts[name]} | {errs[name]['loss']:.1e} | {errs[name]['grad_h']:.1e} | "
              f"{errs[name]['grad_w']:.1e} |" for name in run]
    lines += ["", f"As it is minus before, per round: median {statistics.median(differences):+.3f} ms (range "
              f"{min(differences):+.3f} .. {max(differences):+.3f}). Errors: largest entry's difference over the "
              f"largest entry, against float64 on the first {n_err} tokens."]
    write_benchmark(out, "head_loss", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
