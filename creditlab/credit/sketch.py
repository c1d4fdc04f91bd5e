"""The sketched product: keep the omitted input-gradient product, but through k directions.

The synthetic backward still computes each branch's output gradient dY_b (tokens, m), because the weight gradient
dY_b^T n_b needs it. So instead of predicting the correction c_b = dY_b W_b (W_b: (m, d)) from elsewhere, this
source computes it through a rank-k factorization, c_b ~ (dY_b L_b) R_b with L_b (m, k) and R_b (k, d). That costs
2k(m + d) per token against the omitted product's 2md, and dY_b W_b is never formed. Nothing is fitted and nothing
is injected at the tap: the correction is the gradient the product's own backward hands to n_b. `credit.sketch`
chooses the factors, in one of two forms:

* Projected (`svd`, `subspace`): L_b = W_b V_b, R_b = V_b^T with V_b (d, k) an orthonormal basis of the weight's
  leading right singular subspace. The sketch is c_b V_b V_b^T, the true correction projected onto span(V_b):
  biased, since what of c_b lies outside span(V_b) is lost in every update alike. V_b is refreshed every
  `credit.sketch_every` updates (the refresh is the expensive part, and the leading subspace of a weight moves
  slowly): `svd` by a full SVD of the current weight; `subspace` by SUBSPACE_ITERATIONS steps of subspace
  iteration warm-started from the last basis, V <- orth(W^T (W V)), each O(mdk) instead of the SVD's O(md^2). A
  step shrinks the part of span(V) outside the leading k-subspace by (sigma_{k+1} / sigma_k)^2; the warm start
  carries what earlier refreshes converged, so a slowly moving subspace needs only to follow its drift since the
  last refresh, and two steps (not one) leave room for a weight whose spectrum is flat near k. Its first refresh
  (no basis yet) is a randomized range finder (Halko, Martinsson and Tropp 2011), seeded from `train.seed`. Only
  span(V_b) matters (c V V^T), so neither form orders or signs its vectors beyond choosing the leading k.
  L_b = W_b V_b is recomputed from the current weight in every backward: it costs m*d*k per micro-batch, nothing
  per token, and makes the sketch exactly c_b V_b V_b^T however stale V_b is; a cached one would add the weight's
  drift since the refresh to that error, for no saving worth having.
* Sampled (`sampled`): L_b = S_b, R_b = S_b^T W_b / k with S_b (m, k) of i.i.d. Rademacher entries (+-1), fresh
  every micro-batch. E[S S^T] = k I, so E[(dY S)(S^T W) / k] = dY W: unbiased, its error a zero-mean noise that
  averages out over micro-batches and updates instead of a bias that accumulates. The price is that noise: its
  squared norm is about ||dY||^2 ||W||^2 / k against the correction's ||dY W||^2, so where k is small against the
  weight's rank the noise can exceed the correction it estimates. No basis, no refresh: the draws
  come from a generator the source owns, seeded statelessly from `train.seed`, the update, the micro-batch's index
  within it and the process's rank, so a resumed run draws what an unbroken one would. Why Rademacher (see
  `sampled_estimate`): dense and static-shaped, the same FLOPs as the projected sketch, and of the dense
  projections the lower variance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from creditlab.config import Config
from creditlab.credit.sources import CreditSource, stream_seed
# credit.sketch's forms and the subspace refresh's steps (module docstring), defined beside their FLOPs
from creditlab.flops import SKETCH_FORMS as FORMS, SUBSPACE_ITERATIONS
from creditlab.model import ExactCredit, GPT
from creditlab.ops.qk_norm import QKEpilogue
from creditlab.ops.relu2 import ReLU2, expand_relu2_values

# The randomized range finder of `subspace`'s first refresh: oversampling columns and power iterations (Halko et
# al. 2011, sec. 4.2-4.3: p = 5..10 columns; one or two power iterations for a slowly decaying spectrum).
RANGE_OVERSAMPLE, RANGE_POWER = 8, 2
# Tags that keep the source's random streams apart: the range finder's test matrices and the sampled signs.
_RANGE_STREAM, _SIGNS_STREAM = 1, 2


def projected_estimate(dy: torch.Tensor, weight: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """(dY W V) V^T: dY W projected onto span(V), V (d, k). W V (m, k) is formed once per micro-batch, in float32 or
    better, then the two thin products per token in dY's dtype."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    factor = (weight.to(acc) @ basis.to(acc)).to(dy.dtype)  # A = W V (m, k)
    return (dy @ factor) @ basis.to(dy.dtype).t()


def sampled_estimate(dy: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(dY S)(S^T W) / k, an unbiased estimate of dY W for S (m, k) with E[S S^T] = k I (Rademacher here).

    S^T W / k (k, d) is formed once per micro-batch in float32 or better, then the two thin products per token in
    dY's dtype: 2k(m + d) per token and 2mdk per micro-batch, exactly the projected sketch's FLOPs. The 1/k falls on
    that small factor, so S stays +-1, exact in any dtype.

    Why Rademacher random projection: it is dense and of a fixed shape, so the backward compiles into the same graph
    every update (no data-dependent gather or multinomial draw) and costs what the rank-k sketch costs. Among dense
    projections with i.i.d. zero-mean unit-variance entries of fourth moment mu4, one rank-one term s s^T has
    E||dY s s^T W||^2 = tr(A) tr(B) + 2 tr(AB) + (mu4 - 3) sum_i A_ii B_ii with A = W W^T, B = dY^T dY (both
    positive semidefinite, so the last sum is >= 0): Rademacher's mu4 = 1 takes 2 sum_i A_ii B_ii off a Gaussian's
    (mu4 = 3) variance. Column-row sampling (CRS, Adelman et al. 2021: k of the m columns of dY with the rows of W,
    probabilities proportional to the product of their norms) has lower variance still, but needs the column norms of
    dY first and then a data-dependent gather, inside the backward, of a sample that changes every micro-batch."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    right = (signs.to(acc).t() @ weight.to(acc) / signs.shape[-1]).to(dy.dtype)  # S^T W / k (k, d)
    return (dy @ signs.to(dy.dtype)) @ right


class _SketchedLinear(torch.autograd.Function):
    """F.linear(n, W) whose backward gives W its exact gradient and n the sketch: `projected_estimate` with the
    basis V, or `sampled_estimate` with the signs S where `sampled`.

    The forward is F.linear itself, so under autocast it casts as F.linear does. The backward casts
    explicitly to the output gradient's dtype instead of relying on the autocast state, which the backward
    (run by the autograd engine, possibly compiled) need not share with the forward."""

    @staticmethod
    def forward(ctx, n, weight, operand, expand: bool, sampled: bool = False):
        ctx.save_for_backward(n, weight, operand)
        ctx.sampled = sampled
        if not expand:
            return F.linear(n, weight)
        return expand_relu2_values(n, weight)[0]  # the fused MLP's convention: dy below is dL/d(n W^T)

    @staticmethod
    def backward(ctx, dy):
        n, weight, operand = ctx.saved_tensors
        grad_n = (sampled_estimate if ctx.sampled else projected_estimate)(dy, weight, operand)
        grad_weight = dy.flatten(0, -2).t() @ n.to(dy.dtype).flatten(0, -2)  # what F.linear's backward computes
        return grad_n.to(n.dtype), grad_weight.to(weight.dtype), None, None, None


class SketchCredit(ExactCredit):
    """The synthetic step: n keeps its gradient path, and the product's backward sketches the omitted part through
    each branch's basis, (branches, d, k)."""

    sampled = False

    def __init__(self, basis: torch.Tensor):
        self.basis = basis

    def operand(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        return self.basis[index]

    def product(self, index: int, n: torch.Tensor, weight: torch.Tensor, activation=None):
        operand = self.operand(index, weight)
        if isinstance(activation, QKEpilogue):  # the sketch needs dL/d(n W^T): the product, then the epilogue
            return activation.after(_SketchedLinear.apply(n, weight, operand, False, self.sampled))
        return _SketchedLinear.apply(n, weight, operand, isinstance(activation, ReLU2), self.sampled)  # fused MLP


class SampledCredit(SketchCredit):
    """The sampled sketch: each branch's signs S_b are the first m_b rows of `signs` (branches, m_max, k), drawn
    outside the compiled forward and passed in as one tensor, so that every micro-batch traces the same graph."""

    sampled = True

    def operand(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        return self.basis[index, : weight.shape[0]]


def leading_basis(weight: torch.Tensor, rank: int) -> torch.Tensor:
    """The leading `rank` right singular vectors of `weight` (m, d) as columns (d, rank), in float32 or better."""
    w = weight.detach().to(torch.promote_types(weight.dtype, torch.float32))
    _, _, vh = torch.linalg.svd(w, full_matrices=False)
    return vh[:rank].t()


def subspace_iteration(weight: torch.Tensor, basis: torch.Tensor,
                       iterations: int = SUBSPACE_ITERATIONS) -> torch.Tensor:
    """`iterations` steps of V <- orth(W^T (W V)) (QR) from `basis` (d, k): an orthonormal basis (d, k) closer to
    the leading right singular subspace of `weight` (m, d), in float32 or better. Its columns are not singular
    vectors (only their span is meant)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    w, v = weight.detach().to(acc), basis.detach().to(acc)
    for _ in range(iterations):
        v, _ = torch.linalg.qr(w.t() @ (w @ v))
    return v


def randomized_basis(weight: torch.Tensor, rank: int, generator: torch.Generator,
                     oversample: int = RANGE_OVERSAMPLE, power: int = RANGE_POWER) -> torch.Tensor:
    """The randomized range finder (Halko, Martinsson and Tropp 2011, algorithms 4.4 and 5.1): a Gaussian test
    matrix of rank + oversample columns, `power` power iterations re-orthonormalized at every product, then
    Rayleigh-Ritz (the SVD of the small Q^T W) truncated to the leading `rank` right singular vectors (d, rank)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    w = weight.detach().to(acc)
    columns = min(rank + oversample, *w.shape)
    # drawn in float64 whatever the weight's dtype, so that a float32 run and its float64 reference (the step
    # check) start from the same test matrix
    omega = torch.randn(w.shape[1], columns, generator=generator, device=w.device, dtype=torch.float64).to(acc)
    q, _ = torch.linalg.qr(w @ omega)  # (m, l): the range of W
    for _ in range(power):
        q, _ = torch.linalg.qr(w.t() @ q)
        q, _ = torch.linalg.qr(w @ q)
    _, _, vh = torch.linalg.svd(q.t() @ w, full_matrices=False)  # (l, d)
    return vh[:rank].t()


def rademacher(shape, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """i.i.d. +-1 entries, each sign with probability 1/2, on the generator's device."""
    bits = torch.randint(0, 2, shape, generator=generator, device=generator.device, dtype=torch.int8)
    return (bits * 2 - 1).to(dtype)


class SketchSource(CreditSource):
    """Synthetic updates sketch the omitted products; exact updates (where a schedule asks for them) are native."""

    name, omits = "sketch", True
    about = "the omitted product itself through k directions (credit.sketch_rank; credit.sketch: svd|subspace|sampled)"

    def __init__(self, width: int, branches: int, rank: int, every: int, form: str = "svd", seed: int = 0):
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"unknown sketch form {form!r}; valid: {'|'.join(FORMS)}")
        self.rank, self.every, self.form, self.seed = rank, every, form, seed
        if form != "sampled":
            self.register_buffer("basis", torch.zeros(branches, width, rank))
        # The update whose weights the basis was taken from (-1: never). A Python int, saved as extra state, so
        # that deciding whether to refresh never reads the device and a resumed run refreshes when an unbroken
        # one would.
        self.refreshed_at = -1
        # `sampled`: the (update, micro-batch) of the last draw, which numbers the micro-batches of an update, and
        # that draw's signs (branches, m_max, k); the signs are never saved, being a function of the two and the seed.
        self.drawn = (-1, -1)
        self.signs: torch.Tensor | None = None
        self._generator: torch.Generator | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> "SketchSource":
        c = cfg.credit
        return cls(cfg.model.width, cfg.model.branches, c.sketch_rank, c.sketch_every, c.sketch, cfg.train.seed)

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        c = cfg.credit
        if c.sketch not in FORMS:
            return [f"credit.sketch must be one of {'|'.join(FORMS)}, got {c.sketch!r}"]
        if c.sketch_rank < 1 or c.sketch_every < 1:
            return [f"credit.sketch_rank and credit.sketch_every must be positive, got {c.sketch_rank} and "
                    f"{c.sketch_every}"]
        if c.sketch_rank > cfg.model.width:
            why = ("k directions cost 2k(m + d) per token, more than the omitted product's 2md beyond the width"
                   if c.sketch == "sampled" else "a weight has no more right singular vectors than that")
            return [f"credit.sketch_rank ({c.sketch_rank}) exceeds model.width ({cfg.model.width}): {why}"]
        return []

    def generator(self, device: torch.device, *stream: int) -> torch.Generator:
        """The source's generator on `device`, seeded from train.seed and `stream` alone (stateless: what it draws
        depends on nothing drawn before)."""
        device = torch.device(device)
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator.manual_seed(stream_seed(self.seed, *stream))

    @torch.no_grad()
    def refresh(self, model: GPT, update: int = 0) -> None:
        """Take every branch's basis from the model's current weights: a full SVD (`svd`), or subspace iteration
        from the last basis (`subspace`; the randomized range finder where there is none yet). Nothing for
        `sampled`, which has no basis (its signs are drawn every micro-batch): a benchmark that times the refresh
        of every source that has one times nothing there."""
        if self.form == "sampled":
            return
        for b, linear in enumerate(model.branch_modules()):
            w = linear.weight
            if self.form == "svd":
                basis = leading_basis(w, self.rank)
            elif self.refreshed_at < 0:
                basis = randomized_basis(w, self.rank, self.generator(w.device, _RANGE_STREAM, update, b))
            else:
                basis = subspace_iteration(w, self.basis[b])
            self.basis[b].copy_(basis)
        self.refreshed_at = update

    def refresh_due(self, update: int) -> bool:
        """Whether the basis predates the last multiple of sketch_every at or before `update`. On a schedule of
        synthetic updates only, that is `update % sketch_every == 0`; an exact update on a multiple moves the
        refresh to the next synthetic update, which is the first to need it. Never for `sampled`."""
        if self.form == "sampled":
            return False
        return self.refreshed_at < 0 or self.refreshed_at < update // self.every * self.every

    @torch.no_grad()
    def draw(self, model: GPT, update: int, micro: int, rank: int = 0) -> torch.Tensor:
        """`sampled`: the signs of micro-batch `micro` of update `update` on process `rank`, (branches, m_max, k) on
        the weights' device and in their dtype, from train.seed and those three alone. Each process of a
        data-parallel run draws its own, so that their averaged gradient averages independent estimates."""
        linears = model.branch_modules()
        w = linears[0].weight
        shape = (len(linears), max(lin.out_features for lin in linears), self.rank)
        self.signs = rademacher(shape, self.generator(w.device, _SIGNS_STREAM, update, micro, rank), w.dtype)
        self.drawn = (update, micro)
        return self.signs

    def context(self, trainer, inputs, targets, kind: str, scale: float) -> ExactCredit:
        if kind != "synthetic":
            return self.exact_step()
        update = trainer.update_index
        if self.form == "sampled":  # the micro-batches of an update numbered in the order they run
            micro = self.drawn[1] + 1 if self.drawn[0] == update else 0
            self.draw(trainer.model, update, micro, trainer.runtime.rank)
        elif self.refresh_due(update):
            self.refresh(trainer.model, update)
        return self.step()

    def recorded_kind(self, update: int, kind: str) -> str:
        return "refresh" if kind == "synthetic" and self.refreshed_at == update else kind

    def step(self) -> SketchCredit:
        if self.form == "sampled":
            if self.signs is None:
                raise RuntimeError("the sampled sketch has no signs yet: call draw(model, update, micro) first")
            return SampledCredit(self.signs)
        if self.refreshed_at < 0:
            raise RuntimeError("the sketch source has no basis yet: call refresh(model) first")
        return SketchCredit(self.basis)

    def get_extra_state(self) -> dict:
        return {"refreshed_at": self.refreshed_at, "drawn": list(self.drawn)}

    def set_extra_state(self, state) -> None:
        if isinstance(state, int):  # a checkpoint of the source before the sampled form: refreshed_at alone
            state = {"refreshed_at": state, "drawn": [-1, -1]}
        self.refreshed_at = int(state["refreshed_at"])
        self.drawn = tuple(int(x) for x in state["drawn"])
        self.signs = None  # drawn again, the same, by the next micro-batch of its update


__all__ = ["SketchSource", "SketchCredit", "SampledCredit", "leading_basis", "subspace_iteration",
           "randomized_basis", "projected_estimate", "sampled_estimate", "rademacher", "FORMS"]
