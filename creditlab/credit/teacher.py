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

The DNI rival is fitted the same way (credit/dni.py), its code computed from the branch input alone. Both fits
share `rank_space_fit`: the regression's gradient and statistics without forming a (B, T, d) prediction.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from creditlab import runtime as rt
from creditlab import ops
from creditlab.config import CreditConfig
from creditlab.ops import fit_rows
from creditlab.model import ExactCredit

STATS = ("weighted_sq_error", "pred_dot_true", "pred_sq", "true_sq")


def inverse_signal(true_sq: torch.Tensor) -> torch.Tensor:
    """1 / |c|^2, and 0 where the true correction is exactly zero (zero-initialized projections): such a branch
    teaches nothing and scores nothing."""
    return torch.where(true_sq > 0, 1.0 / true_sq.clamp_min(1e-300), torch.zeros_like(true_sq))


def fit_stats(pred_sq: torch.Tensor, pred_dot_true: torch.Tensor, true_sq: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The columns of STATS, stacked along `dim`: the normalized squared error |pred - c|^2 / |c|^2 from the
    three inner products, and the products themselves."""
    error = (pred_sq - 2.0 * pred_dot_true + true_sq) * inverse_signal(true_sq)
    return torch.stack([error, pred_dot_true, pred_sq, true_sq], dim=dim)


def _fit_dtypes(true: torch.Tensor, low_precision: bool) -> tuple[torch.dtype, torch.dtype]:
    """(accumulation dtype, dtype of the products over (B, T, d)). The products run in the gradient's own dtype
    when asked (bf16 under autocast: half the bytes of float32 and tensor-core rate); sums and everything of
    rank size stay in float32 or better."""
    acc = torch.promote_types(true.dtype, torch.float32)
    mm = true.dtype if low_precision and true.dtype in (torch.bfloat16, torch.float16) else acc
    return acc, mm


def wide_product(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, mm: torch.dtype) -> torch.Tensor:
    """a @ b with inputs in `mm` and the result in `acc`. On CUDA a bf16/fp16 product writes its float32
    accumulator straight out (torch.mm's out_dtype): no rounding of a sum over many tokens to 8 bits."""
    a, b = a.to(mm), b.to(mm)
    if a.is_cuda and mm in (torch.bfloat16, torch.float16) and acc == torch.float32:
        return torch.mm(a, b, out_dtype=acc)
    return (a @ b).to(acc)


class RankSpaceFit(NamedTuple):
    """One branch's regression of the prediction D gated onto its true correction c (`rank_space_fit`). The
    token-wise gradients are given before the loss's scalar factor, 2 scale / |c|^2 (known only once every token
    is summed): the loss's gradient for the code is factor * code_grad, for the gate's pre-activation
    factor * gate_grad."""
    d_decoder: torch.Tensor  # (d, 2r), factor included
    code_grad: torch.Tensor  # (pred - c) D * gate, (..., 2r)
    gate_grad: torch.Tensor  # (pred - c) D * code * gate (1 - gate), (..., 2r)
    factor: torch.Tensor  # 2 scale / |c|^2, 0 where c is exactly zero
    stats: torch.Tensor  # the columns of STATS
    gram: torch.Tensor  # gated^T gated (2r, 2r)
    cross: torch.Tensor  # c^T gated (d, 2r)


def rank_space_fit(true: torch.Tensor, gate: torch.Tensor, code: torch.Tensor, decoder: torch.Tensor, scale: float,
                   acc: torch.dtype, mm: torch.dtype, fused: bool = True) -> RankSpaceFit:
    """The regression of the prediction D gated (B, T, d), gated = gate * code, onto the true correction c, loss
    scale * |D gated - c|^2 / |c|^2: its gradients for D, the code and the gate, the branch's fit statistics, and
    the least-squares moments: the features' Gram matrix gated^T gated (2r, 2r) and their cross moment c^T gated
    (d, 2r), whose solve D = (c^T gated)(gated^T gated)^-1 is the closed-form fit (credit.fit=lstsq).

    Everything is done in rank space: with M = D^T D, |pred|^2 = sum gated M gated and
    <pred, c> = sum gated (c D). The (B, T, d) prediction and residual are never formed. `fused` on CUDA: one
    kernel reads c once for c D and |c|^2 and does the token-wise rest on chip (ops/fit_rows.py); c^T gated is
    a product of its own. Otherwise the same arithmetic op by op, which reads c three times."""
    D = decoder.to(acc)
    gram_weights = D.t() @ D  # M (2r, 2r)
    if fused and _fit_kernel_takes(true, code, acc, mm):
        lead, r2 = true.shape[:-1], code.shape[-1]
        c = true.to(mm).flatten(0, -2)
        gated, code_grad, gate_grad, partial = fit_rows.fit_rows_op(
            c, gate.flatten(0, -2), code.flatten(0, -2), D.to(mm), gram_weights)
        sums = partial.sum(0)
        true_sq, pred_sq, pred_dot_true = sums[0], sums[1], sums[2]
        gram = sums[fit_rows.SUMS:].view(r2, r2)
        code_grad, gate_grad = code_grad.view(*lead, r2), gate_grad.view(*lead, r2)
    else:
        c = true.to(mm)
        gate, code = gate.to(acc), code.to(acc)
        gated = gate * code
        c_decoded = (c @ D.to(mm)).to(acc)  # c D (B, T, 2r)
        true_sq = true.to(acc).square().sum()
        gated_m = gated @ gram_weights  # gated M (B, T, 2r)
        pred_sq, pred_dot_true = (gated_m * gated).sum(), (c_decoded * gated).sum()
        gram = gated.flatten(0, -2).t() @ gated.flatten(0, -2)  # gated^T gated (2r, 2r)
        residual = gated_m - c_decoded  # (pred - c) D: d|pred - c|^2/d(gated), halved
        code_grad, gate_grad = residual * gate, residual * code * gate * (1.0 - gate)
        c, gated = c.flatten(0, -2), gated.flatten(0, -2)
    cross = wide_product(c.t(), gated, acc, mm)  # c^T gated (d, 2r)
    # d(scale * |pred - c|^2 / |c|^2)/d(pred) = 2 scale (pred - c) / |c|^2, pulled back to D (and, by the caller
    # through the factor, to the code and the gate):
    factor = (2.0 * scale) * inverse_signal(true_sq)
    d_decoder = factor * (D @ gram - cross)  # (pred - c)^T gated
    return RankSpaceFit(d_decoder, code_grad, gate_grad, factor, fit_stats(pred_sq, pred_dot_true, true_sq), gram,
                        cross)


def _fit_kernel_takes(true: torch.Tensor, code: torch.Tensor, acc: torch.dtype, mm: torch.dtype) -> bool:
    return ops.available(true) and acc == torch.float32 and fit_rows.takes(true.shape[-1], code.shape[-1], mm)


class _FitBranch(torch.autograd.Function):
    """The learned predictor's fit at one branch: gated = g * code, with the state gate g = sigmoid(n G^T) and
    the code of the terminal error arriving at the zero-valued slot."""

    @staticmethod
    def forward(ctx, n, gate_weight, decoder, code_sink, stats_sink, gram_sink, cross_sink, scale: float,
                low_precision: bool, fused: bool):
        """gram_sink and cross_sink (or None): zero-valued slots whose gradients are the least-squares moments."""
        gate = torch.sigmoid(n @ gate_weight.to(n.dtype).t())  # (B, T, 2r), a forward state
        ctx.save_for_backward(n, gate, decoder)
        ctx.scale, ctx.low_precision, ctx.fused, ctx.moments = scale, low_precision, fused, gram_sink is not None
        return n.view_as(n), n.new_zeros(gate.shape)

    @staticmethod
    def backward(ctx, true, code):
        n, gate, decoder = ctx.saved_tensors
        acc, mm = _fit_dtypes(true, ctx.low_precision)
        fit = rank_space_fit(true, gate, code, decoder, ctx.scale, acc, mm, ctx.fused)
        d_gate_weight = fit.factor * (fit.gate_grad.to(mm).flatten(0, 1).t() @ n.to(mm).flatten(0, 1)).to(acc)
        moments = (fit.gram, fit.cross) if ctx.moments else (None, None)
        return (true, d_gate_weight.to(decoder.dtype), fit.d_decoder.to(decoder.dtype), fit.factor * fit.code_grad,
                fit.stats, *moments, None, None, None)


class FitCredit(ExactCredit):
    """Exact backprop that fits the learned predictor on the fly (see the module docstring)."""

    def __init__(self, predictor, scale: float, code_sink: torch.Tensor, stats_sink: torch.Tensor,
                 error_probe: torch.Tensor, low_precision: bool = False, moment_sinks=None, fused: bool = True):
        self.predictor, self.scale, self.low_precision, self.fused = predictor, scale, low_precision, fused
        self.code_sink, self.stats_sink, self.error_probe = code_sink, stats_sink, error_probe
        self.moment_sinks = moment_sinks
        self.total = None
        self.x_terminal = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        p = self.predictor
        code_sink = self.code_sink[..., p.code_slice(index)]  # this branch's part of the code
        n_omit, slot = _FitBranch.apply(n, p.state_gates[index], p.decoders[index], code_sink,
                                        self.stats_sink[index], *_moment_slots(self.moment_sinks, index),
                                        self.scale, self.low_precision, self.fused)
        slot = p.widen(index, slot)
        self.total = slot if self.total is None else self.total + slot
        return n_omit

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        self.x_terminal = x.detach()
        x = self.predictor.tap(x, self.total)  # sends the code [p ; m] to every slot
        return x + self.error_probe.to(x.dtype)  # the probe's gradient is e


def _moment_slots(sinks, index: int):
    """This branch's slots of the (Gram, cross-moment) sinks, or (None, None) when no closed-form fit runs."""
    return (None, None) if sinks is None else (sinks[0][index], sinks[1][index])


def code_objective(predictor, e: torch.Tensor, x_terminal: torch.Tensor, code_grad: torch.Tensor) -> torch.Tensor:
    """<[p ; m](e), code_grad>: its gradient is the fit's share that reaches P, the mean gate and its bias
    through the code, once the backward has summed code_grad over the branches. Compiled with its backward:
    a dozen passes over (B, T, d) and (B, T, r) tensors that would otherwise run as separate eager kernels."""
    dtype = predictor.decoders.dtype
    a, a_rev = predictor.mean_weights(x_terminal.to(dtype))
    return (predictor.code(e, a, a_rev) * code_grad.to(dtype)).sum()


def summarize_stats(stats: list[torch.Tensor]) -> dict:
    """One update's fit report from its micro-batches' statistics (branches, len(STATS)) each: per branch the
    normalized error (mean over micro-batches) and the cosine (of the sums)."""
    return FitReport(stats).read()


class FitReport:
    """A fit report whose statistics are still being computed on the device: they are copied to the host
    without waiting (rt.HostCopy), and `read` turns them into the report, waiting for the copy only then. So an
    update that fits need not wait for its own end."""

    def __init__(self, stats: list[torch.Tensor]):
        # (micro-batches, branches, len(STATS))
        self.stats = rt.HostCopy(torch.stack(stats).double()) if stats else None

    def read(self) -> dict:
        if self.stats is None:
            return {"fit_error": math.nan, "fit_cosine": math.nan, "fit_branches": {}}
        s = self.stats.get()
        signal = s[..., 3] > 0  # micro-batches whose true correction was not exactly zero
        count = signal.sum(0)
        error = torch.where(count > 0, (s[..., 0] * signal).sum(0) / count.clamp_min(1), float("nan"))
        cosine = torch.where(count > 0, s[..., 1].sum(0) / (s[..., 2].sum(0) * s[..., 3].sum(0)).sqrt().clamp_min(
            1e-300), float("nan"))
        branches = {str(b): {"error": float(error[b]), "cosine": float(cosine[b])} for b in range(s.shape[1])}
        # NaN when no branch had a non-zero true correction (zero-initialized projections): nothing to fit yet.
        return {"fit_error": float(error.nanmean()), "fit_cosine": float(cosine.nanmean()), "fit_branches": branches}


def read_fit(fit: "dict | FitReport | None") -> dict | None:
    """A source's fit report (`end_update`), read: a FitReport waits for its statistics here."""
    return fit.read() if isinstance(fit, FitReport) else fit


class Teaching:
    """What the trainer asks of a teacher: a micro-batch's `context`, and `collect` after its backward, which
    appends the micro-batch's fit statistics (branches, len(STATS)) to `self.stats`."""

    stats: list[torch.Tensor]

    def report(self) -> FitReport:
        """This update's fit report, of the predictor as it stood, read when asked (the trainer reads it with
        the update); the statistics start anew."""
        summary = FitReport(self.stats)
        self.stats = []
        return summary

    def summarize(self) -> dict:
        return self.report().read()

    def context(self, trainer, inputs: torch.Tensor, scale: float) -> ExactCredit:
        raise NotImplementedError

    def collect(self, trainer, credit) -> None:
        raise NotImplementedError

    def teach(self, trainer, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
        """One teacher micro-batch as a training update runs it: this context, the trainer's forward and backward
        (gradients accumulate into the model), then the collection."""
        credit = self.context(trainer, inputs, scale)
        loss = trainer.forward_backward(inputs, targets, credit, scale)
        self.collect(trainer, credit)
        return loss


class Teacher(Teaching):
    """Owns a fitted source's optimizer and the per-branch fit metrics of the current teacher update.

    A teacher micro-batch is exact backprop under a credit context (`context`, made by a subclass's `fit_credit`)
    whose backward computes the fit's gradient branch by branch; the trainer runs it as it runs every micro-batch,
    and `collect` takes what the backward left in the context's sinks."""

    def __init__(self, module: torch.nn.Module, decoders: torch.nn.Parameter, cfg: CreditConfig):
        self.module, self.decoders = module, decoders
        self.optimizer = torch.optim.Adam(module.parameters(), lr=cfg.predictor_lr, betas=(0.9, 0.99))
        # the fit's products over (B, T, d) in the gradient's dtype (bf16 under autocast, float32 sums); each
        # branch's token-wise regression in one Triton pass on CUDA where it takes the shapes (ops/fit_rows.py).
        # Off (the step check's plain reference): float32 or wider, op by op.
        self.low_precision = self.fused = True
        self.stats: list[torch.Tensor] = []
        # credit.fit=lstsq: the decoders are solved, not stepped. Per branch, the Gram matrix of the features and
        # their cross moment with the true correction, summed over this update's micro-batches, then each update's
        # sums (divided by its |c|^2, so that every teacher update weighs alike) averaged with weight `decay` on
        # the past: the least-squares problem over recent teacher updates, in (2r, 2r) and (d, 2r) per branch.
        self.closed_form, self.decay, self.ridge = cfg.fit == "lstsq", cfg.fit_decay, cfg.fit_ridge
        self.moment_sums: list[torch.Tensor] | None = None  # this update's [gram, cross]
        self.moments: list[torch.Tensor] | None = None  # the running average [gram, cross]

    def fit_credit(self, trainer, inputs: torch.Tensor, scale: float, stats_sink: torch.Tensor,
                   moment_sinks) -> ExactCredit:
        raise NotImplementedError

    def _moment_sinks(self, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.closed_form:
            return None
        branches, d, r2 = self.decoders.shape
        sink = dict(device=device, dtype=torch.float32 if self.dtype != torch.float64 else torch.float64,
                    requires_grad=True)
        return torch.zeros(branches, r2, r2, **sink), torch.zeros(branches, d, r2, **sink)

    def after_backward(self, trainer, credit) -> None:
        """The part of the fit that needs the whole backward first (nothing, unless a subclass says so)."""

    def context(self, trainer, inputs: torch.Tensor, scale: float) -> ExactCredit:
        """The context of one teacher micro-batch: exact backprop whose backward fits the source into sinks."""
        branches = trainer.model.cfg.branches
        stats_sink = torch.zeros(branches, len(STATS), device=inputs.device, dtype=self.dtype, requires_grad=True)
        return self.fit_credit(trainer, inputs, scale, stats_sink, self._moment_sinks(inputs.device))

    def collect(self, trainer, credit) -> None:
        """After the micro-batch's backward: what its sinks received."""
        if credit.stats_sink.grad is None:
            raise RuntimeError("the teacher's backward did not reach the branches: no fit")
        self.after_backward(trainer, credit)
        self.stats.append(credit.stats_sink.grad.detach())
        if credit.moment_sinks is not None:
            self.add_moments([sink.grad if sink.grad is not None else torch.zeros_like(sink)
                              for sink in credit.moment_sinks])

    def add_moments(self, moments: list[torch.Tensor]) -> None:
        """Add one micro-batch's [Gram, cross moment] to this update's sums."""
        self.moment_sums = moments if self.moment_sums is None else [a + m for a, m in zip(self.moment_sums, moments)]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def step(self) -> FitReport:
        """Apply the accumulated fit (gradient step, and with lstsq the decoders' solve); return per-branch
        normalized error and cosine, measured on this update's corrections before the fit moved (as a FitReport,
        read when the update is)."""
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:  # every rank fits the same predictor
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            for m in self.moment_sums or []:
                dist.all_reduce(m, op=dist.ReduceOp.SUM)
        if self.closed_form:
            self.decoders.grad = None  # solved below, not stepped
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        true_sq = torch.stack([s[:, STATS.index("true_sq")] for s in self.stats]).sum(0) if self.stats else None
        if distributed and true_sq is not None:
            dist.all_reduce(true_sq, op=dist.ReduceOp.SUM)
        summary = self.report()
        if self.closed_form and self.moment_sums is not None and true_sq is not None:
            self.set_decoders(self.solve(true_sq))
        self.moment_sums = None
        return summary

    @torch.no_grad()
    def solve(self, true_sq: torch.Tensor) -> torch.Tensor:
        """Fold this update's moments into the running average and solve the ridge system of every branch:
        D_b = X_b (G_b + ridge * mean(diag G_b) I)^-1 (d, 2r). A branch never seen with a signal keeps its decoder."""
        gram, cross = (m.double() for m in self.moment_sums)
        true_sq = true_sq.to(gram)
        seen, weight = true_sq > 0, inverse_signal(true_sq)
        gram, cross = gram * weight[:, None, None], cross * weight[:, None, None]
        if self.moments is None:
            self.moments = [gram, cross]
        else:
            keep = seen[:, None, None]
            self.moments = [torch.where(keep, self.decay * old + (1 - self.decay) * new, old)
                            for old, new in zip(self.moments, (gram, cross))]
        gram, cross = self.moments
        scale = torch.diagonal(gram, dim1=1, dim2=2).mean(-1)  # (branches,)
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        system = gram + (self.ridge * scale + (scale == 0))[:, None, None] * eye  # no signal: identity, not solved
        if self.ridge > 0:
            solved = torch.linalg.solve(system, cross.transpose(1, 2)).transpose(1, 2)
        else:
            solved = torch.linalg.lstsq(system, cross.transpose(1, 2)).solution.transpose(1, 2)
        current = self.effective_decoders().double()
        return torch.where((scale > 0)[:, None, None], solved, current)

    def effective_decoders(self) -> torch.Tensor:
        """The decoders as the prediction uses them (branches, d, 2r)."""
        return self.decoders.detach()

    @torch.no_grad()
    def set_decoders(self, solved: torch.Tensor) -> None:
        self.decoders.copy_(solved.to(self.decoders.dtype))

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "moments": self.moments}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        moments = state.get("moments")  # checkpoints are read to the CPU; the moments live with the decoders
        self.moments = None if moments is None else [m.to(self.decoders.device) for m in moments]


class LearnedTeacher(Teacher):
    """The learned predictor's teacher: the branches' fits meet the code of the terminal error, sent to each
    branch's slot by the predictor's tap; the code's share of the gradient goes to P and the mean gate once,
    after the backward."""

    def __init__(self, predictor, cfg: CreditConfig):
        super().__init__(predictor, predictor.decoders, cfg)
        self.predictor = predictor
        self.code_objective = None  # compiled on the first teacher micro-batch when the trainer compiles

    def fit_credit(self, trainer, inputs, scale, stats_sink, moment_sinks) -> FitCredit:
        p, (B, T) = self.predictor, inputs.shape
        sinks = dict(device=inputs.device, dtype=self.dtype, requires_grad=True)
        code_sink = torch.zeros(B, T, p.code_width, **sinks)
        # In the residual stream's dtype: e arrives in it, and a wider copy would only move more bytes.
        probe_dtype = trainer.runtime.autocast_dtype or self.dtype
        error_probe = torch.zeros(B, T, p.decoders.shape[1], **sinks | {"dtype": probe_dtype})
        return FitCredit(p, scale, code_sink, stats_sink, error_probe, self.low_precision, moment_sinks, self.fused)

    def after_backward(self, trainer, credit: FitCredit) -> None:
        if credit.code_sink.grad is None or credit.error_probe.grad is None:
            raise RuntimeError("the teacher's backward did not reach the tap: no fit of the code")
        if self.code_objective is None:
            self.code_objective = rt.maybe_compile(code_objective, trainer.runtime)
        with torch.enable_grad():  # the code's share of the fit gradient, into P and the mean gate
            self.code_objective(self.predictor, credit.error_probe.grad, credit.x_terminal,
                                credit.code_sink.grad).backward()
