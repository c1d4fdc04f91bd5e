"""Teacher acquisition: on an exact update, fit the predictor to the true corrections as they stream past.

The teacher update is ordinary exact backprop with a fit riding inside its one backward pass, with no hooks,
so it compiles like any other step:

* each branch input passes `_FitBranch`, the identity on n_b that also emits a zero-valued code slot s_b
  (B, T, 2r) feeding the learned source's terminal adjoint. In the backward, the gradient arriving at the
  omitted product's input is the true correction c_b, and the gradient arriving at s_b is the code
  [p ; m] of the terminal error (the adjoint sends it there). `_FitBranch.backward` passes c_b on unchanged
  and, in the same breath, computes the regression loss's gradient for that branch: the normalized squared
  error |D_b (g_b * code) - c_b|^2 / |c_b|^2, analytically, into G_b, D_b and the code. No step holds more
  than the one true correction of the branch being fitted.
* the code's gradient, summed over branches in code space (B, T, 2r), is pushed through [p ; m] into the
  projection and the mean gate once, after the backward, from the terminal error captured at the tap.

The DNI rival is fitted the same way (`_FitLocal`), its code computed from the branch input alone. Both fits
share `_rank_space_fit`: the regression's gradient and statistics without forming a (B, T, d) prediction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from creditlab import runtime as rt
from creditlab.config import CreditConfig
from creditlab.credit.sources import gate_and_code
from creditlab.model import ExactCredit

STATS = ("weighted_sq_error", "pred_dot_true", "pred_sq", "true_sq")


def _fit_dtypes(true: torch.Tensor, low_precision: bool) -> tuple[torch.dtype, torch.dtype]:
    """(accumulation dtype, dtype of the products over (B, T, d)). The products run in the gradient's own dtype
    when asked (bf16 under autocast: half the bytes of float32 and tensor-core rate); sums and everything of
    rank size stay in float32 or better."""
    acc = torch.promote_types(true.dtype, torch.float32)
    mm = true.dtype if low_precision and true.dtype in (torch.bfloat16, torch.float16) else acc
    return acc, mm


def _rank_space_fit(true: torch.Tensor, gated: torch.Tensor, decoder: torch.Tensor, scale: float,
                    acc: torch.dtype, mm: torch.dtype):
    """The regression of the prediction D gated (B, T, d) onto the true correction c, loss
    scale * |D gated - c|^2 / |c|^2: its gradients for D and for gated, and the branch's fit statistics.

    Everything is done in rank space: with M = D^T D, |pred|^2 = sum gated M gated and
    <pred, c> = sum gated (c D). The (B, T, d) prediction and residual are never formed; the true correction is
    read by two thin products and one sum."""
    D = decoder.to(acc)
    c = true.to(mm)
    c_decoded = (c @ D.to(mm)).to(acc)  # c D (B, T, 2r)
    c_gated = (c.flatten(0, 1).t() @ gated.to(mm).flatten(0, 1)).to(acc)  # c^T gated (d, 2r)
    true_sq = true.to(acc).square().sum()
    gated_m = gated @ (D.t() @ D)  # gated M (B, T, 2r)
    pred_sq, pred_dot_true = (gated_m * gated).sum(), (c_decoded * gated).sum()
    # A branch whose true correction is exactly zero (zero-initialized projections) teaches nothing.
    weight = torch.where(true_sq > 0, 1.0 / true_sq.clamp_min(1e-300), torch.zeros_like(true_sq))
    # d(scale * weight * |pred - c|^2)/d(pred) = 2 scale weight (pred - c), pulled back to D and to gated:
    factor = (2.0 * scale) * weight
    gram = gated.flatten(0, 1).t() @ gated.flatten(0, 1)  # gated^T gated (2r, 2r)
    d_decoder = factor * (D @ gram - c_gated)  # (pred - c)^T gated
    d_gated = factor * (gated_m - c_decoded)  # (pred - c) D
    sq_error = pred_sq - 2.0 * pred_dot_true + true_sq
    stats = torch.stack([sq_error * weight, pred_dot_true, pred_sq, true_sq])
    return d_decoder, d_gated, stats


class _FitBranch(torch.autograd.Function):
    """The learned predictor's fit at one branch: gated = g * code, with the state gate g = sigmoid(n G^T) and
    the code of the terminal error arriving at the zero-valued slot."""

    @staticmethod
    def forward(ctx, n, gate_weight, decoder, code_sink, stats_sink, scale: float, low_precision: bool):
        gate = torch.sigmoid(n @ gate_weight.to(n.dtype).t())  # (B, T, 2r), a forward state
        ctx.save_for_backward(n, gate, decoder)
        ctx.scale, ctx.low_precision = scale, low_precision
        return n.view_as(n), n.new_zeros(gate.shape)

    @staticmethod
    def backward(ctx, true, code):
        n, gate, decoder = ctx.saved_tensors
        acc, mm = _fit_dtypes(true, ctx.low_precision)
        gate, code = gate.to(acc), code.to(acc)
        d_decoder, d_gated, stats = _rank_space_fit(true, gate * code, decoder, ctx.scale, acc, mm)
        d_gate_pre = d_gated * code * gate * (1.0 - gate)
        d_gate_weight = d_gate_pre.to(mm).flatten(0, 1).t() @ n.to(mm).flatten(0, 1)  # (2r, d)
        return (true, d_gate_weight.to(decoder.dtype), d_decoder.to(decoder.dtype), d_gated * gate, stats,
                None, None)


class _FitLocal(torch.autograd.Function):
    """The DNI predictor's fit at one branch: gated = sigmoid(n G^T) * (n U^T), from the branch input alone."""

    @staticmethod
    def forward(ctx, n, gate_weight, code_weight, decoder, stats_sink, scale: float, low_precision: bool):
        """decoder: the effective s_b D_b; the caller's autograd carries its gradient on to D_b."""
        gate, coded = gate_and_code(n, gate_weight, code_weight)
        ctx.save_for_backward(n, gate, coded, decoder)
        ctx.scale, ctx.low_precision = scale, low_precision
        return n.view_as(n)

    @staticmethod
    def backward(ctx, true):
        n, gate, coded, decoder = ctx.saved_tensors
        acc, mm = _fit_dtypes(true, ctx.low_precision)
        gate, coded = gate.to(acc), coded.to(acc)
        d_decoder, d_gated, stats = _rank_space_fit(true, gate * coded, decoder, ctx.scale, acc, mm)
        d_pre = torch.cat([d_gated * coded * gate * (1.0 - gate), d_gated * gate], dim=-1)  # (B, T, 4r)
        d_gate_weight, d_code_weight = (d_pre.to(mm).flatten(0, 1).t() @ n.to(mm).flatten(0, 1)).chunk(2)
        dtype = decoder.dtype
        return true, d_gate_weight.to(dtype), d_code_weight.to(dtype), d_decoder.to(dtype), stats, None, None


class FitCredit(ExactCredit):
    """Exact backprop that fits the learned predictor on the fly (see the module docstring)."""

    def __init__(self, predictor, scale: float, code_sink: torch.Tensor, stats_sink: torch.Tensor,
                 error_probe: torch.Tensor, low_precision: bool = False):
        self.predictor, self.scale, self.low_precision = predictor, scale, low_precision
        self.code_sink, self.stats_sink, self.error_probe = code_sink, stats_sink, error_probe
        self.total = None
        self.x_terminal = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        p = self.predictor
        n_omit, slot = _FitBranch.apply(n, p.state_gates[index], p.decoders[index], self.code_sink,
                                        self.stats_sink[index], self.scale, self.low_precision)
        self.total = slot if self.total is None else self.total + slot
        return n_omit

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        self.x_terminal = x.detach()
        x = self.predictor.tap(x, self.total)  # sends the code [p ; m] to every slot
        return x + self.error_probe.to(x.dtype)  # the probe's gradient is e


class LocalFitCredit(ExactCredit):
    """Exact backprop that fits the DNI predictor on the fly: each branch's regression from its own input."""

    def __init__(self, dni, scale: float, stats_sink: torch.Tensor, low_precision: bool = False):
        self.dni, self.scale, self.stats_sink, self.low_precision = dni, scale, stats_sink, low_precision

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        d = self.dni
        return _FitLocal.apply(n, d.gates[index], d.codes[index], d.decoder(index), self.stats_sink[index],
                               self.scale, self.low_precision)


def code_objective(predictor, e: torch.Tensor, x_terminal: torch.Tensor, code_grad: torch.Tensor) -> torch.Tensor:
    """<[p ; m](e), code_grad>: its gradient is the fit's share that reaches P, the mean gate and its bias
    through the code, once the backward has summed code_grad over the branches. Compiled with its backward:
    a dozen passes over (B, T, d) and (B, T, r) tensors that would otherwise run as separate eager kernels."""
    dtype = predictor.decoders.dtype
    a, a_rev = predictor.mean_weights(x_terminal.to(dtype))
    return (predictor.code(e, a, a_rev) * code_grad.to(dtype)).sum()


class Teacher:
    """Owns a fitted source's optimizer and the per-branch fit metrics of the current teacher update.

    A teacher micro-batch is exact backprop under a credit context (`fit_credit`) whose backward computes the
    fit's gradient branch by branch; subclasses say which context, and what is left after the backward."""

    def __init__(self, module: torch.nn.Module, cfg: CreditConfig):
        self.module = module
        self.optimizer = torch.optim.Adam(module.parameters(), lr=cfg.predictor_lr, betas=(0.9, 0.99))
        self.low_precision = cfg.fit_precision == "auto"
        self.stats: list[torch.Tensor] = []

    def fit_credit(self, trainer, inputs: torch.Tensor, scale: float, stats_sink: torch.Tensor) -> ExactCredit:
        raise NotImplementedError

    def after_backward(self, trainer, credit) -> None:
        """The part of the fit that needs the whole backward first (nothing, unless a subclass says so)."""

    def teach(self, trainer, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
        """One exact micro-batch (gradients accumulate into the model) that also fits the source."""
        branches = trainer.model.cfg.branches
        stats_sink = torch.zeros(branches, len(STATS), device=inputs.device, dtype=self.dtype, requires_grad=True)
        credit = self.fit_credit(trainer, inputs, scale, stats_sink)
        forward = getattr(trainer, "_forward", None) or trainer.ddp or trainer.model
        with trainer.runtime.autocast():
            loss = forward(inputs, targets, credit=credit, loss_chunk=trainer.cfg.train.loss_chunk)
        (loss * scale).backward()
        if stats_sink.grad is None:
            raise RuntimeError("the teacher's backward did not reach the branches: no fit")
        self.after_backward(trainer, credit)
        self.stats.append(stats_sink.grad.detach())
        return loss.detach()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def step(self) -> dict:
        """Apply the accumulated fit gradient; return per-branch normalized error and cosine."""
        if dist.is_available() and dist.is_initialized():  # every rank fits the same predictor
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.summarize()

    def summarize(self) -> dict:
        if not self.stats:
            return {"fit_error": math.nan, "fit_cosine": math.nan, "fit_branches": {}}
        s = torch.stack(self.stats).double().cpu()  # (micro-batches, branches, len(STATS))
        self.stats = []
        signal = s[..., 3] > 0  # micro-batches whose true correction was not exactly zero
        count = signal.sum(0)
        error = torch.where(count > 0, (s[..., 0] * signal).sum(0) / count.clamp_min(1), float("nan"))
        cosine = torch.where(count > 0, s[..., 1].sum(0) / (s[..., 2].sum(0) * s[..., 3].sum(0)).sqrt().clamp_min(
            1e-300), float("nan"))
        branches = {str(b): {"error": float(error[b]), "cosine": float(cosine[b])} for b in range(s.shape[1])}
        # NaN when no branch had a non-zero true correction (zero-initialized projections): nothing to fit yet.
        return {"fit_error": float(error.nanmean()), "fit_cosine": float(cosine.nanmean()), "fit_branches": branches}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class LearnedTeacher(Teacher):
    """The learned predictor's teacher: the branches' fits meet the code of the terminal error, sent to each
    branch's slot by the predictor's tap; the code's share of the gradient goes to P and the mean gate once,
    after the backward."""

    def __init__(self, predictor, cfg: CreditConfig):
        super().__init__(predictor, cfg)
        self.predictor = predictor
        self.code_objective = None  # compiled on the first teacher micro-batch when the trainer compiles

    def fit_credit(self, trainer, inputs, scale, stats_sink) -> FitCredit:
        p, (B, T) = self.predictor, inputs.shape
        sinks = dict(device=inputs.device, dtype=self.dtype, requires_grad=True)
        code_sink = torch.zeros(B, T, 2 * p.rank, **sinks)
        # In the residual stream's dtype: e arrives in it, and a wider copy would only move more bytes.
        probe_dtype = trainer.runtime.autocast_dtype or self.dtype
        error_probe = torch.zeros(B, T, p.decoders.shape[1], **sinks | {"dtype": probe_dtype})
        return FitCredit(p, scale, code_sink, stats_sink, error_probe, self.low_precision)

    def after_backward(self, trainer, credit: FitCredit) -> None:
        if credit.code_sink.grad is None or credit.error_probe.grad is None:
            raise RuntimeError("the teacher's backward did not reach the tap: no fit of the code")
        if self.code_objective is None:
            self.code_objective = rt.maybe_compile(code_objective, trainer.runtime)
        with torch.enable_grad():  # the code's share of the fit gradient, into P and the mean gate
            self.code_objective(self.predictor, credit.error_probe.grad, credit.x_terminal,
                                credit.code_sink.grad).backward()


class DNITeacher(Teacher):
    """The DNI source's teacher: each branch's regression, from its own input, done where its correction
    arrives; it also keeps the source's per-branch scale s_b (the running RMS of the true corrections)."""

    def __init__(self, dni, cfg: CreditConfig):
        super().__init__(dni, cfg)
        self.correction_sizes: list[int] = []  # elements of one branch's correction, per micro-batch

    def fit_credit(self, trainer, inputs, scale, stats_sink) -> LocalFitCredit:
        return LocalFitCredit(self.module, scale, stats_sink, self.low_precision)

    def teach(self, trainer, inputs, targets, scale: float) -> torch.Tensor:
        loss = super().teach(trainer, inputs, targets, scale)
        self.correction_sizes.append(inputs.numel() * trainer.model.cfg.width)
        return loss

    def step(self) -> dict:
        true_sq = torch.stack([s[:, STATS.index("true_sq")] for s in self.stats]).double()  # (micro, branches)
        sizes = torch.tensor(self.correction_sizes, dtype=torch.float64, device=true_sq.device)[:, None]
        rms = (true_sq / sizes).mean(0).sqrt()
        if dist.is_available() and dist.is_initialized():  # the same scales on every rank
            dist.all_reduce(rms, op=dist.ReduceOp.AVG)
        self.correction_sizes = []
        summary = super().step()  # applies the gradients computed with the scales they were computed under
        self.module.track_scales(rms.to(self.module.scales.dtype))
        return summary
