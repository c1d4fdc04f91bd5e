"""The learned predictor's skinny products at the seed shape: the state gate sigmoid(n G^T) and the decode
(code * gate) D^T as Triton kernels with the elementwise work inside (kernels/gate_decode.py), against what the
compiler makes of the plain path (a cuBLAS product and a pass of its own) and against the cuBLAS product alone;
alternated rounds in one process, each path's bf16 error against float64 first.

    python benchmarks/gate_decode.py --out DIR [--tokens 131072] [--width 512] [--rank 32]

Each path is captured in a CUDA graph of `CALLS` calls, so the host's launch cost (a compiled function's wrapper,
a Triton launch) is not timed: the step's backward launches these from compiled code, ahead of the GPU. Writes
DIR/gate_decode.json and DIR/gate_decode.md. Any CUDA machine with Triton.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from creditlab.kernels import gate_decode as gd  # noqa: E402
from creditlab.runtime import write_benchmark  # noqa: E402
from fit_rows import branch_problem  # noqa: E402
from fp8_head import checked_paths, error_text, failure_rows, ratio_text, round_summary  # noqa: E402

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
    problem = branch_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    _, out, N, d, r2 = problem
    torch.manual_seed(0)
    n = torch.randn(N, d, device="cuda").bfloat16()
    gate_weight = torch.randn(r2, d, device="cuda") * d ** -0.5  # float32, as the parameter is
    code = (torch.randn(N, r2, device="cuda") * 1e-2).bfloat16()
    gate = torch.rand(N, r2, device="cuda").bfloat16()
    decoder = torch.randn(d, r2, device="cuda") * 0.05

    plain_gate = torch.compile(lambda n_, g_: torch.sigmoid(n_ @ g_.to(n_.dtype).t()))
    plain_decode = torch.compile(lambda c, g, dec: (c * g) @ dec.to(c.dtype).t())
    g16, d16, gated = gate_weight.bfloat16(), decoder.bfloat16(), code * gate
    want_gate = torch.sigmoid(n.double() @ gate_weight.double().t())
    want_decode = (code.double() * gate.double()) @ decoder.double().t()
    want_gated_decode = gated.double() @ decoder.double().t()  # the product alone, its input gated already

    groups = {
        "gate": [("plain, compiled: cuBLAS product, then the sigmoid", lambda: plain_gate(n, gate_weight), want_gate),
                 ("cuBLAS product alone (no sigmoid)", lambda: n @ g16.t(), None)],
        "decode": [("plain, compiled: the gated code, then a cuBLAS product",
                    lambda: plain_decode(code, gate, decoder), want_decode),
                   ("cuBLAS product alone (gated code given)", lambda: gated @ d16.t(), want_gated_decode)]}
    gate_tiles = [gd.GATE_TILES] + [gd.GateTiles(bm, bk, stages, warps) for bm, bk, stages, warps in
                                    ((128, 64, 3, 4), (128, 64, 4, 8), (128, 128, 3, 8), (64, 64, 4, 4), (256, 64, 3, 8))]
    decode_tiles = [gd.DECODE_TILES] + [gd.DecodeTiles(bm, bn, warps) for bm, bn, warps in
                                        ((128, 128, 4), (64, 128, 4), (128, 256, 8), (64, 256, 4), (256, 128, 8))]
    default = lambda tiles, chosen: " (the default)" if tiles == chosen else ""  # noqa: E731
    for tiles in dict.fromkeys(gate_tiles):
        groups["gate"].append((f"kernel, TMA: {tiles.block_m} rows, K steps of "
                               f"{tiles.block_k}, {tiles.stages} stages, {tiles.warps} warps"
                               f"{default(tiles, gd.GATE_TILES)}",
                               lambda t=tiles: gd.state_gate(n, gate_weight, t), want_gate))
    for tiles in dict.fromkeys(decode_tiles):
        groups["decode"].append((f"kernel, TMA: {tiles.block_m} rows, column chunks of "
                                 f"{tiles.block_n}, {tiles.warps} warps{default(tiles, gd.DECODE_TILES)}",
                                 lambda t=tiles: gd.gated_decode(code, gate, decoder, t), want_decode))
    moved = {"gate": N * d * 2 + N * r2 * 2, "decode": 2 * N * r2 * 2 + N * d * 2}  # the bytes each must move

    replays, errors, failures, group_of, base = checked_paths(groups, graphed)
    times = {name: [t / CALLS for t in ms] for name, ms in replays.items()}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": N, "width": d,
              "code_width": r2, "calls_per_replay": CALLS, "paths": {}, "failures": failures}
    lines = [f"# The predictor's skinny products, {N:,} tokens x {d} <-> {r2} bf16 ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "",
             f"Ten alternated rounds of five graph replays of {CALLS} calls, all paths in one process; ms per call. "
             "Ratios: over the plain path of the same product. TB/s: the bytes the product must move (the wide "
             "operand once, the narrow ones once) over its time. Error: the largest entry's difference from float64 "
             "over the float64 result's largest entry.", "",
             "| path | µs per call | TB/s | over plain, per round (range) | bf16 error |", "|---|---|---|---|---|"]
    for group in groups:
        for name in (k for k in times if group_of[k] == group):
            r = round_summary(times[name], times[base[group]])
            median = r["median_ms"]
            result["paths"][name] = {"product": group} | r | {"error": errors[name],
                                                              "tb_per_s": moved[group] / median / 1e9}
            lines.append(f"| {group}: {name} | {median * 1e3:.1f} | {moved[group] / median / 1e9:.2f} | "
                         f"{ratio_text(r)} | {error_text(errors[name])} |")
    lines += failure_rows(failures, 5)
    write_benchmark(out, "gate_decode", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
