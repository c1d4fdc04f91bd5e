"""Training: a tiny model overfits one batch, learns the synthetic stream, and gradient accumulation is exact."""

from __future__ import annotations

import math

import pytest
import torch

from creditlab import config
from creditlab.data.synthetic import SyntheticLoader
from creditlab.evaluate import EvalRow
from creditlab.model import GPT
from creditlab.train import Trainer, median_last

CPU = ["train.device=cpu", "train.compile=off"]
TINY = ["model.vocab_size=97", "train.warmup=0", "model.seq_len=32", "train.micro_batch=8", "train.grad_accum=1"] + CPU


class FixedLoader:
    """A loader whose next() always returns the same batch."""

    def __init__(self, batch: torch.Tensor):
        self.batch, self.calls = batch, 0

    def next(self) -> torch.Tensor:
        self.calls += 1
        return self.batch


class ListLoader:
    def __init__(self, batches):
        self.batches, self.i = list(batches), 0

    def next(self) -> torch.Tensor:
        batch = self.batches[self.i]
        self.i += 1
        return batch


@torch.no_grad()
def randomize(model: GPT, seed: int = 0) -> GPT:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        p.copy_(r * p.shape[1] ** -0.5 if p.ndim == 2 else 0.5 + 0.5 * r)
    return model


def unigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    p = torch.bincount(tokens.flatten(), minlength=vocab).double()
    p = p[p > 0] / p.sum()
    return -(p * p.log()).sum().item()


def test_overfits_one_fixed_batch():
    cfg = config.load("tiny", TINY + ["train.updates=60", "train.dtype=float32"])
    V, B, T = cfg.model.vocab_size, cfg.train.micro_batch, cfg.model.seq_len
    batch = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(0))
    loader = FixedLoader(batch)
    rows = Trainer(cfg, loader=loader).run(progress=False)
    assert loader.calls == 60 and len(rows) == 60
    assert rows[0].loss == pytest.approx(math.log(V), rel=1e-6)  # zero head: uniform over the true vocabulary
    # A predictor that ignores context cannot beat the batch's empirical unigram entropy (~4.37 nats here), and
    # its bigram statistics are ambiguous for few tokens; < 0.5 nats means the model has memorized the batch.
    h1 = unigram_entropy(batch[:, 1:], V)
    assert h1 > 4.0
    assert rows[-1].loss < 0.5, [round(r.loss, 3) for r in rows[::10]]
    assert all(math.isfinite(r.loss) for r in rows)


def test_learns_the_synthetic_stream():
    cfg = config.load("tiny", ["model.vocab_size=97", "train.updates=60", "train.dtype=float32"] + CPU)
    V = cfg.model.vocab_size
    trainer = Trainer(cfg)  # the default loader: the synthetic stream, new batches every micro-step
    assert isinstance(trainer.loader, SyntheticLoader)
    rows = trainer.run(progress=False)
    assert trainer.loader.position == cfg.train.updates * cfg.train.grad_accum
    assert rows[0].loss == pytest.approx(math.log(V), rel=1e-6)
    # Tokens of the stream are uniform over the vocabulary (a random start in a permutation, uniform noise), so a
    # context-free predictor scores ln V = 4.57; the successor rule (right 90% of the time) reaches ~0.8.
    sample = trainer.loader.batch_at(10_000)
    assert unigram_entropy(sample, V) > 4.3
    final = median_last(rows, 5, "loss")
    assert final < 2.0, [round(r.loss, 3) for r in rows[::10]]


def test_rows_report_the_update():
    cfg = config.load("tiny", TINY + ["train.updates=3", "train.grad_accum=2", "train.dtype=float32"])
    batch = torch.randint(0, 97, (8, 33), generator=torch.Generator().manual_seed(1))
    loader = FixedLoader(batch)
    trainer = Trainer(cfg, loader=loader)
    rows = trainer.run(progress=False)
    assert [r.update for r in rows] == [0, 1, 2] and trainer.update_index == 3
    assert loader.calls == 3 * 2  # grad_accum micro-batches per update
    assert all(r.kind == "native" and r.tokens == 2 * 8 * 32 for r in rows)
    assert all(r.seconds > 0 and r.tokens_per_s == pytest.approx(r.tokens / r.seconds) for r in rows)
    assert all(r.peak_allocated_mib is None and r.mfu is None for r in rows)  # CPU: no memory figures, no peak
    assert [r.lr_scale for r in rows] == pytest.approx([trainer.optimizers.lr_scale(u) for u in range(3)])
    assert all(p.grad is None for p in trainer.model.parameters())  # zeroed after the step


def test_non_finite_loss_stops_the_run():
    cfg = config.load("tiny", TINY + ["train.updates=2", "train.dtype=float32"])
    trainer = Trainer(cfg, loader=FixedLoader(torch.zeros(8, 33, dtype=torch.long)))
    with torch.no_grad():
        trainer.model.embed.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="update 1"):
        trainer.train_update()


def _ga_trainer(micro_batch: int, grad_accum: int, loader) -> Trainer:
    cfg = config.load("tiny", ["model.vocab_size=97", "model.seq_len=16", "model.width=32", "model.heads=2",
                               "model.mlp_hidden=64", f"train.micro_batch={micro_batch}",
                               f"train.grad_accum={grad_accum}", "train.dtype=float64", "train.updates=4", "train.warmup=0"] + CPU)
    torch.manual_seed(0)
    model = randomize(GPT(cfg.model).double())
    return Trainer(cfg, model=model, loader=loader)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_equals_one_big_micro_batch():
    B = 3
    tokens = torch.randint(0, 97, (2 * B, 17), generator=torch.Generator().manual_seed(2))
    x, y = tokens[:, :-1], tokens[:, 1:]
    trainer = _ga_trainer(B, 2, FixedLoader(tokens))
    assert next(trainer.model.parameters()).dtype == torch.float64
    credit = trainer.source.exact_step()

    trainer.optimizers.zero_grad()
    l1 = trainer.forward_backward(x[:B], y[:B], credit, 0.5)
    l2 = trainer.forward_backward(x[B:], y[B:], credit, 0.5)
    accumulated = _grads(trainer.model)

    trainer.optimizers.zero_grad()
    whole = trainer.forward_backward(x, y, credit, 1.0)
    single = _grads(trainer.model)

    assert ((l1 + l2) / 2).item() == pytest.approx(whole.item(), rel=1e-13)
    for name, g in single.items():
        assert g.abs().sum() > 0, name  # randomized weights: every path carries gradient
        err = (accumulated[name] - g).norm() / g.norm()
        assert err.item() <= 1e-12, (name, err.item())
    # A single half-batch alone is not the same gradient (the comparison can fail).
    trainer.optimizers.zero_grad()
    trainer.forward_backward(x[:B], y[:B], credit, 1.0)
    half = trainer.model.embed.weight.grad
    assert (half - single["embed.weight"]).norm() > 1e-3 * single["embed.weight"].norm()


def test_gradient_accumulation_gives_the_same_update():
    """End to end through train_update (float64): GA=2 of B and GA=1 of 2B move the weights identically."""
    B = 3
    tokens = torch.randint(0, 97, (2 * B, 17), generator=torch.Generator().manual_seed(3))
    ga = _ga_trainer(B, 2, ListLoader([tokens[:B], tokens[B:]]))
    one = _ga_trainer(2 * B, 1, ListLoader([tokens]))
    a, b = dict(ga.model.named_parameters()), dict(one.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)  # identical initialization
    before = {n: p.detach().clone() for n, p in a.items()}
    ra, rb = ga.train_update(), one.train_update()
    assert ra.loss == pytest.approx(rb.loss, rel=1e-13)
    assert ra.tokens == rb.tokens == 2 * B * 16
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-10, atol=1e-12, msg=n)
    assert any(not torch.equal(a[n], before[n]) for n in a)  # the update did move the weights


def test_records_identify_the_source_by_content(tmp_path):
    """source_sha256 hashes the package's own files, so a record names the code that ran without git."""
    from creditlab import runtime as rt

    assert rt.environment()["source_sha256"] == rt.source_sha256() and len(rt.source_sha256()) == 64
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = rt.source_sha256(tmp_path)
    assert rt.source_sha256(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert rt.source_sha256(tmp_path) != before


class CountingLoader(SyntheticLoader):
    """The synthetic stream, counting what the trainer asks of it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[int] = []

    def batch_at(self, position: int) -> torch.Tensor:
        self.asked.append(position)
        return super().batch_at(position)


def test_the_next_updates_first_batch_is_made_ahead_and_the_loader_counts_only_what_was_taken():
    cfg = config.load("tiny", TINY + ["train.updates=3", "train.grad_accum=2", "train.dtype=float32"])
    loader = CountingLoader(97, 8, 32, seed=3)
    trainer = Trainer(cfg, loader=loader)
    taken = []
    trainer_batch = trainer._batch
    trainer._batch = lambda: taken.append(trainer_batch()) or taken[-1]
    trainer.run(progress=False)
    # the micro-batches in the loader's order
    assert [torch.equal(x, SyntheticLoader(97, 8, 32, seed=3).batch_at(i)[:, :-1]) for i, (x, _) in enumerate(taken)] \
        == [True] * 6
    # the loader's position (what a checkpoint saves) counts the six taken, not the seventh made ahead
    assert loader.position == 6 and trainer.state_dict()["loader"]["position"] == 6
    # made ahead: the first micro-batch of updates 2, 3 and of a fourth, each once, before it was taken
    assert loader.asked == [0, 1, 2, 3, 4, 5, 6] and trainer._ahead is not None


def test_a_batch_made_ahead_for_another_position_is_not_taken():
    cfg = config.load("tiny", TINY + ["train.updates=1", "train.dtype=float32"])
    loader = SyntheticLoader(97, 8, 32, seed=3)
    trainer = Trainer(cfg, loader=loader)
    trainer.run(progress=False)
    loader.position = 5  # e.g. restored from a checkpoint
    inputs, _ = trainer._batch()
    assert torch.equal(inputs, SyntheticLoader(97, 8, 32, seed=3).batch_at(5)[:, :-1]) and loader.position == 6


def test_reading_an_update_waits_for_the_update_alone():
    """What the host reads of an update (its losses and gradient norms) is one copy behind the update's work: a
    read that ran tensor ops of its own (an isfinite check, `.item()` per loss) would add device work, and on the
    GPU a wait, to every update. On the CPU any op shows in the dispatcher."""
    from dispatched import DispatchedOps as Ops

    from creditlab import runtime as rt

    copy = rt.HostCopy(torch.stack([torch.ones(3).mean(), torch.zeros(()).sum()]))
    with Ops() as ops:
        values = copy.get().tolist()
    assert ops.seen == [] and values == [1.0, 0.0]
    with Ops() as ops:  # the check is able to see a read's ops
        torch.stack([torch.ones(1)]).mean().item()
    assert ops.seen
