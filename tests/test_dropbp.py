"""The `dropbp` control (credit/dropbp.py): its rate, its pattern, its float64 check and its compilation."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from creditlab import checks, config
from creditlab import runtime as rt
from creditlab.credit import make_source
from creditlab.credit.dropbp import DropBPSource, DropCredit
from creditlab.credit.schedules import plan_for
from creditlab.data import SyntheticLoader
from creditlab.flops import dropbp_rate, flop_budget
from creditlab.model import ExactCredit

SMALL = checks.seed_structure()
TINY = ["model.vocab_size=97", "credit.source=dropbp"]


def test_the_rate_skips_the_omitted_products_flops_in_expectation():
    for preset in ("seed", "tiny"):
        model = config.load(preset, []).model
        rate = dropbp_rate(model)
        assert rate.rate * rate.branches_backward == pytest.approx(flop_budget(model).omitted_per_token, rel=1e-12)
    seed = dropbp_rate(config.load("seed", []).model)
    assert seed.rate == 3584 / 16384  # (3d + h) / (8d + 2T + 4h) at d=512, h=2048, T=2048
    assert make_source(config.load("seed", ["credit.source=dropbp"])).rate == seed.rate
    assert "dropbp rate p" in seed.derivation() and "0.21875" in seed.derivation()


def test_a_dropped_branch_skips_its_counted_backward():
    """Op by op every product is an aten.mm the counter sees: a dropped MLP skips exactly its 4*2*d*h per target; a
    dropped attention branch its 4*4d^2 and the gate's thin product (the counter does not count the scores, the
    convention's 4*T*d)."""
    model = checks.randomized_model(SMALL, 0)
    idx, targets = checks._batch(SMALL, 0)
    rate, tokens = dropbp_rate(SMALL), idx.numel()

    def backward_flops(dropped):
        loss = model(idx, targets, credit=DropCredit([b in dropped for b in range(SMALL.branches)]))
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        return flops.get_total_flops()

    with model.op_by_op():
        native = backward_flops(())
        assert native - backward_flops((3,)) == rate.mlp_backward * tokens
        gate = 4 * SMALL.gate_dim * SMALL.heads
        attention_scores = 4 * SMALL.seq_len * SMALL.width
        assert native - backward_flops((2,)) == (rate.attention_backward - attention_scores + gate) * tokens


def test_the_pattern_is_drawn_from_the_seed_and_the_update_alone():
    cfg = config.load("tiny", TINY)
    source = make_source(cfg)
    patterns = [source.pattern(u) for u in range(400)]
    assert patterns == [make_source(cfg).pattern(u) for u in range(400)]  # stateless: a resumed run draws the same
    assert len({tuple(p) for p in patterns}) > 100  # a new draw each update
    dropped = sum(map(sum, patterns)) / (400 * cfg.model.branches)
    assert abs(dropped - source.rate) < 0.03  # i.i.d. Bernoulli(p): standard error 0.008 here
    other = make_source(config.load("tiny", [*TINY, "train.seed=7"]))
    assert [other.pattern(u) for u in range(20)] != patterns[:20]


def test_its_updates_are_synthetic_and_it_has_no_teacher():
    cfg = config.load("tiny", TINY)
    source = make_source(cfg)
    assert source.omits and not source.fits

    def kinds(schedule, n):
        return "".join(plan_for(schedule, 4, source.omits, source.fits).kind(u)[0] for u in range(n))

    assert kinds(cfg.credit.schedule, 5) == "sssss"
    assert kinds("fixed:4", 5) == "nsssn"  # its exact updates are native


def test_every_micro_batch_of_an_update_drops_the_same_branches():
    from creditlab.train import Trainer

    cfg = config.load("tiny", [*TINY, "train.grad_accum=3", "train.updates=4", "train.warmup=0"])
    trainer = Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))
    seen = []
    context = trainer.source.context

    def spy(*args, **kw):
        credit = context(*args, **kw)
        seen.append((trainer.update_index, tuple(trainer.source.last_dropped)))
        return credit

    trainer.source.context = spy
    trainer.run(progress=False)
    for u in range(4):
        drawn = {dropped for update, dropped in seen if update == u}
        assert drawn == {tuple(b for b, d in enumerate(trainer.source.pattern(u)) if d)}
    assert len({dropped for _, dropped in seen}) > 1


def test_a_resumed_run_drops_what_an_unbroken_one_drops():
    import copy

    from creditlab.train import Trainer

    cfg = config.load("tiny", [*TINY, "train.updates=4", "train.warmup=0"])

    def trainer():
        return Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))

    unbroken = trainer()
    unbroken.run(progress=False)
    first = trainer()
    first.run(2, progress=False)
    resumed = trainer()
    resumed.load_state(copy.deepcopy(first.state_dict()))
    resumed.run(progress=False)
    assert resumed.source.last_dropped == unbroken.source.last_dropped
    for name, p in unbroken.model.named_parameters():
        assert torch.equal(dict(resumed.model.named_parameters())[name], p), name


def test_the_float64_check_passes():
    for cfg in (SMALL, config.load("tiny", ["model.vocab_size=97"]).model):
        result = checks.dropbp_check(cfg, 0)
        assert result["passed"], result
        assert result["dropped_parameters"] > 0 and result["none_dropped_max_rel_err"] <= checks.TOLERANCE
        assert result["reference_max_rel_err"] <= checks.TOLERANCE and result["differs_from_native"] > 1e-3


class _DropsNothing(DropCredit):
    """Reports its pattern (`dropped`) but adds every branch output with its gradient."""

    def output(self, index, y):
        return y


class _DetachesTheInput(DropCredit):
    """Detaches what the dropped branch's product reads instead of its output: no input gradient through the
    product, but its weight gradients (and the rest of the branch) stay."""

    def branch(self, index, n):
        return n.detach() if self.dropped[index] else n

    def output(self, index, y):
        return y


@pytest.mark.parametrize("mutant", [_DropsNothing, _DetachesTheInput])
def test_the_check_fails_a_context_that_does_not_drop_the_output(mutant):
    result = checks.dropbp_check(SMALL, 0, context=mutant)
    assert not result["passed"]
    assert result["dropped_with_gradient"]  # (a): the dropped branches' parameters got a gradient
    assert result["reference_max_rel_err"] > 1e-3  # (c): not the gradient of the forward with constants
    assert result["none_dropped_max_rel_err"] <= checks.TOLERANCE  # with nothing dropped, each mutant is native


def test_the_check_fails_a_context_that_drops_when_told_to_drop_nothing():
    class DropsTheFirst(DropCredit):
        def output(self, index, y):
            return y.detach() if index == 0 else super().output(index, y)

    result = checks.dropbp_check(SMALL, 0, context=DropsTheFirst)
    assert not result["passed"] and result["none_dropped_max_rel_err"] > 1e-3


def test_the_constant_reference_is_native_with_nothing_dropped():
    model = checks.randomized_model(SMALL, 2)
    idx, targets = checks._batch(SMALL, 2)
    native = checks._trunk_grads(model, idx, targets, ExactCredit())
    reference = checks.constant_branches_reference(model, idx, targets, [False] * SMALL.branches)
    assert all(torch.equal(reference[name], native[name]) for name in native)


@pytest.mark.slow  # about 13 s on two cores: twenty graphs through aot_eager
def test_training_compiles_each_block_once_per_variant(monkeypatch):
    """Each synthetic update draws a new pattern. Compiled whole, the model would need a graph per pattern (2^8 on
    the tiny model); compiled per block (train.py), each block has at most four graphs for the patterns (attention
    and MLP each kept or dropped) and two for the trainer's exact context (native updates, with a gradient;
    evaluation, without), with no graph break, and the compiled run trains as the eager one does."""
    from creditlab.evaluate import Evaluator
    from creditlab.train import Trainer

    updates = 12
    overrides = [*TINY, f"train.updates={updates}", "train.warmup=0", "credit.schedule=fixed:5",
                 "train.eval_every=6", "train.eval_tokens=256"]
    losses, counts = {}, {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = config.load("tiny", [*overrides, f"train.compile={'on' if compiled else 'off'}"])
        with monkeypatch.context() as patch, warnings.catch_warnings():
            patch.setattr(rt.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
            warnings.filterwarnings("error", message="torch.compile failed")
            trainer = Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))
            evaluator = Evaluator(cfg, trainer.runtime, purpose="test")
            with trainer.model.op_by_op():  # as the other compiled-training tests: no last-bit drift for Muon
                rows = trainer.run(progress=False, evaluator=evaluator)
            losses[compiled] = [row.loss for row in rows]
        counters = torch._dynamo.utils.counters
        counts[compiled] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    torch._dynamo.reset()
    layers = cfg.model.layers
    synthetic = [row.update for row in rows if row.kind == "synthetic"]
    patterns = {tuple(trainer.source.pattern(u)) for u in synthetic}
    variants = {(i, p[2 * i], p[2 * i + 1]) for p in patterns for i in range(layers)}  # block, its two flags
    graphs, breaks = counts[True]
    assert len(patterns) > len(synthetic) // 2 and "native" in {row.kind for row in rows} and breaks == 0
    assert graphs == len(variants) + 2 * layers <= (DropBPSource.compile_per_block + 2) * layers
    assert counts[False] == (0, 0)
    # the compiled backward sums in another order than the eager engine; Muon grows that over twelve updates
    assert losses[True][:5] == pytest.approx(losses[False][:5], rel=1e-5)
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


@pytest.mark.slow
def test_two_processes_train_with_dropped_branches(tmp_path):
    """Under DDP a dropped branch's parameters get no gradient on any rank (the pattern is drawn from the seed and
    the update alone): the trainer tells DDP to look for them, else it would wait for them (an error at update 2)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "creditlab.cli",
           "train", "--preset", "tiny", "--json"]
    for item in [*TINY, "train.updates=3", "train.warmup=0", f"train.out_dir={tmp_path}"]:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["updates"] == 3


@pytest.mark.slow  # about 11 s: two compiled runs
def test_after_the_warming_contexts_a_compiled_run_compiles_no_block_variant(monkeypatch):
    """arms_runner.warm_variants runs the source's four warming contexts (each block's attention and MLP each kept
    or dropped): afterwards the synthetic updates, whose drawn patterns meet new variants for many updates without
    it, compile nothing, so a short timed run times the step."""
    from creditlab.experiments.arms_runner import graphs_compiled, warm_variants
    from creditlab.train import Trainer

    compiled = {}
    for warm in (False, True):
        torch._dynamo.reset()
        cfg = config.load("tiny", [*TINY, "train.updates=6", "train.warmup=0", "credit.schedule=never",
                                   "train.compile=on"])
        with monkeypatch.context() as patch:
            patch.setattr(rt.torch, "compile", functools.partial(torch.compile, backend="eager"))
            trainer = Trainer(cfg, loader=SyntheticLoader(97, cfg.train.micro_batch, cfg.model.seq_len, seed=0))
            if warm:
                assert warm_variants(trainer) == 4
            trainer.train_update()  # the optimizer's first step and the like
            compiled[warm] = []
            for _ in range(5):
                before = graphs_compiled()
                row = trainer.train_update()
                assert row.kind == "synthetic"
                compiled[warm].append(graphs_compiled() - before)
    torch._dynamo.reset()
    assert compiled[True] == [0] * 5
    assert sum(compiled[False]) > 0, compiled  # without the warming, later updates meet variants not yet compiled
