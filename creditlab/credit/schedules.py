"""Schedules: which kind each update is, decided from the history so far.

An update is `synthetic` (the 16 products omitted, the source's credit injected) or exact. For a source that
fits, an exact update is a `teacher` update (exact backprop that also fits the source); for one that does not,
it is a plain `native` update. A source that omits nothing makes every update native whatever the schedule.

`credit.schedule` names one (a new schedule is one class here and one line in SCHEDULES):

  fixed            one exact update in credit.teacher_every (0: none), the first update exact
  fixed:K          one in K
  never            no exact update at all (the default for a source that does not fit)
  warmup:N[,K]     N exact updates first, then one in K (default credit.teacher_every), K - 1 synthetic before each
  adaptive[:A,B]   ADA-GP-like: the synthetic phase after each teacher update is K - 1 updates long, with K kept
                   within [A, B] (default 2, 16) and started at credit.teacher_every. On each teacher update the
                   fit's cosine c, measured on that update's fresh corrections before the fit moves (out of
                   sample), is compared with b, a running mean of the earlier ones (weight 1/2): c >= b
                   lengthens the phase by one update, c < 0.9 b halves it, and a fit with no signal (c <= 0 or
                   not measured) drops K to A. Additive increase, multiplicative decrease: the phases grow slowly
                   while the predictor holds its fit and shrink at once when it goes stale.

This module imports nothing of creditlab, so that config.py can parse a schedule when a config is built.
"""

from __future__ import annotations

import math

KINDS = ("teacher", "synthetic", "native")


class Schedule:
    """Base: `exact(update)` says whether the update is exact; `observe` feeds back what the update measured."""

    def __init__(self, every: int):
        self.every = every  # credit.teacher_every, the default period of the schedules that take one

    def exact(self, update: int) -> bool:
        raise NotImplementedError

    def observe(self, update: int, kind: str, fit: dict | None) -> None:
        """Called after every update with its kind and, on teacher updates, the source's fit report."""

    def reads(self, kind: str) -> bool:
        """Whether observing an update of this kind can change what the schedule says of the next update (then
        the next update waits until this one is read)."""
        return False

    def describe(self) -> str:
        raise NotImplementedError

    def spec(self) -> str | None:
        """The schedule as a `credit.schedule` value that fixes its exact updates in advance, whatever the source
        (a fair floor runs `zero` under it); None where they depend on the run."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Never(Schedule):
    def exact(self, update: int) -> bool:
        return False

    def describe(self) -> str:
        return "no exact update"

    def spec(self) -> str:
        return "never"


class Fixed(Schedule):
    def __init__(self, every: int, period: int | None = None):
        super().__init__(every)
        self.period = every if period is None else period
        if self.period < 0:
            raise ValueError(f"fixed:{self.period}: the period must be >= 0")

    def exact(self, update: int) -> bool:
        return self.period > 0 and update % self.period == 0

    def describe(self) -> str:
        return f"one exact update in {self.period}" if self.period else "no exact update"

    def spec(self) -> str:
        return f"fixed:{self.period}"


class Warmup(Schedule):
    def __init__(self, every: int, warm: int | None = None, period: int | None = None):
        super().__init__(every)
        if warm is None:
            raise ValueError("warmup needs its number of exact updates: warmup:N or warmup:N,K")
        self.warm, self.period = warm, every if period is None else period
        if self.warm < 0 or self.period < 1:
            raise ValueError(f"warmup:{self.warm},{self.period}: need N >= 0 and K >= 1")

    def exact(self, update: int) -> bool:
        return update < self.warm or (update - self.warm) % self.period == self.period - 1

    def describe(self) -> str:
        return f"{self.warm} exact updates, then one in {self.period}"

    def spec(self) -> str:
        return f"warmup:{self.warm},{self.period}"


class Adaptive(Schedule):
    DROP = 0.9  # a fit below DROP x its running mean has gone stale: halve the phase
    MEAN_WEIGHT = 0.5  # weight of the newest cosine in the running mean

    def __init__(self, every: int, shortest: int = 2, longest: int = 16):
        super().__init__(every)
        if not 1 <= shortest <= longest:
            raise ValueError(f"adaptive:{shortest},{longest}: need 1 <= A <= B")
        self.shortest, self.longest = shortest, longest
        self.period = min(max(every, shortest), longest)
        self.next_exact = 0
        self.baseline: float | None = None
        self.history: list[tuple[int, float, int]] = []  # (update, cosine, period chosen after it)

    def exact(self, update: int) -> bool:
        return update >= self.next_exact

    def reads(self, kind: str) -> bool:
        return kind != "synthetic"

    def observe(self, update: int, kind: str, fit: dict | None) -> None:
        if kind == "synthetic":
            return
        cosine = math.nan if fit is None else float(fit.get("fit_cosine", math.nan))
        if not math.isfinite(cosine) or cosine <= 0:
            self.period = self.shortest
        elif self.baseline is not None:
            if cosine >= self.baseline:
                self.period = min(self.period + 1, self.longest)
            elif cosine < self.DROP * self.baseline:
                self.period = max(self.period // 2, self.shortest)
        if math.isfinite(cosine):
            self.baseline = cosine if self.baseline is None else \
                (1 - self.MEAN_WEIGHT) * self.baseline + self.MEAN_WEIGHT * cosine
        self.next_exact = update + self.period
        self.history.append((update, cosine, self.period))

    def describe(self) -> str:
        return f"adaptive: one exact update in {self.shortest} to {self.longest}, starting at {self.period}"

    def state_dict(self) -> dict:
        return {"period": self.period, "next_exact": self.next_exact, "baseline": self.baseline,
                "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.period, self.next_exact, self.baseline = state["period"], state["next_exact"], state["baseline"]
        self.history = [tuple(h) for h in state["history"]]


SCHEDULES: dict[str, type[Schedule]] = {"fixed": Fixed, "never": Never, "warmup": Warmup, "adaptive": Adaptive}


def parse(spec: str, every: int) -> Schedule:
    """The schedule named by `credit.schedule` (name[:int,int...]); a ValueError says what is wrong."""
    name, _, args = spec.strip().partition(":")
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)} "
                         "(fixed, fixed:K, never, warmup:N,K, adaptive, adaptive:A,B)")
    try:
        numbers = [int(a) for a in args.split(",")] if args else []
    except ValueError:
        raise ValueError(f"schedule {spec!r}: its arguments must be integers, e.g. warmup:20,4") from None
    try:
        return SCHEDULES[name](every, *numbers)
    except TypeError:
        raise ValueError(f"schedule {spec!r}: too many arguments for {name}") from None


class Plan:
    """A schedule bound to a source: the kind of each update."""

    def __init__(self, schedule: Schedule, omits: bool, fits: bool):
        self.schedule, self.omits, self.fits = schedule, omits, fits

    def kind(self, update: int) -> str:
        if not self.omits:
            return "native"
        if self.schedule.exact(update):
            return "teacher" if self.fits else "native"
        return "synthetic"

    def observe(self, update: int, kind: str, fit: dict | None) -> None:
        self.schedule.observe(update, kind, fit)

    def reads(self, kind: str) -> bool:
        return self.schedule.reads(kind)


def plan_for(spec: str, every: int, omits: bool, fits: bool) -> Plan:
    """The plan of a source: `fixed` means `never` for a source that does not fit (its exact updates would teach
    nothing); any other schedule gives such a source plain native updates where it says exact."""
    schedule = parse(spec, every)
    if spec.strip() == "fixed" and not fits:
        schedule = Never(every)
    return Plan(schedule, omits, fits)
