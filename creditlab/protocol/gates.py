"""The resource screen's gates and verdict: pure functions of what the two arms measured.

Four outcomes, decided in this order, the first that applies wins:

1. capacity_miss: an arm ran out of memory, or the synthetic arm's peak allocated memory (the maximum over all
   its completed updates) exceeds `peak_gate_mib`;
2. cap_miss: the screen occupied the device longer than `cap_gpu_s` (it stops when the cap is exceeded);
3. timing_miss: the ratio of last-six (WINDOW) medians of synthetic over native seconds per update exceeds the
   ratio gate (0.9066667: (1 + 3r)/4 <= screen.cycle_gate = 0.93 with one exact teacher update in four);
4. pass.

Capacity comes first because it is certain as soon as it is seen (a peak only grows), while a screen stopped by
its cap has not measured everything. The peak gate applies to the synthetic arm (the candidate); the native
peak is reported beside it. On the CPU no device memory is measured: the peak gate is `n/a` and does not take
part in the verdict, so capacity can then be missed only through an out-of-memory error. A screen on the CPU
is exploratory in any case (screen.py): what these gates say is reported as measured, never recorded as a
verdict.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

VERDICTS = ("pass", "timing_miss", "capacity_miss", "cap_miss")
EXIT_CODES = {"pass": 0, "capacity_miss": 3, "timing_miss": 4, "cap_miss": 5}
EXIT_ERROR = 1  # the screen failed for another reason (traceback recorded); no verdict
EXIT_REFUSED = 2  # refused before it ran: admission mismatch, verdict already reached, unusable config
EXIT_INVALID = 6  # the screen's own premises failed (initialization or inputs differ between arms); no verdict


WINDOW = 6  # the verdict reads medians of the last six updates of each arm (the screen's protocol)


def ratio_gate(cycle_gate: float, teacher_every: int) -> float:
    """The synthetic/native ratio r at which one teacher cycle of K updates, (1 + (K - 1) r) / K of native's time,
    meets `cycle_gate`: r = (K cycle_gate - 1) / (K - 1); K is credit.teacher_every (4 where it names no cycle)."""
    k = teacher_every if teacher_every >= 2 else 4
    return (k * cycle_gate - 1) / (k - 1)


@dataclass(frozen=True)
class Gates:
    ratio: float = 0.9066667
    peak_mib: float = 23_400.0
    cap_s: float = 1_200.0
    window: int = WINDOW

    @classmethod
    def from_config(cls, cfg) -> "Gates":
        s = cfg.screen
        return cls(ratio_gate(s.cycle_gate, cfg.credit.teacher_every), s.peak_gate_mib, s.cap_gpu_s)


@dataclass(frozen=True)
class ArmSummary:
    """What one arm measured: seconds and peaks of each completed update, and where it ran out of memory."""

    name: str
    planned: int
    seconds: tuple[float, ...] = ()
    peak_allocated_mib: tuple[float | None, ...] = ()
    peak_reserved_mib: tuple[float | None, ...] = ()
    oom_update: int | None = None  # 0-based update at which it ran out of memory (-1: before the first)

    @property
    def completed(self) -> int:
        return len(self.seconds)

    @property
    def complete(self) -> bool:
        return self.completed >= self.planned and self.oom_update is None

    def window(self, window: int) -> int:
        return max(1, min(window, self.planned))

    def median_last(self, window: int) -> float | None:
        return statistics.median(self.seconds[-self.window(window):]) if self.seconds else None

    @property
    def peak_allocated(self) -> float | None:
        values = [v for v in self.peak_allocated_mib if v is not None]
        return max(values) if values else None

    @property
    def peak_reserved(self) -> float | None:
        values = [v for v in self.peak_reserved_mib if v is not None]
        return max(values) if values else None


@dataclass(frozen=True)
class GateResult:
    name: str  # oom | peak | cap | ratio
    measured: float | str | None
    limit: float | None
    outcome: str  # pass | miss | n/a | not measured
    note: str = ""


@dataclass(frozen=True)
class Decision:
    verdict: str
    sentence: str
    decided_by: GateResult | None  # the gate that decided a miss (None for pass)
    ratio: float | None
    window: int
    gates: tuple[GateResult, ...] = field(default_factory=tuple)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "sentence": self.sentence, "ratio": self.ratio, "window": self.window,
                "decided_by": asdict(self.decided_by) if self.decided_by else None,
                "gates": {g.name: asdict(g) for g in self.gates}}


def _mib(x: float) -> str:
    return f"{x:,.3f} MiB"


def _at(arm: ArmSummary) -> str:
    return "before its first update" if arm.oom_update < 0 else f"at update {arm.oom_update + 1}"


def decide(native: ArmSummary, synthetic: ArmSummary, occupied_s: float, gates: Gates,
           device_memory: bool, cap_hit: bool = False) -> Decision:
    """The verdict of a screen from its two arms, the occupied device-seconds and the gates.

    `device_memory`: whether the device reports memory (CUDA); without it the peak gate is n/a.
    `cap_hit`: whether the runner stopped the screen because the cap was exceeded."""
    w = synthetic.window(gates.window)
    nat, syn = native.median_last(w), synthetic.median_last(w)
    both_complete = native.complete and synthetic.complete
    ratio = syn / nat if (nat and syn is not None) else None

    oom_arm = next((a for a in (native, synthetic) if a.oom_update is not None), None)
    oom = GateResult("oom", oom_arm.name if oom_arm else None, None, "miss" if oom_arm else "pass",
                     f"{oom_arm.name} arm out of memory {_at(oom_arm)} after {oom_arm.completed} completed updates"
                     if oom_arm else "no out-of-memory error")

    peak = synthetic.peak_allocated
    if not device_memory:
        peak_gate = GateResult("peak", None, gates.peak_mib, "n/a",
                               "no device memory on the CPU; the verdict does not use this gate")
    elif peak is None:
        peak_gate = GateResult("peak", None, gates.peak_mib, "not measured", "no synthetic update completed")
    else:
        peak_gate = GateResult("peak", peak, gates.peak_mib, "miss" if peak > gates.peak_mib else "pass",
                               "synthetic arm, peak allocated over all its updates")

    over_cap = cap_hit or occupied_s > gates.cap_s
    cap = GateResult("cap", occupied_s, gates.cap_s, "miss" if over_cap else "pass",
                     "occupied device-seconds, stopped at the cap" if cap_hit else "occupied device-seconds")

    if ratio is None or not both_complete:
        timing = GateResult("ratio", ratio, gates.ratio, "not measured",
                            f"needs both arms complete (native {native.completed}/{native.planned}, "
                            f"synthetic {synthetic.completed}/{synthetic.planned})")
    else:
        timing = GateResult("ratio", ratio, gates.ratio, "miss" if ratio > gates.ratio else "pass",
                            f"synthetic/native, medians of the last {w} updates")
    table = (oom, peak_gate, cap, timing)

    progress = f"native {native.completed}/{native.planned}, synthetic {synthetic.completed}/{synthetic.planned}"
    if oom_arm is not None:
        return Decision("capacity_miss",
                        f"Capacity miss: the {oom_arm.name} arm ran out of memory {_at(oom_arm)} "
                        f"({progress} updates completed).", oom, ratio, w, table)
    if peak_gate.outcome == "miss":
        return Decision("capacity_miss",
                        f"Capacity miss: the synthetic arm's peak of {_mib(peak)} exceeds the "
                        f"{_mib(gates.peak_mib)} gate.", peak_gate, ratio, w, table)
    if cap.outcome == "miss":
        return Decision("cap_miss",
                        f"Cap miss: the screen occupied the device for {occupied_s:,.1f} s, over the "
                        f"{gates.cap_s:,.0f} s cap ({progress} updates completed).", cap, ratio, w, table)
    if timing.outcome == "not measured":
        raise ValueError(f"no verdict: the arms are incomplete ({progress}) without an out-of-memory error or "
                         "a cap stop")
    medians = f"last-{w} medians {syn:.4f} s vs {nat:.4f} s per update"
    if timing.outcome == "miss":
        return Decision("timing_miss",
                        f"Timing miss: synthetic/native = {ratio:.4f} > {gates.ratio:.7g} ({medians}).",
                        timing, ratio, w, table)
    peak_text = (f"synthetic peak {_mib(peak)} <= {_mib(gates.peak_mib)}" if peak_gate.outcome == "pass" else
                 "peak gate not applicable on the CPU (not used by the verdict)")
    return Decision("pass",
                    f"Pass: synthetic/native = {ratio:.4f} <= {gates.ratio:.7g} ({medians}); {peak_text}; "
                    f"{occupied_s:,.1f} of {gates.cap_s:,.0f} occupied device-seconds.", None, ratio, w, table)
