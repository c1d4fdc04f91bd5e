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
    "credit.rank=4", "credit.fit_precision=float32"]


def _setup(source: str, fit: str = "lstsq", seed: int = 3):
    cfg = config.load("tiny", OVERRIDES + [f"credit.source={source}", f"credit.fit={fit}"])
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
        features = (p.gate(b, n) * code).flatten(0, 1)  # (B*T, 2r)
        grams.append(features.t() @ features)
        crosses.append(c.flatten(0, 1).t() @ features)
    return torch.stack(grams), torch.stack(crosses)


def test_streamed_moments_equal_an_explicit_float64_computation():
    trainer, batches = _setup("learned")
    gram, cross = _explicit_moments(trainer, batches[0])
    trainer.source.teach(trainer, batches[0][:, :-1], batches[0][:, 1:], 1.0)
    streamed_gram, streamed_cross = trainer.source.teacher.moment_sums
    torch.testing.assert_close(streamed_gram, gram, rtol=1e-10, atol=0)
    torch.testing.assert_close(streamed_cross, cross, rtol=1e-10, atol=0)
    wrong_gram, wrong_cross = _explicit_moments(trainer, batches[0], mutate=True)  # gates of the wrong branch
    assert not torch.allclose(streamed_gram, wrong_gram, rtol=1e-3)
    assert not torch.allclose(streamed_cross, wrong_cross, rtol=1e-3)


def test_adam_fit_streams_no_moments():
    trainer, batches = _setup("learned", fit="adam")
    trainer.source.teach(trainer, batches[0][:, :-1], batches[0][:, 1:], 1.0)
    assert trainer.source.teacher.moment_sums is None


@pytest.mark.parametrize("source", ["learned", "dni"])
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
