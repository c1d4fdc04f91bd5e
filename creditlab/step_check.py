"""The training step as it runs against the same step in float64, op by op.

`creditlab check` proves the credit path's algebra in float64 on the CPU, where every module is torch arithmetic
run eagerly. Training runs something else: the compiled step, in its precision (bf16 autocast on CUDA), through
the fused modules' Functions and their kernels, under whatever torch the machine has. This module runs one
micro-batch of each kind an arm trains with (native, synthetic, teacher) three ways from the same random
weights and inputs:

* **compiled**: the trainer's step as configured;
* **eager**: the same step with the compiler off (same precision, same kernels);
* **reference**: float64 on the CPU, eager, with every fused module, kernel and option at its plain form.

and gives each parameter's gradient error against the reference, ||g - g_ref|| / ||g_ref|| (on a teacher
micro-batch also what the fit gives the predictor: its gradients, statistics and moments). Eager's error is
the precision's; a compiled error far above it is the compiler's (one torch version compiled an autograd
Function's backward to zeros), and an error far above the precision in both is a kernel's or a Function's.
Every weight is random: the zero-initialized projections and head would give every branch's input a zero
gradient and hide a wrong branch backward.
"""

from __future__ import annotations

import math
import warnings

import torch

from creditlab import config as config_mod
from creditlab.checks import randomize_, relative_error
from creditlab.data import SyntheticLoader

# The options whose fused forms the reference replaces by torch arithmetic (the defaults of records that predate
# them; config.Config.from_dict), and how the reference runs.
PLAIN_REFERENCE = ("model.mlp=plain", "model.qk=plain", "model.norm=plain", "model.attn_gate=plain",
                   "model.embed=plain", "model.head=plain", "model.recompute=none", "credit.decode=plain",
                   "credit.gates=separate", "credit.products=plain", "credit.fit_rows=plain",
                   "train.device=cpu", "train.dtype=float64", "train.compile=off", "train.prefetch=false")

# A compiled gradient is flagged when its error is over COMPILED_OVER_EAGER times eager's and over FLOOR (so
# that parameters whose eager error is at float32's level are not flagged for noise): the compiler's doing. Any
# gradient, compiled or eager, is flagged when its error is over CEILING: a dropped or doubled contribution gives
# errors of order one, bf16's rounding through the model should stay well under it (benchmarks/ measures it).
COMPILED_OVER_EAGER = 2.0
FLOOR = 1e-3
CEILING = 0.1


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
    """One micro-batch of each kind the source of `preset` with `overrides` trains with, compiled, eager and in the
    float64 reference (the module's docstring). Returns each kind's {parameter: {compiled, eager}} errors, the
    flagged parameters and a verdict."""
    from creditlab.train import Trainer

    overrides = [*overrides, f"train.micro_batch={micro_batch}", "train.grad_accum=1"]
    made = {}
    for way, extra in (("compiled", ()), ("eager", ("train.compile=off",)), ("reference", PLAIN_REFERENCE)):
        cfg = config_mod.load(preset, [*overrides, *extra])
        loader = SyntheticLoader(cfg.model.vocab_size, micro_batch, cfg.model.seq_len, seed=seed)
        made[way] = Trainer(cfg, loader=loader)
    if not made["compiled"].runtime.compile:
        raise config_mod.ConfigError("the step check compares the compiled step with the eager one, but "
                                     "train.compile is off here; drop that override (or set train.compile=on)")
    randomize(made["compiled"], seed)
    for way in ("eager", "reference"):  # the same weights: load_state_dict casts to each model's dtype
        made[way].model.load_state_dict(made["compiled"].model.state_dict())
        made[way].source.load_state_dict(made["compiled"].source.state_dict())
    batch = made["reference"].loader.next()
    inputs, targets = batch[:, :-1], batch[:, 1:]

    errors, flagged = {}, []
    for kind in kinds_of(made["compiled"].source):
        with warnings.catch_warnings():  # a compiler that fails must not be checked as its eager fallback
            warnings.filterwarnings("error", message="torch.compile failed")
            grads = {way: gradients(trainer, inputs, targets, kind) for way, trainer in made.items()}
        reference = grads["reference"]
        # what the reference computes and a step left out counts as zeros
        errors[kind] = {name: {way: relative_error(grads[way].get(name, torch.zeros_like(want)), want)
                               for way in ("compiled", "eager")}
                        for name, want in reference.items()}
        for name, err in errors[kind].items():
            compiled, eager = err["compiled"], err["eager"]
            if compiled > max(COMPILED_OVER_EAGER * eager, FLOOR):
                flagged.append({"kind": kind, "parameter": name, **err, "why": "compiled over eager"})
            elif not max(compiled, eager) <= CEILING:  # NaN is flagged too
                flagged.append({"kind": kind, "parameter": name, **err, "why": "over the ceiling"})
        worst = largest(errors[kind], "compiled")
        say(f"{kind}: largest compiled error {errors[kind][worst]['compiled']:.2e} ({worst}; eager "
            f"{errors[kind][worst]['eager']:.2e}), {sum(1 for f in flagged if f['kind'] == kind)} flagged")
    return {"errors": errors, "flagged": flagged, "verdict": "consistent" if not flagged else "INCONSISTENT",
            "bounds": {"compiled_over_eager": COMPILED_OVER_EAGER, "floor": FLOOR, "ceiling": CEILING},
            "micro_batch": micro_batch, "seed": seed}


def largest(errors: dict, way: str) -> str:
    """The parameter whose `way` (compiled, eager) error is the largest, a NaN before any number."""
    return max(errors, key=lambda name: math.inf if math.isnan(errors[name][way]) else errors[name][way])
