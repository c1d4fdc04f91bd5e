"""benchmarks/widths.py: its arms resolve at every width, and its summary reads ratios, ideals and the gate."""

import json

import pytest

from benchmark_scripts import load
from creditlab import config
from creditlab.flops import flop_budget


def test_every_arm_resolves_at_every_width():
    widths, arms = load("widths"), load("arms")
    for width in widths.WIDTHS:
        for spec in ["native", *widths.ARMS.values()]:
            cfg = config.load(widths.preset(width), arms.overrides_of(spec))
            assert cfg.model.width == width and cfg.model.heads == width // 128, (width, spec)


def _rows(seconds):
    return [{"update": i, "kind": "synthetic", "seconds": s} for i, s in enumerate(seconds)]


def _arms_json(native: float, zero_ratio: float, cycle_ratio: float, gpu: str = "TEST GPU",
               noise: float = 0.0) -> dict:
    """Arms at known ratios to native; the cycle a teacher at 1.2 and synthetic updates at what makes its mean
    cycle_ratio; `noise` spreads the cycle's rounds (and so its bounds) by up to that share, alternating."""
    base = [native * (1 + 0.01 * (i % 3)) for i in range(16)]  # drift that hits every arm of a round alike
    synthetic = (4 * cycle_ratio - 1.2) / 3
    return {"meta": {"env": {"gpu": gpu}},
            "results": [{"arm": "native", "rows": _rows(base), "median_last6_s": native},
                        {"arm": "zero", "rows": _rows([s * zero_ratio for s in base])},
                        {"arm": "learned", "cycle_s": cycle_ratio * native,  # a teacher every fourth update
                         "rows": [{"update": i, "kind": "teacher" if i % 4 == 0 else "synthetic",
                                   "seconds": s * (1.2 if i % 4 == 0 else synthetic) * (1 + noise * (-1) ** (i // 4))}
                                  for i, s in enumerate(base)]},
                        {"arm": "sketch@credit.sketch_rank=16@credit.sketch=subspace", "rows": _rows(base),
                         "refresh_share_s": 0.1 * native}]}


def test_the_summary_reads_ratios_ideals_and_the_narrowest_width_that_passes(tmp_path):
    widths = load("widths")
    for width, cycle in ((512, 0.95), (1024, 0.92), (2048, 0.90)):
        (tmp_path / f"w{width}").mkdir()
        (tmp_path / f"w{width}" / "arms.json").write_text(json.dumps(_arms_json(0.3, 0.9, cycle)))
    assert widths.summarize(tmp_path) == 0
    got = json.loads((tmp_path / "widths.json").read_text())
    assert got["gate_first_width"] == 1024 and got["devices"] == ["TEST GPU"]
    zero = got["ratios"]["512"]["zero"]
    assert zero["ratio"] == pytest.approx(0.9) and zero["low"] <= 0.9 <= zero["high"]
    assert got["ratios"]["1024"]["cycle (one teacher in four)"]["ratio"] == pytest.approx(0.92)
    # the learned update and the teacher read from the cycle's own rounds, each against native's of that round
    assert got["ratios"]["512"]["learned (synthetic)"]["ratio"] == pytest.approx((4 * 0.95 - 1.2) / 3)
    assert got["ratios"]["512"]["teacher"]["ratio"] == pytest.approx(1.2)
    assert got["gate"] == {"512": "misses", "1024": "holds", "2048": "holds"}
    # a refresh's share counts in the sketch's ratio, as compare counts it
    assert got["ratios"]["512"]["sketch16"]["ratio"] == pytest.approx(1.1, rel=0.02)
    f = flop_budget(config.load("seed-w2048").model).omitted_fraction
    assert got["ideals"]["2048"]["zero"] == pytest.approx(1 - f) and got["ideals"]["2048"]["fp8"] == pytest.approx(1 - f / 2)
    assert got["ideals"]["512"]["zero"] > got["ideals"]["2048"]["zero"]  # the omitted share grows with width
    assert "holds first at width 1,024 (0.920 [0.920, 0.920]), and at 2,048" in (tmp_path / "widths.md").read_text()
    assert (tmp_path / "widths.png").stat().st_size > 0
    assert "different devices" not in (tmp_path / "widths.md").read_text()


def test_rounds_in_which_an_arm_compiled_are_left_out_of_its_ratio(tmp_path):
    """dropbp compiles a block variant on many of its first updates (its drop pattern meets a new one): those
    rounds time the compiler, and the ratio reads the others."""
    widths = load("widths")
    data = _arms_json(0.3, 0.9, 0.95)
    compiling = {1, 2, 3, 5, 6, 9, 12}
    data["results"].append({"arm": "dropbp", "rows": [
        {"update": i, "kind": "synthetic", "seconds": 0.3 * (5.0 if i in compiling else 0.85),
         "graphs_compiled": 2 if i in compiling else 0} for i in range(16)]})
    (tmp_path / "w512").mkdir()
    (tmp_path / "w512" / "arms.json").write_text(json.dumps(data))
    assert widths.summarize(tmp_path) == 0
    got = json.loads((tmp_path / "widths.json").read_text())["ratios"]["512"]["dropbp"]
    assert got["ratio"] == pytest.approx(0.85, rel=0.03) and got["rounds"] == 14 - 6  # rounds 3-16, six compiled


def test_a_passing_width_is_not_called_the_narrowest_while_narrower_ones_are_unmeasured(tmp_path):
    widths = load("widths")
    (tmp_path / "w1536").mkdir()
    (tmp_path / "w1536" / "arms.json").write_text(json.dumps(_arms_json(0.3, 0.9, 0.92)))
    assert widths.summarize(tmp_path) == 0
    got = json.loads((tmp_path / "widths.json").read_text())
    assert got["gate_first_width"] is None and got["unmeasured"] == [512, 1024]
    text = (tmp_path / "widths.md").read_text()
    assert "holds at width 1,536" in text and "not yet measured: width 512, 1,024" in text
    assert "holds first" not in text


def test_widths_measured_on_different_devices_are_flagged(tmp_path):
    widths = load("widths")
    for width, gpu in ((512, "GPU A"), (1024, "GPU B")):
        (tmp_path / f"w{width}").mkdir()
        (tmp_path / f"w{width}" / "arms.json").write_text(json.dumps(_arms_json(0.3, 0.9, 0.95, gpu)))
    assert widths.summarize(tmp_path) == 0
    text = (tmp_path / "widths.md").read_text()
    assert "different devices (width 512: GPU A, width 1,024: GPU B)" in text
    assert "| arm | width 512 (GPU A) | width 1,024 (GPU B) |" in text  # each column names its card
    assert "misses at 512 (0.950 [0.950, 0.950], GPU A) and 1,024 (0.950 [0.950, 0.950], GPU B)" in text


def test_the_figure_joins_only_widths_of_one_device(tmp_path, monkeypatch):
    """A line between widths measured on different cards would read a ratio across devices: each device gets its
    own line and marker."""
    import matplotlib.axes

    widths = load("widths")
    for width, gpu in ((512, "GPU A"), (1024, "GPU A"), (1536, "GPU B"), (2048, "GPU B")):
        (tmp_path / f"w{width}").mkdir()
        (tmp_path / f"w{width}" / "arms.json").write_text(json.dumps(_arms_json(0.3, 0.9, 0.95, gpu)))
    lines = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        lines.extend((list(line.get_xdata()), line.get_linestyle(), line.get_marker()) for line in got)
        return got

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    assert widths.summarize(tmp_path) == 0
    solid = [xs for xs, style, _ in lines if style == "-" and len(xs) > 1]
    assert solid and all(set(xs) in ({512, 1024}, {1536, 2048}) for xs in solid)
    assert {m for xs, _, m in lines if xs in ([1536], [2048])} >= {"s"}  # GPU B's points: its own marker


def test_an_arm_measured_only_on_the_second_device_keeps_its_legend_entry(tmp_path, monkeypatch):
    import matplotlib.axes

    widths = load("widths")
    for width, gpu in ((512, "GPU A"), (1024, "GPU B")):
        data = _arms_json(0.3, 0.9, 0.95, gpu)
        if gpu == "GPU A":  # the sketch ran at width 1,024 only
            data["results"] = [r for r in data["results"] if not r["arm"].startswith("sketch")]
        (tmp_path / f"w{width}").mkdir()
        (tmp_path / f"w{width}" / "arms.json").write_text(json.dumps(data))
    labels = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, *a, **kw: labels.append(kw.get("label"))
                        or real(self, *a, **kw))
    assert widths.summarize(tmp_path) == 0
    assert "sketch16" in labels and "zero" in labels


def test_a_summary_of_nothing_says_what_to_run(tmp_path, capsys):
    assert load("widths").summarize(tmp_path) == 2
    assert "benchmarks/widths.py run" in capsys.readouterr().err


def test_widths_outside_the_presets_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    widths = load("widths")
    monkeypatch.setattr("sys.argv", ["widths.py", "run", str(tmp_path / "out"), "--widths", "512,640"])
    assert widths.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--widths 512,1024" in err
    assert not (tmp_path / "out").exists()


def test_each_widths_process_output_is_kept_beside_its_record(tmp_path, capsys, monkeypatch):
    """What a width's process prints is shown and appended to its folder's log.txt, a failed process's too, and a
    rerun adds to that log under its own command line."""
    import sys
    widths = load("widths")
    speak = [sys.executable, "-c", "import sys; print('round 1'); print('broke', file=sys.stderr); sys.exit(3)"]
    log = tmp_path / "w2048" / "log.txt"
    assert widths.run_logged(speak, log) == 3
    assert widths.run_logged(speak[:2] + ["print('round 1 again')"], log) == 0
    kept = log.read_text().splitlines()
    assert kept[0].startswith("$ ") and kept[1:3] == ["round 1", "broke"]
    assert kept[3].startswith("$ ") and kept[4:] == ["round 1 again"]
    assert "round 1\nbroke\n" in capsys.readouterr().out
    seen = []
    monkeypatch.setattr(widths, "run_logged", lambda cmd, path: seen.append((cmd, path)) or 5)
    assert widths.run(tmp_path, 4, (2048,)) == 5
    assert seen[0][1] == log and "--preset" in seen[0][0] and "seed-w2048" in seen[0][0]
    assert "w2048: arms.py exited 5" in capsys.readouterr().err


def test_a_width_run_with_fewer_arms_runs_those_and_says_which_it_left_out(tmp_path, capsys, monkeypatch):
    widths = load("widths")
    seen = []
    monkeypatch.setattr(widths, "run_logged", lambda cmd, path: seen.append(cmd) or 1)
    monkeypatch.setattr("sys.argv", ["widths.py", "run", str(tmp_path), "--widths", "2048", "--arms", "learned,fp8"])
    assert widths.main() == 1
    assert seen[0][seen[0].index("--arms") + 1] == "native,learned,fp8"
    monkeypatch.setattr("sys.argv", ["widths.py", "run", str(tmp_path), "--arms", "learned,cycle"])
    assert widths.main() == 2 and "--arms zero,learned" in capsys.readouterr().err and len(seen) == 1
    data = _arms_json(0.3, 0.9, 0.95)
    data["results"] = [r for r in data["results"] if r["arm"] in ("native", "learned")]
    (tmp_path / "w512").mkdir()
    (tmp_path / "w512" / "arms.json").write_text(json.dumps(data))
    assert widths.summarize(tmp_path) == 0
    text = (tmp_path / "widths.md").read_text()
    assert "Width 512 ran without zero, sketch16, fp8, dropbp (`run --arms`)" in text
    assert "| zero | - |" in text


def test_a_width_stopped_by_a_signal_is_said_to_read_only_its_full_rounds(tmp_path):
    widths = load("widths")
    data = _arms_json(0.3, 0.9, 0.95)
    data["meta"] |= {"updates": 16, "stopped": {"signal": "SIGINT", "full_rounds": 9}}
    for result in data["results"]:
        result["rows"] = result["rows"][:9]
    (tmp_path / "w512").mkdir()
    (tmp_path / "w512" / "arms.json").write_text(json.dumps(data))
    assert widths.summarize(tmp_path) == 0
    text = (tmp_path / "widths.md").read_text()
    assert "Width 512 was stopped by SIGINT after 9 of 16 rounds" in text
    assert json.loads((tmp_path / "widths.json").read_text())["ratios"]["512"]["zero"]["rounds"] == 7


def test_ctrl_c_while_a_width_runs_waits_for_what_its_process_keeps(tmp_path, monkeypatch):
    """Ctrl-C reaches the width's process and this one alike: this one goes on reading until the process has
    said what it kept and ended, and returns its exit code."""
    import os
    import signal
    import sys
    import threading

    widths = load("widths")
    child = [sys.executable, "-c", "import sys, time; print('round 1', flush=True); time.sleep(1.0); "
             "print('kept 1 round', flush=True); sys.exit(130)"]
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        code = widths.run_logged(child, tmp_path / "log.txt")
    finally:
        timer.cancel()
    assert code == 130
    assert (tmp_path / "log.txt").read_text().splitlines()[1:] == ["round 1", "kept 1 round"]


def test_a_cycle_whose_bounds_straddle_the_gate_is_not_said_to_hold(tmp_path):
    """The cycle's bounds come from its parts' intervals: a point under the gate with an upper bound over it is at
    the gate, neither holding nor missing; the same point with tight parts holds."""
    widths = load("widths")
    for width, noise in ((512, 0.0), (1024, 0.04)):
        (tmp_path / f"w{width}").mkdir()
        (tmp_path / f"w{width}" / "arms.json").write_text(json.dumps(_arms_json(0.3, 0.9, 0.925, noise=noise)))
    assert widths.summarize(tmp_path) == 0
    got = json.loads((tmp_path / "widths.json").read_text())
    wide = got["ratios"]["1024"]["cycle (one teacher in four)"]
    assert wide["low"] < 0.925 < 0.93 < wide["high"]
    assert got["gate"] == {"512": "holds", "1024": "at the gate"}
    text = (tmp_path / "widths.md").read_text()
    assert "holds first at width 512" in text and "the cycle's bounds straddle it at 1,024" in text


def test_records_without_compile_counts_are_said_to_read_every_round(tmp_path):
    widths = load("widths")
    (tmp_path / "w512").mkdir()
    (tmp_path / "w512" / "arms.json").write_text(json.dumps(_arms_json(0.3, 0.9, 0.95)))
    assert widths.summarize(tmp_path) == 0
    assert "Recorded before each update counted the graphs it compiled (width 512)" in (
        tmp_path / "widths.md").read_text()


T_975_DF2 = 4.302652729749464  # Student's t, 97.5th percentile, two degrees of freedom (from tables)


def _compare(arms: dict[str, tuple[list[float], list[float], str | None]]) -> dict:
    """A compare.json: per arm, its seeds' speedups, its seeds' costs per update (native's update taking 2 s) and the
    speedups' bound; seed 3 of every arm run twice (its repeat, at the same cost, averaged into it)."""
    keys = ("1", "2", "3", "3r2")
    return {"seeds": [1, 2, 3],
            "runs": {arm: {key: {"seconds_per_update": 2.0 * costs[min(i, 2)]} for i, key in enumerate(keys)}
                     for arm, (_, costs, _) in arms.items()},
            "summary": {arm: {"speedup": {"per_seed": {str(seed): {"value": v, "bound": bound}
                                                       for seed, v in zip((1, 2, 3), speeds)}}}
                        for arm, (speeds, _, bound) in arms.items()}}


def test_the_projection_carries_a_comparisons_learning_to_a_width():
    widths = load("widths")
    costs = {widths.CYCLE: {"ratio": 0.95, "low": 0.9, "high": 0.96},
             "sketch16": {"ratio": 0.9, "low": 0.89, "high": 0.91},
             "zero": {"ratio": 0.8, "low": 0.79, "high": 0.81}}
    compare = _compare({"native": ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], None),
                        "learned@credit.fit=lstsq": ([0.9, 0.92, 0.94], [1.0, 1.0, 1.0], None),
                        "sketch@credit.sketch_rank=16@credit.sketch=subspace": ([0.8, 0.81, 0.82], [1.0] * 3, None),
                        "sketch@credit.sketch_rank=32": ([0.99, 0.99, 0.99], [1.0] * 3, None),
                        "zero@credit.schedule=fixed:4": ([0.85, 0.85, 0.85], [0.9, 0.95, 1.0], None),
                        "zero@credit.schedule=fixed:2": ([0.85, 0.85, 0.85], [0.9, 0.9, 0.9], None),
                        "zero@credit.schedule=warmup:10": ([0.85, 0.85, 0.85], [0.9, 0.9, 0.9], None),
                        "zero": ([0.7, 0.7, 0.7], [0.9, 0.9, 0.9], "below")})
    rows = {r["arm"]: r for r in widths.project(compare, costs)}
    # native, a sketch the width benchmark did not measure and a schedule of no fixed share have no cost there
    assert set(rows) == {"learned@credit.fit=lstsq", "sketch@credit.sketch_rank=16@credit.sketch=subspace",
                         "zero@credit.schedule=fixed:4", "zero@credit.schedule=fixed:2", "zero"}
    half = T_975_DF2 * 0.02 / 3 ** 0.5  # the learned arm's shares 0.90, 0.92, 0.94: sd 0.02
    learned = rows["learned@credit.fit=lstsq"]
    assert learned["projected"]["ratio"] == pytest.approx(0.92 / 0.95)  # under 1 at the point
    assert learned["projected"]["low"] == pytest.approx((0.92 - half) / 0.96)
    assert learned["projected"]["high"] == pytest.approx((0.92 + half) / 0.9)
    assert not learned["ruled_out"]  # its upper end reaches 1
    sketch = rows["sketch@credit.sketch_rank=16@credit.sketch=subspace"]
    assert sketch["projected"]["high"] == pytest.approx((0.81 + T_975_DF2 * 0.01 / 3 ** 0.5) / 0.89)
    assert sketch["ruled_out"]  # 0.938: even its best end is under 1
    floor = rows["zero@credit.schedule=fixed:4"]  # one exact update in four at native's cost, three at zero's
    assert floor["cost"] == pytest.approx({"ratio": 0.85, "low": 0.8425, "high": 0.8575})
    assert floor["share"]["mean"] == pytest.approx(0.85 * 0.95)  # speedup times the study's own cost, per seed
    assert rows["zero@credit.schedule=fixed:2"]["cost"]["ratio"] == pytest.approx(0.9)  # (0.8 + 1) / 2
    zero = rows["zero"]  # every seed above native's cheapest budget: an upper bound only
    assert zero["share_upper_only"] and zero["projected"]["low"] is None and zero["ruled_out"]
    text = widths.projection_md(list(rows.values()), 1536, "study/compare.json", ["TEST GPU"])
    assert "| zero | < 0.630 | 0.800 [0.790, 0.810] | < 0.797 | ruled out |" in text
    assert "| learned@credit.fit=lstsq | 0.920 [" in text and "| kept |" in text


def test_a_projection_to_an_unmeasured_width_says_what_to_run(tmp_path, capsys):
    widths = load("widths")
    assert widths.project_command(tmp_path, tmp_path / "compare.json", 2048, None) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"benchmarks/widths.py run {tmp_path} --widths 2048" in err


def test_a_projection_from_what_is_not_a_comparison_says_so(tmp_path, capsys):
    widths = load("widths")
    (tmp_path / "w1536").mkdir()
    (tmp_path / "w1536" / "arms.json").write_text("{}")
    (tmp_path / "widths.json").write_text("{}")
    for text in (None, "not json", "{}"):
        if text is not None:
            (tmp_path / "c.json").write_text(text)
        assert widths.project_command(tmp_path, tmp_path / "c.json", 1536, None) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "is not a comparison's compare.json" in err, err
