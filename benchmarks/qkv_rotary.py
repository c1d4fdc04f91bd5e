"""The Q/K/V product with QK-norm and rotary in its epilogue (kernels/qkv_rotary.py, the step's; on Hopper also the
Gluon kernel, kernels/qkv_hopper.py, which the step runs there, at four tilings) against the cuBLAS product followed
by the one-pass QK-norm kernel (what a source that forms the product itself runs) at the seed shape; alternated
rounds in one process, each path's bf16 error against float64 first.

    python benchmarks/qkv_rotary.py --out DIR [--batch 64] [--seq 2048] [--heads 4] [--head-dim 128]

Writes DIR/qkv_rotary.json and DIR/qkv_rotary.md. Any CUDA machine with Triton.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import checked_paths, error_text, failure_rows, ratio_text, round_summary  # noqa: E402
from qk_norm import attention_problem  # noqa: E402

from creditlab.ops import qk_norm_rotary as qk_kernels  # noqa: E402
from creditlab.ops import qkv_hopper  # noqa: E402
from creditlab.ops import qkv_rotary  # noqa: E402
from creditlab.ops import relu2_matmul as rm  # noqa: E402
from creditlab.ops._triton import multiprocessors  # noqa: E402
from creditlab.model import Rotary, norm  # noqa: E402
from creditlab.ops.qk_norm import reference_forward  # noqa: E402
from creditlab.runtime import write_benchmark  # noqa: E402

TILES = [qkv_rotary.TileConfig(bm, heads, bk, group, stages, warps) for bm, heads, bk, group, stages, warps in
         ((128, 2, 64, 16, 3, 8), (128, 1, 64, 16, 3, 8), (128, 1, 64, 16, 4, 8), (128, 1, 64, 16, 3, 4),
          (128, 2, 64, 8, 3, 8), (64, 2, 64, 16, 3, 4))]


def main() -> int:
    problem = attention_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    _, out, B, T, H, hd, rot = problem
    d, M = H * hd, B * T
    torch.manual_seed(0)
    x = torch.randn(M, d, device="cuda").bfloat16()
    w = (torch.randn(3 * d, d, device="cuda") * d ** -0.5).bfloat16()
    qkv64 = x.double() @ w.double().t()
    q64, k64, v64 = qkv64.view(B, T, 3, H, hd).unbind(2)
    rot64 = Rotary(hd, T, 10_000.0).cuda().double()
    want = tuple(t.reshape(B, T, H, hd) for t in (rot64(norm(q64)), rot64(norm(k64)), v64))

    def then_kernel():
        q, k, v, _ = qk_kernels.qk_norm_rotary_forward((x @ w.t()).view(B, T, 3 * d), rot.cos, rot.sin, H)
        return q, k, v

    paths = [("cuBLAS product, then the QK-norm kernel", then_kernel, want),
             ("cuBLAS product alone", lambda: x @ w.t(), None),
             ("Triton product alone, no epilogue (relu2_matmul's loop)", lambda: rm.matmul(x, w, False), None)]
    for tiles in TILES:
        default = " (the default)" if tiles == qkv_rotary.DEFAULT_TILES else ""
        paths.append((f"product + QK-norm epilogue: {tiles.block_m} x {tiles.heads_per_tile * hd} x "
                      f"{tiles.block_k}, groups of {tiles.group_m}, {tiles.stages} stages, {tiles.warps} warps"
                      f"{default}",
                      lambda t=tiles: tuple(qkv_rotary.qkv_norm_rotary(x, w, rot.cos, rot.sin, H, T, 1e-6, t)[0].view(
                          3, B, T, H, hd)), want))
    if qkv_hopper.supported(x, w, H):
        for heads, group, stages, post_step in ((2, 16, 3, 3), (2, 8, 3, 3), (2, 16, 3, 6), (1, 16, 4, 3)):
            tiling = dict(heads_per_tile=heads, group_m=group, stages=stages, post_step=post_step)
            chosen = tiling == dict(heads_per_tile=qkv_hopper.HEADS_PER_TILE, group_m=qkv_hopper.GROUP_M,
                                    stages=qkv_hopper.STAGES, post_step=qkv_hopper.POST_STEP)
            paths.append((f"Gluon product + QK-norm epilogue: {qkv_hopper.BLOCK_M} x {heads * hd} x "
                          f"{qkv_hopper.BLOCK_K}, groups of {group}, {stages} stages, previous store waited for at K "
                          f"step {post_step}{' (what the step runs)' if chosen else ''}",
                          lambda t=tiling: tuple(qkv_hopper.qkv_norm_rotary(
                              x, w, rot.cos, rot.sin, H, T, 1e-6, **t)[0].view(3, B, T, H, hd)), want))
        # one warpgroup a program, two programs a multiprocessor (as benchmarks/relu2_hopper.py's)
        two = 2 * multiprocessors(x.device.index or 0)
        for bm, heads, stages in ((64, 2, 2), (128, 1, 2)):
            tiling = dict(block_m=bm, heads_per_tile=heads, stages=stages, warps=4, programs=two)
            paths.append((f"Gluon product + QK-norm epilogue: {bm} x {heads * hd} x {qkv_hopper.BLOCK_K}, "
                          f"{stages} stages, 4 warps, two programs a multiprocessor",
                          lambda t=tiling: tuple(qkv_hopper.qkv_norm_rotary(
                              x, w, rot.cos, rot.sin, H, T, 1e-6, **t)[0].view(3, B, T, H, hd)), want))
    times, errors, failures, _, base = checked_paths({"forward": paths})  # q, k and v each against float64
    flop = 2 * M * d * 3 * d
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": M, "width": d,
              "heads": H, "paths": {}, "failures": failures}
    lines = [f"# The Q/K/V product and QK-norm + rotary, {M:,} tokens x {d} -> 3 x {d}, {H} heads, bf16 "
             f"({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "Ten alternated rounds of five calls, all paths in one process; ms per call. Ratio: over the cuBLAS "
             "product then the QK-norm kernel, round by round. Error: q, k, v, each the largest entry's difference from "
             "float64 over the float64 result's largest entry.", "",
             "| path | ms | TFLOP/s of the product | over the product then the kernel, per round (range) | bf16 error q, k, v |",
             "|---|---|---|---|---|"]
    for name in times:
        r = round_summary(times[name], times[base["forward"]])
        median = r["median_ms"]
        result["paths"][name] = r | {"errors_qkv": errors[name], "tflop_per_s": flop / median / 1e9}
        lines.append(f"| {name} | {median:.4f} | {flop / median / 1e9:.0f} | {ratio_text(r)} | "
                     f"{error_text(errors[name])} |")
    lines += failure_rows(failures, 5)
    # the row scales the backward reads, which the timed paths return beside q, k, v
    want_scales = reference_forward(qkv64.view(B, T, 3 * d), rot64.cos, rot64.sin, H)[3].view(M, 2, H)
    kernels = [("Triton", lambda: qkv_rotary.qkv_norm_rotary(x, w, rot.cos, rot.sin, H, T, 1e-6)[1])]
    if qkv_hopper.supported(x, w, H):
        for epilogue, label in ((qkv_hopper.EPILOGUE_BRANCH_FREE, "branch-free epilogue"),
                                (qkv_hopper.EPILOGUE_V_AS_IS, "tiles of v as made"),
                                (qkv_hopper.EPILOGUE_TABLES_EARLY, "tables read early"),
                                (qkv_hopper.EPILOGUE_OVERLAPPED, "epilogue beside the next products")):
            kernels.append((f"Gluon ({label})", lambda e=epilogue: qkv_hopper.qkv_norm_rotary(
                x, w, rot.cos, rot.sin, H, T, 1e-6, epilogue=e)[1]))
    result["scales_errors"] = {}
    lines += ["", "Row scales (1 / rms of each head of q and k, float32), largest entry's difference from float64 "
              "over the float64 result's largest entry:", ""]
    for name, scales in kernels:
        got = scales().double()
        error = ((got - want_scales).abs().max() / want_scales.abs().max()).item()  # NaN stays NaN
        result["scales_errors"][name] = error
        lines.append(f"- {name} kernel: {error:.2e}")
    write_benchmark(out, "qkv_rotary", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
