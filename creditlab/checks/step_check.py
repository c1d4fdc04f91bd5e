"""The training step as it runs against the same step in float64, op by op.

`creditlab check` proves the credit path's algebra in float64 on the CPU, where every module is torch arithmetic
run eagerly. Training runs something else: the compiled step, in its precision (bf16 autocast on CUDA), through
the fused modules' Functions and their kernels, under whatever torch the machine has. This module runs one
micro-batch of each kind an arm trains with (native, synthetic, teacher) four ways from the same random weights
and inputs:

* **compiled**: the trainer's step as configured;
* **eager**: the same step with the compiler off (same precision, same kernels);
* **plain**: eager in the same precision on the same device, every fused module op by op (`GPT.op_by_op`), the
  head in plain precision and no kernel of ours: what torch arithmetic in this precision gives, the level a
  parameter is judged by;
* **reference**: the plain step in float64 on the CPU.

and gives each parameter's gradient error against the reference, ||g - g_ref|| / ||g_ref|| (on a teacher
micro-batch also what the fit gives the predictor: its gradients, statistics and moments). A compiled error far
above eager's is the compiler's (one torch version compiled an autograd Function's backward to zeros); an eager
error far above the plain step's is a fused module's, a Function's or a kernel's. A parameter of a few elements
(the scalar mixes, whose gradients are sums over every token and channel) can carry an error of order one in
bf16 in the plain step itself, and one draw of that noise is no level to judge by: such a parameter is listed as
not judged at that precision. Every weight is random: the zero-initialized projections and head would give
every branch's input a zero gradient and hide a wrong branch backward.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from creditlab import config as config_mod
from creditlab import ops
from creditlab.checks import randomize_, relative_error
from creditlab.data import SyntheticLoader

# The plain step's settings (besides its model op by op and our kernels off), and how the float64 reference runs.
PLAIN = ("model.head=plain", "train.compile=off")
PLAIN_REFERENCE = (*PLAIN, "train.device=cpu", "train.dtype=float64")

# A parameter is judged against its level, the plain step's error. The eager error is flagged over OVER_LEVEL
# times the level (a fused module's doing), the compiled error over OVER_LEVEL times the larger of eager's and
# the level (the compiler's): a dropped or doubled contribution gives errors of order one against a level of
# bf16's rounding, while the same precision in another order of operations stays within a small factor of the
# plain step. FLOOR keeps float32's level from being judged by its noise. The level is one draw of the rounding's
# noise, which sets a scale only over many elements: over k elements two draws' norms differ by a factor c with
# a chance of order c^-k (over two elements, more than 4 x in one case of 17), so a parameter of fewer than
# MIN_ELEMENTS is not judged where its level could reach FLOOR / OVER_LEVEL (the scalar mixes in bf16). A level
# over CEILING, where there are elements enough, is flagged: the plain step itself is off.
OVER_LEVEL = 4.0
FLOOR = 1e-3
MIN_ELEMENTS = 16
CEILING = 0.1
WAYS = ("compiled", "eager", "plain")


def kinds_of(source) -> list[str]:
    """The kinds of micro-batch an arm's source trains with."""
    if not source.omits:
        return ["native"]
    return ["synthetic", "teacher"] if source.fits else ["synthetic"]


@torch.no_grad()
def randomize(trainer, seed: int) -> None:
    """Every weight of the trainer's model random (checks.randomize_), and the source's all-zero parameters (the
    learned predictor's decoders) N(0, 0.3^2)."""
    torch.manual_seed(seed)
    randomize_(trainer.model)
    for p in trainer.source.parameters():
        if p.numel() and not p.any():
            p.normal_(0.0, 0.3)


def gradients(trainer, inputs: torch.Tensor, targets: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """What one micro-batch of `kind` through the trainer's own step computes, in float64 on the CPU: every model
    parameter's gradient and, where the source fits (a teacher micro-batch), the gradients its fit gave the
    source's parameters (`source.NAME`), the fit's statistics of each branch (`source.fit_statistics`) and with
    credit.fit=lstsq its moments (`source.fit_gram`, `source.fit_cross`)."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.source.zero_grad(set_to_none=True)
    device = trainer.runtime.device
    inputs, targets = inputs.to(device), targets.to(device)
    credit = trainer.source.context(trainer, inputs, targets, kind, 1.0)
    trainer.forward_backward(inputs, targets, credit, 1.0)
    trainer.source.after_backward(trainer, credit, kind)
    found = {name: p.grad if p.grad is not None else torch.zeros_like(p)
             for name, p in trainer.model.named_parameters()}
    found |= {f"source.{name}": p.grad for name, p in trainer.source.named_parameters() if p.grad is not None}
    teacher = getattr(trainer.source, "teacher", None)
    if kind == "teacher" and getattr(teacher, "stats", None):
        found["source.fit_statistics"] = teacher.stats[-1]
        if getattr(teacher, "moment_sums", None) is not None:  # credit.fit=lstsq: one micro-batch's moments
            found |= {"source.fit_gram": teacher.moment_sums[0], "source.fit_cross": teacher.moment_sums[1]}
    return {name: t.detach().to("cpu", torch.float64) for name, t in found.items()}


def check_step(preset: str, overrides, micro_batch: int = 2, seed: int = 0, say=print) -> dict:
    """One micro-batch of each kind the source of `preset` with `overrides` trains with, compiled, eager, plain and
    in the float64 reference (the module's docstring). Returns each kind's {parameter: {compiled, eager, plain}}
    errors, the flagged parameters, those too small to judge at this precision, and a verdict."""
    from creditlab.train import Trainer

    overrides = [*overrides, f"train.micro_batch={micro_batch}", "train.grad_accum=1"]
    made = {}
    for way, extra in (("compiled", ()), ("eager", ("train.compile=off",)), ("plain", PLAIN),
                       ("reference", PLAIN_REFERENCE)):
        cfg = config_mod.load(preset, [*overrides, *extra])
        loader = SyntheticLoader(cfg.model.vocab_size, micro_batch, cfg.model.seq_len, seed=seed)
        made[way] = Trainer(cfg, loader=loader)
    if not made["compiled"].runtime.compile:
        raise config_mod.ConfigError("the step check compares the compiled step with the eager one, but "
                                     "train.compile is off here; drop that override (or set train.compile=on)")
    randomize(made["compiled"], seed)
    for way in ("eager", "plain", "reference"):  # the same weights: load_state_dict casts to each model's dtype
        made[way].model.load_state_dict(made["compiled"].model.state_dict())
        made[way].source.load_state_dict(made["compiled"].source.state_dict())
    batch = made["reference"].loader.next()
    inputs, targets = batch[:, :-1], batch[:, 1:]

    errors, flagged, unjudged = {}, [], []
    for kind in kinds_of(made["compiled"].source):
        with warnings.catch_warnings():  # a compiler that fails must not be checked as its eager fallback
            warnings.filterwarnings("error", message="torch.compile failed")
            grads = {}
            for way, trainer in made.items():
                plain = way in ("plain", "reference")
                with contextlib.ExitStack() as stack:
                    if plain:
                        stack.enter_context(trainer.model.op_by_op())
                    if way == "plain":
                        stack.enter_context(ops.off())
                    grads[way] = gradients(trainer, inputs, targets, kind)
        reference = grads["reference"]
        # what the reference computes and a step left out counts as zeros
        errors[kind] = {name: {**{way: relative_error(grads[way].get(name, torch.zeros_like(want)), want)
                                  for way in WAYS}, "elements": want.numel()}
                        for name, want in reference.items()}
        for name, err in errors[kind].items():
            why = judge(err)
            if why == "unjudged":
                unjudged.append({"kind": kind, "parameter": name, **err})
            elif why:
                flagged.append({"kind": kind, "parameter": name, **err, "why": why})
        judged = judged_errors(errors[kind], unjudged, kind)
        left_out = len(errors[kind]) - len(judged)
        if judged:  # the largest over the judged parameters, as the benchmark's table reads them
            worst = largest(judged, "compiled")
            say(f"{kind}: largest judged compiled error {judged[worst]['compiled']:.2e} ({worst}; eager "
                f"{judged[worst]['eager']:.2e}, plain {judged[worst]['plain']:.2e}), "
                f"{sum(1 for f in flagged if f['kind'] == kind)} flagged, {left_out} not judged at this precision")
        else:
            say(f"{kind}: no parameter judged at this precision ({left_out} too small)")
    return {"errors": errors, "flagged": flagged, "unjudged": unjudged,
            "verdict": "consistent" if not flagged else "INCONSISTENT",
            "bounds": {"over_level": OVER_LEVEL, "floor": FLOOR, "min_elements": MIN_ELEMENTS, "ceiling": CEILING},
            "micro_batch": micro_batch, "seed": seed}


def judge(err: dict) -> str:
    """Why one parameter's errors {compiled, eager, plain, elements} are flagged: "" when they are not, "unjudged"
    when it has too few elements for its level to be judged at this precision (the bounds above)."""
    compiled, eager, level = err["compiled"], err["eager"], err["plain"]
    if not all(math.isfinite(e) for e in (compiled, eager, level)):
        return "not finite"
    if err["elements"] < MIN_ELEMENTS and level > FLOOR / OVER_LEVEL:
        return "unjudged"
    reasons = []
    if level > CEILING:
        reasons.append("plain over the ceiling")
    if eager > max(OVER_LEVEL * level, FLOOR):
        reasons.append("eager over plain")
    if compiled > max(OVER_LEVEL * max(eager, level), FLOOR):
        reasons.append("compiled over eager")
    return ", ".join(reasons)


def judged_errors(errors: dict, unjudged: list[dict], kind: str) -> dict:
    """One kind's {parameter: errors}, less the parameters `unjudged` lists for that kind."""
    left_out = {f["parameter"] for f in unjudged if f["kind"] == kind}
    return {name: err for name, err in errors.items() if name not in left_out}


def largest(errors: dict, way: str) -> str:
    """The parameter whose `way` (compiled, eager, plain) error is the largest, a NaN before any number."""
    return max(errors, key=lambda name: math.inf if math.isnan(errors[name][way]) else errors[name][way])
