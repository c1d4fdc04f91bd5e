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
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from creditlab import runtime as rt
from creditlab.config import CreditConfig
from creditlab.model import ExactCredit

STATS = ("weighted_sq_error", "pred_dot_true", "pred_sq", "true_sq")


class _FitBranch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, n, gate_weight, decoder, code_sink, stats_sink, scale: float, low_precision: bool):
        gate = torch.sigmoid(n @ gate_weight.to(n.dtype).t())  # (B, T, 2r), a forward state
        ctx.save_for_backward(n, gate, decoder)
        ctx.scale, ctx.low_precision = scale, low_precision
        return n.view_as(n), n.new_zeros(gate.shape)

    @staticmethod
    def backward(ctx, true, code):
        n, gate, decoder = ctx.saved_tensors
        acc = torch.promote_types(true.dtype, torch.float32)
        # The products over (B, T, d) run in the gradient's own dtype when asked (bf16 under autocast: half the
        # bytes of float32 and tensor-core rate); sums and everything of rank size stay in float32 or better.
        mm = true.dtype if ctx.low_precision and true.dtype in (torch.bfloat16, torch.float16) else acc
        D = decoder.to(acc)
        gated = gate.to(acc) * code.to(acc)  # (B, T, 2r)
        # Everything the fit needs of the prediction D (g * code) - c is done in rank space: with
        # M = D^T D, |pred|^2 = sum gated M gated and <pred, c> = sum gated (c D). The (B, T, d) prediction and
        # residual are never formed; the true correction is read by two thin products and one sum.
        c = true.to(mm)
        c_decoded = (c @ D.to(mm)).to(acc)  # c D (B, T, 2r)
        c_gated = (c.flatten(0, 1).t() @ gated.to(mm).flatten(0, 1)).to(acc)  # c^T gated (d, 2r)
        true_sq = true.to(acc).square().sum()
        gated_m = gated @ (D.t() @ D)  # gated M (B, T, 2r)
        pred_sq, pred_dot_true = (gated_m * gated).sum(), (c_decoded * gated).sum()
        # A branch whose true correction is exactly zero (zero-initialized projections) teaches nothing.
        weight = torch.where(true_sq > 0, 1.0 / true_sq.clamp_min(1e-300), torch.zeros_like(true_sq))
        # d(scale * weight * |pred - c|^2)/d(pred) = 2 scale weight (pred - c), pulled back to D and to gated:
        factor = (2.0 * ctx.scale) * weight
        gram = gated.flatten(0, 1).t() @ gated.flatten(0, 1)  # gated^T gated (2r, 2r)
        d_decoder = factor * (D @ gram - c_gated)  # (pred - c)^T gated
        d_gated = factor * (gated_m - c_decoded)  # (pred - c) D
        d_gate_pre = d_gated * code.to(acc) * gate.to(acc) * (1.0 - gate.to(acc))
        d_gate_weight = d_gate_pre.to(mm).flatten(0, 1).t() @ n.to(mm).flatten(0, 1)  # (2r, d)
        sq_error = pred_sq - 2.0 * pred_dot_true + true_sq
        stats = torch.stack([sq_error * weight, pred_dot_true, pred_sq, true_sq])
        return (true, d_gate_weight.to(decoder.dtype), d_decoder.to(decoder.dtype), d_gated * gate.to(acc), stats,
                None, None)


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


def code_objective(predictor, e: torch.Tensor, x_terminal: torch.Tensor, code_grad: torch.Tensor) -> torch.Tensor:
    """<[p ; m](e), code_grad>: its gradient is the fit's share that reaches P, the mean gate and its bias
    through the code, once the backward has summed code_grad over the branches. Compiled with its backward:
    a dozen passes over (B, T, d) and (B, T, r) tensors that would otherwise run as separate eager kernels."""
    dtype = predictor.decoders.dtype
    a, a_rev = predictor.mean_weights(x_terminal.to(dtype))
    return (predictor.code(e, a, a_rev) * code_grad.to(dtype)).sum()


class Teacher:
    """Owns the predictor's optimizer and the per-branch fit metrics of the current teacher update."""

    def __init__(self, predictor, cfg: CreditConfig):
        self.predictor = predictor
        self.optimizer = torch.optim.Adam(predictor.parameters(), lr=cfg.predictor_lr, betas=(0.9, 0.99))
        self.low_precision = cfg.fit_precision == "auto"
        self.stats: list[torch.Tensor] = []
        self.code_objective = None  # compiled on the first teacher micro-batch when the trainer compiles

    def teach(self, trainer, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
        """One exact micro-batch (gradients accumulate into the model) that also fits the predictor."""
        p = self.predictor
        B, T = inputs.shape
        dtype = p.decoders.dtype
        sinks = dict(device=inputs.device, dtype=dtype, requires_grad=True)
        code_sink = torch.zeros(B, T, 2 * p.rank, **sinks)
        stats_sink = torch.zeros(p.decoders.shape[0], len(STATS), **sinks)
        # In the residual stream's dtype: e arrives in it, and a wider copy would only move more bytes.
        probe_dtype = trainer.runtime.autocast_dtype or dtype
        error_probe = torch.zeros(B, T, p.decoders.shape[1], **sinks | {"dtype": probe_dtype})
        credit = FitCredit(p, scale, code_sink, stats_sink, error_probe, self.low_precision)
        forward = getattr(trainer, "_forward", None) or trainer.ddp or trainer.model
        with trainer.runtime.autocast():
            loss = forward(inputs, targets, credit=credit, loss_chunk=trainer.cfg.train.loss_chunk)
        (loss * scale).backward()
        if code_sink.grad is None or error_probe.grad is None:
            raise RuntimeError("the teacher's backward did not reach the tap and the branches: no fit")
        if self.code_objective is None:
            self.code_objective = rt.maybe_compile(code_objective, trainer.runtime)
        with torch.enable_grad():  # the code's share of the fit gradient, into P and the mean gate
            self.code_objective(p, error_probe.grad, credit.x_terminal, code_sink.grad).backward()
        self.stats.append(stats_sink.grad.detach())
        return loss.detach()

    def step(self) -> dict:
        """Apply the accumulated fit gradient; return per-branch normalized error and cosine."""
        if dist.is_available() and dist.is_initialized():  # every rank fits the same predictor
            for p in self.predictor.parameters():
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
