"""The Triton kernels against float64 autograd, on the CPU through Triton's interpreter (tests/kernel_checks.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    done = subprocess.run([sys.executable, str(HERE / "kernel_checks.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", ["one_block", "many_blocks", "saturated", "near_zero"])
def test_softcap_ce_matches_autograd_in_float32(report, case):
    r = report[case]
    assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 2e-6, r
    assert r["padding_grad_zero"]


def test_softcap_ce_reads_the_padding_but_gives_it_nothing(report):
    # the loads are masked at the padded width (wide loads), so the padding columns are read: NaN and inf there
    # must reach neither the loss nor any gradient
    r = report["nan_padding"]
    assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 2e-6, r
    assert r["padding_grad_zero"]


def test_softcap_ce_in_bf16_writes_bf16_gradients_to_bf16_accuracy(report):
    r = report["bf16"]
    assert r["grad_dtype"] == "torch.bfloat16"
    assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 8e-3, r


def test_the_benchmarks_variants_of_the_kernel_compute_the_same_loss(report):
    # benchmarks/softcap_ce_held.py: one pass with the row held on chip, two passes with loads ahead, L2 hints or
    # a polynomial exp2; the failing comparison below is the same check against a different function
    variants = report["softcap_variants"]
    assert len(variants) == 2 * 14, sorted(variants)
    for name, r in variants.items():
        assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 2e-6 and r["padding_grad_zero"], (name, r)


def test_the_comparison_fails_for_a_different_function(report):
    r = report["wrong_cap"]  # the kernel at cap 15 against the reference at cap 14
    assert r["loss_rel"] > 1e-3 and r["grad_abs"] > 1e-3, r


def test_head_loss_through_the_kernel_matches_the_torch_arithmetic(report):
    assert max(report["head_loss"].values()) < 2e-6, report["head_loss"]


def test_the_operator_declares_its_shapes_truthfully(report):
    assert all(report["opcheck"].values()), report["opcheck"]


def test_the_compiled_model_keeps_no_chunk_of_logits_for_the_backward(report):
    # The head loss as one operator: only grad_h and grad_w are kept, no chunk of logits (or their gradient).
    assert report["logits_kept_fused"] == 0, report
    # The same loop traced op by op (the earlier structure) kept both chunks' logits gradients: the check fails.
    assert report["logits_kept_op_by_op"] == 2, report


@pytest.mark.parametrize("case", ["transpose_partial", "transpose_one_tile"])
def test_the_tiled_transpose_is_exact_and_writes_every_element(report, case):
    r = report[case]
    assert r["exact"] and r["dtype"] == "torch.float8_e5m2", r
    assert not r["equals_untransposed"], r  # a copy that did not transpose fails the same comparison


@pytest.mark.parametrize("case", ["relu2_even", "relu2_partial", "relu2_one_subtile"])
def test_relu2_matmul_kernels_match_float64_and_write_every_element(report, case):
    r = report[case]
    assert r["all_written"], r
    for op in ("relu2_linear", "relu2_dgrad", "matmul_nk", "matmul_kn"):
        assert r[op] < 1e-5, (op, r)  # float32 accumulation of K <= 40 products


def test_the_relu2_comparison_fails_for_a_wrong_derivative(report):
    # the derivative epilogue (2 sqrt(post)) against a reference with relu(h) in place of 2 relu(h)
    assert report["relu2_wrong_derivative"]["relu2_dgrad"] > 0.5, report["relu2_wrong_derivative"]


def test_the_fused_mlp_through_the_kernels_matches_the_float64_mlp(report):
    r = report["fused_mlp"]
    assert r["epilogues_launched"] == [1, 2], r  # the ReLU^2 forward and the derivative epilogue ran
    assert max(r["errors"].values()) < 1e-5, r


@pytest.mark.parametrize("case", ["qk_even", "qk_partial_rows", "qk_strided_rows"])
def test_qk_norm_rotary_kernels_match_the_float64_model_and_write_every_element(report, case):
    r = report[case]
    assert r["all_written"], r
    assert max(r[key] for key in ("q", "k", "v", "dqkv", "scales")) < 1e-6, r  # float32 arithmetic


def test_the_qk_comparison_fails_for_another_epsilon(report):
    r = report["qk_wrong_eps"]  # the kernel's norm at eps 1e-2 against the model's 1e-6
    assert min(r["q"], r["k"], r["dqkv"]) > 1e-4, r


@pytest.mark.parametrize("case", ["qkv_two_heads_a_tile", "qkv_one_head_a_tile", "qkv_odd_heads"])
def test_the_qkv_product_with_qk_norm_in_its_epilogue_matches_float64_and_writes_every_element(report, case):
    r = report[case]
    assert r["all_written"], r
    assert max(r[key] for key in ("q", "k", "v", "scales")) < 1e-5, r  # float32 products over 24-40 terms


def test_the_qkv_comparison_fails_for_another_epsilon(report):
    r = report["qkv_wrong_eps"]  # the kernel's norm at eps 1e-2 against the model's 1e-6
    assert min(r["q"], r["k"]) > 1e-4 and r["v"] < 1e-5, r


def test_the_qkv_product_function_through_the_kernel_matches_the_float64_model(report):
    r = report["qkv_product"]
    assert r["launched"] == 1, r  # the forward went through the kernel
    assert max(r["errors"].values()) < 1e-5, r


def test_the_qkv_product_operator_declares_its_outputs_truthfully(report):
    assert report["qkv_opcheck"] == {"torch": ["SUCCESS"], "kernel": ["SUCCESS"]}, report["qkv_opcheck"]


@pytest.mark.parametrize("case", ["thin_linear_gate", "thin_linear_odd", "thin_linear_one_block"])
def test_the_thin_products_kernels_match_float64_and_write_every_element(report, case):
    r = report[case]
    assert r["all_written"], r
    assert max(r["y"], r["dx"], r["dw"]) < 1e-5, r  # float32 sums of 12 terms, and of 300 for dw


def test_the_thin_product_comparison_fails_without_a_blocks_partial_sum(report):
    r = report["thin_linear_dropped_partial"]
    assert r["dw"] > 1e-3 and max(r["y"], r["dx"]) < 1e-5, r


def test_the_attention_gate_through_the_kernels_matches_float64_f_linear(report):
    r = report["attention_gate"]
    assert r["launched"] == ["forward", "backward"], r
    assert max(r["errors"].values()) < 1e-5, r


def test_the_attention_gate_operators_declare_their_outputs_truthfully(report):
    assert report["attention_gate_opcheck"] == {"torch": ["SUCCESS"], "kernel": ["SUCCESS"]}, \
        report["attention_gate_opcheck"]


@pytest.mark.parametrize("case", ["norm_decode_with_dn", "norm_decode_without_dn", "norm_decode_without_residual"])
def test_norm_backward_with_the_decode_inside_matches_float64_autograd(report, case):
    r = report[case]
    assert r["all_written"] and r["dx"] < 1e-5, r  # float32 arithmetic, n read back in float32


@pytest.mark.parametrize("case", ["norm_decode_dropped", "norm_decode_residual_dropped"])
def test_the_norm_decode_comparison_fails_without_the_correction_or_the_residual(report, case):
    assert report[case]["dx"] > 1e-2, report[case]


def test_the_fused_decode_through_the_operator_matches_its_float64_torch_path(report):
    r = report["fused_decode"]
    assert r["launched"] == 1, r  # the kernel ran, not the fallback
    assert r["correction_share"] > 0.1 and r["residual_share"] > 0.1, r  # both parts of the result matter
    assert r["dx"] < 1e-5, r


def test_the_norm_decode_operator_declares_its_schema_truthfully(report):
    assert report["norm_decode_opcheck"] and all(report["norm_decode_opcheck"].values()), report["norm_decode_opcheck"]


@pytest.mark.parametrize("case", ["gate_decode_tiles", "gate_decode_strided", "gate_decode_default_tiles"])
def test_the_predictors_gate_and_decode_kernels_match_float64_and_write_every_element(report, case):
    r = report[case]
    assert r["all_written"], r
    assert r["gate"] < 1e-6 and r["decode"] < 1e-6, r  # float32 accumulation of K <= 64 products


def test_the_gate_decode_comparison_fails_without_the_sigmoid_or_the_gate(report):
    r = report["gate_decode_wrong"]  # the same kernels against n G^T and code D^T
    assert r["gate"] > 1e-2 and r["decode"] > 1e-2, r


def test_the_streaming_share_through_the_gate_decode_operators_matches_its_float64_torch_path(report):
    r = report["streaming_products"]
    assert r["launched"] == ["gate", "decode"], r  # both kernels ran, not the fallback
    assert r["gate_matters"] > 0.1, r  # the gate changes the correction, so a decode that dropped it would fail
    assert r["dn"] < 1e-6, r


def test_the_gate_decode_operators_declare_their_schemas_truthfully(report):
    assert report["gate_decode_opcheck"] and all(report["gate_decode_opcheck"].values()), report["gate_decode_opcheck"]


@pytest.mark.parametrize("case", ["fit_rows", "fit_rows_one_program"])
def test_fit_rows_kernel_matches_float64_and_writes_every_element(report, case):
    r = report[case]
    assert r["all_written"], r
    assert max(r[k] for k in ("gated", "code_grad", "gate_grad", "sums", "gram")) < 1e-5, r


def test_the_fit_rows_comparison_fails_for_a_wrong_gate_derivative(report):
    r = report["fit_rows_wrong_derivative"]
    assert r["gate_grad"] > 1e-2 and r["code_grad"] < 1e-5, r


def test_the_rank_space_fit_through_the_kernel_matches_its_float64_op_by_op_path(report):
    r = report["rank_space_fit"]
    assert r["launched"] == 1, r  # the kernel ran, not the fallback
    assert max(r["errors"].values()) < 1e-5, r


def test_the_fit_rows_operator_declares_its_shapes_truthfully(report):
    assert report["fit_rows_opcheck"] and all(report["fit_rows_opcheck"].values()), report["fit_rows_opcheck"]


def _hopper_cases():
    """(kernel, its arguments' types in order, constants, warps) at the seed shape, for the kernels that take plain
    pointers (the fused MLP's takes TMA descriptors, made on a GPU)."""
    from creditlab.kernels import embedding_grad, fit_rows, gate_decode as gd, norm_decode, qk_norm_rotary as qk, softcap_ce, tiled_transpose
    from creditlab.kernels import qkv_rotary as qkv, thin_linear as thin

    qkv_tiles = qkv.DEFAULT_TILES

    tiles = fit_rows.DEFAULT_TILES
    gate, decode = gd.GATE_TILES, gd.DECODE_TILES
    return {
        "fit_rows": (fit_rows._fit_rows, ["*bf16"] * 4 + ["*fp32", "*bf16", "*fp32", "*bf16", "*fp32", "i32"],
                     {"D": 512, "R2": 64, "ROWS": tiles.rows, "BK": tiles.block_k, "TILES": tiles.tiles,
                      "STAGES": tiles.stages, "SUMS": fit_rows.SUMS}, tiles.warps),
        "qk_forward": (qk._qk_forward, ["*bf16"] * 4 + ["*fp32"] * 3 + ["i32", "i32", "i32", "fp32"],
                       {"H": 4, "HD": 128, "ROWS": qk.ROWS}, qk.WARPS),
        "qk_backward": (qk._qk_backward, ["*bf16"] * 5 + ["*fp32"] * 3 + ["*bf16", "i32", "i32"],
                        {"H": 4, "HD": 128, "ROWS": qk.BACKWARD_ROWS}, qk.BACKWARD_WARPS),
        "softcap_ce": (softcap_ce._softcap_ce_rows, ["*bf16", "*bf16", "*i64", "*fp32", "i32", "fp32", "fp32"],
                       {"vocab": 12289, "padded": 12352, "BLOCK": softcap_ce.DEFAULT_BLOCK, "FAST": True,
                        "STAGES": softcap_ce.DEFAULT_STAGES}, softcap_ce.DEFAULT_WARPS),
        # the FP8 head's: the gradient written in e5m2 (the interpreter's FP8 rounding differs from the GPU's, so
        # only the compile is checked here; the values are checked on the GPU, benchmarks/fp8_head.py)
        "softcap_ce_fp8": (softcap_ce._softcap_ce_rows, ["*bf16", "*fp8e5", "*i64", "*fp32", "i32", "fp32", "fp32"],
                           {"vocab": 12289, "padded": 12352, "BLOCK": softcap_ce.DEFAULT_BLOCK, "FAST": True,
                            "STAGES": softcap_ce.DEFAULT_STAGES}, softcap_ce.DEFAULT_WARPS),
        "embedding_grad": (embedding_grad._embedding_grads, ["*i32", "*i64", "*bf16", "*fp32", "i32"],
                           {"width": 512, "BLOCK_ROWS": embedding_grad.BLOCK_ROWS,
                            "BLOCK_COLS": embedding_grad.BLOCK_COLS, "FLOAT32": False}, embedding_grad.WARPS),
        "transpose": (tiled_transpose._transpose, ["*u8", "*u8", "i32", "i32"], {"BLOCK": tiled_transpose.BLOCK},
                      tiled_transpose.WARPS),
        "norm_decode": (norm_decode._norm_decode_backward, ["*bf16", "*bf16", "*bf16", "*fp32", "*bf16", "*bf16", "*bf16",
                                                            "*bf16", "i32"],
                        {"D": 512, "R2": 64, "ROWS": norm_decode.ROWS, "HAS_DN": False, "HAS_RESIDUAL": True},
                        norm_decode.WARPS),
        # TMA descriptors as the launch's host-built TensorDescriptors type them
        "state_gate": (gd._state_gate, [f"tensordesc<bf16[{gate.block_m}, {gate.block_k}]>",
                                        f"tensordesc<bf16[64, {gate.block_k}]>", f"tensordesc<bf16[{gate.block_m}, 64]>"],
                       {"K": 512, "BLOCK_M": gate.block_m, "BLOCK_K": gate.block_k, "STAGES": gate.stages}, gate.warps),
        "thin_forward": (thin._thin_forward, ["*bf16", "i32", "*bf16", "*bf16", "i32"],
                         {"K": 12, "N": 4, "KP": 16, "NP": 4, "ROWS": thin.ROWS}, thin.WARPS),
        "thin_backward": (thin._thin_backward, ["*bf16", "*bf16", "i32", "*bf16", "*bf16", "*fp32", "i32"],
                          {"K": 12, "N": 4, "KP": 16, "NP": 4, "ROWS": thin.ROWS}, thin.WARPS),
        "qkv_rotary": (qkv._qkv_kernel, [f"tensordesc<bf16[{qkv_tiles.block_m}, {qkv_tiles.block_k}]>",
                                         f"tensordesc<bf16[{128 * qkv_tiles.heads_per_tile}, {qkv_tiles.block_k}]>"]
                       + [f"tensordesc<bf16[1, {qkv_tiles.block_m}, 64]>"] + ["*fp32"] * 3 + ["i32", "i32", "fp32"],
                       {"K": 512, "WIDTH": 512, "HD": 128, "HEADS_PER_TILE": qkv_tiles.heads_per_tile,
                        "BLOCK_M": qkv_tiles.block_m, "BLOCK_K": qkv_tiles.block_k, "GROUP_M": qkv_tiles.group_m,
                        "PROGRAMS": 132}, qkv_tiles.warps),
        "gated_decode": (gd._gated_decode, [f"tensordesc<bf16[{decode.block_m}, 64]>"] * 2
                         + [f"tensordesc<bf16[{decode.block_n}, 64]>", f"tensordesc<bf16[{decode.block_m}, {decode.block_n}]>"],
                         {"N": 512, "BLOCK_M": decode.block_m, "BLOCK_N": decode.block_n}, decode.warps),
    }


SHARED_MEMORY = 227 * 1024  # a Hopper multiprocessor's, per program


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fit_rows", "qk_forward", "qk_backward", "softcap_ce", "softcap_ce_fp8", "transpose",
                                  "norm_decode", "embedding_grad", "state_gate", "gated_decode", "qkv_rotary",
                                  "thin_forward", "thin_backward"])
def test_each_kernel_compiles_for_hopper(name):
    """Through Triton's whole compiler to a cubin for sm_90 at the seed shape's constants, on the CPU: what the
    interpreter lets pass (a global that is not a constexpr, a shape past the shared memory) fails here."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    kernel, types, constants, warps = _hopper_cases()[name]
    names = [a for a in kernel.arg_names if a not in constants]
    assert len(names) == len(types) and set(constants) <= set(kernel.arg_names), (names, types)
    typed = dict(zip(names, types))
    signature = {a: typed.get(a, "constexpr") for a in kernel.arg_names}
    # pointers 16-byte aligned, as the JIT specializes them at a launch
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    try:
        compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except RuntimeError as error:  # no ptxas in this Triton install
        if "ptxas" in str(error):
            pytest.skip(str(error))
        raise
    assert compiled.asm["cubin"] and compiled.metadata.shared <= SHARED_MEMORY


def _gluon_descriptor(block):
    """A bf16 TMA descriptor's type, as the launch's host-built descriptor with the default shared layout gives it."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return f"tensordesc<bf16[{', '.join(map(str, block))}],{layout!r}>"


def _compile_gluon(kernel, signature: dict, constants: dict, warps: int, registers: int | None = None):
    """A Gluon kernel through Triton's compiler to a cubin for sm_90, on the CPU (`registers`: maxnreg)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource(fn=kernel, signature=signature | {k: "constexpr" for k in constants},
                            constexprs=constants)
    try:
        options = {"num_warps": warps} | ({"maxnreg": registers} if registers else {})
        return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as error:  # no ptxas in this Triton install
        if "ptxas" in str(error):
            pytest.skip(str(error))
        raise


def _compile_gluon_mlp(stages: int, expand: bool = False, separate_post: bool = False, bk: int | None = None):
    """One of the fused MLP's Gluon kernels (the derivative product, or with `expand` the expansion) at the seed
    shape's constants (131,072 tokens, 512 -> 2,048); `separate_post`: the post tile in a buffer of its own."""
    from creditlab.kernels import relu2_hopper as hopper

    bm, bn, bk = hopper.BLOCK_M, hopper.BLOCK_N, bk or hopper.BLOCK_K
    constants = {"K_STEPS": 512 // bk, "B_IS_KN": not expand,
                 "EPILOGUE": hopper.EPILOGUE_RELU2 if expand else hopper.EPILOGUE_RELU2_GRAD,
                 "POST_STEP": 0 if separate_post else 3, "STAGES": stages, "GROUP": hopper.GROUP_M,
                 "SEPARATE_POST": separate_post, "num_warps": hopper.WARPS}
    signature = {"a_desc": _gluon_descriptor([bm, bk]), "b_desc": _gluon_descriptor([bn, bk] if expand else [bk, bn]),
                 "post_desc": _gluon_descriptor([bm, bn]), "c_desc": _gluon_descriptor([bm, bn]), "M": "i32",
                 "N": "i32"}
    return _compile_gluon(hopper._mlp_kernel, signature, constants, hopper.WARPS)


def _compile_gluon_qkv(stages: int, heads_per_tile: int = 2, epilogue: int | None = None):
    """The Gluon Q/K/V product with QK-norm and rotary in its epilogue (kernels/qkv_hopper.py) at the seed shape's
    constants (512 -> 3 x 512, 4 heads of 128), tiles one or two heads wide, the epilogue in the form named (by
    default the kernel's)."""
    from creditlab.kernels import qkv_hopper

    bm, bk, bn = qkv_hopper.BLOCK_M, qkv_hopper.BLOCK_K, 128 * heads_per_tile
    constants = {"WIDTH": 512, "HD": 128, "K_STEPS": 512 // bk, "STAGES": stages, "GROUP": qkv_hopper.GROUP_M,
                 "POST_STEP": qkv_hopper.POST_STEP,
                 "EPILOGUE": qkv_hopper.EPILOGUE if epilogue is None else epilogue, "num_warps": qkv_hopper.WARPS}
    signature = {"a_desc": _gluon_descriptor([bm, bk]), "b_desc": _gluon_descriptor([bn, bk]),
                 "out_desc": _gluon_descriptor([bm, bn]), "scales": "*fp32", "cos": "*fp32", "sin": "*fp32",
                 "M": "i32", "T": "i32", "eps": "fp32"}
    return _compile_gluon(qkv_hopper._qkv_kernel, signature, constants, qkv_hopper.WARPS)


def _shared_memory_at_three_and_four_stages(compile_at_stages):
    """(the kernel compiled at 3 stages, its shared memory at 4 stages): bytes, or inf where the compiler itself
    refuses the allocation."""
    compiled = compile_at_stages(3)
    try:
        four = compile_at_stages(4).metadata.shared
    except Exception as error:
        if "shared" not in str(error).lower() and "resource" not in str(error).lower():
            raise
        four = float("inf")
    return compiled, four


def _issues_warpgroup_products_and_tma(compiled) -> bool:
    ptx = compiled.asm["ptx"]
    return bool(compiled.asm["cubin"]) and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.slow
@pytest.mark.parametrize("expand", [False, True])
def test_the_gluon_mlp_kernels_compile_for_hopper_within_their_shared_memory(expand):
    # Gluon has no interpreter: the kernels' arithmetic is checked against float64 on the GPU
    # (benchmarks/relu2_hopper.py); here, that each compiles to warpgroup products and TMA copies within the
    # shared memory, and (the check can fail) that a fourth stage of operands, 48 KB more, does not fit
    compiled, four = _shared_memory_at_three_and_four_stages(lambda stages: _compile_gluon_mlp(stages, expand))
    assert _issues_warpgroup_products_and_tma(compiled)
    assert compiled.metadata.shared <= SHARED_MEMORY < four, (compiled.metadata.shared, four)


@pytest.mark.slow
def test_the_derivative_kernel_with_its_post_tile_apart_fits_hopper_at_two_stages_not_three():
    # the post tile's own buffer (64 KB) fits beside 2 stages of 64-wide K steps or 4 of 32-wide ones, and (the
    # check can fail) not beside the default 3 stages
    for stages, bk in ((2, 64), (4, 32)):
        compiled = _compile_gluon_mlp(stages, separate_post=True, bk=bk)
        assert _issues_warpgroup_products_and_tma(compiled)
        assert compiled.metadata.shared <= SHARED_MEMORY, (stages, bk, compiled.metadata.shared)
    assert _compile_gluon_mlp(3, separate_post=True).metadata.shared > SHARED_MEMORY


def test_the_apart_derivative_forms_name_what_is_wrong_before_any_launch():
    from creditlab.kernels import relu2_dgrad_apart as apart

    dy, w, post = torch.zeros(128, 64), torch.zeros(64, 256), torch.zeros(128, 256)
    with pytest.raises(ValueError, match="no derivative form 'whole_tile'"):
        apart.relu2_dgrad(dy, w, post, "whole_tile")  # the default kernel is relu2_hopper's
    with pytest.raises(ValueError, match="shapes differ"):
        apart.relu2_dgrad(dy, w, post[:, :128], "overlapped")
    with pytest.raises(ValueError, match="whole number of pieces"):
        apart.relu2_dgrad(dy, w, post, "specialized", piece_rows=48)


@pytest.mark.slow
def test_the_overlapped_derivative_kernel_compiles_for_hopper_in_the_default_kernels_shared_memory():
    # each tile's epilogue in 16-row pieces beside the next tile's products: its post rows come by plain loads,
    # so it needs no more shared memory than the default kernel, and (the check can fail) a fourth stage of
    # operands does not fit beside its tile buffer either
    from creditlab.kernels import relu2_dgrad_apart as apart
    from creditlab.kernels import relu2_hopper as hopper

    bm, bn, bk = hopper.BLOCK_M, hopper.BLOCK_N, hopper.BLOCK_K

    def at(stages):
        return _compile_gluon(
            apart._dgrad_kernel_overlapped,
            {"a_desc": _gluon_descriptor([bm, bk]), "b_desc": _gluon_descriptor([bk, bn]),
             "c_desc": _gluon_descriptor([bm, bn]), "rows_desc": _gluon_descriptor([16, bn]), "post": "*bf16",
             "M": "i32", "N": "i32"},
            {"K_STEPS": 512 // bk, "STAGES": stages, "GROUP": hopper.GROUP_M, "num_warps": hopper.WARPS},
            hopper.WARPS)

    compiled, four = _shared_memory_at_three_and_four_stages(at)
    assert _issues_warpgroup_products_and_tma(compiled)
    assert compiled.metadata.shared <= _compile_gluon_mlp(3).metadata.shared < four, (compiled.metadata.shared, four)


@pytest.mark.slow
@pytest.mark.parametrize("rows, warps, registers", [(16, 4, 152), (8, 4, 88)])
def test_the_specialized_derivative_kernel_compiles_for_hopper_with_its_partitions_registers(rows, warps, registers):
    # the epilogue on warps of its own: one more barrier pair beside the default kernel's shared memory, and the
    # register file traded between the partitions (setmaxnreg); and (the check can fail) a fourth operand stage
    # does not fit
    from creditlab.kernels import relu2_dgrad_apart as apart
    from creditlab.kernels import relu2_hopper as hopper

    bm, bn, bk = hopper.BLOCK_M, hopper.BLOCK_N, hopper.BLOCK_K

    def at(stages):
        return _compile_gluon(
            apart._dgrad_kernel_specialized,
            {"a_desc": _gluon_descriptor([bm, bk]), "b_desc": _gluon_descriptor([bk, bn]),
             "c_desc": _gluon_descriptor([bm, bn]), "post": "*bf16", "M": "i32", "N": "i32"},
            {"K_STEPS": 512 // bk, "STAGES": stages, "GROUP": hopper.GROUP_M, "PIECE": rows, "EPILOGUE_WARPS": warps,
             "EPILOGUE_REGISTERS": registers, "num_warps": hopper.WARPS},
            hopper.WARPS, apart.specialized_registers(warps))

    compiled, four = _shared_memory_at_three_and_four_stages(at)
    assert _issues_warpgroup_products_and_tma(compiled) and "setmaxnreg" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= SHARED_MEMORY < four, (compiled.metadata.shared, four)


@pytest.mark.slow
def test_the_gluon_qkv_kernel_compiles_for_hopper_within_its_shared_memory():
    # as the MLP kernels'; q, k, v and the row scales are checked against float64 on the GPU by
    # benchmarks/qkv_rotary.py before it times the kernel
    compiled, four = _shared_memory_at_three_and_four_stages(_compile_gluon_qkv)
    assert _issues_warpgroup_products_and_tma(compiled)
    assert compiled.metadata.shared <= SHARED_MEMORY < four, (compiled.metadata.shared, four)
    # the one-head tile the benchmark also times, at four stages (160 KB)
    one_head = _compile_gluon_qkv(stages=4, heads_per_tile=1)
    assert _issues_warpgroup_products_and_tma(one_head)
    assert one_head.metadata.shared <= SHARED_MEMORY, one_head.metadata.shared
    # the epilogue's other forms, which the benchmark times beside it
    from creditlab.kernels import qkv_hopper

    for epilogue in (qkv_hopper.EPILOGUE_V_AS_IS, qkv_hopper.EPILOGUE_TABLES_EARLY):
        form = _compile_gluon_qkv(stages=3, epilogue=epilogue)
        assert _issues_warpgroup_products_and_tma(form) and form.metadata.shared == compiled.metadata.shared
    # the epilogue in pieces beside the next tile's products: its own kernel, in the same shared memory, each
    # 32-row block of a tile leaving by its own store
    bm, bk, bn = qkv_hopper.BLOCK_M, qkv_hopper.BLOCK_K, 256
    overlapped = _compile_gluon(
        qkv_hopper._qkv_kernel_overlapped,
        {"a_desc": _gluon_descriptor([bm, bk]), "b_desc": _gluon_descriptor([bn, bk]),
         "out_desc": _gluon_descriptor([bm, bn]), "rows_desc": _gluon_descriptor([32, bn]), "scales": "*fp32",
         "cos": "*fp32", "sin": "*fp32", "M": "i32", "T": "i32", "eps": "fp32"},
        {"WIDTH": 512, "HD": 128, "K_STEPS": 512 // bk, "STAGES": 3, "GROUP": qkv_hopper.GROUP_M,
         "num_warps": qkv_hopper.WARPS}, qkv_hopper.WARPS)
    assert _issues_warpgroup_products_and_tma(overlapped)
    assert overlapped.metadata.shared == compiled.metadata.shared, overlapped.metadata.shared


def test_model_qk_kernel_gluon_reaches_the_gluon_kernel_where_it_takes_the_operands(monkeypatch):
    """model.qk_kernel=gluon (and gluon_overlapped, with its epilogue's form) sends the product to
    kernels/qkv_hopper.py where that kernel takes the operands, and model.qk_kernel=triton never does; on this CPU
    the Gluon kernel takes nothing."""
    from creditlab import qk_norm
    from creditlab.kernels import qkv_hopper
    from creditlab.model import Rotary

    g = torch.Generator().manual_seed(0)
    B, T, heads, hd, d = 2, 8, 2, 16, 24
    n, w = torch.randn(B, T, d, generator=g), torch.randn(3 * heads * hd, d, generator=g)
    rot = Rotary(hd, T, 10_000.0)
    assert not qkv_hopper.supported(n.view(B * T, d).bfloat16(), w.bfloat16(), heads)  # no Hopper GPU here
    want = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads, "gluon")  # the torch arithmetic
    calls = []

    def through_torch(x, w, cos, sin, heads, T, eps, **form):  # the kernel's contract, by the torch arithmetic
        calls.append((x.shape, form))
        q, k, v, scales = qk_norm.reference_forward((x @ w.t()).view(-1, T, w.shape[0]), cos, sin, heads, eps)
        return torch.stack((q, k, v)).view(3, x.shape[0], -1), scales.reshape(x.shape[0], 2, heads)

    monkeypatch.setattr(qkv_hopper, "supported", lambda x, w, heads: True)
    monkeypatch.setattr(qkv_hopper, "qkv_norm_rotary", through_torch)
    qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads, "triton")
    assert calls == []
    got = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads, "gluon")
    overlapped = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads, "gluon_overlapped")
    assert calls == [((B * T, d), {}), ((B * T, d), {"epilogue": qkv_hopper.EPILOGUE_OVERLAPPED})]
    for a, b, c in zip(got, want, overlapped):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(c, b)


@pytest.mark.parametrize("case", ["embedding_zipf", "embedding_one_token", "embedding_distinct", "embedding_few_tokens"])
def test_the_sorted_embedding_gradient_is_float64_index_add(report, case):
    # bf16 rows summed in float32: a run of 100 rows of unit scale rounds at about 1e-6
    r = report[case]
    assert r["dtype"] == "torch.float32" and r["abs"] < 2e-6 * max(r["scale"], 1.0), r


def test_the_embedding_gradients_comparison_fails_for_the_wrong_rows(report):
    r = report["embedding_unsorted_order"]  # the ids' permutation replaced by the identity
    assert r["abs"] > 0.1 * r["scale"], r


def test_the_fused_lookups_through_the_kernel_give_autograds_table_gradients(report):
    r = dict(report["embedding_lookups"])
    assert r.pop("out_dtype_bf16") == 1.0
    assert len(r) == 3 and max(r.values()) < 1e-5, r


def test_the_lookups_backward_operator_declares_its_shapes_truthfully(report):
    assert all(report["embedding_opcheck"].values()), report["embedding_opcheck"]


def test_the_product_operators_count_the_flops_of_the_products_they_replace():
    """A FLOP count (FlopCounterMode: the sketch's cost test, MFU checks) sees the Q/K/V product with its epilogue
    and the attention gate's passes as it sees the F.linear they stand in for, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from creditlab import qk_norm
    from creditlab.attention_gate import gate_linear
    from creditlab.model import Rotary

    g = torch.Generator().manual_seed(0)
    n = torch.randn(2, 8, 24, generator=g, requires_grad=True)
    rot = Rotary(16, 8, 10_000.0)

    def flops(fn, *operands):
        with FlopCounterMode(display=False) as counter:
            out = fn(*operands)
            torch.autograd.grad(sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))), operands)
        return counter.get_total_flops()

    w_qkv = torch.randn(96, 24, generator=g, requires_grad=True)
    w_gate = torch.randn(4, 12, generator=g, requires_grad=True)
    assert flops(lambda a, b: qk_norm.product_norm_rotary(a, b, rot.cos, rot.sin, 2), n, w_qkv) == \
        flops(torch.nn.functional.linear, n, w_qkv) == 3 * 2 * 16 * 24 * 96
    gate_input = n[..., :12]
    assert flops(gate_linear, gate_input, w_gate) == flops(torch.nn.functional.linear, gate_input, w_gate) > 0
