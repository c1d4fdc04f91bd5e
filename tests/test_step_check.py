"""The step check (creditlab/checks/step_check.py): the trainer's compiled step against its float64 plain reference,
here with the aot_eager backend (no C++ toolchain needed) in float32 on the CPU."""

from __future__ import annotations

import functools

import pytest
import torch

from creditlab import config
from creditlab import runtime as rt
from creditlab.checks import step_check
from creditlab.credit import registry
from creditlab.model import GPT

TINY = ["model.vocab_size=97", "train.compile=on"]


@pytest.fixture
def aot_eager(monkeypatch):
    """The trainer's torch.compile with the given backend (aot_eager unless a test passes its own)."""
    def use(backend="aot_eager"):
        monkeypatch.setattr(rt.torch, "compile", functools.partial(torch.compile, backend=backend))
    use()
    yield use
    torch._dynamo.reset()


@pytest.mark.parametrize("source, kinds", [("exact", ["native"]), ("zero", ["synthetic"]),
                                           ("learned", ["synthetic", "teacher"]),
                                           pytest.param("learned@credit.fit=lstsq", ["synthetic", "teacher"],
                                                        marks=pytest.mark.slow)])
def test_the_compiled_step_agrees_with_the_float64_reference(source, kinds, aot_eager):
    source, *extra = source.split("@")
    result = step_check.check_step("tiny", [*TINY, f"credit.source={source}", *extra], say=lambda line: None)
    assert list(result["errors"]) == kinds
    assert result["verdict"] == "consistent" and not result["flagged"] and not result["unjudged"]
    names = [name for name, _ in GPT(config.load("tiny", TINY).model).named_parameters()]
    for kind, errors in result["errors"].items():
        assert list(errors)[:len(names)] == names  # every parameter of the model
        fitted = list(errors)[len(names):]  # and on a teacher micro-batch, what the fit gave the source
        assert ("source.fit_statistics" in fitted and "source.predictor.decoders" in fitted) == (kind == "teacher")
        assert ("source.fit_gram" in fitted and "source.fit_cross" in fitted) == (kind == "teacher" and bool(extra))
        for err in errors.values():  # float32 against float64
            assert 0 < err["compiled"] < 1e-4 and 0 < err["eager"] < 1e-4 and 0 < err["plain"] < 1e-4


# The quick run checks the cheap ones; exact, zero and learned are checked just above, and the slow run checks all.
SLOW_TO_COMPILE = ("exact", "zero", "learned", "typed", "dni", "fdfa", "fitted_feedback", "dfa", "oracle")


@pytest.mark.parametrize("source", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_TO_COMPILE else s
                                    for s in registry.SOURCES])
def test_every_registered_source_compiles_to_the_float64_gradients(source, aot_eager):
    """A new source is one class and one registration line: its step is checked here with no test of its own."""
    result = step_check.check_step("tiny", [*TINY, f"credit.source={source}"], say=lambda line: None)
    assert result["verdict"] == "consistent" and not result["unjudged"], result["flagged"]
    assert all(err["compiled"] < 1e-4 for errors in result["errors"].values() for err in errors.values())


def _dropping_backend(output: int):
    """aot_eager whose compiled backward returns zeros for its `output`-th gradient: a compiler that drops one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def forward(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def backward(gm, example_inputs):
        def run(*args):
            outs = list(gm(*args))
            outs[output] = torch.zeros_like(outs[output])
            return outs
        return make_boxed_func(run)

    return aot_autograd(fw_compiler=forward, bw_compiler=backward)


def test_a_compiler_that_drops_a_gradient_is_flagged(aot_eager):
    aot_eager(_dropping_backend(output=1))
    result = step_check.check_step("tiny", [*TINY, "credit.source=exact"], say=lambda line: None)
    assert result["verdict"] == "INCONSISTENT"
    flagged = {f["parameter"] for f in result["flagged"]}
    assert flagged  # the dropped gradient, and whatever it reaches
    for f in result["flagged"]:
        assert f["why"] == "compiled over eager" and f["eager"] < 1e-4
        assert f["compiled"] > step_check.OVER_LEVEL * f["eager"]


def test_a_wrong_function_in_both_steps_is_flagged(aot_eager, monkeypatch):
    # The keep_output norm's backward (the fused steps') doubled; the reference's plain norm is autograd's.
    from creditlab import model

    backward = model.norm_backward
    monkeypatch.setattr(model, "norm_backward", lambda dn, n, scale: 2 * backward(dn, n, scale))
    result = step_check.check_step("tiny", [*TINY, "credit.source=exact"], say=lambda line: None)
    assert result["verdict"] == "INCONSISTENT"
    assert result["flagged"] and all(f["why"] == "eager over plain" for f in result["flagged"])
    for f in result["flagged"]:  # wrong in the compiled and the eager step alike, right in the plain one
        assert f["plain"] < 1e-4 and f["eager"] > 1e-2 and f["compiled"] == pytest.approx(f["eager"], rel=1e-2)


@pytest.mark.parametrize("compiled, eager, plain, elements, why", [
    (0.012, 0.013, 0.012, 512, ""),  # bf16's level, in three orders of operations
    (0.04, 0.04, 0.012, 512, ""),  # a fused module less precise than torch's, within the allowance
    (0.06, 0.06, 0.012, 512, "eager over plain"),  # beyond it: a Function's or a kernel's error, in both steps
    (0.9, 0.012, 0.012, 512, "compiled over eager"),  # the compiler's
    (0.9, 0.5, 0.012, 512, "eager over plain"),  # the compiler keeps the error it was given
    (3.0, 0.5, 0.012, 512, "eager over plain, compiled over eager"),
    (0.2, 0.2, 0.2, 512, "plain over the ceiling"),
    (7.0, 0.9, 1.2, 2, "unjudged"),  # a scalar mix in bf16: its level is one draw of the rounding's noise
    (7.0, 0.9, 1.2, 48, "plain over the ceiling, compiled over eager"),  # with elements enough it is judged
    (0.5, 1e-7, 1e-7, 2, "compiled over eager"),  # in float32 a scalar mix is judged: its noise is far below FLOOR
    (2e-4, 1e-7, 1e-7, 2, ""),  # and float32's noise is not flagged
    (float("nan"), 1e-7, 1e-7, 512, "not finite"),
])
def test_each_parameter_is_judged_against_the_plain_steps_level(compiled, eager, plain, elements, why):
    assert step_check.judge({"compiled": compiled, "eager": eager, "plain": plain, "elements": elements}) == why


def test_the_plain_step_runs_without_the_kernels(aot_eager, monkeypatch):
    from creditlab import ops

    class OnCuda:
        is_cuda = True

    monkeypatch.setattr(ops, "triton", object())  # a machine with Triton, a tensor on CUDA
    assert ops.available(OnCuda())
    with ops.off():
        assert not ops.available(OnCuda())
    assert ops.available(OnCuda())

    def op_by_op(model) -> bool:
        return all(m.op_by_op for m in model.modules() if isinstance(getattr(m, "op_by_op", None), bool))

    seen = []
    gradients = step_check.gradients
    monkeypatch.setattr(step_check, "gradients", lambda trainer, *args: (
        seen.append((op_by_op(trainer.model), trainer.runtime.device.type, ops._off)), gradients(trainer, *args))[1])
    step_check.check_step("tiny", [*TINY, "credit.source=exact"], say=lambda line: None)
    # compiled, eager, plain, reference: the plain step and the reference op by op, and only the plain step (on the
    # step's own device) with our kernels off
    assert seen == [(False, "cpu", False), (False, "cpu", False), (True, "cpu", True), (True, "cpu", False)]


@pytest.mark.slow
def test_the_benchmark_writes_every_arms_table_and_exits_1_when_anything_is_flagged(tmp_path, monkeypatch, aot_eager):
    """benchmarks/step_gradients.py end to end on the CPU (its GPU-only parts stood in for): the table has a row
    per arm and kind, the JSON every parameter; a dropped gradient makes the verdict and the exit status."""
    import json
    import sys

    from benchmark_scripts import load

    script = load("step_gradients")
    monkeypatch.setattr(script, "gpu_benchmark_folder", lambda out: (tmp_path / out).resolve())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "cpu")
    argv = ["step_gradients.py", "--preset", "tiny", "--arms", "native,learned", "--set", "model.vocab_size=97",
            "--set", "train.compile=on"]
    (tmp_path / "good").mkdir()
    monkeypatch.setattr(sys, "argv", [*argv, "--out", "good"])
    assert script.main() == 0
    table = (tmp_path / "good" / "step_gradients.md").read_text()
    assert [line.split(" | ")[:2] for line in table.splitlines() if line.startswith("| native") or
            line.startswith("| learned")] == [["| native", "native"], ["| learned", "synthetic"],
                                               ["| learned", "teacher"]]
    assert "Verdict: **consistent**" in table
    assert (tmp_path / "good" / "step_gradients.png").stat().st_size > 10_000
    result = json.loads((tmp_path / "good" / "step_gradients.json").read_text())
    assert set(result["arms"]["learned"]["errors"]) == {"synthetic", "teacher"}

    aot_eager(_dropping_backend(output=1))
    (tmp_path / "bad").mkdir()
    monkeypatch.setattr(sys, "argv", [*argv, "--out", "bad"])
    assert script.main() == 1
    assert "Verdict: **INCONSISTENT**" in (tmp_path / "bad" / "step_gradients.md").read_text()


def test_the_check_refuses_a_step_that_is_not_compiled_and_a_compiler_that_falls_back(aot_eager):
    with pytest.raises(config.ConfigError, match="train.compile is off"):
        step_check.check_step("tiny", ["model.vocab_size=97", "credit.source=exact"])  # the CPU's default: off

    def failing(gm, example_inputs):
        raise RuntimeError("this backend cannot compile")

    aot_eager(failing)
    with pytest.raises(Exception, match="torch.compile failed"):
        step_check.check_step("tiny", [*TINY, "credit.source=exact"], say=lambda line: None)
