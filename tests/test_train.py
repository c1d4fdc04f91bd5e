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
TINY = ["model.vocab_size=97", "model.seq_len=32", "train.micro_batch=8", "train.grad_accum=1"] + CPU


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
                               f"train.grad_accum={grad_accum}", "train.dtype=float64", "train.updates=4"] + CPU)
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


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_next_updates_first_batch_is_made_ahead_and_the_loader_counts_only_what_was_taken(prefetch):
    cfg = config.load("tiny", TINY + ["train.updates=3", "train.grad_accum=2", "train.dtype=float32",
                                      f"train.prefetch={prefetch}"])
    loader = CountingLoader(97, 8, 32, seed=3)
    trainer = Trainer(cfg, loader=loader)
    taken = []
    trainer_batch = trainer._batch
    trainer._batch = lambda: taken.append(trainer_batch()) or taken[-1]
    trainer.run(progress=False)
    # the same micro-batches in the same order either way
    assert [torch.equal(x, SyntheticLoader(97, 8, 32, seed=3).batch_at(i)[:, :-1]) for i, (x, _) in enumerate(taken)] \
        == [True] * 6
    # the loader's position (what a checkpoint saves) counts the six taken, not the seventh made ahead
    assert loader.position == 6 and trainer.state_dict()["loader"]["position"] == 6
    # made ahead: the first micro-batch of updates 2, 3 and of a fourth, each once, before it was taken
    assert loader.asked == ([0, 1, 2, 3, 4, 5, 6] if prefetch else [0, 1, 2, 3, 4, 5])
    assert (trainer._ahead is not None) == prefetch


def test_a_batch_made_ahead_for_another_position_is_not_taken():
    cfg = config.load("tiny", TINY + ["train.updates=1", "train.dtype=float32"])
    loader = SyntheticLoader(97, 8, 32, seed=3)
    trainer = Trainer(cfg, loader=loader)
    trainer.run(progress=False)
    loader.position = 5  # e.g. restored from a checkpoint
    inputs, _ = trainer._batch()
    assert torch.equal(inputs, SyntheticLoader(97, 8, 32, seed=3).batch_at(5)[:, :-1]) and loader.position == 6


def test_a_record_from_before_the_prefetch_reads_false():
    d = config.load("tiny").to_dict()
    del d["train"]["prefetch"]
    assert config.Config.from_dict(d).train.prefetch is False and config.load("tiny").train.prefetch is True


def _overlap_trainer(overlap: bool, *sets: str) -> Trainer:
    cfg = config.load("tiny", TINY + ["train.updates=5", "train.grad_accum=2", "train.dtype=float32",
                                      f"train.overlap={overlap}", *sets])
    return Trainer(cfg, loader=SyntheticLoader(97, 8, 32, seed=3))


def test_an_overlapped_run_trains_as_a_settled_one_and_reads_each_update_after_queuing_the_next():
    runs = {}
    for overlap in (True, False):
        trainer = _overlap_trainer(overlap)
        queued_when_read = []  # the trainer's update count when each row arrives
        rows = trainer.run(progress=False, on_row=lambda r, t=trainer: queued_when_read.append(t.update_index))
        runs[overlap] = rows, queued_when_read, trainer.model.state_dict()
    (rows, queued, state), (rows_s, queued_s, state_s) = runs[True], runs[False]
    assert [(r.update, r.kind, r.loss) for r in rows] == [(r.update, r.kind, r.loss) for r in rows_s]
    assert all(torch.equal(state[k], state_s[k]) for k in state)
    assert queued_s == [1, 2, 3, 4, 5]  # settled: each row read before the next update is queued
    assert queued == [2, 3, 4, 5, 5]  # overlapped: one update ahead, the last one settled
    assert all(r.seconds > 0 for r in rows)


def test_an_overlapped_run_settles_before_each_checkpoint_and_evaluation():
    trainer = _overlap_trainer(True, "train.checkpoint_every=2", "train.eval_every=3")
    seen = {}  # update -> (trainer's update count, a parameter's sum) when its row arrives

    def on_row(row):
        seen[row.update] = trainer.update_index, float(trainer.model.head.weight.detach().sum())

    evaluated = []

    def evaluator(model, update):
        evaluated.append((update, float(model.head.weight.detach().sum())))
        return EvalRow(update, "dev", 0.0, None, 0, 0.0)

    trainer.run(progress=False, on_row=on_row, evaluator=evaluator)
    # updates 2 and 4 (1-based) are checkpoints, 3 and 5 evaluated: their rows come with the state after exactly
    # them; update 1's once update 2 is queued
    assert {u: count for u, (count, _) in seen.items()} == {0: 2, 1: 2, 2: 3, 3: 4, 4: 5}
    # evaluations after updates 0 (before any), 3 and 5 (the last): each of the state after exactly them
    assert [u for u, _ in evaluated] == [0, 3, 5]
    assert evaluated[1][1] == seen[2][1] and evaluated[2][1] == seen[4][1]




def test_an_overlapped_run_stops_at_the_non_finite_update_and_reads_nothing_after_it():
    trainer = _overlap_trainer(True, "train.updates=6")
    read = []
    poison_after = 2  # the third update's loss is non-finite

    def queue(align=False, settled=False, _queue=trainer.queue_update):
        if trainer.update_index == poison_after:
            with torch.no_grad():
                trainer.model.embed.weight.fill_(float("nan"))
        return _queue(align, settled)

    trainer.queue_update = queue
    with pytest.raises(FloatingPointError, match="update 3") as caught:
        trainer.run(progress=False, on_row=lambda r: read.append(r.update))
    assert read == [0, 1] and caught.value.details["update_index"] == 2
    assert trainer.update_index == 4  # the update after it was queued, and never read


def test_a_failure_to_queue_after_a_non_finite_update_reports_the_divergence():
    trainer = _overlap_trainer(True)
    calls = {"n": 0}

    def queue(align=False, settled=False, _queue=trainer.queue_update):
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                trainer.model.embed.weight.fill_(float("nan"))
        if calls["n"] == 3:
            raise RuntimeError("a kernel refused its non-finite input")
        return _queue(align, settled)

    trainer.queue_update = queue
    with pytest.raises(FloatingPointError, match="update 2") as caught:
        trainer.run(progress=False)
    assert isinstance(caught.value.__context__, RuntimeError)


def test_a_record_from_before_the_overlap_reads_false():
    d = config.load("tiny").to_dict()
    del d["train"]["overlap"]
    assert config.Config.from_dict(d).train.overlap is False
    d["train"]["overlap"] = True
    assert config.Config.from_dict(d).train.overlap is True


def test_device_time_is_read_from_events_only_when_asked(monkeypatch):
    from creditlab import runtime as rt

    log = []

    class FakeEvent:
        made = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = FakeEvent.made = FakeEvent.made + 1

        def record(self):
            log.append(("record", self.at))

        def synchronize(self):
            log.append(("wait", self.at))

        def elapsed_time(self, end):
            return 250.0 * (end.at - self.at)  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    runtime = rt.Runtime(torch.device("cuda"), torch.float32, None, compile=False)
    with rt.DeviceTimer(runtime) as timer:
        log.append("work")
    assert log == [("record", 1), "work", ("record", 2)]  # nothing waited on at the region's start or end
    assert timer.seconds == 0.25 and timer.seconds == 0.25
    assert log[3:] == [("wait", 2)]  # the end waited on once, when first read


def test_reading_an_update_queues_no_device_work():
    """A read that ran an op on the update's tensors (`.item()` of a loss on the GPU, an isfinite check) would be
    queued behind the next update, and the host would wait for that one too: an overlapped run would be settled
    in all but name. So a read runs no tensor op at all; on the CPU any op shows in the dispatcher."""
    from dispatched import DispatchedOps as Ops

    trainer = _overlap_trainer(True)
    queued = trainer.queue_update()
    with Ops() as ops:
        row = trainer.read_update(queued)
    assert ops.seen == [] and math.isfinite(row.loss)
    with Ops() as ops:  # the check is able to see a read's ops
        torch.stack([torch.ones(1)]).mean().item()
    assert ops.seen
