"""The sketched product: keep the omitted input-gradient product, but at rank k.

The synthetic backward still computes each branch's output gradient dY_b, because the weight gradient
dY_b^T n_b needs it. So instead of predicting the correction c_b = dY_b W_b from elsewhere, this source
computes it through a rank-k factor of the weight: c_b ~ (dY_b A_b) V_b^T with V_b (d, k) the leading right
singular vectors of W_b (m, d) and A_b = W_b V_b (m, k). That costs 2k(m + d) per token against the omitted
product's 2md, and dY_b W_b is never formed. Nothing is fitted and nothing is injected at the tap: the
correction is the gradient the product's own backward hands to n_b.

V_b is refreshed every `credit.sketch_every` updates by a truncated SVD of the current weight (the SVD is
the expensive part, and the leading subspace of a weight moves slowly). A_b is recomputed from the current
weight in every backward: it costs m*d*k per micro-batch, nothing per token, and makes the sketch exactly
the true correction projected onto span(V_b), c_b V_b V_b^T, however stale V_b is. A cached A_b would add
the weight's drift since the refresh to that error, for no saving worth having.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from creditlab.config import Config
from creditlab.credit.sources import CreditSource
from creditlab.model import ExactCredit, GPT
from creditlab.ops.qk_norm import QKEpilogue
from creditlab.ops.relu2 import ReLU2, expand_relu2_values


class _SketchedLinear(torch.autograd.Function):
    """F.linear(n, W) whose backward gives W its exact gradient and n the rank-k sketch (dY W V) V^T.

    The forward is F.linear itself, so under autocast it casts as F.linear does. The backward casts
    explicitly to the output gradient's dtype instead of relying on the autocast state, which the backward
    (run by the autograd engine, possibly compiled) need not share with the forward."""

    @staticmethod
    def forward(ctx, n, weight, basis, expand: bool):
        ctx.save_for_backward(n, weight, basis)
        if not expand:
            return F.linear(n, weight)
        return expand_relu2_values(n, weight)[0]  # the fused MLP's convention: dy below is dL/d(n W^T)

    @staticmethod
    def backward(ctx, dy):
        n, weight, basis = ctx.saved_tensors
        acc = torch.promote_types(weight.dtype, torch.float32)
        factor = (weight.to(acc) @ basis.to(acc)).to(dy.dtype)  # A = W V (m, k), once per micro-batch
        grad_n = (dy @ factor) @ basis.to(dy.dtype).t()
        grad_weight = dy.flatten(0, -2).t() @ n.to(dy.dtype).flatten(0, -2)  # what F.linear's backward computes
        return grad_n.to(n.dtype), grad_weight.to(weight.dtype), None, None


class SketchCredit(ExactCredit):
    """The synthetic step: n keeps its gradient path, and the product's backward sketches the omitted part."""

    def __init__(self, basis: torch.Tensor):
        self.basis = basis  # (branches, d, k)

    def product(self, index: int, n: torch.Tensor, weight: torch.Tensor, activation=None):
        if isinstance(activation, QKEpilogue):  # the sketch needs dL/d(n W^T): the product, then the epilogue
            return activation.after(_SketchedLinear.apply(n, weight, self.basis[index], False))
        return _SketchedLinear.apply(n, weight, self.basis[index], isinstance(activation, ReLU2))  # fused MLP


def leading_basis(weight: torch.Tensor, rank: int) -> torch.Tensor:
    """The leading `rank` right singular vectors of `weight` (m, d) as columns (d, rank), in float32 or better."""
    w = weight.detach().to(torch.promote_types(weight.dtype, torch.float32))
    _, _, vh = torch.linalg.svd(w, full_matrices=False)
    return vh[:rank].t()


class SketchSource(CreditSource):
    """Synthetic updates sketch the omitted products; exact updates (where a schedule asks for them) are native."""

    name, omits = "sketch", True
    about = "the omitted product itself through a rank-k factor of its weight (credit.sketch_rank)"

    def __init__(self, width: int, branches: int, rank: int, every: int):
        super().__init__()
        self.rank, self.every = rank, every
        self.register_buffer("basis", torch.zeros(branches, width, rank))
        # The update whose weights the basis was taken from (-1: never). A Python int, saved as extra state, so
        # that deciding whether to refresh never reads the device and a resumed run refreshes when an unbroken
        # one would.
        self.refreshed_at = -1

    @classmethod
    def from_config(cls, cfg: Config) -> "SketchSource":
        return cls(cfg.model.width, cfg.model.branches, cfg.credit.sketch_rank, cfg.credit.sketch_every)

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        c = cfg.credit
        if c.sketch_rank < 1 or c.sketch_every < 1:
            return [f"credit.sketch_rank and credit.sketch_every must be positive, got {c.sketch_rank} and "
                    f"{c.sketch_every}"]
        if c.sketch_rank > cfg.model.width:
            return [f"credit.sketch_rank ({c.sketch_rank}) exceeds model.width ({cfg.model.width}): "
                    "a weight has no more right singular vectors than that"]
        return []

    @torch.no_grad()
    def refresh(self, model: GPT, update: int = 0) -> None:
        """Take every branch's basis from the model's current weights."""
        for b, linear in enumerate(model.branch_modules()):
            self.basis[b].copy_(leading_basis(linear.weight, self.rank))
        self.refreshed_at = update

    def refresh_due(self, update: int) -> bool:
        """Whether the basis predates the last multiple of sketch_every at or before `update`. On a schedule of
        synthetic updates only, that is `update % sketch_every == 0`; an exact update on a multiple moves the
        refresh to the next synthetic update, which is the first to need it."""
        return self.refreshed_at < 0 or self.refreshed_at < update // self.every * self.every

    def context(self, trainer, inputs, targets, kind: str, scale: float) -> ExactCredit:
        if kind != "synthetic":
            return self.exact_step()
        if self.refresh_due(trainer.update_index):
            self.refresh(trainer.model, trainer.update_index)
        return self.step()

    def recorded_kind(self, update: int, kind: str) -> str:
        return "refresh" if kind == "synthetic" and self.refreshed_at == update else kind

    def step(self) -> SketchCredit:
        if self.refreshed_at < 0:
            raise RuntimeError("the sketch source has no basis yet: call refresh(model) first")
        return SketchCredit(self.basis)

    def get_extra_state(self) -> int:
        return self.refreshed_at

    def set_extra_state(self, state: int) -> None:
        self.refreshed_at = int(state)


__all__ = ["SketchSource", "SketchCredit", "leading_basis"]
