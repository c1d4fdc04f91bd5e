"""Arms: a credit source plus a schedule plus overrides, by name.

An arm spec is a name, optionally with overrides of its own joined by '@':
`learned`, `learned@credit.schedule=adaptive`, `sketch@credit.sketch_rank=16`, `zero@credit.schedule=fixed:4`
(one native update in four, nothing injected in the others). The spec is the arm's label in
records and reports. Every credit source is an arm of its own name (`exact`'s is `native`): `compare`, the
resource screen and the arms benchmark read one registry. `intermittent` is native backprop given the GPU-seconds of a reference arm (compare.py
derives its number of updates); it is built from the same parts as `native`, not special training code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from creditlab import config as config_mod
from creditlab.credit import registry
from creditlab.credit.schedules import plan_for


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]
    source: str  # the credit source it runs
    budgeted: bool = False  # its update count comes from a reference arm's GPU-seconds
    note: str | None = None  # what it is, where the source's own `about` does not say it

    @property
    def about(self) -> str:
        """One line on what the arm is (read from its source's class: imported only when asked)."""
        return self.note or registry.source_class(self.source).about


class _Registry(Mapping):
    """The arms by name: `native` (the `exact` source), one arm per other credit source of credit/registry.py
    (named as the source, its `about` line the source's), and `intermittent`. Built from the sources' registry
    when first read, so a source registered there is an arm of every command, with no second list."""

    def _arms(self) -> dict[str, Arm]:
        key = tuple(registry.SOURCES.items())  # built again when a source is registered
        if getattr(self, "_key", None) != key:
            sources = [Arm(name, (f"credit.source={name}",), name) for name in registry.SOURCES if name != "exact"]
            self._key = key
            self._built = {arm.name: arm for arm in (
                Arm("native", ("credit.source=exact",), "exact"), *sources,
                Arm("intermittent", ("credit.source=exact",), "exact", budgeted=True,
                    note="native backprop, fewer updates at the reference arm's GPU-seconds, its schedule fully "
                         "decayed"))}
        return self._built

    def __getitem__(self, name: str) -> Arm:
        return self._arms()[name]

    def __iter__(self):
        return iter(self._arms())

    def __len__(self) -> int:
        return len(self._arms())


ARMS: Mapping[str, Arm] = _Registry()


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
        if item.partition("=")[0].strip() == "credit.source":
            raise config_mod.ConfigError(f"arm {text!r}: an arm's own overrides may not change its credit source "
                                         f"(the arm is named by it); name the arm by the source instead, e.g. "
                                         f"{item.partition('=')[2].strip()}@...")
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


# ---- what a comparison adds to the listed arms: fair floors and native's budgets -----------------------------

@dataclass
class Role:
    """Why an arm is in a comparison and what it is judged against."""
    added: str | None = None  # None: listed by the user; "floor" or "budget": added by the comparison
    floor: str | None = None  # the label of the arm's floor (`zero` under the arm's schedule), if it has one
    floor_note: str = ""  # why the arm has no floor, or what its floor is
    budget: float | None = None  # a native budget: its fraction of train.updates
    floor_of: list[str] = field(default_factory=list)  # the arms this arm is the floor of

    def to_dict(self) -> dict:
        return {"added": self.added, "floor": self.floor, "floor_note": self.floor_note, "budget": self.budget,
                "floor_of": list(self.floor_of)}


def _plan(cfg: config_mod.Config):
    source = registry.source_class(cfg.credit.source)
    return source, plan_for(cfg.credit.schedule, cfg.credit.teacher_every, source.omits, source.fits_with(cfg))


def exact_updates(cfg: config_mod.Config) -> list[int]:
    """The updates of a run of `cfg` that are exact (teacher or native) although its source omits products; an
    adaptive schedule's first decision only (its later ones depend on the run)."""
    source, plan = _plan(cfg)
    if not source.omits:
        return []
    return [u for u in range(cfg.train.updates) if plan.kind(u) != "synthetic"]


# What an arm writes, not what it computes: an arm's own override of one of these does not make its floor another
RECORDING_KEYS = (*config_mod.COSMETIC_KEYS, "train.checkpoint_every")


def floor_spec(spec: ArmSpec, cfg: config_mod.Config) -> tuple[str | None, str]:
    """The label of an arm's floor and a note on it. An arm whose source omits the products is judged against
    `zero` (nothing injected) with the same exact updates: zero under the arm's schedule where it has exact
    updates, plain zero where it has none. The floor keeps the arm's own overrides outside [credit], but for those
    that only say what is written (RECORDING_KEYS). An arm that omits nothing (native, intermittent) or injects
    nothing (zero) has none; nor has an adaptive schedule, whose exact updates depend on the run."""
    source, plan = _plan(cfg)
    if not source.omits or cfg.credit.source == "zero":
        return None, "its own floor" if cfg.credit.source == "zero" else "omits nothing"
    exact = plan.schedule.spec()
    if exact is None:
        return None, (f"no fixed floor: credit.schedule={cfg.credit.schedule} decides its exact updates from "
                      "the run")
    kept = [item for item in spec.extra if not item.strip().startswith("credit.")
            and item.partition("=")[0].strip() not in RECORDING_KEYS]
    if exact_updates(cfg):
        kept.append(f"credit.schedule={exact}")
        note = f"zero with the same exact updates ({plan.schedule.describe()})"
    else:
        note = "plain zero: the arm has no exact update"
    return "@".join(["zero", *kept]), note


def budget_label(updates: int, base_updates: int) -> str:
    return "native" if updates == base_updates else f"native@train.updates={updates}"


def budget_updates(fraction: float, base_updates: int) -> int:
    return max(1, round(fraction * base_updates))


def resolve_arms(specs: list[ArmSpec], preset: str, overrides, floors: bool = True,
                 budgets: list[float] = ()) -> tuple[list[ArmSpec], dict[str, Role]]:
    """The listed arms with what judging them needs: native at each budget (fractions of train.updates) and the
    fair floor of each arm that has one. An added arm that one of the listed arms already is (the same config)
    is not added twice: the listed one serves. Returns the arms in their running order (listed first) and each
    arm's role."""
    def identity(spec: ArmSpec, updates: int | None = None) -> str:
        try:
            return config_mod.Config.to_json(arm_config(preset, overrides, spec, 0, updates))
        except config_mod.ConfigError:  # refused later, naming the arm (CompareRun.check)
            return f"invalid: {spec.label}"

    base = config_mod.load(preset, list(overrides))
    out = list(specs)
    roles = {s.label: Role() for s in specs}
    by_identity = {identity(s): s.label for s in specs if not s.arm.budgeted}

    def add(label: str, role: Role) -> str:
        spec = parse_arm(label)
        known = by_identity.get(identity(spec))
        if known is not None:
            if roles[known].added is None and role.budget is not None:
                roles[known].budget = role.budget
            return known
        out.append(spec)
        roles[spec.label] = role
        by_identity[identity(spec)] = spec.label
        return spec.label

    for fraction in budgets:
        updates = budget_updates(fraction, base.train.updates)
        add(budget_label(updates, base.train.updates), Role(added="budget", budget=fraction))
    if floors:
        for spec in specs:
            if spec.arm.budgeted:
                roles[spec.label].floor_note = "omits nothing"
                continue
            try:
                cfg = arm_config(preset, overrides, spec, 0)
            except config_mod.ConfigError:
                continue  # refused later, naming the arm (CompareRun.check)
            label, note = floor_spec(spec, cfg)
            roles[spec.label].floor_note = note
            if label is not None:
                floor = add(label, Role(added="floor", floor_note="its own floor"))
                roles[spec.label].floor = floor
                roles[floor].floor_of.append(spec.label)
    return out, roles
