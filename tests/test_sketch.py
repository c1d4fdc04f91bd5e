"""The sketched-product source (credit/sketch.py): exact at full rank and only there, the FLOPs it adds, its
refresh schedule, its place in the fit ceiling, and its parity through the compiler and under autocast."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from creditlab.experiments import ceiling as ceil
from creditlab import checks, cli
from creditlab.config import load
from creditlab.credit import make_source
from creditlab.credit.sketch import SketchCredit, SketchSource, _SketchedLinear, leading_basis
from creditlab.credit.sources import ZeroSource
from creditlab.data import SyntheticLoader
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


@pytest.mark.parametrize("k", [16, 64])
def test_flops_are_zeros_plus_the_predicted_sketch(k):
    """Exactly, no tolerance: the backward adds 2k(m + d) per token per branch and the factor A = W V, 2mdk per
    branch per micro-batch; the forward is zero's; `creditlab flops`'s sketch_cost predicts both terms."""
    model = checks.randomized_model(SMALL, 2)
    idx, targets = checks._batch(SMALL, 2)
    z_forward, z_matmuls, z_backward = _cost(model, idx, targets, ZeroSource().step())
    s_forward, s_matmuls, s_backward = _cost(model, idx, targets, _sketch(model, k).step())
    d, tokens = SMALL.width, idx.numel()
    outputs = [lin.out_features for lin in model.branch_modules()]  # m_b: 3d (attention) or mlp_hidden
    per_token = sum(2 * k * (m + d) for m in outputs)
    per_micro_batch = sum(2 * m * d * k for m in outputs)
    assert s_forward == z_forward
    assert s_matmuls == z_matmuls + 3 * SMALL.branches  # A = W V, dY A, (dY A) V^T
    assert s_backward - z_backward == per_token * tokens + per_micro_batch
    predicted = sketch_cost(SMALL, k)
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
    sketch = json.loads(capsys.readouterr().out)["sketch"]
    assert sketch["per_token"] == 8 * 2 * 16 * ((3 * 512 + 512) + (2048 + 512)) == 1_179_648
    assert sketch["omitted_share"] == 1_179_648 / 29_360_128
    assert cli.main(["flops", "--preset", "seed", "--sketch"]) == 0
    assert "sketch / target" in capsys.readouterr().out


def test_the_sketched_product_compiles_to_the_eager_gradients():
    torch.manual_seed(0)
    n = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(48, 16, dtype=torch.float64, requires_grad=True)
    basis = leading_basis(weight, 6).double()
    probe = torch.randn(2, 5, 48, dtype=torch.float64)

    def loss(n, weight):
        return (_SketchedLinear.apply(n, weight, basis, None) * probe).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(loss(n, weight), (n, weight))
    for got, want in zip(torch.autograd.grad(compiled(n, weight), (n, weight)), eager):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and they are what they should be: the exact weight gradient, the input gradient projected onto span(V)
    native = torch.autograd.grad((F.linear(n, weight) * probe).sum(), (n, weight))
    torch.testing.assert_close(eager[1], native[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(eager[0], native[0] @ basis @ basis.t(), rtol=1e-12, atol=1e-12)


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
def test_sketch_training_is_the_same_through_the_compiler(monkeypatch):
    """As the fitted sources' test in test_credit.py: the compiled step (aot_eager backend) trains as the eager
    one, with a refresh inside the run, and does not fall back to eager."""
    rows, _, _ = train_eager_and_compiled(["model.vocab_size=97", "credit.source=sketch", "credit.sketch_rank=16",
                                           "credit.sketch_every=2", "train.updates=4", "train.warmup=0"], monkeypatch)
    assert [r.kind for r in rows] == ["refresh", "synthetic", "refresh", "synthetic"]
