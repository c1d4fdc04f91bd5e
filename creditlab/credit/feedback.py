"""Feedback sources: every branch's correction is a full linear map of the token's own terminal error,
c_{b,t} = e_t M_b with M_b (d, d), decoded in the backward only.

* `dfa`: M_b fixed and random (direct feedback alignment).
* `fitted_feedback`: M_b = D_b^T, the least-squares map from e to the true correction c_b, solved from statistics
  streamed on teacher updates: the Gram E^T E of the terminal error (d, d, shared by all branches) and the cross
  moments C_b^T E (d, d per branch). It is the `full` family of the fit ceiling (ceiling.py), made a source.

Injection: the forward threads one carrier tensor through every branch (`_FeedbackChain`, the identity on it) and
hands it to the tap (`_Pass`), whose backward gives the carrier the terminal error e. Walking back along the
chain, each branch's node receives e when the backward reaches that branch, returns e M_b as its input's gradient
and passes e on. The forward pays for nothing but views: no product the backward alone needs is formed in it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from creditlab.config import Config, CreditConfig
from creditlab.credit.sources import CreditSource, FittedSource, OmitCredit
from creditlab.credit.teacher import Teacher, _fit_dtypes, wide_product
from creditlab.model import ExactCredit


class _FeedbackChain(torch.autograd.Function):
    """The identity on the carrier; its backward hands the carrier's gradient e on and gives n the correction e M."""

    @staticmethod
    def forward(ctx, carrier, n, mapping):
        ctx.save_for_backward(mapping)
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, e):
        (mapping,) = ctx.saved_tensors
        return e, e @ mapping.to(e.dtype), None


class _Pass(torch.autograd.Function):
    """The identity on x_L; its backward gives the carrier the terminal error as well."""

    @staticmethod
    def forward(ctx, x, carrier):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, e):
        return e, e


def carrier_of(carrier: torch.Tensor | None, n: torch.Tensor) -> torch.Tensor:
    """The chain's carrier so far, or at the first branch a zero of n's shape that costs no memory."""
    return n.new_zeros(()).expand_as(n) if carrier is None else carrier


class FeedbackCredit(OmitCredit):
    """The synthetic step of a feedback source: `mapping(b)` is branch b's M_b (d, d), c_b = e M_b."""

    def __init__(self, mapping):
        self.mapping = mapping
        self.carrier = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        self.carrier = _FeedbackChain.apply(carrier_of(self.carrier, n), n, self.mapping(index))
        return n.detach()

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.carrier is None else _Pass.apply(x, self.carrier)


class DFASource(CreditSource):
    """Direct feedback alignment (Launay et al. 2020 style): c_b = e B_b with fixed seeded random B_b."""

    name, omits = "dfa", True

    def __init__(self, width: int, branches: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("feedback", torch.randn(branches, width, width, generator=g) * width ** -0.5)

    @classmethod
    def from_config(cls, cfg: Config) -> "DFASource":
        return cls(cfg.model.width, cfg.model.branches, cfg.credit.feedback_seed)

    def step(self) -> FeedbackCredit:
        return FeedbackCredit(lambda b: self.feedback[b])


# ---- the fitted feedback and its teacher --------------------------------------------------------------------

class _FitFeedback(torch.autograd.Function):
    """On a teacher update, branch b's node of the chain: the identity on n (the omitted product's input) and on
    the carrier. Its backward receives the true correction c_b and the terminal error e together, passes both on
    unchanged, and gives the sinks the cross moment c_b^T e (d, d) and |c_b|^2."""

    @staticmethod
    def forward(ctx, n, carrier, cross_sink, true_sq_sink, low_precision: bool):
        ctx.low_precision = low_precision
        return n.view_as(n), carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, true, e):
        acc, mm = _fit_dtypes(true, ctx.low_precision)
        cross = wide_product(true.flatten(0, 1).t(), e.flatten(0, 1), acc, mm)
        return true, e, cross, true.to(acc).square().sum(), None


class FeedbackFitCredit(ExactCredit):
    """Exact backprop whose backward streams every branch's cross moment with the terminal error."""

    def __init__(self, cross_sink: torch.Tensor, true_sq_sink: torch.Tensor, error_probe: torch.Tensor,
                 low_precision: bool, scale: float):
        self.cross_sink, self.true_sq_sink, self.error_probe = cross_sink, true_sq_sink, error_probe
        self.low_precision, self.scale = low_precision, scale
        self.carrier = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        n_omit, self.carrier = _FitFeedback.apply(n, carrier_of(self.carrier, n), self.cross_sink[index],
                                                  self.true_sq_sink[index], self.low_precision)
        return n_omit

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.carrier is None else _Pass.apply(x, self.carrier)
        return x + self.error_probe.to(x.dtype)  # the probe's gradient is e, for the Gram


class FittedFeedbackSource(FittedSource):
    """c_b = D_b e: a full (d, d) map per branch from the terminal error, fitted on teacher updates."""

    name, omits = "fitted_feedback", True

    def __init__(self, width: int, branches: int, credit: CreditConfig):
        super().__init__(credit)
        self.decoders = nn.Parameter(torch.zeros(branches, width, width))  # D_b: c_t = D_b e_t

    @classmethod
    def from_config(cls, cfg: Config) -> "FittedFeedbackSource":
        return cls(cfg.model.width, cfg.model.branches, cfg.credit)

    def step(self) -> FeedbackCredit:
        return FeedbackCredit(lambda b: self.decoders[b].detach().t())

    def make_teacher(self):
        return FeedbackTeacher(self, self.credit_cfg)


class FeedbackTeacher(Teacher):
    """Everything of the fit follows from the streamed moments: with G = E^T E and X_b = C_b^T E of a micro-batch,
    |pred|^2 = tr(D G D^T), <pred, c> = <D, X>, and the regression's gradient 2 (D G - X) / |c|^2. So `adam` steps
    on that gradient and `lstsq` solves D_b = X_b (G + ridge I)^-1 (Teacher.solve, the features being e itself);
    no (B, T, d) prediction is ever formed."""

    def __init__(self, source: FittedFeedbackSource, cfg: CreditConfig):
        super().__init__(source, source.decoders, cfg)

    def context(self, trainer, inputs, scale: float) -> FeedbackFitCredit:
        branches, d, _ = self.decoders.shape
        sink = dict(device=inputs.device, dtype=torch.float32 if self.dtype != torch.float64 else torch.float64,
                    requires_grad=True)
        cross_sink, true_sq_sink = torch.zeros(branches, d, d, **sink), torch.zeros(branches, **sink)
        probe_dtype = trainer.runtime.autocast_dtype or self.dtype
        error_probe = torch.zeros(*inputs.shape, d, **sink | {"dtype": probe_dtype})
        return FeedbackFitCredit(cross_sink, true_sq_sink, error_probe, self.low_precision, scale)

    def collect(self, trainer, credit: FeedbackFitCredit) -> None:
        if credit.cross_sink.grad is None or credit.error_probe.grad is None:
            raise RuntimeError("the teacher's backward did not reach the branches and the tap: no fit")
        branches, d, _ = self.decoders.shape
        e = credit.error_probe.grad.flatten(0, 1)
        gram = wide_product(e.t(), e, *_fit_dtypes(e, self.low_precision)).to(credit.cross_sink.dtype)
        cross, true_sq = credit.cross_sink.grad, credit.true_sq_sink.grad
        self.stats.append(self._stats(gram, cross, true_sq))
        if self.closed_form:  # Teacher.solve's layout: one Gram per branch (here all the same)
            self.add_moments([gram.expand(branches, d, d).clone(), cross.clone()])
        else:
            self._accumulate_gradient(gram, cross, true_sq, credit.scale)

    def _stats(self, gram, cross, true_sq) -> torch.Tensor:
        D = self.decoders.detach().to(gram.dtype)
        pred_sq = torch.einsum("bdk,kl,bdl->b", D, gram, D)
        dot = (D * cross).sum((1, 2))
        weight = torch.where(true_sq > 0, 1.0 / true_sq.clamp_min(1e-300), torch.zeros_like(true_sq))
        # the columns of teacher.STATS
        stats = torch.stack([(pred_sq - 2 * dot + true_sq) * weight, dot, pred_sq, true_sq], dim=1)
        return stats.to(self.dtype)

    def _accumulate_gradient(self, gram, cross, true_sq, scale: float) -> None:
        D = self.decoders.detach().to(gram.dtype)
        weight = torch.where(true_sq > 0, 1.0 / true_sq.clamp_min(1e-300), torch.zeros_like(true_sq))
        grad = ((2.0 * scale) * weight[:, None, None] * (D @ gram - cross)).to(self.decoders.dtype)
        self.decoders.grad = grad if self.decoders.grad is None else self.decoders.grad + grad


__all__ = ["DFASource", "FeedbackCredit", "FittedFeedbackSource", "FeedbackTeacher", "FeedbackFitCredit"]
