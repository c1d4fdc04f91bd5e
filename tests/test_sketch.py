"""The sketched-product source (credit/sketch.py): exact at full rank and only there, the FLOPs it adds, its
refresh schedule, its place in the fit ceiling, and its parity through the compiler and under autocast; the
sampled form unbiased (and a biased mutant caught by the same test), the subspace refresh tracking the SVD's basis,
and every form's draws and refreshes the same in a resumed run."""

from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from creditlab.experiments import ceiling as ceil
from creditlab import checks, cli
from creditlab.config import load
from creditlab.credit import make_source
from creditlab.config import ConfigError
from creditlab.credit import sketch as sk
from creditlab.credit.sketch import SketchCredit, SketchSource, _SketchedLinear, leading_basis
from creditlab.credit.sources import ZeroSource
from creditlab.data import SyntheticLoader
from creditlab import flops
from creditlab.flops import sketch_cost
from creditlab.model import ExactCredit
from creditlab.ops.qk_norm import QKEpilogue
from creditlab.ops.relu2 import expand_relu2_values
from creditlab.train import Trainer
from tests.test_credit import CountMatmuls, train_eager_and_compiled

SMALL = checks.seed_structure()  # 8 layers, 16 branches, width 64


def _sketch(model, rank: int) -> SketchSource:
    source = SketchSource(SMALL.width, SMALL.branches, rank, every=50).double()
    source.refresh(model)
    return source


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def _cosine(a: dict, b: dict) -> float:
    a, b = _flat(a), _flat(b)
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("seed", [0, 1])
def test_full_rank_sketch_is_native_backprop(seed):
    """At k = d, V V^T = I: the sketched synthetic backward is native backprop, every trunk gradient."""
    model = checks.randomized_model(SMALL, seed)
    idx, targets = checks._batch(SMALL, seed)
    native = checks._trunk_grads(model, idx, targets, ExactCredit())
    errors = checks._rel_errors(checks._trunk_grads(model, idx, targets, _sketch(model, SMALL.width).step()), native)
    assert len(errors) == len(list(model.trunk_parameters()))
    assert max(errors.values()) <= checks.TOLERANCE, max(errors.values())  # measured about 2e-14


class _TransposedSketch(torch.autograd.Function):
    """A mutant: (dY W V) V instead of (dY W V) V^T, which at full rank is not the identity on dY W."""

    @staticmethod
    def forward(ctx, n, weight, basis, activation):
        ctx.save_for_backward(n, weight, basis)
        return F.linear(n, weight) if activation is None else expand_relu2_values(n, weight)[0]

    @staticmethod
    def backward(ctx, dy):
        n, weight, basis = ctx.saved_tensors
        return (dy @ (weight @ basis)) @ basis, dy.flatten(0, -2).t() @ n.flatten(0, -2), None, None


class _TransposedCredit(SketchCredit):
    def product(self, index, n, weight, activation=None):
        if isinstance(activation, QKEpilogue):  # as SketchCredit: the product, then the epilogue
            return activation.after(_TransposedSketch.apply(n, weight, self.basis[index], None))
        return _TransposedSketch.apply(n, weight, self.basis[index], activation)


def test_low_rank_differs_the_svd_basis_beats_a_random_one_and_a_mutant_fails():
    model = checks.randomized_model(SMALL, 0)
    idx, targets = checks._batch(SMALL, 0)
    native = checks._trunk_grads(model, idx, targets, ExactCredit())
    grads = lambda credit: checks._trunk_grads(model, idx, targets, credit)  # noqa: E731
    k = 16
    source = _sketch(model, k)
    low = grads(source.step())
    assert max(checks._rel_errors(low, native).values()) > 1e-3  # so the full-rank equality can fail
    random_basis, _ = torch.linalg.qr(torch.randn(SMALL.branches, SMALL.width, k, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(0)))
    random = grads(SketchCredit(random_basis))
    # The leading singular subspace keeps more of each product than a random one: the gradient is closer to
    # native's (measured cosine 0.963 against 0.949, and zero's far below).
    assert _cosine(random, native) < _cosine(low, native) < 1 - 1e-3
    assert _cosine(grads(ZeroSource().step()), native) < _cosine(random, native)
    full = _sketch(model, SMALL.width).basis
    assert max(checks._rel_errors(grads(_TransposedCredit(full)), native).values()) > 1e-3
    assert max(checks._rel_errors(grads(SketchCredit(full[..., :-1])), native).values()) > 1e-6  # one short


def _cost(model, idx, targets, credit):
    with FlopCounterMode(display=False) as forward:
        loss = model(idx, targets, credit=credit)
    with CountMatmuls() as counter, FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), counter.count, backward.get_total_flops()


@pytest.mark.parametrize("form, k", [("svd", 16), ("svd", 64), ("sampled", 16)])
def test_flops_are_zeros_plus_the_predicted_sketch(form, k):
    """Exactly, no tolerance: the backward adds 2k(m + d) per token per branch and the factor A = W V (sampled:
    S^T W / k), 2mdk per branch per micro-batch; the forward is zero's; `creditlab flops`'s sketch_cost predicts both
    terms, the same for every form."""
    model = checks.randomized_model(SMALL, 2)
    idx, targets = checks._batch(SMALL, 2)
    z_forward, z_matmuls, z_backward = _cost(model, idx, targets, ZeroSource().step())
    if form == "sampled":
        source = SketchSource(SMALL.width, SMALL.branches, k, every=50, form="sampled").double()
        source.draw(model, 0, 0)
    else:
        source = _sketch(model, k)
    s_forward, s_matmuls, s_backward = _cost(model, idx, targets, source.step())
    d, tokens = SMALL.width, idx.numel()
    outputs = [lin.out_features for lin in model.branch_modules()]  # m_b: 3d (attention) or mlp_hidden
    per_token = sum(2 * k * (m + d) for m in outputs)
    per_micro_batch = sum(2 * m * d * k for m in outputs)
    assert s_forward == z_forward
    assert s_matmuls == z_matmuls + 3 * SMALL.branches  # A = W V, dY A, (dY A) V^T (sampled: S^T W, dY S, .. @)
    assert s_backward - z_backward == per_token * tokens + per_micro_batch
    predicted = sketch_cost(SMALL, k, form)
    assert (predicted.per_token, predicted.per_micro_batch) == (per_token, per_micro_batch)
    assert predicted.omitted_per_token == sum(2 * m * d for m in outputs)


def _projection(basis: torch.Tensor) -> torch.Tensor:
    """V V^T per branch: what the sketch uses of V (the SVD's signs are arbitrary)."""
    return basis @ basis.transpose(1, 2)


def _leading(model, rank: int) -> torch.Tensor:
    return torch.stack([leading_basis(lin.weight, rank) for lin in model.branch_modules()])


def test_the_basis_is_refreshed_from_the_current_weights_every_sketch_every_updates():
    cfg = load("tiny", ["model.vocab_size=97", "credit.source=sketch", "credit.sketch_every=3",
                        "credit.sketch_rank=8", "train.updates=7"])
    trainer = Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))
    source = trainer.source
    refreshed, due_basis = [], None
    for update in range(7):
        if update % 3 == 0:
            due_basis = _leading(trainer.model, 8)  # the weights at the start of a refreshing update
        before = source.basis.clone()
        row = trainer.train_update()
        if not torch.equal(before, source.basis):
            refreshed.append(update)
        # a refreshing update is recorded as its own kind, so that costs count the SVD at its own median
        assert row.kind == ("refresh" if refreshed and refreshed[-1] == update else "synthetic")
        torch.testing.assert_close(_projection(source.basis), _projection(due_basis), rtol=0, atol=1e-5)
    assert refreshed == [0, 3, 6]  # the weights changed at every update; the basis only on schedule
    assert source.refreshed_at == 6

    # Saved with the source, so a resumed run refreshes when an unbroken one would.
    other = make_source(cfg)
    other.load_state_dict(source.state_dict())
    assert other.refreshed_at == 6 and torch.equal(other.basis, source.basis)
    assert not other.refresh_due(8) and other.refresh_due(9)
    # An exact update on a multiple moves the refresh to the next synthetic update, which is the first to need it.
    other.refreshed_at = 6
    assert [u for u in range(7, 14) if other.refresh_due(u)] == [9, 10, 11, 12, 13]


def test_config_problems_and_a_missing_basis():
    with pytest.raises(ValueError, match="sketch_rank"):
        load("tiny", ["credit.source=sketch", "credit.sketch_rank=65"])  # tiny's width is 64
    assert load("tiny", ["credit.source=sketch", "credit.sketch_rank=64"]).credit.sketch_rank == 64
    with pytest.raises(RuntimeError, match="refresh"):
        make_source(load("tiny", ["credit.source=sketch"])).step()


def test_credit_sketch_names_one_of_its_forms(capsys):
    for form in sk.FORMS:
        assert load("tiny", ["credit.source=sketch", f"credit.sketch={form}", "credit.sketch_rank=8"]).credit.sketch \
            == form
    with pytest.raises(ConfigError) as exc:
        load("tiny", ["credit.source=sketch", "credit.sketch=bogus"])
    assert "credit.sketch must be one of svd|subspace|sampled, got 'bogus'" in str(exc.value)
    assert cli.main(["flops", "--set", "credit.source=sketch", "--set", "credit.sketch=bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "credit.sketch must be one of svd|subspace|sampled, got 'bogus'" in err
    with pytest.raises(RuntimeError, match="draw"):  # the sampled form's step needs its signs
        make_source(load("tiny", ["credit.source=sketch", "credit.sketch=sampled", "credit.sketch_rank=8"])).step()


# ---- the sampled form: unbiased --------------------------------------------------------------------------------

DRAWS = (16, 64, 256, 1024, 4096)


def _mean_error_slope(estimator, dy, weight, repetitions: int = 4) -> tuple[float, list[float]]:
    """The slope of log error against log N of the mean of N independent estimates of dY W (N in DRAWS), the
    error ||mean - dY W|| / ||dY W|| root-mean-squared over `repetitions` independent sequences of draws.
    `estimator(dy, weight, generator)` draws what it needs from the generator. Unbiased with finite variance: the
    error falls as 1/sqrt(N), slope -1/2; a bias b holds it near b once the noise is below it, slope towards 0."""
    true = dy @ weight
    squared = torch.zeros(len(DRAWS), dtype=torch.float64)
    for repetition in range(repetitions):
        generator = torch.Generator().manual_seed(1000 + repetition)
        total, count = torch.zeros_like(true), 0
        for i, draws in enumerate(DRAWS):
            while count < draws:
                total += estimator(dy, weight, generator)
                count += 1
            squared[i] += ((total / draws - true).norm() / true.norm()) ** 2
    errors = (squared / repetitions).sqrt()
    x = torch.tensor([math.log(n) for n in DRAWS], dtype=torch.float64)
    x, y = x - x.mean(), errors.log() - errors.log().mean()
    return float((x * y).sum() / (x * x).sum()), errors.tolist()


M, D, K = 48, 16, 8  # the product's output and input widths, and the directions sampled


def _sampled(dy, weight, generator):
    """The estimator the source's backward runs: sampled_estimate with the source's Rademacher signs."""
    return sk.sampled_estimate(dy, weight, sk.rademacher((M, K), generator, torch.float64))


def _scaled_mutant(dy, weight, generator):  # biased: (k + 1) / k times the estimate
    return _sampled(dy, weight, generator) * (K + 1) / K


def _mean_mutant(dy, weight, generator):  # biased: signs of mean 1/2 (P(+1) = 3/4), so E[S S^T] != k I
    signs = torch.where(torch.rand(M, K, generator=generator, dtype=torch.float64) < 0.75, 1.0, -1.0)
    return sk.sampled_estimate(dy, weight, signs)


@pytest.mark.parametrize("estimator, unbiased", [(_sampled, True), (_scaled_mutant, False), (_mean_mutant, False)],
                         ids=["sampled", "scaled_mutant", "mean_mutant"])
def test_the_sampled_estimate_is_unbiased_and_a_biased_mutant_fails_the_same_test(estimator, unbiased):
    """float64: the mean of N draws approaches dY W as 1/sqrt(N) (fitted slope in [-0.6, -0.4] over N = 16..4096);
    each mutant, run through the very same assertion, does not (measured slopes -0.49; -0.30 and -0.01)."""
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(32, M, dtype=torch.float64, generator=g)
    weight = torch.randn(M, D, dtype=torch.float64, generator=g)
    slope, errors = _mean_error_slope(estimator, dy, weight)
    assert (-0.6 <= slope <= -0.4) == unbiased, (slope, errors)


def test_the_models_sampled_gradient_averages_to_native():
    """The estimator above is the one the model's backward runs: through the source's sampled context on the float64
    model, every trunk gradient (each a function of the branch inputs' gradients, each branch's estimate drawn
    independently) averaged over N draws approaches native's as 1/sqrt(N) (measured slope -0.47 over N = 4..64)."""
    model = checks.randomized_model(SMALL, 0)
    idx, targets = checks._batch(SMALL, 0)
    native = _flat(checks._trunk_grads(model, idx, targets, ExactCredit()))
    source = SketchSource(SMALL.width, SMALL.branches, 16, every=50, form="sampled", seed=3).double()
    total, errors = torch.zeros_like(native), {}
    for draw in range(64):
        signs = source.draw(model, 0, draw)
        assert signs.shape == (SMALL.branches, SMALL.mlp_hidden, 16) and set(signs.unique().tolist()) == {-1.0, 1.0}
        total += _flat(checks._trunk_grads(model, idx, targets, source.step()))
        if draw + 1 in (4, 16, 64):
            errors[draw + 1] = float((total / (draw + 1) - native).norm() / native.norm())
    slope = math.log(errors[64] / errors[4]) / math.log(16)
    assert -0.6 <= slope <= -0.4, errors
    assert errors[64] < 0.5, errors


def test_the_sampled_product_is_sampled_estimate_with_its_branchs_signs():
    """One branch through SampledCredit: its input gradient is sampled_estimate(dY, W, S_b[:m]) exactly."""
    torch.manual_seed(0)
    n = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64)
    signs = sk.rademacher((3, 64, 6), torch.Generator().manual_seed(1), torch.float64)  # m_max 64 > m = 40
    probe = torch.randn(2, 5, 40, dtype=torch.float64)
    (got,) = torch.autograd.grad(sk.SampledCredit(signs).product(2, n, weight), n, probe)
    torch.testing.assert_close(got, sk.sampled_estimate(probe, weight, signs[2, :40]), rtol=0, atol=0)


# ---- the subspace refresh -------------------------------------------------------------------------------------


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||P_a - P_b||_2 of the orthogonal projections onto span(a), span(b): the sine of the largest principal
    angle between the two subspaces (0: the same, 1: some direction of one orthogonal to the other)."""
    return float(torch.linalg.matrix_norm(a @ a.t() - b @ b.t(), ord=2))


def test_the_warm_started_subspace_iteration_tracks_the_svd_basis_and_a_cold_start_does_not():
    """A weight with a gap after its k-th singular value, perturbed five times: the randomized first refresh and
    then two warm-started iterations per perturbation span what the full SVD's basis spans (measured distance
    0.002); the first basis kept without iterating drifts away (0.14), and a random basis without iterations is
    nowhere near (1.0)."""
    g = torch.Generator().manual_seed(0)
    m, d, k = 96, 32, 8
    u, _ = torch.linalg.qr(torch.randn(m, d, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    spectrum = torch.cat([torch.linspace(4, 2, k), torch.linspace(1, 0.1, d - k)]).double()
    weight = u @ torch.diag(spectrum) @ v.t()
    first = sk.randomized_basis(weight, k, torch.Generator().manual_seed(1))
    assert _distance(first, leading_basis(weight, k)) < 1e-2
    # the same test matrix in float32 (drawn in float64 whatever the dtype), so a float32 run has its float64 basis
    single = sk.randomized_basis(weight.float(), k, torch.Generator().manual_seed(1))
    assert single.dtype == torch.float32 and _distance(single.double(), first) < 1e-5
    basis = first
    for _ in range(5):
        weight = weight + 0.1 * torch.randn(m, d, generator=g, dtype=torch.float64) / d ** 0.5
        basis = sk.subspace_iteration(weight, basis)
        torch.testing.assert_close(basis.t() @ basis, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-12)
    svd = leading_basis(weight, k)
    assert _distance(basis, svd) < 1e-2
    assert _distance(first, svd) > 5e-2  # so the iterations did the tracking
    cold, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    assert _distance(sk.subspace_iteration(weight, cold, iterations=0), svd) > 0.5


def test_the_subspace_source_starts_randomized_then_iterates_from_its_last_basis():
    """Through training: the first refresh is the range finder on the source's own seeded stream (the same seed,
    the same basis), every later one SUBSPACE_ITERATIONS steps from the basis before it, on the weights at the
    start of the refreshing update; a refreshing update is recorded as `refresh`."""
    cfg = load("tiny", ["model.vocab_size=97", "credit.source=sketch", "credit.sketch=subspace",
                        "credit.sketch_every=2", "credit.sketch_rank=8", "train.updates=5", "train.grad_accum=1",
                        "train.warmup=0"])
    trainer = Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))
    source, kinds = trainer.source, []
    for update in range(5):
        weights = [lin.weight.detach().clone() for lin in trainer.model.branch_modules()]
        before = source.basis.clone()
        kinds.append(trainer.train_update().kind)
        if update == 0:
            want = [sk.randomized_basis(w, 8, source.generator(w.device, sk._RANGE_STREAM, 0, b))
                    for b, w in enumerate(weights)]
        elif update % 2 == 0:
            want = [sk.subspace_iteration(w, before[b]) for b, w in enumerate(weights)]
        else:
            want = list(before)
        torch.testing.assert_close(source.basis, torch.stack(want), rtol=0, atol=0)
    assert kinds == ["refresh", "synthetic", "refresh", "synthetic", "refresh"]
    other = make_source(cfg)
    other.refresh(trainer.model)
    again = make_source(cfg)
    again.refresh(trainer.model)
    assert torch.equal(other.basis, again.basis)  # seeded from train.seed: the same first basis
    reseeded = make_source(load("tiny", ["credit.source=sketch", "credit.sketch=subspace", "credit.sketch_rank=8",
                                         "train.seed=7"]))
    reseeded.refresh(trainer.model)
    assert not torch.equal(other.basis, reseeded.basis)


# ---- determinism: the draws, and a resumed run ------------------------------------------------------------------


def test_the_signs_are_a_function_of_seed_update_and_micro_batch_alone():
    model = checks.randomized_model(SMALL, 0)
    make = lambda seed: SketchSource(SMALL.width, SMALL.branches, 8, 50, "sampled", seed=seed)  # noqa: E731
    a, b = make(5), make(5)
    first = a.draw(model, 3, 1).clone()
    a.draw(model, 9, 0)  # whatever was drawn before
    assert torch.equal(b.draw(model, 3, 1), first) and torch.equal(a.draw(model, 3, 1), first)
    for other in (a.draw(model, 3, 0), a.draw(model, 4, 1), a.draw(model, 3, 1, rank=1), make(6).draw(model, 3, 1)):
        assert not torch.equal(other, first)
    assert first.dtype == torch.float64 and first.abs().eq(1).all()
    assert abs(first.mean().item()) < 0.02  # 16 x 256 x 8 fair signs


@pytest.mark.parametrize("form", sk.FORMS)
def test_a_resumed_run_continues_as_an_unbroken_one(form):
    """Two micro-batches an update, a refresh every two updates: a run stopped after update 3 and resumed from its
    state (the source's through state_dict) computes every later update bit for bit as the unbroken run does."""
    cfg = load("tiny", ["model.vocab_size=97", "credit.source=sketch", f"credit.sketch={form}", "credit.sketch_rank=8",
                        "credit.sketch_every=2", "train.updates=6", "train.grad_accum=2", "train.warmup=0"])
    make = lambda: Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))  # noqa: E731
    unbroken = make()
    rows = [unbroken.train_update() for _ in range(6)]
    stopped = make()
    for _ in range(3):
        stopped.train_update()
    state = copy.deepcopy(stopped.state_dict())
    assert state["source"]["_extra_state"]["drawn"] == ([2, 1] if form == "sampled" else [-1, -1])
    resumed = make()
    resumed.load_state(state)
    again = [resumed.train_update() for _ in range(3)]
    assert [(r.kind, r.loss) for r in again] == [(r.kind, r.loss) for r in rows[3:]]
    for (name, p), q in zip(unbroken.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    if form == "sampled":
        assert torch.equal(resumed.source.signs, unbroken.source.signs)
        assert all(r.kind == "synthetic" for r in rows)
    else:
        assert torch.equal(resumed.source.basis, unbroken.source.basis)
        assert [r.kind for r in rows] == ["refresh", "synthetic"] * 3
    old = make_source(cfg)  # a checkpoint of the source before its extra state was a dict: refreshed_at alone
    old.set_extra_state(4)
    assert old.refreshed_at == 4 and old.drawn == (-1, -1)


class _OutputTap(ExactCredit):
    """Exact backprop that keeps each omitted product's output y_b, whose gradient is dY_b."""

    def __init__(self):
        self.outputs = []

    def product(self, index, n, weight, activation=None):
        if isinstance(activation, QKEpilogue):  # the Q/K/V product: the product, kept, then its epilogue
            y = super().product(index, n, weight)
            self.outputs.append(y)
            return activation.after(y)
        y = super().product(index, n, weight, activation)  # fused or not, y's gradient is dL/d(n W^T)
        self.outputs.append(y)
        return y


def _explicit_sketch_scores(model, batches, rank: int):
    """Per branch, the cosine and normalized error of (dY_b A_b) V_b^T against c_b, pooled over `batches`, from
    the recorded output gradients: the sketch as the source computes it, not through the ceiling's identity."""
    dots, pred_sq, true_sq = 0, 0, 0
    bases = _leading(model, rank).double()
    weights = [lin.weight.detach() for lin in model.branch_modules()]
    for inputs, targets in batches:
        tap = _OutputTap()
        outputs = torch.autograd.grad(model(inputs, targets, credit=tap), tap.outputs)
        corrections = ceil.record_batch(model, inputs, targets).corrections
        pred = torch.stack([(dy @ (w @ v)) @ v.t() for dy, w, v in zip(outputs, weights, bases)])
        true = torch.stack(corrections)
        dots = dots + (pred * true).sum((1, 2, 3))
        pred_sq, true_sq = pred_sq + pred.square().sum((1, 2, 3)), true_sq + true.square().sum((1, 2, 3))
    return dots / (pred_sq * true_sq).sqrt(), (pred_sq - 2 * dots + true_sq) / true_sq


def test_ceiling_scores_the_sketch_exact_at_full_rank_and_lower_below():
    model = checks.randomized_model(SMALL, 4)
    batches = [checks._batch(SMALL, 40 + i) for i in range(3)]
    cfg = load("tiny")
    cfg.model = SMALL
    result = ceil.ceiling(model, batches, cfg.credit, 0, sketch_ranks=(16, 32, 64, 100))
    assert {"sketch16", "sketch32", "sketch64"} <= set(result.fits) and "sketch100" not in result.fits  # capped
    full = result.fits["sketch64"]
    for metric in (full.heldout_cosine, full.in_cosine):
        torch.testing.assert_close(metric, torch.ones_like(metric), rtol=0, atol=1e-10)
    for metric in (full.heldout_error, full.in_error):
        assert metric.abs().max() <= 1e-10
    # Nested subspaces: the cosine |c P| / |c| can only grow with the rank, branch by branch.
    low, mid = result.fits["sketch16"], result.fits["sketch32"]
    assert (low.heldout_cosine < mid.heldout_cosine).all() and (mid.heldout_cosine < 1 - 1e-3).all()
    # The ceiling's scores are those of the sketch computed as the source does, from dY_b.
    for scored, chosen in (("heldout", batches[-1:]), ("in", batches[:-1])):
        cosine, error = _explicit_sketch_scores(model, chosen, 16)
        torch.testing.assert_close(getattr(low, f"{scored}_cosine"), cosine, rtol=1e-10, atol=0)
        torch.testing.assert_close(getattr(low, f"{scored}_error"), error, rtol=1e-10, atol=0)
    report = ceil.to_json(result)["families"]["sketch16"]
    assert report["features"] == 16 and len(report["branches"]) == SMALL.branches
    assert all(row["ridge"] is None and isinstance(row["heldout_cosine"], float) for row in report["branches"])


def test_cli_ceiling_and_flops_report_the_sketch(tmp_path, capsys):
    tiny = ["--set", "model.vocab_size=97", "--set", "train.device=cpu", "--set", "train.eval_tokens=0"]
    out = tmp_path / "ceiling"
    assert cli.main(["ceiling", "--updates", "2", *tiny, "--batches", "2", "--sketch", "8,64,100", "--json",
                     "--out", str(out)]) == 0
    families = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["families"]
    assert set(families) == {"seed", "seed_nogate", "seed_rank4x", "typed", "full", "sketch8", "sketch64"}
    assert families["sketch64"]["heldout_cosine"] == pytest.approx(1.0, abs=1e-5)  # float32 model
    assert families["sketch8"]["heldout_cosine"] < families["sketch64"]["heldout_cosine"]
    assert cli.main(["flops", "--preset", "seed", "--json", "--set", "credit.source=sketch",
                     "--set", "credit.sketch_rank=16"]) == 0
    printed = json.loads(capsys.readouterr().out)
    sketch, forms = printed["sketch"], printed["sketch_forms"]
    assert sketch["per_token"] == 8 * 2 * 16 * ((3 * 512 + 512) + (2048 + 512)) == 1_179_648
    assert sketch["omitted_share"] == 1_179_648 / 29_360_128
    assert sketch == forms["svd"] and set(forms) == {"svd", "subspace", "sampled"}  # svd: the default form
    # every form the same per target and per micro-batch; the refresh per form, amortized over 50 updates
    assert {(f["per_token"], f["per_micro_batch"]) for f in forms.values()} == {(1_179_648, 8 * 2 * 512 * 16 * 3584)}
    d, k, q = 512, 16, flops.SUBSPACE_ITERATIONS
    assert forms["svd"]["refresh"] == 8 * sum(4 * m * d * d + 8 * d ** 3 for m in (3 * d, 2048))  # Golub-Reinsch
    assert forms["subspace"]["refresh"] == 8 * q * sum(4 * m * d * k + 4 * d * k * k for m in (3 * d, 2048))
    assert forms["sampled"]["refresh"] == 0 and forms["sampled"]["every"] is None
    tokens = 64 * 2048  # the seed preset's micro-batch; 4 of them an update
    assert forms["svd"]["amortized_per_token"] == pytest.approx(
        1_179_648 + 8 * 2 * 512 * 16 * 3584 / tokens + forms["svd"]["refresh"] / (50 * 4 * tokens), rel=1e-12)
    assert cli.main(["flops", "--preset", "seed", "--sketch"]) == 0
    out = capsys.readouterr().out
    assert "sketch / target" in out and "refresh (SVD)" in out and "refresh (subsp.)" in out
    assert "sampled (credit.sketch), rank 32" in out and "(no refresh)" in out


@pytest.mark.parametrize("sampled", [False, True])
def test_the_sketched_product_compiles_to_the_eager_gradients(sampled):
    """In one graph (fullgraph: no graph break), for the projected and the sampled form alike."""
    torch.manual_seed(0)
    n = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(48, 16, dtype=torch.float64, requires_grad=True)
    basis = leading_basis(weight, 6).double()
    signs = sk.rademacher((48, 6), torch.Generator().manual_seed(1), torch.float64)
    operand = signs if sampled else basis
    probe = torch.randn(2, 5, 48, dtype=torch.float64)

    def loss(n, weight, operand):
        return (_SketchedLinear.apply(n, weight, operand, None, sampled) * probe).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(loss(n, weight, operand), (n, weight))
    for got, want in zip(torch.autograd.grad(compiled(n, weight, operand), (n, weight)), eager):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if sampled:  # a fresh draw each micro-batch is a new tensor of the same shape: the same graph, not recompiled
        other = sk.rademacher((48, 6), torch.Generator().manual_seed(2), torch.float64)
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.autograd.grad(compiled(n, weight, other), (n, weight))
    # and they are what they should be: the exact weight gradient, the input gradient projected onto span(V), or
    # sampled, (dY S)(S^T W) / k
    native = torch.autograd.grad((F.linear(n, weight) * probe).sum(), (n, weight))
    torch.testing.assert_close(eager[1], native[1], rtol=1e-12, atol=1e-12)
    want = probe @ signs @ signs.t() @ weight / 6 if sampled else native[0] @ basis @ basis.t()
    torch.testing.assert_close(eager[0], want, rtol=1e-12, atol=1e-12)


def test_under_autocast_it_casts_as_f_linear_does():
    """The forward is F.linear's under autocast (CPU bf16 here; CUDA autocast casts F.linear alike); the backward
    returns each gradient in its input's dtype, the weight's equal to F.linear's and the input's, at full rank,
    equal to it within bf16 rounding."""
    torch.manual_seed(1)
    n = torch.randn(4, 8, 32).bfloat16().requires_grad_()
    weight = (torch.randn(96, 32) * 32 ** -0.5).requires_grad_()
    basis = leading_basis(weight, 32)
    probe = torch.randn(4, 8, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sketched, native = _SketchedLinear.apply(n, weight, basis, None), F.linear(n, weight)
    assert sketched.dtype == native.dtype == torch.bfloat16 and torch.equal(sketched, native)
    got = torch.autograd.grad(sketched, (n, weight), probe.bfloat16())
    want = torch.autograd.grad(native, (n, weight), probe.bfloat16())
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    rel = (got[0].float() - want[0].float()).norm() / want[0].float().norm()
    assert rel < 2e-2, rel


@pytest.mark.slow
@pytest.mark.parametrize("form", ["subspace", "sampled"])
def test_the_compiled_step_of_each_form_agrees_with_the_float64_reference(form, monkeypatch):
    """The step check (tests/test_step_check.py checks the default form): the compiled, eager and plain float32
    steps against the float64 reference, each trainer with its own source, so each draws its own range finder's test
    matrix (subspace) or signs (sampled): the same numbers whatever the dtype."""
    from creditlab.checks import step_check
    from creditlab import runtime as rt

    monkeypatch.setattr(rt.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    result = step_check.check_step("tiny", ["model.vocab_size=97", "train.compile=on", "credit.source=sketch",
                                            f"credit.sketch={form}", "credit.sketch_rank=8"], say=lambda line: None)
    torch._dynamo.reset()
    assert result["verdict"] == "consistent" and not result["unjudged"], result["flagged"]
    assert all(err["compiled"] < 1e-4 for errors in result["errors"].values() for err in errors.values())


@pytest.mark.slow
@pytest.mark.parametrize("form", sk.FORMS)
def test_sketch_training_is_the_same_through_the_compiler(form, monkeypatch):
    """As the fitted sources' test in test_credit.py: the compiled step (aot_eager backend) trains as the eager
    one, with a refresh inside the run (svd, subspace) or fresh signs every micro-batch (sampled), does not fall
    back to eager and breaks no graph."""
    rows, _, _ = train_eager_and_compiled(["model.vocab_size=97", "credit.source=sketch", "credit.sketch_rank=16",
                                           f"credit.sketch={form}", "credit.sketch_every=2", "train.updates=4",
                                           "train.warmup=0"], monkeypatch)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    if form == "sampled":
        assert [r.kind for r in rows] == ["synthetic"] * 4
    else:
        assert [r.kind for r in rows] == ["refresh", "synthetic", "refresh", "synthetic"]
