"""The screen's verdict: a pure function of the arms' measurements and the gates, table-driven."""

from __future__ import annotations

import pytest

from creditlab import config
from creditlab.protocol.gates import EXIT_CODES, EXIT_ERROR, EXIT_INVALID, EXIT_REFUSED, VERDICTS, ArmSummary, \
    Gates, decide

GATES = Gates(ratio=0.9066667, peak_mib=23_400.0, cap_s=1_200.0, window=6)
N = 12


def arm(name, seconds=1.0, n=N, peak=20_000.0, oom=None, last=None):
    secs = [seconds] * n
    if last is not None:  # the last six differ from the first: the verdict must read only the window
        secs = [100.0] * (n - 6) + [last] * 6 if n >= 6 else [last] * n
    return ArmSummary(name, N, tuple(secs), tuple([peak] * n), tuple([None if peak is None else peak + 100] * n), oom)


# (case, native, synthetic, occupied_s, cap_hit, device_memory, verdict, deciding gate, expected ratio)
CASES = [
    ("pass", arm("native", 1.0), arm("synthetic", 0.85), 100.0, False, True, "pass", None, 0.85),
    ("ratio exactly at the gate passes", arm("native", 1.0), arm("synthetic", 0.9066667), 100.0, False, True,
     "pass", None, 0.9066667),
    ("just over the gate misses", arm("native", 1.0), arm("synthetic", 0.9067), 100.0, False, True,
     "timing_miss", "ratio", 0.9067),
    ("slower synthetic", arm("native", 1.0), arm("synthetic", 1.2), 100.0, False, True, "timing_miss", "ratio", 1.2),
    ("window medians only: early slow updates ignored", arm("native", last=1.0), arm("synthetic", last=0.8),
     100.0, False, True, "pass", None, 0.8),
    ("window medians only: early fast updates ignored", arm("native", 1.0),
     ArmSummary("synthetic", N, tuple([0.1] * 6 + [1.0] * 6), tuple([1.0] * 12), tuple([1.0] * 12)),
     100.0, False, True, "timing_miss", "ratio", 1.0),
    ("synthetic peak over the gate", arm("native", 1.0), arm("synthetic", 0.8, peak=23_400.5), 100.0, False, True,
     "capacity_miss", "peak", 0.8),
    ("synthetic peak at the gate passes", arm("native", 1.0), arm("synthetic", 0.8, peak=23_400.0), 100.0, False,
     True, "pass", None, 0.8),
    ("native peak over the gate does not decide", arm("native", 1.0, peak=30_000.0), arm("synthetic", 0.8),
     100.0, False, True, "pass", None, 0.8),
    ("synthetic out of memory (the seed's outcome)", arm("native", 1.1797),
     ArmSummary("synthetic", N, oom_update=0), 78.4, False, True, "capacity_miss", "oom", None),
    ("native out of memory", ArmSummary("native", N, (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), oom_update=2),
     ArmSummary("synthetic", N), 10.0, False, True, "capacity_miss", "oom", None),
    ("out of memory beats the cap", arm("native", 1.0), ArmSummary("synthetic", N, (0.8,), (1.0,), (1.0,), 1),
     2_000.0, True, True, "capacity_miss", "oom", 0.8),
    ("cap exceeded, stopped", arm("native", 1.0), arm("synthetic", 0.8, n=5), 1_200.5, True, True,
     "cap_miss", "cap", 0.8),
    ("cap exceeded at the end", arm("native", 1.0), arm("synthetic", 0.8), 1_300.0, False, True,
     "cap_miss", "cap", 0.8),
    ("cap beats timing", arm("native", 1.0), arm("synthetic", 1.5), 1_300.0, False, True, "cap_miss", "cap", 1.5),
    ("peak beats the cap", arm("native", 1.0), arm("synthetic", 0.8, n=3, peak=30_000.0), 1_300.0, True, True,
     "capacity_miss", "peak", 0.8),
    ("CPU: no peaks, the peak gate is n/a and passes through", arm("native", 1.0, peak=None),
     arm("synthetic", 0.8, peak=None), 5.0, False, False, "pass", None, 0.8),
    ("CPU: timing still decides", arm("native", 1.0, peak=None), arm("synthetic", 0.95, peak=None), 5.0, False,
     False, "timing_miss", "ratio", 0.95),
    ("CPU: out of memory still decides", arm("native", 1.0, peak=None), ArmSummary("synthetic", N, oom_update=4),
     5.0, False, False, "capacity_miss", "oom", None),
]


@pytest.mark.parametrize("case,native,synthetic,occupied,cap_hit,device_memory,verdict,gate,ratio", CASES,
                         ids=[c[0] for c in CASES])
def test_verdict_table(case, native, synthetic, occupied, cap_hit, device_memory, verdict, gate, ratio):
    d = decide(native, synthetic, occupied, GATES, device_memory=device_memory, cap_hit=cap_hit)
    assert d.verdict == verdict, d.sentence
    assert (d.decided_by.name if d.decided_by else None) == gate
    assert d.ratio == pytest.approx(ratio) if ratio is not None else d.ratio is None
    assert d.exit_code == EXIT_CODES[verdict]
    assert d.sentence.lower().startswith(verdict.replace("_", " ").split()[0])
    gates = {g.name: g for g in d.gates}
    assert set(gates) == {"oom", "peak", "cap", "ratio"}
    if gate is not None:  # the numbers that decided it are reported with it
        assert d.decided_by.outcome == "miss"
        assert gates[gate].outcome == "miss"
    if not device_memory:
        assert gates["peak"].outcome == "n/a" and gates["peak"].measured is None
        assert "does not use" in gates["peak"].note
    assert set(d.to_json()) >= {"verdict", "sentence", "ratio", "decided_by", "gates", "window"}


def test_decision_reports_the_deciding_numbers():
    d = decide(arm("native", 2.0), arm("synthetic", 1.9), 50.0, GATES, device_memory=True)
    assert d.decided_by.measured == pytest.approx(0.95) and d.decided_by.limit == GATES.ratio
    assert "0.9500" in d.sentence and "1.9000 s vs 2.0000 s" in d.sentence
    d = decide(arm("native", 1.0), arm("synthetic", 0.8, peak=24_000.0), 50.0, GATES, device_memory=True)
    assert d.decided_by.measured == 24_000.0 and "24,000.000 MiB" in d.sentence
    d = decide(arm("native", 1.0), ArmSummary("synthetic", N, oom_update=-1), 50.0, GATES, device_memory=True)
    assert "before its first update" in d.sentence


def test_window_never_exceeds_the_updates():
    short = Gates(window=6)
    n, s = ArmSummary("native", 3, (5.0, 1.0, 1.0)), ArmSummary("synthetic", 3, (5.0, 0.8, 0.8))
    d = decide(n, s, 1.0, short, device_memory=False)
    assert d.window == 3 and d.ratio == pytest.approx(0.8)


def test_incomplete_arms_without_a_reason_have_no_verdict():
    with pytest.raises(ValueError, match="no verdict"):
        decide(arm("native", 1.0), arm("synthetic", 0.8, n=5), 10.0, GATES, device_memory=True)


def test_gates_come_from_the_config_and_exit_codes_are_distinct():
    g = Gates.from_config(config.load("seed"))
    assert (round(g.ratio, 7), g.peak_mib, g.cap_s, g.window) == (0.9066667, 23_400.0, 1_200.0, 6)
    # the ratio gate follows the cycle gate and the teacher cycle's length: one teacher in 2 at 0.93 gives 0.86
    assert Gates.from_config(config.load("seed", ["credit.teacher_every=2"])).ratio == pytest.approx(0.86)
    assert set(EXIT_CODES) == set(VERDICTS)
    codes = list(EXIT_CODES.values()) + [EXIT_ERROR, EXIT_REFUSED, EXIT_INVALID]
    assert len(set(codes)) == len(codes) and EXIT_CODES["pass"] == 0
