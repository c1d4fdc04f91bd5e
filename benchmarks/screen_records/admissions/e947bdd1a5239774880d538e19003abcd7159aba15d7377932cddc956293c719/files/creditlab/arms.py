"""Arms: a credit source plus a schedule plus overrides, by name.

An arm spec is a name, optionally with overrides of its own joined by '@':
`learned`, `learned@credit.schedule=adaptive`, `sketch@credit.sketch_rank=16`, `zero@credit.schedule=fixed:4`
(one native update in four, nothing injected in the others). The spec is the arm's label in
records and reports. `intermittent` is native backprop given the GPU-seconds of a reference arm (compare.py
derives its number of updates); it is built from the same parts as `native`, not special training code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from creditlab import config as config_mod


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    about: str
    budgeted: bool = False  # its update count comes from a reference arm's GPU-seconds


ARMS: dict[str, Arm] = {arm.name: arm for arm in (
    Arm("native", ("credit.source=exact",), "exact backpropagation"),
    Arm("oracle", ("credit.source=oracle",), "true corrections of the same batch injected (trains as native)"),
    Arm("zero", ("credit.source=zero",), "the 16 products omitted, nothing injected"),
    Arm("learned", ("credit.source=learned",), "learned predictor, one exact teacher update in credit.teacher_every"),
    Arm("typed", ("credit.source=typed",), "learned predictor with its code laid out by branch kind (attention: "
                                           "[m ; p], MLP: p of rank 2r)"),
    Arm("fitted_feedback", ("credit.source=fitted_feedback",), "a full least-squares map of the terminal error "
                                                                "per branch, fitted on teacher updates"),
    Arm("dfa", ("credit.source=dfa",), "fixed random feedback of the terminal error (calibrated to the true "
                                       "corrections' RMS on teacher updates with credit.dfa_scale=calibrated)"),
    Arm("fdfa", ("credit.source=fdfa",), "feedback operators estimated from forward-mode directional derivatives "
                                         "(no true gradients), on the schedule's exact updates"),
    Arm("sketch", ("credit.source=sketch",), "the omitted product itself through a rank-k factor of its weight "
                                             "(credit.sketch_rank)"),
    Arm("dni", ("credit.source=dni",), "predicted from each branch's own state, fitted on teacher updates"),
    Arm("intermittent", ("credit.source=exact",), "native backprop, fewer updates at the reference arm's "
                                                  "GPU-seconds, its schedule fully decayed", budgeted=True),
)}


@dataclass(frozen=True)
class ArmSpec:
    label: str  # as written: name[@key=value...]
    arm: Arm
    extra: tuple[str, ...]  # the spec's own overrides

    @property
    def overrides(self) -> tuple[str, ...]:
        return self.arm.overrides + self.extra


def parse_arm(text: str) -> ArmSpec:
    name, *extra = [part.strip() for part in text.strip().split("@")]
    if name not in ARMS:
        raise config_mod.ConfigError(f"unknown arm {name!r}; arms: {', '.join(ARMS)} "
                                     "(add overrides of an arm's own as name@section.key=value)")
    for item in extra:
        if "=" not in item:
            raise config_mod.ConfigError(f"arm {text!r}: {item!r} is not of the form section.key=value")
    return ArmSpec(text.strip(), ARMS[name], tuple(extra))


def parse_arms(text: str) -> list[ArmSpec]:
    # A comma before a digit belongs to an override's value (`learned@credit.schedule=warmup:20,4`): arm names
    # start with a letter.
    specs = [parse_arm(part) for part in re.split(r",(?!\s*\d)", text) if part.strip()]
    if not specs:
        raise config_mod.ConfigError("--arms needs at least one arm, e.g. --arms native,zero,learned")
    labels = [s.label for s in specs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise config_mod.ConfigError(f"arm(s) given twice: {', '.join(duplicates)}")
    return specs


def arm_config(preset: str, overrides, spec: ArmSpec, seed: int, updates: int | None = None) -> config_mod.Config:
    """The config of one arm at one seed: preset, the run's --set overrides, the arm's own, then the seed."""
    items = [*overrides, *spec.overrides, f"train.seed={seed}"]
    if updates is not None:
        items.append(f"train.updates={updates}")
    return config_mod.load(preset, items)
