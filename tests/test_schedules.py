"""Schedules: which updates are exact, decided apart from the source, from the history so far."""

from __future__ import annotations

import math

import pytest
from creditlab import config
from creditlab.credit.schedules import Adaptive, parse, plan_for
from creditlab.train import Trainer


def kinds(plan, updates: int, cosines=None) -> str:
    """The plan's kinds as letters (t, s, n), feeding it a scripted fit cosine on every teacher update."""
    out, cosines = [], list(cosines or [])
    for u in range(updates):
        kind = plan.kind(u)
        fit = {"fit_cosine": cosines.pop(0) if cosines else 0.5} if kind == "teacher" else None
        plan.observe(u, kind, fit)
        out.append(kind[0])
    return "".join(out)


def test_fixed_never_and_warmup():
    assert kinds(plan_for("fixed", 4, omits=True, fits=True), 9) == "tssstssst"
    assert kinds(plan_for("fixed:3", 4, omits=True, fits=True), 7) == "tsstsst"
    assert kinds(plan_for("fixed:0", 4, omits=True, fits=True), 4) == "ssss"
    assert kinds(plan_for("never", 4, omits=True, fits=True), 4) == "ssss"
    assert kinds(plan_for("warmup:3,4", 4, omits=True, fits=True), 11) == "tttssstssst"
    assert kinds(plan_for("warmup:2", 3, omits=True, fits=True), 8) == "ttsstsst"


def test_a_source_that_fits_nothing_gets_native_updates_where_the_schedule_says_exact():
    assert kinds(plan_for("fixed", 4, omits=True, fits=False), 5) == "sssss"  # fixed teaches nothing: none
    assert kinds(plan_for("fixed:4", 4, omits=True, fits=False), 5) == "nsssn"  # one native update in four
    assert kinds(plan_for("fixed:4", 4, omits=False, fits=False), 3) == "nnn"  # exact omits nothing


def test_adaptive_lengthens_while_the_fit_holds_and_halves_when_it_goes_stale():
    plan = plan_for("adaptive:2,8", 4, omits=True, fits=True)
    schedule = plan.schedule
    # teacher at 0 (first cosine: the baseline), then c >= b lengthens by one each time: 4 -> 5 -> 6
    assert kinds(plan, 16, cosines=[0.30, 0.31, 0.32, 0.10]) == "tssstsssstssssst"
    assert [period for _, _, period in schedule.history] == [4, 5, 6, 3]  # 0.10 < 0.9 b: halved
    assert schedule.baseline == pytest.approx(0.5 * (0.5 * (0.5 * 0.30 + 0.5 * 0.31) + 0.5 * 0.32) + 0.5 * 0.10)


def test_adaptive_stays_within_its_bounds_and_drops_to_the_shortest_without_signal():
    schedule = Adaptive(4, 2, 5)
    update = 0
    for cosine in [0.2, 0.3, 0.4, 0.5, 0.6, 0.7]:  # ever better: lengthen, but never beyond 5
        schedule.observe(update, "teacher", {"fit_cosine": cosine})
        update = schedule.next_exact
    assert schedule.period == 5
    schedule.observe(update, "teacher", {"fit_cosine": math.nan})  # nothing measured: teach at once again
    assert schedule.period == 2 and schedule.next_exact == update + 2
    schedule.observe(schedule.next_exact, "teacher", {"fit_cosine": 0.71})
    schedule.observe(schedule.next_exact, "teacher", {"fit_cosine": 0.01})  # collapsed: halved, not below 2
    assert schedule.period == 2


def test_adaptive_in_between_keeps_its_period():
    schedule = Adaptive(4, 2, 16)
    schedule.observe(0, "teacher", {"fit_cosine": 0.5})
    schedule.observe(4, "teacher", {"fit_cosine": 0.47})  # below b = 0.5, above 0.9 b: keep
    assert schedule.period == 4 and schedule.next_exact == 8


@pytest.mark.parametrize("spec, fragment", [("sometimes", "unknown schedule"), ("fixed:a", "integers"),
                                            ("fixed:1,2", "too many"), ("warmup", "needs its number"),
                                            ("adaptive:9,3", "1 <= A <= B"), ("fixed:-1", ">= 0")])
def test_bad_schedules_say_what_is_wrong(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse(spec, 4)
    with pytest.raises(config.ConfigError, match="credit.schedule"):
        config.load("tiny", ["credit.source=learned", f"credit.schedule={spec}"])


def _trainer(schedule: str, updates: int = 6) -> Trainer:
    cfg = config.load("tiny", ["credit.source=learned", f"credit.schedule={schedule}", "train.device=cpu",
                               "train.compile=off", "train.micro_batch=2", "train.grad_accum=1",
                               "model.seq_len=16", "model.vocab_size=97", f"train.updates={updates}"])
    return Trainer(cfg)


def test_the_trainer_follows_the_schedule_and_checkpoints_its_state(tmp_path):
    trainer = _trainer("adaptive:2,8")
    rows = [trainer.train_update() for _ in range(3)]
    # the fresh model's zero output projections give the first teacher update no signal: teach again at once
    assert math.isnan(rows[0].fit["fit_cosine"])
    assert [r.kind for r in rows] == ["teacher", "synthetic", "teacher"]
    trainer.save_checkpoint(tmp_path / "ck.pt")
    resumed = _trainer("adaptive:2,8")
    resumed.load_checkpoint(tmp_path / "ck.pt")
    assert repr(resumed.plan.schedule.state_dict()) == repr(trainer.plan.schedule.state_dict())  # NaN != NaN
    assert resumed.plan.schedule.history and resumed.plan.schedule.next_exact == trainer.plan.schedule.next_exact
    warm = _trainer("warmup:2,3")
    assert [warm.train_update().kind for _ in range(5)] == ["teacher", "teacher", "synthetic", "synthetic", "teacher"]


def test_only_an_adaptive_schedule_reads_a_teacher_update_before_it_picks_the_next():
    for schedule in ("adaptive:2,8", "fixed:3"):
        trainer = _trainer(schedule, updates=7)
        assert trainer.plan.reads("teacher") == schedule.startswith("adaptive")
        assert not trainer.plan.reads("synthetic")
