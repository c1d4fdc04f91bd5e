"""The fused MLP's two products on Hopper: the Gluon kernels (the derivative product's post tile brought in by TMA
during the K loop, the results stored asynchronously) against the Triton kernels of the step, with and without
their epilogues, and cuBLAS, at the seed shape; alternated rounds in one process, each path's bf16 error against
float64 first.

    python benchmarks/relu2_hopper.py --out DIR [--tokens 131072] [--width 512] [--hidden 2048]

Writes DIR/relu2_hopper.json and DIR/relu2_hopper.md. Any CUDA machine of compute capability 9.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import checked_paths, error_text, failure_rows, ratio_text, round_summary  # noqa: E402
from relu2_mlp import mlp_problem  # noqa: E402

from creditlab.ops import relu2_hopper as hopper  # noqa: E402
from creditlab.ops._triton import multiprocessors  # noqa: E402
from creditlab.ops import relu2_matmul as rm  # noqa: E402
from creditlab.runtime import write_benchmark  # noqa: E402


def main() -> int:
    problem = mlp_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    out, (M, d, m), x, w_fc, w_proj, dy = problem
    post = rm.relu2_linear(x, w_fc)
    flop = 2 * M * d * m
    h = x.double() @ w_fc.double().t()
    want_expand, want_h = torch.relu(h) ** 2, h
    want_dgrad = (dy.double() @ w_proj.double()) * 2 * post.double().sqrt()
    want_plain = dy.double() @ w_proj.double()

    # (name, callable, the float64 result it computes); each group's first path is the base of its ratios
    groups = {"dgrad": [("Triton kernel + derivative epilogue (the step's before)",
                         lambda: rm.relu2_dgrad(dy, w_proj, post), want_dgrad),
                        ("Triton kernel, no epilogue", lambda: rm.matmul(dy, w_proj, True), want_plain),
                        ("cuBLAS product only", lambda: dy @ w_proj, want_plain)],
              "expand": [("expansion: Triton kernel + ReLU^2 epilogue (the step's)",
                          lambda: rm.relu2_linear(x, w_fc), want_expand),
                         ("expansion: Triton kernel, no epilogue", lambda: rm.matmul(x, w_fc, False), want_h),
                         ("expansion: cuBLAS product only", lambda: x @ w_fc.t(), want_h),
                         ("expansion: Gluon + ReLU^2 epilogue", lambda: hopper.relu2_linear(x, w_fc), want_expand),
                         ("expansion: Gluon + ReLU^2 epilogue, groups of 8",
                          lambda: hopper.relu2_linear(x, w_fc, group_m=8), want_expand),
                         ("expansion: Gluon, no epilogue", lambda: hopper.matmul(x, w_fc, False), want_h)]}
    for post_step, group in ((3, 16), (3, 8)):
        groups["dgrad"].append((f"Gluon + derivative epilogue, post requested at K step {post_step}, group {group}",
                                lambda s=post_step, g=group: hopper.relu2_dgrad(dy, w_proj, post, post_step=s,
                                                                                group_m=g), want_dgrad))
    groups["dgrad"].append(("Gluon, no epilogue", lambda: hopper.relu2_dgrad(dy, w_proj, None), want_plain))
    # One warpgroup a program and two programs a multiprocessor, so that one program's epilogue can run beside
    # the other's products (the accumulator at most 64 x 256 or 128 x 128 at 255 registers a thread; two
    # programs' operand stages and tile buffers within the multiprocessor's shared memory).
    two = 2 * multiprocessors(x.device.index or 0)
    for bm, bn, bk, stages in ((64, 256, 64, 2), (64, 256, 32, 3), (128, 128, 64, 2)):
        tiling = dict(block_m=bm, block_n=bn, block_k=bk, stages=stages, warps=4, programs=two)
        label = f"{bm} x {bn} x {bk}, {stages} stages, 4 warps, two programs a multiprocessor"
        groups["dgrad"].append((f"Gluon + derivative epilogue: {label}",
                                lambda t=tiling: hopper.relu2_dgrad(dy, w_proj, post, **t), want_dgrad))
        groups["expand"].append((f"expansion: Gluon + ReLU^2 epilogue: {label}",
                                 lambda t=tiling: hopper.relu2_linear(x, w_fc, **t), want_expand))

    times, errors, failures, group_of, base = checked_paths(groups)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "K": d, "N": m,
              "paths": {}, "failures": failures}
    lines = [f"# The fused MLP's products, {M:,} x {d} -> {m} bf16 ({torch.cuda.get_device_name()}, torch "
             f"{torch.__version__})", "",
             "Ten alternated rounds of five calls, all paths in one process. Ratios: over the first path of the "
             "same product. Error: the largest entry's difference from float64 over the float64 result's largest "
             "entry.", "",
             "| path | ms | TFLOP/s | over the step's kernel, per round (range) | bf16 error |",
             "|---|---|---|---|---|"]
    for name, ms in times.items():
        r = result["paths"][name] = round_summary(ms, times[base[group_of[name]]]) | {
            "error": errors[name], "product": group_of[name]}
        median = r["median_ms"]
        lines.append(f"| {name} | {median:.4f} | {flop / median / 1e9:.0f} | {ratio_text(r)} | "
                     f"{error_text(errors[name])} |")
    lines += failure_rows(failures, 5)
    write_benchmark(out, "relu2_hopper", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
