"""The verdict's arithmetic: intervals over seeds, native's loss-against-GPU-seconds curve, speedups, words.

Pure numbers, no tensors and no files, so that every rule a comparison's report states is a function a test can
pin. The rules:

* **Paired by seed.** Arms of one seed share the initialization and the data order, so a difference between two
  arms is taken per seed, then averaged over seeds. Repeats of one seed (the same seed run again, which differs
  only by the device's nondeterminism) are averaged into that seed first: the seed is the unit.
* **Interval.** The mean over seeds with a two-sided 95% Student-t interval, mean ± t(0.975, n-1) s / sqrt(n).
  With fewer than two seeds there is no interval.
* **Native's curve.** Native backprop run at several budgets, each with its learning rate fully decayed within
  its own budget, gives points (GPU-seconds, final DEV loss). The loss is made non-increasing in GPU-seconds by
  isotonic regression (pool adjacent violators), then the GPU-seconds native needs to reach a loss L are read
  off it piecewise linearly in log GPU-seconds. A loss above the cheapest budget's is "below" the curve's range
  (native needs less than its cheapest budget), one under the dearest budget's "above" it: never extrapolated.
* **Speedup** = the GPU-seconds native needs to reach the arm's DEV loss / the arm's GPU-seconds; > 1 pays.
* **Verdict word**, from the interval alone: `pays` when its lower end exceeds 1, `does not pay` when its upper
  end is below 1, `cannot tell` otherwise. A speedup that is only bounded in some seed ("below x", "above y")
  enters as its bound, and only a verdict that the bound cannot overturn is said: bounds from below the curve
  can only lower the speedup, so they allow `does not pay`, never `pays` (and the other way round).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LEVEL = 0.95
METHOD = "mean over seeds, two-sided 95% Student-t interval"


# ---- Student's t ------------------------------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, f = 1e-300, 1.0
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return f


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; the symmetry serves the other
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, by bisection on the CDF (to 1e-12 relative)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


# ---- intervals over seeds ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interval:
    mean: float | None
    low: float | None
    high: float | None
    n: int
    values: tuple[float, ...]

    def to_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "values": list(self.values),
                "method": METHOD}

    def text(self, digits: int = 4, signed: bool = False) -> str:
        if self.mean is None:
            return "–"
        fmt = f"{{:{'+' if signed else ''}.{digits}f}}"
        if self.low is None:
            return fmt.format(self.mean) + " (one seed)"
        return f"{fmt.format(self.mean)} [{fmt.format(self.low)}, {fmt.format(self.high)}]"


def interval(values, level: float = LEVEL) -> Interval:
    """The mean of `values` (one per seed) with its two-sided Student-t interval; None and non-finite values are
    left out; with one value there is a mean and no interval."""
    kept = tuple(float(v) for v in values if v is not None and math.isfinite(v))
    if not kept:
        return Interval(None, None, None, 0, ())
    mean = statistics.fmean(kept)
    if len(kept) < 2:
        return Interval(mean, None, None, 1, kept)
    half = t_quantile(0.5 + level / 2, len(kept) - 1) * statistics.stdev(kept) / math.sqrt(len(kept))
    return Interval(mean, mean - half, mean + half, len(kept), kept)


def by_seed(values: dict[str, float | None]) -> dict[int, float]:
    """Per-run values (keyed by run key: "3", or "3r2" for the second run of seed 3) averaged into their seed."""
    grouped: dict[int, list[float]] = {}
    for key, value in values.items():
        if value is not None and math.isfinite(value):
            grouped.setdefault(seed_of(key), []).append(value)
    return {seed: statistics.fmean(v) for seed, v in sorted(grouped.items())}


def run_key(seed: int, repeat: int = 1) -> str:
    """The key of one run of a seed in a comparison's records: "3", then "3r2", "3r3", ... for its repeats."""
    return str(seed) if repeat == 1 else f"{seed}r{repeat}"


def seed_of(key: str) -> int:
    return int(str(key).partition("r")[0])


def noise(values: dict[str, float | None]) -> dict:
    """Run-to-run against seed-to-seed standard deviation of one quantity. Run-to-run: pooled over the seeds
    that ran more than once (the same seed, so the same initialization and data order). Seed-to-seed: over the
    seeds' means."""
    grouped: dict[int, list[float]] = {}
    for key, value in values.items():
        if value is not None and math.isfinite(value):
            grouped.setdefault(seed_of(key), []).append(value)
    repeated = [v for v in grouped.values() if len(v) > 1]
    dof = sum(len(v) - 1 for v in repeated)
    run_sd = math.sqrt(sum((x - statistics.fmean(v)) ** 2 for v in repeated for x in v) / dof) if dof else None
    means = [statistics.fmean(v) for v in grouped.values()]
    return {"run_to_run_sd": run_sd, "run_to_run_dof": dof,
            "seed_to_seed_sd": statistics.stdev(means) if len(means) > 1 else None, "seeds": len(means)}


# ---- native's curve and speedups --------------------------------------------------------------------------

def isotonic_decreasing(ys: list[float]) -> list[float]:
    """The non-increasing sequence nearest to `ys` in squared error (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out = []
    for total, count in blocks:
        out += [total / count] * count
    return out


@dataclass(frozen=True)
class Reach:
    """The GPU-seconds native needs to reach a loss: `seconds`, or only a bound ("below" its cheapest budget's
    seconds, "above" its dearest budget's) where the loss lies outside the curve's range."""
    seconds: float | None
    bound: str | None = None
    limit: float | None = None  # the bound's seconds


class NativeCurve:
    """Native's final DEV loss against its GPU-seconds over its budgets (one seed), made non-increasing."""

    def __init__(self, points: list[tuple[float, float]]):
        points = sorted((float(g), float(l)) for g, l in points if g is not None and l is not None
                        and math.isfinite(g) and math.isfinite(l) and g > 0)
        if not points:
            raise ValueError("native's curve needs at least one budget with GPU-seconds and a DEV loss")
        self.seconds = [g for g, _ in points]
        self.measured = [l for _, l in points]
        self.loss = isotonic_decreasing(self.measured)

    def seconds_to_reach(self, loss: float) -> Reach:
        g, fitted = self.seconds, self.loss
        if loss > fitted[0]:
            return Reach(None, "below", g[0])
        if loss < fitted[-1]:
            return Reach(None, "above", g[-1])
        for i in range(len(g)):
            if fitted[i] <= loss:  # the first budget that reaches it
                if i == 0 or fitted[i] == loss:
                    return Reach(g[i])
                frac = (fitted[i - 1] - loss) / (fitted[i - 1] - fitted[i])
                return Reach(math.exp(math.log(g[i - 1]) + frac * (math.log(g[i]) - math.log(g[i - 1]))))
        return Reach(g[-1])  # not reached: fitted[-1] == loss up to rounding

    def to_dict(self) -> dict:
        return {"gpu_seconds": self.seconds, "dev_loss": self.measured, "dev_loss_isotonic": self.loss}


@dataclass(frozen=True)
class Speedup:
    value: float | None  # the speedup, or the bound where `bound` says it is only bounded
    bound: str | None = None  # "below" (the speedup is under value) | "above" (over value) | None

    def text(self, digits: int = 3) -> str:
        if self.value is None:
            return "–"
        return f"{self.value:.{digits}f}" if self.bound is None else f"{self.bound} {self.value:.{digits}f}"

    def to_dict(self) -> dict:
        return {"value": self.value, "bound": self.bound}


def speedup(curve: NativeCurve, loss: float | None, seconds: float | None) -> Speedup:
    """GPU-seconds native needs to reach `loss` over the arm's `seconds`."""
    if loss is None or seconds is None or not (math.isfinite(loss) and seconds > 0):
        return Speedup(None)
    reach = curve.seconds_to_reach(loss)
    if reach.bound is not None:
        return Speedup(reach.limit / seconds, reach.bound)
    return Speedup(reach.seconds / seconds)


PAYS, DOES_NOT_PAY, CANNOT_TELL = "pays", "does not pay", "cannot tell"


def speedup_verdict(per_seed: list[Speedup]) -> tuple[Interval, str]:
    """The interval of the seeds' speedups (bounds entering as their values) and the verdict word it allows."""
    usable = [s for s in per_seed if s.value is not None]
    iv = interval([s.value for s in usable])
    if iv.low is None:
        return iv, CANNOT_TELL
    bounds = {s.bound for s in usable} - {None}
    if iv.low > 1.0 and "below" not in bounds:
        return iv, PAYS
    if iv.high < 1.0 and "above" not in bounds:
        return iv, DOES_NOT_PAY
    return iv, CANNOT_TELL


def difference_word(iv: Interval, better: str, worse: str, same: str = "no difference resolved") -> str:
    """`better` when the interval lies below zero, `worse` above it, else `same`."""
    if iv.low is None:
        return "one seed: not assessed"
    if iv.high < 0:
        return better
    if iv.low > 0:
        return worse
    return same
