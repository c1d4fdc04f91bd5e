"""Feedback sources: every branch's correction is a full linear map of the token's own terminal error,
c_{b,t} = e_t M_b with M_b (d, d), decoded in the backward only.

* `dfa`: M_b fixed and random (direct feedback alignment); with credit.dfa_scale=calibrated, scaled per branch so
  that its corrections have the RMS of the true ones, measured on teacher updates.
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
import torch.distributed as dist
import torch.nn as nn

from creditlab.config import Config, CreditConfig
from creditlab.credit.sources import FittedSource, OmitCredit
from creditlab.credit.teacher import (STATS, Teacher, Teaching, _fit_dtypes, fit_stats, inverse_signal,
                                      summarize_stats, wide_product)
from creditlab.model import ExactCredit

FEEDBACK_SEED = 1234  # `dfa`'s fixed random feedback: the same matrices whatever the training seed


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


def moment_context(trainer, inputs: torch.Tensor, branches: int, width: int, dtype: torch.dtype,
                   low_precision: bool, scale: float) -> FeedbackFitCredit:
    """A teacher micro-batch's context that streams the moments of every branch's true correction with e."""
    sink = dict(device=inputs.device, dtype=torch.float32 if dtype != torch.float64 else torch.float64,
                requires_grad=True)
    cross_sink, true_sq_sink = torch.zeros(branches, width, width, **sink), torch.zeros(branches, **sink)
    probe_dtype = trainer.runtime.autocast_dtype or dtype
    error_probe = torch.zeros(*inputs.shape, width, **sink | {"dtype": probe_dtype})
    return FeedbackFitCredit(cross_sink, true_sq_sink, error_probe, low_precision, scale)


def streamed_moments(credit: FeedbackFitCredit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """After the backward: the Gram E^T E (d, d), the cross moments C_b^T E (branches, d, d) and |C_b|^2."""
    if credit.cross_sink.grad is None or credit.error_probe.grad is None:
        raise RuntimeError("the teacher's backward did not reach the branches and the tap: no fit")
    e = credit.error_probe.grad.flatten(0, 1)
    gram = wide_product(e.t(), e, *_fit_dtypes(e, credit.low_precision)).to(credit.cross_sink.dtype)
    return gram, credit.cross_sink.grad, credit.true_sq_sink.grad


def feedback_stats(D: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, true_sq: torch.Tensor) -> torch.Tensor:
    """The columns of teacher.STATS for the prediction c_t = D_b e_t (D: branches, d, d), from the moments:
    |pred|^2 = tr(D G D^T) and <pred, c> = <D, X>."""
    D = D.to(gram.dtype)
    pred_sq = torch.einsum("bdk,kl,bdl->b", D, gram, D)
    return fit_stats(pred_sq, (D * cross).sum((1, 2)), true_sq)


class FittedFeedbackSource(FittedSource):
    """c_b = D_b e: a full (d, d) map per branch from the terminal error, fitted on teacher updates."""

    name, omits = "fitted_feedback", True
    about = "a full least-squares map of the terminal error per branch, fitted on teacher updates"

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
        return moment_context(trainer, inputs, branches, d, self.dtype, self.low_precision, scale)

    def collect(self, trainer, credit: FeedbackFitCredit) -> None:
        branches, d, _ = self.decoders.shape
        gram, cross, true_sq = streamed_moments(credit)
        self.stats.append(feedback_stats(self.decoders.detach(), gram, cross, true_sq).to(self.dtype))
        if self.closed_form:  # Teacher.solve's layout: one Gram per branch (here all the same)
            self.add_moments([gram.expand(branches, d, d).clone(), cross.clone()])
        else:
            self._accumulate_gradient(gram, cross, true_sq, credit.scale)

    def _accumulate_gradient(self, gram, cross, true_sq, scale: float) -> None:
        D = self.decoders.detach().to(gram.dtype)
        grad = ((2.0 * scale) * inverse_signal(true_sq)[:, None, None] * (D @ gram - cross)).to(self.decoders.dtype)
        self.decoders.grad = grad if self.decoders.grad is None else self.decoders.grad + grad


# ---- direct feedback alignment, and its calibration ---------------------------------------------------------

class DFASource(FittedSource):
    """Direct feedback alignment (Launay et al. 2020 style): c_b = s_b e B_b with fixed seeded random B_b.

    s_b = 1 as drawn (credit.dfa_scale=none: no teacher updates). Calibrated, s_b is the running ratio of the
    RMS of branch b's true corrections to the RMS of e B_b, both measured on teacher updates: random feedback
    then injects corrections of the right size, whatever their direction. Only teacher updates need the
    measurement; the synthetic step is the same chain either way."""

    name, omits = "dfa", True
    about = ("fixed random feedback of the terminal error (calibrated to the true corrections' RMS on teacher updates "
             "with credit.dfa_scale=calibrated)")

    def __init__(self, width: int, branches: int, seed: int, credit: CreditConfig | None = None):
        super().__init__(credit or CreditConfig())
        self.fits = self.credit_cfg.dfa_scale == "calibrated"
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("feedback", torch.randn(branches, width, width, generator=g) * width ** -0.5)
        self.register_buffer("scales", torch.ones(branches))

    @classmethod
    def from_config(cls, cfg: Config) -> "DFASource":
        return cls(cfg.model.width, cfg.model.branches, FEEDBACK_SEED, cfg.credit)

    @classmethod
    def fits_with(cls, cfg: Config) -> bool:
        return cfg.credit.dfa_scale == "calibrated"

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        problems = super().config_problems(cfg)
        if cfg.credit.dfa_scale not in ("none", "calibrated"):
            problems.append(f"credit.dfa_scale must be one of none|calibrated, got {cfg.credit.dfa_scale!r}")
        return problems

    def step(self) -> FeedbackCredit:
        if not self.fits:
            return FeedbackCredit(lambda b: self.feedback[b])
        return FeedbackCredit(lambda b: self.scales[b] * self.feedback[b])

    def make_teacher(self):
        return DFACalibration(self, self.credit_cfg)


class MeasuredFeedback(Teaching):
    """A teacher that measures maps c_b = e M_b it does not fit by least squares against the true corrections:
    each teacher micro-batch streams the moments (as the fitted feedback's teacher does) and keeps the fit
    statistics of `maps()` (branches, d, d) as they stand."""

    def __init__(self, maps, cfg: CreditConfig):
        self.maps, self.low_precision = maps, True
        self.stats: list[torch.Tensor] = []

    def context(self, trainer, inputs, scale: float) -> FeedbackFitCredit:
        M = self.maps()
        return moment_context(trainer, inputs, M.shape[0], M.shape[1], M.dtype, self.low_precision, scale)

    def collect(self, trainer, credit: FeedbackFitCredit) -> None:
        gram, cross, true_sq = streamed_moments(credit)  # c = e M_b is the prediction D_b e with D_b = M_b^T
        self.stats.append(feedback_stats(self.maps().transpose(1, 2), gram, cross, true_sq))


class DFACalibration(MeasuredFeedback):
    """The teacher of calibrated DFA: it fits nothing but s_b. The measured statistics of B_b (at unit scale)
    hold, per branch, |c_b|^2, |e B_b|^2 = tr(B_b^T G B_b) and <c_b, e B_b>; so the fit report (error and cosine
    of the injected s_b e B_b) costs nothing more. s_b follows the RMS ratio with momentum, the first
    measurement taken whole (as DNI's scales)."""

    MOMENTUM = 0.9

    def __init__(self, source: DFASource, cfg: CreditConfig):
        super().__init__(lambda: source.feedback, cfg)
        self.source = source
        self.calibrated = False

    @torch.no_grad()
    def step(self) -> dict:
        unit = torch.stack(self.stats).double()  # (micro-batches, branches, len(STATS)) at s_b = 1
        self.stats = []
        true_sq, pred_sq = unit[..., STATS.index("true_sq")].sum(0), unit[..., STATS.index("pred_sq")].sum(0)
        if dist.is_available() and dist.is_initialized():  # the same scales on every rank
            both = torch.stack([true_sq, pred_sq])
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
            true_sq, pred_sq = both
        s = self.source.scales.double()
        # the report: the corrections injected until now, s_b e B_b, against the true ones
        dot, pred, true = (unit[..., STATS.index(k)] for k in ("pred_dot_true", "pred_sq", "true_sq"))
        summary = summarize_stats(list(fit_stats(pred * s * s, dot * s, true)))
        measured = torch.where(pred_sq > 0, (true_sq / pred_sq.clamp_min(1e-300)).sqrt(), s)
        blended = measured if not self.calibrated else self.MOMENTUM * s + (1 - self.MOMENTUM) * measured
        self.source.scales.copy_(blended.to(self.source.scales.dtype))
        self.calibrated = True
        return summary | {"scales": [float(x) for x in self.source.scales]}

    def state_dict(self) -> dict:
        return {"calibrated": self.calibrated}

    def load_state_dict(self, state: dict) -> None:
        self.calibrated = state["calibrated"]


__all__ = ["DFASource", "DFACalibration", "MeasuredFeedback", "FeedbackCredit", "FittedFeedbackSource", "FeedbackTeacher",
           "FeedbackFitCredit", "feedback_stats", "moment_context", "streamed_moments"]
