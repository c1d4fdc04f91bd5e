"""The faster step's targets read from one side-by-side run of the arms, each with its verdict.

    python benchmarks/targets.py DIR/arms.json [--out DIR/targets.md]

The run must hold `native`; the targets of the arms it lacks are listed as not measured. Each target is read
two ways: on last-six medians, as the targets are stated, and per round (the arm's update against the other's
in the same round, the median over rounds 3 on with a 95% bootstrap interval), which carries less of the card's
drift. A verdict is `met` or `missed` on each reading; none is softened when the two disagree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab.experiments.arms_runner import round_difference_ms, steady_ratio  # noqa: E402

PEAK_GATE_MIB = 23_400.0  # the resource screen's peak gate (config.ScreenConfig.peak_gate_mib)


@dataclass(frozen=True)
class Target:
    name: str
    limit: float
    stretch: float | None = None


TARGETS = {
    "native": Target("native s/update", 0.29, 0.27),
    "learned": Target("learned (streaming, zero decoders) / native", 0.93, 0.9066667),
    "learned_minus_zero": Target("learned - zero, ms per update", 3.0),
    "teacher": Target("teacher / native", 1.07),
    "peak": Target("every arm's peak allocated MiB", PEAK_GATE_MIB),
}


def _verdict(value: float | None, target: Target) -> str:
    if value is None:
        return "not measured"
    if target.stretch is not None and value <= target.stretch:
        return "met (stretch too)"
    return "met" if value <= target.limit else "missed"


def _seconds(result: dict) -> list[float]:
    return [row["seconds"] for row in result["rows"]]


def _interval(reading, digits: int) -> str:
    return f"{reading[0]:.{digits}f} ({reading[1]:.{digits}f} .. {reading[2]:.{digits}f})"


def _row(target: Target, last_six: float | None = None, last_six_text: str = "-", per_round: float | None = None,
         per_round_text: str = "-") -> dict:
    return {"target": target, "last_six": last_six, "last_six_text": last_six_text, "per_round": per_round,
            "per_round_text": per_round_text}


# The arms the targets read, by their registry labels (results written before the one registry named them
# `learned` and `teacher`, and read the same)
LABELS = {"learned@credit.schedule=never": "learned", "learned@credit.teacher_every=1": "teacher"}


def evaluate(results: list[dict]) -> list[dict]:
    """One row per target: what was measured on each reading and its verdict."""
    by_arm = {LABELS.get(r["arm"], r["arm"]): r for r in results if "oom" not in r}
    if "native" not in by_arm:
        raise SystemExit("the run has no native arm: every target is read against native")
    native = by_arm["native"]
    rows = []

    mfu = native.get("median_last6_mfu")
    later = _seconds(native)[2:]  # the rounds the per-round readings use
    rows.append(_row(TARGETS["native"], native["median_last6_s"],
                     f"{native['median_last6_s']:.4f} s" + (f" (MFU {100 * mfu:.1f}%)" if mfu is not None else ""),
                     statistics.median(later) if later else None,
                     f"{statistics.median(later):.4f} s (median)" if later else "-"))

    for arm in ("learned", "teacher"):
        if arm not in by_arm:
            rows.append(_row(TARGETS[arm]))
            continue
        last_six = by_arm[arm]["median_last6_s"] / native["median_last6_s"]
        per_round = steady_ratio(by_arm[arm]["rows"], native["rows"])
        rows.append(_row(TARGETS[arm], last_six, f"{last_six:.4f}", per_round and per_round[0],
                         _interval(per_round, 4) if per_round else "-"))

    if "learned" in by_arm and "zero" in by_arm:
        last_six = 1e3 * (by_arm["learned"]["median_last6_s"] - by_arm["zero"]["median_last6_s"])
        per_round = round_difference_ms(_seconds(by_arm["learned"]), _seconds(by_arm["zero"]))
        rows.append(_row(TARGETS["learned_minus_zero"], last_six, f"{last_six:+.1f} ms", per_round and per_round[0],
                         _interval(per_round, 1) + " ms" if per_round else "-"))
    else:
        rows.append(_row(TARGETS["learned_minus_zero"]))

    peaks = {name: r["peak_allocated_mib"] for name, r in by_arm.items() if r.get("peak_allocated_mib")}
    out_of_memory = [r["arm"] for r in results if "oom" in r]
    worst = max(peaks, key=peaks.get) if peaks else None
    text = "-" if worst is None else f"{peaks[worst]:,.0f} MiB ({worst})"
    if out_of_memory:
        text += f"; out of memory: {', '.join(out_of_memory)}"
    # an arm that ran out of memory misses the peak target whatever the others held
    rows.append(_row(TARGETS["peak"], None if worst is None else (float("inf") if out_of_memory else peaks[worst]),
                     text))
    for row in rows:
        row["verdict_last_six"] = _verdict(row["last_six"], row["target"])
        row["verdict_per_round"] = "-" if row["per_round_text"] == "-" else _verdict(row["per_round"], row["target"])
    return rows


def markdown(rows: list[dict], source: str) -> str:
    lines = [f"Targets read from `{source}`.", "",
             "| target | limit (stretch) | last six | verdict | per round, rounds 3 on (median, 95% interval) | "
             "verdict |", "|---|---|---|---|---|---|"]
    for row in rows:
        t = row["target"]
        limit = f"<= {t.limit:g}" + (f" ({t.stretch:g})" if t.stretch is not None else "")
        lines.append(f"| {t.name} | {limit} | {row['last_six_text']} | {row['verdict_last_six']} | "
                     f"{row['per_round_text']} | {row['verdict_per_round']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms_json", help="arms.json of one run of benchmarks/arms.py")
    ap.add_argument("--out", help="write the table here as well")
    args = ap.parse_args()
    path = Path(args.arms_json)
    try:
        results = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"targets: cannot read {path} as a run of benchmarks/arms.py ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    table = markdown(evaluate(results), path.name)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
