"""The attention gate's thin product (gate_dim -> heads per token) at the seed shape: cuBLAS's three products
(forward, input gradient, weight gradient) against the one-pass Triton kernels the model runs
(kernels/thin_linear.py); alternated rounds in one process, each path's bf16 error against float64 first.

    python benchmarks/attention_gate.py --out DIR [--tokens 131072] [--width 512] [--gate-dim 12] [--heads 4]

Each path is captured in a CUDA graph of 20 calls, so the host's launch cost is not timed (the step launches
these from compiled code, ahead of the GPU). Writes DIR/attention_gate.json and DIR/attention_gate.md. Any CUDA
machine with Triton.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import checked_paths, error_text, failure_rows, ratio_text, round_summary  # noqa: E402

from creditlab.ops import thin_linear  # noqa: E402
from creditlab.runtime import gpu_benchmark_folder, write_benchmark  # noqa: E402

CALLS = 20  # calls per graph replay


def graphed(fn, calls: int = CALLS):
    """fn() `calls` times as one CUDA graph replay (fn warmed up first, on a side stream as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=64 * 2048)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--gate-dim", type=int, default=12)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    N, d, K, H = args.tokens, args.width, args.gate_dim, args.heads
    torch.manual_seed(0)
    n = torch.randn(N, d, device="cuda").bfloat16()
    x = n[:, :K]  # the gate reads the branch input's leading channels in place
    w = (torch.randn(H, K, device="cuda") * K ** -0.5).bfloat16()
    dy = (torch.randn(N, H, device="cuda") * 1e-2).bfloat16()
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    forward, backward = x64 @ w64.t(), (dy64 @ w64, dy64.t() @ x64)

    paths = {"forward": [("cuBLAS: F.linear", lambda: torch.nn.functional.linear(x, w), forward)],
             "backward": [("cuBLAS: dy w and dy^T x", lambda: (dy @ w, dy.t() @ x), backward)]}
    for rows, warps in ((thin_linear.ROWS, thin_linear.WARPS), (128, 4), (256, 4), (1024, 8)):
        default = " (the default)" if (rows, warps) == (thin_linear.ROWS, thin_linear.WARPS) else ""
        paths["forward"].append((f"kernel: {rows} rows a program, {warps} warps{default}",
                                 lambda r=rows, nw=warps: thin_linear.thin_forward(x, w, r, nw), forward))
        paths["backward"].append((f"kernel: {rows} rows a program, {warps} warps, then the partial sums{default}",
                                  lambda r=rows, nw=warps: thin_linear.thin_backward(dy, x, w, r, nw), backward))
    times, errors, failures, group_of, base = checked_paths(paths, graphed)  # each output against float64 first
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": N, "gate_dim": K,
              "heads": H, "calls_per_replay": CALLS, "paths": {}, "failures": failures}
    lines = [f"# The attention gate's product, {N:,} tokens x {K} -> {H} (the leading channels of a {d}-wide input), "
             f"bf16 ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"Ten alternated rounds of five graph replays of {CALLS} calls, all paths in one process; µs per call. "
             "Ratio: over cuBLAS's products of the same direction, round by round. Error: each output's largest "
             "entry's difference from float64 over the float64 result's largest entry.", "",
             "| direction: path | µs per call | over cuBLAS, per round (range) | bf16 error |", "|---|---|---|---|"]
    for name, ms in times.items():
        group = group_of[name]
        r = round_summary([t / CALLS for t in ms], [t / CALLS for t in times[base[group]]])
        result["paths"][name] = {"direction": group} | r | {"errors": errors[name]}
        lines.append(f"| {group}: {name} | {r['median_ms'] * 1e3:.1f} | {ratio_text(r)} | {error_text(errors[name])} |")
    lines += failure_rows(failures, 4)
    write_benchmark(out, "attention_gate", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
