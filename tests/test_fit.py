"""The closed-form fit (credit.fit=lstsq): the moments streamed in the teacher's backward and the ridge solve."""

from __future__ import annotations

import pytest
import torch

from creditlab import config
from creditlab.checks import randomized_model, seed_structure
from creditlab.credit.sources import TerminalTapCredit
from creditlab.model import GPT
from creditlab.train import Trainer
from tests.test_train import ListLoader

MODEL = seed_structure()
OVERRIDES = [f"model.{k}={v}" for k, v in vars(MODEL).items()] + [
    "train.device=cpu", "train.compile=off", "train.dtype=float64", "train.micro_batch=2", "train.grad_accum=1",
    "credit.rank=4"]


def _setup(source: str, fit: str = "lstsq", seed: int = 3, extra: tuple[str, ...] = ()):
    cfg = config.load("tiny", OVERRIDES + [f"credit.source={source}", f"credit.fit={fit}", *extra])
    model = randomized_model(cfg.model, seed)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len + 1), generator=g) for _ in range(4)]
    trainer = Trainer(cfg, model=model, loader=ListLoader(batches))
    torch.manual_seed(seed)
    with torch.no_grad():  # random, non-zero predictor state, so every path carries signal
        for name, p in trainer.source.named_parameters():
            p.normal_(0.0, 0.3 if "decoder" in name else p.shape[-1] ** -0.5 if p.ndim else 0.3)
    return trainer, batches


def _explicit_moments(trainer, batch, mutate: bool = False):
    """Per branch: F = g_b * [p ; m](e), Gram F^T F and cross moment c_b^T F, written plainly in float64."""
    model: GPT = trainer.model
    tap = TerminalTapCredit()
    loss = model(batch[:, :-1], batch[:, 1:], credit=tap)
    e, *corrections = torch.autograd.grad(loss, [tap.x_terminal, *tap.inputs])
    p = trainer.source.predictor
    a, a_rev = p.mean_weights(tap.x_terminal.detach())
    code = p.code(e, a, a_rev)
    grams, crosses = [], []
    for b, (n, c) in enumerate(zip(tap.states, corrections)):
        n = tap.states[(b + 1) % len(tap.states)] if mutate else n
        features = (p.gate(b, n) * code[..., p.code_slice(b)]).flatten(0, 1)  # (B*T, 2r)
        grams.append(features.t() @ features)
        crosses.append(c.flatten(0, 1).t() @ features)
    return torch.stack(grams), torch.stack(crosses)


@pytest.mark.parametrize("source", ["learned", "typed"])
def test_streamed_moments_equal_an_explicit_float64_computation(source):
    trainer, batches = _setup(source)
    gram, cross = _explicit_moments(trainer, batches[0])
    trainer.source.teach(trainer, batches[0][:, :-1], batches[0][:, 1:], 1.0)
    streamed_gram, streamed_cross = trainer.source.teacher.moment_sums
    torch.testing.assert_close(streamed_gram, gram, rtol=1e-10, atol=0)
    torch.testing.assert_close(streamed_cross, cross, rtol=1e-10, atol=0)
    wrong_gram, wrong_cross = _explicit_moments(trainer, batches[0], mutate=True)  # gates of the wrong branch
    assert not torch.allclose(streamed_gram, wrong_gram, rtol=1e-3)
    assert not torch.allclose(streamed_cross, wrong_cross, rtol=1e-3)


def test_fitted_feedback_streams_the_moments_of_the_terminal_error():
    """Gram E^T E (the same for every branch) and cross moments C_b^T E, against a plain float64 computation; the
    cross moment of the neighbouring branch is a mutation the comparison must catch."""
    trainer, batches = _setup("fitted_feedback")
    batch = batches[0]
    tap = TerminalTapCredit()
    loss = trainer.model(batch[:, :-1], batch[:, 1:], credit=tap)
    e, *corrections = torch.autograd.grad(loss, [tap.x_terminal, *tap.inputs])
    e = e.flatten(0, 1)
    crosses = torch.stack([c.flatten(0, 1).t() @ e for c in corrections])
    trainer.source.teach(trainer, batch[:, :-1], batch[:, 1:], 1.0)
    gram, cross = trainer.source.teacher.moment_sums
    torch.testing.assert_close(gram, (e.t() @ e).expand_as(gram), rtol=1e-10, atol=0)
    torch.testing.assert_close(cross, crosses, rtol=1e-10, atol=0)
    assert not torch.allclose(cross, crosses.roll(1, dims=0), rtol=1e-3)
    stats = trainer.source.teacher.stats[-1]  # |c_b|^2 streamed beside them
    torch.testing.assert_close(stats[:, 3], torch.stack([c.square().sum() for c in corrections]), rtol=1e-10, atol=0)


def test_adam_fit_streams_no_moments():
    trainer, batches = _setup("learned", fit="adam")
    trainer.source.teach(trainer, batches[0][:, :-1], batches[0][:, 1:], 1.0)
    assert trainer.source.teacher.moment_sums is None


@pytest.mark.parametrize("source", ["learned", "typed", "dni", "fitted_feedback"])
def test_solve_is_the_ridge_least_squares_optimum(source):
    trainer, batches = _setup(source)
    row = trainer.train_update()  # update 0 is a teacher update
    assert row.kind == "teacher"
    teacher = trainer.source.teacher
    gram, cross = teacher.moments
    ridge = trainer.cfg.credit.fit_ridge * torch.diagonal(gram, dim1=1, dim2=2).mean(-1)
    effective = teacher.effective_decoders().double()
    # The normal equations of min |D F^T - C^T|^2 + ridge |D|^2 hold for the decoders as the prediction uses them.
    residual = effective @ gram + ridge[:, None, None] * effective - cross
    assert residual.norm() / cross.norm() < 1e-9
    before = effective.clone()
    trainer.train_update()  # a synthetic update: nothing is fitted
    torch.testing.assert_close(teacher.effective_decoders().double(), before, rtol=0, atol=0)


def _fixed_model_fit(teacher_updates: int = 6):
    """On a fixed model (it is never stepped), the learned source with the ceiling's `seed` family as its P and
    gates, fitted by lstsq for a few teacher updates cycling over the ceiling's fit batches; returns the held-out
    cosine of the source as trained, the same with each branch given its neighbour's decoder (a mutation), and
    the ceilings of its family and of `full`."""
    from creditlab.experiments import ceiling as ceil

    cfg = config.load("tiny", OVERRIDES + ["credit.source=learned", "credit.fit=lstsq", "credit.predictor_lr=0",
                                           "train.micro_batch=32"])
    model = randomized_model(cfg.model, 11)
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, MODEL.vocab_size, (32, MODEL.seq_len + 1), generator=g) for _ in range(4)]
    batches = [(b[:, :-1], b[:, 1:]) for b in ids]
    trainer = Trainer(cfg, model=model, loader=ListLoader(ids))
    bound = ceil.ceiling(model, batches, cfg.credit, cfg.train.seed)
    predictor = trainer.source.predictor
    with torch.no_grad():  # the family's own P and gates, zero decoders: only the decoders are left to fit
        for name, p in predictor.named_parameters():
            p.copy_(dict(bound.families["seed"].predictor.named_parameters())[name] if name != "decoders" else 0)
    for u in range(teacher_updates):
        trainer.source.teach(trainer, *batches[u % 3], 1.0)
        trainer.source.end_update("teacher")
    scored = ceil.ceiling(model, batches, cfg.credit, cfg.train.seed, predictor).fits["trained"]
    with torch.no_grad():
        predictor.decoders.copy_(predictor.decoders.roll(1, dims=0))
    mutated = ceil.ceiling(model, batches, cfg.credit, cfg.train.seed, predictor).fits["trained"]
    return (float(scored.heldout_cosine.mean()), float(mutated.heldout_cosine.mean()),
            float(bound.fits["seed"].heldout_cosine.mean()), float(bound.fits["full"].heldout_cosine.mean()))


def test_lstsq_reaches_the_seed_familys_ceiling_within_a_few_teacher_updates():
    reached, mutated, ceiling, full = _fixed_model_fit()
    assert ceiling > 0.1  # a family with something to fit
    assert full >= ceiling, (full, ceiling)  # any linear map of the token's own error, held out
    assert reached >= 0.95 * ceiling, (reached, ceiling)
    assert mutated < 0.95 * ceiling, (mutated, ceiling)  # the comparison can fail


def test_calibrated_dfa_takes_the_rms_of_the_true_corrections():
    """After one teacher update s_b = |c_b| / |e B_b| (the RMS ratio over the same tokens), and the report's
    cosine is that of e B_b with c_b, both against a plain float64 computation; B_b's transpose (the other
    orientation of the map) gives other cosines, which the comparison catches."""
    trainer, batches = _setup("dfa", fit="adam", extra=("credit.dfa_scale=calibrated",))
    batch = batches[0]
    tap = TerminalTapCredit()
    loss = trainer.model(batch[:, :-1], batch[:, 1:], credit=tap)
    e, *corrections = torch.autograd.grad(loss, [tap.x_terminal, *tap.inputs])
    B = trainer.source.feedback
    predicted = [e @ B[b] for b in range(len(corrections))]
    ratio = torch.stack([c.norm() / p.norm() for c, p in zip(corrections, predicted)])
    cosine = torch.stack([(c * p).sum() / (c.norm() * p.norm()) for c, p in zip(corrections, predicted)])
    wrong = torch.stack([(c * (e @ B[b].t())).sum() / (c.norm() * (e @ B[b].t()).norm())
                         for b, c in enumerate(corrections)])
    model_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    row = trainer.train_update()
    assert row.kind == "teacher"
    torch.testing.assert_close(trainer.source.scales, ratio, rtol=1e-10, atol=0)
    got = torch.tensor([row.fit["fit_branches"][str(b)]["cosine"] for b in range(len(corrections))],
                       dtype=torch.float64)
    torch.testing.assert_close(got, cosine, rtol=1e-8, atol=1e-12)
    assert not torch.allclose(got, wrong, rtol=1e-3)
    assert any(not torch.equal(v, model_before[k]) for k, v in trainer.model.state_dict().items())  # exact update
    assert trainer.train_update().kind == "synthetic"
