"""The verdict's arithmetic (creditlab/experiments/verdict.py) against cases known without it."""

from __future__ import annotations

import math
import statistics

import pytest

from creditlab.experiments import verdict as vd


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(p):
    # df = 1 is the Cauchy distribution, df = 2 has a closed form too: references that share no code with the
    # continued fraction the module evaluates
    assert vd.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert vd.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    assert vd.t_quantile(1 - p, 2) == pytest.approx(-vd.t_quantile(p, 2), rel=1e-12)


def test_t_quantile_of_many_degrees_of_freedom_is_the_normals():
    normal = statistics.NormalDist().inv_cdf(0.975)
    assert vd.t_quantile(0.975, 1e7) == pytest.approx(normal, rel=1e-6)
    assert vd.t_quantile(0.975, 4) == pytest.approx(2.7764451, rel=1e-7)  # printed tables
    assert vd.t_quantile(0.975, 30) == pytest.approx(2.0422725, rel=1e-7)


def test_interval_of_a_known_sample():
    iv = vd.interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) = 4.302653
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.high - iv.mean == pytest.approx(4.3026527 / math.sqrt(3), rel=1e-7)
    assert iv.low == pytest.approx(2 * iv.mean - iv.high)
    one = vd.interval([5.0, None, float("nan")])
    assert one.mean == 5.0 and one.low is None and one.text() == "5.0000 (one seed)"
    assert vd.interval([]).mean is None


def test_runs_of_a_seed_are_averaged_into_it_and_noise_is_split_by_source():
    values = {"1": 2.0, "1r2": 2.2, "2": 3.0, "3": 4.0}
    assert vd.by_seed(values) == {1: pytest.approx(2.1), 2: 3.0, 3: 4.0}
    n = vd.noise(values)
    assert n["run_to_run_sd"] == pytest.approx(0.2 / math.sqrt(2)) and n["run_to_run_dof"] == 1
    assert n["seed_to_seed_sd"] == pytest.approx(statistics.stdev([2.1, 3.0, 4.0]))
    assert vd.run_key(3) == "3" and vd.run_key(3, 2) == "3r2" and vd.seed_of("3r2") == 3


def test_isotonic_regression_pools_violators():
    assert vd.isotonic_decreasing([3.0, 2.0, 1.0]) == [3.0, 2.0, 1.0]
    assert vd.isotonic_decreasing([3.0, 1.0, 2.0]) == [3.0, 1.5, 1.5]
    assert vd.isotonic_decreasing([1.0, 2.0, 3.0]) == [2.0, 2.0, 2.0]


def test_native_curve_interpolates_in_log_seconds_and_never_extrapolates():
    curve = vd.NativeCurve([(4.0, 2.0), (1.0, 3.0), (2.0, 2.5)])
    assert curve.seconds_to_reach(2.5).seconds == 2.0
    assert curve.seconds_to_reach(2.25).seconds == pytest.approx(2 * math.sqrt(2))  # halfway in log seconds
    assert curve.seconds_to_reach(3.5) == vd.Reach(None, "below", 1.0)
    assert curve.seconds_to_reach(1.5) == vd.Reach(None, "above", 4.0)
    # a noisy curve (more budget, higher loss) is made non-increasing first
    noisy = vd.NativeCurve([(1.0, 3.0), (2.0, 2.4), (3.0, 2.6), (4.0, 2.0)])
    assert noisy.loss == [3.0, 2.5, 2.5, 2.0] and noisy.seconds_to_reach(2.5).seconds == 2.0


def test_speedup_and_its_verdict():
    curve = vd.NativeCurve([(1.0, 3.0), (2.0, 2.5), (4.0, 2.0)])
    assert vd.speedup(curve, 2.5, 1.0) == vd.Speedup(2.0)  # native needs 2 s for what the arm did in 1 s
    assert vd.speedup(curve, 2.5, 4.0) == vd.Speedup(0.5)
    assert vd.speedup(curve, 3.4, 2.0) == vd.Speedup(0.5, "below")
    pays = [vd.Speedup(v) for v in (1.5, 1.6, 1.55)]
    assert vd.speedup_verdict(pays)[1] == vd.PAYS
    assert vd.speedup_verdict([vd.Speedup(v) for v in (0.5, 0.6, 0.55)])[1] == vd.DOES_NOT_PAY
    assert vd.speedup_verdict([vd.Speedup(v) for v in (0.8, 1.2, 1.0)])[1] == vd.CANNOT_TELL
    assert vd.speedup_verdict([vd.Speedup(1.5)])[1] == vd.CANNOT_TELL  # one seed: no interval
    # bounds: "below" can only lower a speedup, so it may back "does not pay" but never "pays"
    assert vd.speedup_verdict([vd.Speedup(v, "below") for v in (0.5, 0.6, 0.55)])[1] == vd.DOES_NOT_PAY
    assert vd.speedup_verdict([vd.Speedup(1.5, "below"), *pays[1:]])[1] == vd.CANNOT_TELL
    assert vd.speedup_verdict([vd.Speedup(1.5, "above"), *pays[1:]])[1] == vd.PAYS
    assert vd.speedup_verdict([vd.Speedup(0.5, "above"), vd.Speedup(0.6), vd.Speedup(0.55)])[1] == vd.CANNOT_TELL
