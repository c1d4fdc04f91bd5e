"""The Triton kernels against float64 autograd, on the CPU through Triton's interpreter, and the kernels the step
runs on Hopper through Triton's compiler for sm_90.

The interpreter checks run in processes of their own, one a kernel file (tests/kernel_checks.py runs
tests/kernel_checks_<kernel>.py; the head loss's compiled-model checks in one more): a failure names its kernel,
and `-k` runs one kernel's tests alone. The processes a run needs start at its first kernel test, as many at once
as there are cores."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent

# The check processes (tests/kernel_checks.py's SPECs), each read by the fixture of its name; the longest first,
# so that the cores run out of work together. softcap_ce's compiled-model checks put a model through the
# compiler, most of the time of them all, so they run beside the kernel's others.
PROCESSES = {"compiled_head": "softcap_ce:compiled", "softcap_ce": "softcap_ce", "qkv_rotary": "qkv_rotary",
             "thin_linear": "thin_linear", "relu2_matmul": "relu2_matmul", "qk_norm_rotary": "qk_norm_rotary",
             "fit_rows": "fit_rows", "tiled_transpose": "tiled_transpose"}


class KernelChecks:
    """One tests/kernel_checks.py process for the check processes these tests read (it forks one a spec, one a
    core at once), its lines read as the checks finish."""

    TIMEOUT = 900  # seconds for them all: the slowest took about a minute on two cores

    def __init__(self, specs: list[str]):
        self.errors = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen([sys.executable, str(HERE / "kernel_checks.py"), *specs],
                                        env=dict(os.environ, PYTHONPATH=str(HERE.parent)), stdout=subprocess.PIPE,
                                        stderr=self.errors, text=True, start_new_session=True)
        self.timer = threading.Timer(self.TIMEOUT, self.close)
        self.timer.start()
        self.lines: dict[str, dict] = {}

    def report(self, fixture: str) -> dict:
        spec = PROCESSES[fixture]
        while spec not in self.lines:
            line = self.process.stdout.readline()
            if not line:  # ended, or stopped by the timer, before this spec's checks
                self.errors.seek(0)
                raise AssertionError(f"tests/kernel_checks.py ended (exit {self.process.wait()}) before the checks "
                                     f"of {spec}:\n{self.errors.read()[-3000:]}")
            record = json.loads(line)
            self.lines[record["spec"]] = record
        record = self.lines[spec]
        kernel, _, part = spec.partition(":")
        assert record["returncode"] == 0, (f"the checks of creditlab/ops/{kernel}.py{f' ({part})' if part else ''}"
                                           f" failed:\n{record['stderr']}")
        return record["report"]

    def close(self) -> None:
        self.timer.cancel()
        if self.process.poll() is None:
            try:  # it and the processes it forked: its session's process group
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass
        self.process.wait()


@pytest.fixture(scope="module")
def checks(request):
    """The processes of the kernels whose fixtures this run's selected tests use (all of a kernel's tests may be
    deselected by -k or -m, and then its process is not started)."""
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    started = KernelChecks([spec for fixture, spec in PROCESSES.items() if fixture in wanted])
    yield started
    started.close()


def _report(kernel: str):
    """The fixture named `kernel`: the report of its checks' process (started only if a selected test uses it)."""
    @pytest.fixture(scope="module", name=kernel)
    def report(checks):
        return checks.report(kernel)
    return report


compiled_head_report = _report("compiled_head")
softcap_ce_report = _report("softcap_ce")
tiled_transpose_report = _report("tiled_transpose")
relu2_matmul_report = _report("relu2_matmul")
qk_norm_rotary_report = _report("qk_norm_rotary")
qkv_rotary_report = _report("qkv_rotary")
thin_linear_report = _report("thin_linear")
fit_rows_report = _report("fit_rows")


def test_every_kernel_file_has_its_checks():
    # the Gluon files have no interpreter: their kernels are compiled for sm_90 below and checked on a GPU
    # (tests/test_gpu_kernels.py)
    kernels = {p.stem for p in (HERE.parent / "creditlab" / "ops").glob("*.py")  # the files that define a kernel
               if "@triton.jit" in p.read_text() or "@gluon.jit" in p.read_text()}
    checked = {p.stem.removeprefix("kernel_checks_") for p in HERE.glob("kernel_checks_*.py")}
    assert checked == {spec.partition(":")[0] for spec in PROCESSES.values()}
    assert kernels == checked | {"relu2_hopper", "qkv_hopper"}, kernels ^ (checked | {"relu2_hopper", "qkv_hopper"})


# creditlab/ops/softcap_ce.py

@pytest.mark.parametrize("case", ["one_block", "many_blocks", "saturated", "near_zero"])
def test_softcap_ce_matches_autograd_in_float32(softcap_ce, case):
    r = softcap_ce[case]
    assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 2e-6, r
    assert r["padding_grad_zero"]


def test_softcap_ce_reads_the_padding_but_gives_it_nothing(softcap_ce):
    # the loads are masked at the padded width (wide loads), so the padding columns are read: NaN and inf there
    # must reach neither the loss nor any gradient
    r = softcap_ce["nan_padding"]
    assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 2e-6, r
    assert r["padding_grad_zero"]


def test_softcap_ce_in_bf16_writes_bf16_gradients_to_bf16_accuracy(softcap_ce):
    r = softcap_ce["bf16"]
    assert r["grad_dtype"] == "torch.bfloat16"
    assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 8e-3, r


def test_the_benchmarks_variants_of_the_kernel_compute_the_same_loss(softcap_ce):
    # benchmarks/softcap_ce_held.py: one pass with the row held on chip, two passes with loads ahead, L2 hints or
    # a polynomial exp2; the failing comparison below is the same check against a different function
    variants = softcap_ce["softcap_variants"]
    assert len(variants) == 2 * 14, sorted(variants)
    for name, r in variants.items():
        assert r["loss_rel"] < 2e-6 and r["grad_abs"] < 2e-6 and r["padding_grad_zero"], (name, r)


def test_the_comparison_fails_for_a_different_function(softcap_ce):
    r = softcap_ce["wrong_cap"]  # the kernel at cap 15 against the reference at cap 14
    assert r["loss_rel"] > 1e-3 and r["grad_abs"] > 1e-3, r


def test_head_loss_through_the_kernel_matches_the_torch_arithmetic(softcap_ce):
    assert max(softcap_ce["head_loss"].values()) < 2e-6, softcap_ce["head_loss"]


def test_the_operator_declares_its_shapes_truthfully(softcap_ce):
    assert all(softcap_ce["opcheck"].values()), softcap_ce["opcheck"]


@pytest.mark.slow  # compiles the whole model (about 20 s on two cores)
def test_the_compiled_model_keeps_no_chunk_of_logits_for_the_backward(compiled_head):
    # The head loss as one operator: only grad_h and grad_w are kept, no chunk of logits (or their gradient).
    assert compiled_head["logits_kept_fused"] == 0, compiled_head
    # The same loop traced op by op (the earlier structure) kept both chunks' logits gradients: the check fails.
    assert compiled_head["logits_kept_op_by_op"] == 2, compiled_head


# creditlab/ops/tiled_transpose.py

@pytest.mark.parametrize("case", ["transpose_partial", "transpose_one_tile"])
def test_the_tiled_transpose_is_exact_and_writes_every_element(tiled_transpose, case):
    r = tiled_transpose[case]
    assert r["exact"] and r["dtype"] == "torch.float8_e5m2", r
    assert not r["equals_untransposed"], r  # a copy that did not transpose fails the same comparison


# creditlab/ops/relu2_matmul.py

@pytest.mark.parametrize("case", ["relu2_even", "relu2_partial", "relu2_one_subtile"])
def test_relu2_matmul_kernels_match_float64_and_write_every_element(relu2_matmul, case):
    r = relu2_matmul[case]
    assert r["all_written"], r
    for op in ("relu2_linear", "relu2_dgrad", "matmul_nk", "matmul_kn"):
        assert r[op] < 1e-5, (op, r)  # float32 accumulation of K <= 40 products


def test_the_relu2_comparison_fails_for_a_wrong_derivative(relu2_matmul):
    # the derivative epilogue (2 sqrt(post)) against a reference with relu(h) in place of 2 relu(h)
    assert relu2_matmul["relu2_wrong_derivative"]["relu2_dgrad"] > 0.5, relu2_matmul["relu2_wrong_derivative"]


def test_the_fused_mlp_through_the_kernels_matches_the_float64_mlp(relu2_matmul):
    r = relu2_matmul["fused_mlp"]
    assert r["epilogues_launched"] == [1, 2], r  # the ReLU^2 forward and the derivative epilogue ran
    assert max(r["errors"].values()) < 1e-5, r


# creditlab/ops/qk_norm_rotary.py

@pytest.mark.parametrize("case", ["qk_even", "qk_partial_rows", "qk_strided_rows"])
def test_qk_norm_rotary_kernels_match_the_float64_model_and_write_every_element(qk_norm_rotary, case):
    r = qk_norm_rotary[case]
    assert r["all_written"], r
    assert max(r[key] for key in ("q", "k", "v", "dqkv", "scales")) < 1e-6, r  # float32 arithmetic


def test_the_qk_comparison_fails_for_another_epsilon(qk_norm_rotary):
    r = qk_norm_rotary["qk_wrong_eps"]  # the kernel's norm at eps 1e-2 against the model's 1e-6
    assert min(r["q"], r["k"], r["dqkv"]) > 1e-4, r


# creditlab/ops/qkv_rotary.py

@pytest.mark.parametrize("case", ["qkv_two_heads_a_tile", "qkv_one_head_a_tile", "qkv_odd_heads"])
def test_the_qkv_product_with_qk_norm_in_its_epilogue_matches_float64_and_writes_every_element(qkv_rotary, case):
    r = qkv_rotary[case]
    assert r["all_written"], r
    assert max(r[key] for key in ("q", "k", "v", "scales")) < 1e-5, r  # float32 products over 24-40 terms


def test_the_qkv_comparison_fails_for_another_epsilon(qkv_rotary):
    r = qkv_rotary["qkv_wrong_eps"]  # the kernel's norm at eps 1e-2 against the model's 1e-6
    assert min(r["q"], r["k"]) > 1e-4 and r["v"] < 1e-5, r


def test_the_qkv_product_function_through_the_kernel_matches_the_float64_model(qkv_rotary):
    r = qkv_rotary["qkv_product"]
    assert r["launched"] == 1, r  # the forward went through the kernel
    assert max(r["errors"].values()) < 1e-5, r


def test_the_qkv_product_operator_declares_its_outputs_truthfully(qkv_rotary):
    assert qkv_rotary["qkv_opcheck"] == {"torch": ["SUCCESS"], "kernel": ["SUCCESS"]}, qkv_rotary["qkv_opcheck"]


# creditlab/ops/thin_linear.py

@pytest.mark.parametrize("case", ["thin_linear_gate", "thin_linear_odd", "thin_linear_one_block"])
def test_the_thin_products_kernels_match_float64_and_write_every_element(thin_linear, case):
    r = thin_linear[case]
    assert r["all_written"], r
    assert max(r["y"], r["dx"], r["dw"]) < 1e-5, r  # float32 sums of 12 terms, and of 300 for dw


def test_the_thin_product_comparison_fails_without_a_blocks_partial_sum(thin_linear):
    r = thin_linear["thin_linear_dropped_partial"]
    assert r["dw"] > 1e-3 and max(r["y"], r["dx"]) < 1e-5, r


def test_the_attention_gate_through_the_kernels_matches_float64_f_linear(thin_linear):
    r = thin_linear["attention_gate"]
    assert r["launched"] == ["forward", "backward"], r
    assert max(r["errors"].values()) < 1e-5, r


def test_the_attention_gate_operators_declare_their_outputs_truthfully(thin_linear):
    assert thin_linear["attention_gate_opcheck"] == {"torch": ["SUCCESS"], "kernel": ["SUCCESS"]}, \
        thin_linear["attention_gate_opcheck"]


# creditlab/ops/fit_rows.py

@pytest.mark.parametrize("case", ["fit_rows", "fit_rows_one_program"])
def test_fit_rows_kernel_matches_float64_and_writes_every_element(fit_rows, case):
    r = fit_rows[case]
    assert r["all_written"], r
    assert max(r[k] for k in ("gated", "code_grad", "gate_grad", "sums", "gram")) < 1e-5, r


def test_the_fit_rows_comparison_fails_for_a_wrong_gate_derivative(fit_rows):
    r = fit_rows["fit_rows_wrong_derivative"]
    assert r["gate_grad"] > 1e-2 and r["code_grad"] < 1e-5, r


def test_the_rank_space_fit_through_the_kernel_matches_its_float64_op_by_op_path(fit_rows):
    r = fit_rows["rank_space_fit"]
    assert r["launched"] == 1, r  # the kernel ran, not the fallback
    assert max(r["errors"].values()) < 1e-5, r


def test_the_fit_rows_operator_declares_its_shapes_truthfully(fit_rows):
    assert fit_rows["fit_rows_opcheck"] and all(fit_rows["fit_rows_opcheck"].values()), fit_rows["fit_rows_opcheck"]


# The kernels the step runs on Hopper, through Triton's compiler for sm_90 (on the CPU: no GPU needed)

def _hopper_cases():
    """(kernel, its arguments' types in order, constants, warps) at the seed shape, for the Triton kernels the step
    runs on Hopper; a TMA descriptor typed as the launch's host-built TensorDescriptor types it."""
    from creditlab.ops import fit_rows, qk_norm_rotary as qk, softcap_ce, tiled_transpose
    from creditlab.ops import qkv_rotary as qkv, relu2_matmul as mlp, thin_linear as thin

    qkv_tiles, tiles, expand = qkv.DEFAULT_TILES, fit_rows.DEFAULT_TILES, mlp.EXPAND_TILES
    epilogue_block = f"tensordesc<bf16[{expand.block_m}, {expand.block_n // expand.subtiles}]>"
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
        # only the compile is checked here; the values are checked on a GPU by tests/test_gpu_kernels.py)
        "softcap_ce_fp8": (softcap_ce._softcap_ce_rows, ["*bf16", "*fp8e5", "*i64", "*fp32", "i32", "fp32", "fp32"],
                           {"vocab": 12289, "padded": 12352, "BLOCK": softcap_ce.DEFAULT_BLOCK, "FAST": True,
                            "STAGES": softcap_ce.DEFAULT_STAGES}, softcap_ce.DEFAULT_WARPS),
        "transpose": (tiled_transpose._transpose, ["*u8", "*u8", "i32", "i32"], {"BLOCK": tiled_transpose.BLOCK},
                      tiled_transpose.WARPS),
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
        # the MLP's expansion (its derivative product runs in Gluon on Hopper, compiled below)
        "relu2_expand": (mlp._matmul_kernel, [f"tensordesc<bf16[{expand.block_m}, {expand.block_k}]>",
                                              f"tensordesc<bf16[{expand.block_n}, {expand.block_k}]>",
                                              epilogue_block, epilogue_block, "i32", "i32", "i32"],
                         {"BLOCK_M": expand.block_m, "BLOCK_N": expand.block_n, "BLOCK_K": expand.block_k,
                          "GROUP_M": expand.group_m, "PROGRAMS": 132, "B_IS_KN": False,
                          "EPILOGUE": mlp.EPILOGUE_RELU2, "SUBTILES": expand.subtiles}, expand.warps),
    }


SHARED_MEMORY = 227 * 1024  # a Hopper multiprocessor's, per program


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fit_rows", "qk_forward", "qk_backward", "softcap_ce", "softcap_ce_fp8", "transpose",
                                  "qkv_rotary", "thin_forward", "thin_backward", "relu2_expand"])
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


def _compile_gluon(kernel, signature: dict, constants: dict, warps: int):
    """A Gluon kernel through Triton's compiler to a cubin for sm_90, on the CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource(fn=kernel, signature=signature | {k: "constexpr" for k in constants},
                            constexprs=constants)
    try:
        return triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except RuntimeError as error:  # no ptxas in this Triton install
        if "ptxas" in str(error):
            pytest.skip(str(error))
        raise


def _compile_gluon_dgrad(stages: int):
    """The fused MLP's Gluon derivative product (kernels/relu2_hopper.py, the one the step runs: relu2.py) at the
    seed shape's constants (131,072 tokens, 512 -> 2,048)."""
    from creditlab.ops import relu2_hopper as hopper

    bm, bn, bk = hopper.BLOCK_M, hopper.BLOCK_N, hopper.BLOCK_K
    constants = {"K_STEPS": 512 // bk, "B_IS_KN": True, "EPILOGUE": hopper.EPILOGUE_RELU2_GRAD, "POST_STEP": 3,
                 "STAGES": stages, "GROUP": hopper.GROUP_M, "num_warps": hopper.WARPS}
    signature = {"a_desc": _gluon_descriptor([bm, bk]), "b_desc": _gluon_descriptor([bk, bn]),
                 "post_desc": _gluon_descriptor([bm, bn]), "c_desc": _gluon_descriptor([bm, bn]), "M": "i32",
                 "N": "i32"}
    return _compile_gluon(hopper._mlp_kernel, signature, constants, hopper.WARPS)


def _compile_gluon_qkv(stages: int, heads_per_tile: int = 2):
    """The Gluon Q/K/V product with QK-norm and rotary in its epilogue (kernels/qkv_hopper.py) at the seed shape's
    constants (512 -> 3 x 512, 4 heads of 128), tiles one or two heads wide."""
    from creditlab.ops import qkv_hopper

    bm, bk, bn = qkv_hopper.BLOCK_M, qkv_hopper.BLOCK_K, 128 * heads_per_tile
    constants = {"WIDTH": 512, "HD": 128, "K_STEPS": 512 // bk, "STAGES": stages, "GROUP": qkv_hopper.GROUP_M,
                 "POST_STEP": qkv_hopper.POST_STEP, "num_warps": qkv_hopper.WARPS}
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
def test_the_gluon_derivative_kernel_compiles_for_hopper_within_its_shared_memory():
    # Gluon has no interpreter: the kernel's arithmetic is checked against float64 on a GPU
    # (tests/test_gpu_kernels.py, benchmarks/relu2_hopper.py); here, that it compiles to warpgroup products and
    # TMA copies within the shared memory, and (the check can fail) that a fourth stage of operands, 48 KB more,
    # does not fit
    compiled, four = _shared_memory_at_three_and_four_stages(_compile_gluon_dgrad)
    assert _issues_warpgroup_products_and_tma(compiled)
    assert compiled.metadata.shared <= SHARED_MEMORY < four, (compiled.metadata.shared, four)


@pytest.mark.slow
def test_the_gluon_qkv_kernel_compiles_for_hopper_within_its_shared_memory():
    # as the MLP kernel's; q, k, v and the row scales are checked against float64 on a GPU
    # (tests/test_gpu_kernels.py, benchmarks/qkv_rotary.py)
    compiled, four = _shared_memory_at_three_and_four_stages(_compile_gluon_qkv)
    assert _issues_warpgroup_products_and_tma(compiled)
    assert compiled.metadata.shared <= SHARED_MEMORY < four, (compiled.metadata.shared, four)
    # the one-head tile the benchmark also times, at four stages (160 KB)
    one_head = _compile_gluon_qkv(stages=4, heads_per_tile=1)
    assert _issues_warpgroup_products_and_tma(one_head)
    assert one_head.metadata.shared <= SHARED_MEMORY, one_head.metadata.shared


def test_the_qkv_product_reaches_the_gluon_kernel_where_it_takes_the_operands(monkeypatch):
    """The Q/K/V product goes to kernels/qkv_hopper.py where that kernel takes the operands (qkv_hopper.supported:
    Hopper with Gluon, tokens a whole number of tiles) and nowhere else; on this CPU the Gluon kernel takes
    nothing."""
    from creditlab.ops import qk_norm
    from creditlab.ops import qkv_hopper
    from creditlab.model import Rotary

    g = torch.Generator().manual_seed(0)
    B, T, heads, hd, d = 2, 8, 2, 16, 24
    n, w = torch.randn(B, T, d, generator=g), torch.randn(3 * heads * hd, d, generator=g)
    rot = Rotary(hd, T, 10_000.0)
    assert not qkv_hopper.supported(n.view(B * T, d).bfloat16(), w.bfloat16(), heads)  # no Hopper GPU here
    want = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads)  # the torch arithmetic
    calls = []

    def through_torch(x, w, cos, sin, heads, T, eps):  # the kernel's contract, by the torch arithmetic
        calls.append((tuple(x.shape), T, eps))
        q, k, v, scales = qk_norm.reference_forward((x @ w.t()).view(-1, T, w.shape[0]), cos, sin, heads, eps)
        return torch.stack((q, k, v)).view(3, x.shape[0], -1), scales.reshape(x.shape[0], 2, heads)

    monkeypatch.setattr(qkv_hopper, "qkv_norm_rotary", through_torch)
    qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads)
    assert calls == []  # the kernel does not take the operands: never called
    monkeypatch.setattr(qkv_hopper, "supported", lambda x, w, heads: True)
    got = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads)
    assert calls == [((B * T, d), T, qk_norm.EPS)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_product_operators_count_the_flops_of_the_products_they_replace():
    """A FLOP count (FlopCounterMode: the sketch's cost test, MFU checks) sees the Q/K/V product with its epilogue
    and the attention gate's passes as it sees the F.linear they stand in for, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from creditlab.ops import qk_norm
    from creditlab.ops.attention_gate import gate_linear
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
