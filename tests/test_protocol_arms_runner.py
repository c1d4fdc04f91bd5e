"""The arms runner shared by the resource screen and benchmarks/arms.py: rounds of one update per arm in
rotated order, arms retired on their own, the whole run stopped, and each arm's memory peak its own."""

from __future__ import annotations

from types import SimpleNamespace

from creditlab.experiments import arms_runner as runner


def test_rotation_puts_every_arm_in_every_position_once_per_cycle():
    names = ["native", "zero", "learned"]
    rounds = [runner.rotation(names, r) for r in range(len(names))]
    assert rounds == [["native", "zero", "learned"], ["zero", "learned", "native"], ["learned", "native", "zero"]]
    for position in range(len(names)):
        assert sorted(r[position] for r in rounds) == sorted(names)
    assert runner.rotation([], 3) == []


def test_rounds_interleave_one_update_of_each_arm():
    seen = []
    taken = runner.run_rounds(["native", "synthetic"], 3, lambda at: seen.append((at.round, at.position, at.arm)))
    assert seen == [(0, 0, "native"), (0, 1, "synthetic"), (1, 0, "synthetic"), (1, 1, "native"),
                    (2, 0, "native"), (2, 1, "synthetic")]
    assert [(s.round, s.position, s.arm) for s in taken] == seen
    # Never two updates of one arm in a row within a round, and every arm has all its updates.
    for arm in ("native", "synthetic"):
        assert sum(s.arm == arm for s in taken) == 3


def test_a_retired_arm_drops_out_and_the_others_go_on():
    def step(at):
        return not (at.arm == "b" and at.round == 1)  # b fails in its second update

    taken = runner.run_rounds(["a", "b", "c"], 4, step)
    assert [s.arm for s in taken if s.arm == "b"] == ["b", "b"]
    assert sum(s.arm == "a" for s in taken) == 4 and sum(s.arm == "c" for s in taken) == 4
    # Positions count only the arms that ran in that round.
    assert [(s.arm, s.position) for s in taken if s.round == 3] == [("a", 0), ("c", 1)]


def test_stop_ends_the_whole_run_before_the_next_step():
    ran = []
    taken = runner.run_rounds(["a", "b"], 5, lambda at: ran.append(at.arm), stop=lambda: len(ran) >= 3)
    assert ran == ["a", "b", "b"] and len(taken) == 3
    rounds = []
    runner.run_rounds(["a", "b"], 2, lambda at: None, after_round=rounds.append)
    assert rounds == [0, 1]


def test_own_memory_takes_the_other_arms_resident_bytes_off_a_peak():
    mib = runner.MIB
    allocated = {"now": 0}
    own = runner.OwnMemory(lambda: allocated["now"], shared=True)

    def build(size):
        allocated["now"] += size * mib
        return size

    assert own.build("a", lambda: build(100)) == 100
    own.build("b", lambda: build(40))
    assert own.resident == {"a": 100 * mib, "b": 40 * mib}

    def update(peak_total, left):  # the device's peak during the update, and what the update leaves alive
        def run():
            allocated["now"] += left * mib
            return SimpleNamespace(peak_allocated_mib=float(peak_total), peak_reserved_mib=500.0)
        return run

    row = own.update("b", update(160, 2))
    assert row.peak_allocated_mib == 60.0  # 160 less a's 100
    assert row.peak_reserved_mib is None  # one pool for all arms: not b's own figure
    assert own.resident["b"] == 42 * mib
    row = own.update("a", update(150, 0))
    assert row.peak_allocated_mib == 108.0  # 150 less b's 42
    # Where the device reports no memory, rows pass through.
    plain = runner.OwnMemory(None)
    row = plain.update("a", lambda: SimpleNamespace(peak_allocated_mib=None, peak_reserved_mib=None))
    assert row.peak_allocated_mib is None


def test_the_round_ratio_pairs_rounds_and_its_interval_holds_the_spread():
    import pytest

    base = [9.0, 9.0] + [0.30, 0.34] * 8
    steady = [0.93 * b for b in base]  # 0.93 of the base in every round, whatever the drift
    median, lo, hi, n = runner.round_ratio(steady, base)
    assert n == 16 and median == pytest.approx(0.93) and lo == pytest.approx(0.93) and hi == pytest.approx(0.93)
    noisy = [b * (0.90 if i % 2 else 0.96) for i, b in enumerate(base)]
    median, lo, hi, _ = runner.round_ratio(noisy, base)
    assert lo < median < hi and lo >= 0.90 and hi <= 0.96
    assert runner.round_ratio(steady[:-1], base) is None
    # the first two rounds (compilation) never count: a huge first update leaves the ratio where it was
    assert runner.round_ratio([99.0] + steady[1:], base)[0] == pytest.approx(0.93)
    assert runner.round_ratio(steady[:4], base[:4]) is None  # two rounds after the skip: too few


def test_the_round_difference_is_taken_round_by_round_in_ms():
    import pytest

    base = [9.0, 9.0] + [0.30, 0.34] * 8  # the card's drift: 40 ms between rounds
    faster = [b - 0.003 for b in base]  # 3 ms faster in every round
    median, lo, hi, n = runner.round_difference_ms(faster, base)
    assert n == 16 and median == lo == hi == pytest.approx(-3.0)
    assert runner.round_difference_ms(faster[:-1], base) is None


def test_an_update_that_meets_a_new_variant_counts_its_compiled_graph_and_leaves_the_steady_rounds():
    """A compiled function specialized on a Python flag (as a block is on dropbp's drop pattern): the counter
    moves on the update that meets a flag value for the first time and stays on one that repeats a value; such an
    update's round is left out of the steady rounds, and with it out, the ratio reads the step, not the compiler."""
    import torch

    step = torch.compile(lambda x, drop: x.detach() * 2 if drop else x * 2, backend="eager")
    x = torch.randn(4)
    compiled = []
    for drop in (False, False, True, True, False):
        before = runner.graphs_compiled()
        step(x, drop)
        compiled.append(runner.graphs_compiled() - before)
    assert compiled == [1, 0, 1, 0, 0]

    native = [{"seconds": 1.0, "graphs_compiled": 0} for _ in range(8)]
    dropping = [{"seconds": 0.85, "graphs_compiled": 0} for _ in range(8)]
    for r in (2, 3, 5):  # rounds that compiled a new variant, taking seconds of compiler time
        dropping[r] = {"seconds": 3.0, "graphs_compiled": 2}
    kept = runner.steady_rounds(dropping, native)
    assert kept == ([0.85] * 3, [1.0] * 3)  # rounds 4, 6, 7
    assert runner.round_ratio(*kept, skip=0)[0] == 0.85
    # counted in, the three compiling rounds of six would put the median above native's time, at 1.925
    assert runner.round_ratio([r["seconds"] for r in dropping], [r["seconds"] for r in native])[0] > 1.9
    # rows recorded before the count existed are all steady; `where` keeps one kind of update
    plain = [{"seconds": s, "kind": k} for s, k in ((1, "teacher"), (1, "teacher"), (0.9, "synthetic"),
                                                     (1.2, "teacher"), (0.9, "synthetic"))]
    assert runner.steady_rounds(plain, [{"seconds": 1.0}] * 5, where=lambda r: r["kind"] == "synthetic") == \
        ([0.9, 0.9], [1.0, 1.0])


def test_signals_are_handled_inside_and_the_handlers_before_restored_after():
    import os
    import signal

    from creditlab.experiments.arms_runner import signals_handled

    seen = []
    before = signal.getsignal(signal.SIGTERM)
    with signals_handled(lambda signum, frame: seen.append(signum)):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_signal_stops_at_once_and_the_first_only_asks():
    import os
    import signal

    import pytest

    from creditlab.experiments.arms_runner import StopRequest

    said = []
    with pytest.raises(KeyboardInterrupt):
        with StopRequest(said.append) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal == "SIGTERM" and said == ["SIGTERM"]
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("the second signal did not stop the run")  # pragma: no cover
    assert said == ["SIGTERM"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
