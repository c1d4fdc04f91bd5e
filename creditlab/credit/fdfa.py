"""FDFA, forward direct feedback alignment (Bacho & Chu 2022): c_b = e M_b as `dfa` injects it, with each
branch's feedback operator M_b (d, d) estimated from forward-mode directional derivatives, never from a true
gradient.

What M_b estimates. Branch b's true correction is c_b = J_b^T e, J_b = dx_L/dn_b through the omitted product
(every token's n_b to every token's x_L). Its token-local part, in the row convention of the injection, is
c_{b,t} = e_t J_{b,tt} with J_{b,tt}[i, j] = dx_{L,t,i}/dn_{b,t,j}; M_b tracks the token average of J_{b,tt}.

The estimator. On a teacher update one forward-mode pass of x_L = model.hidden(idx) carries random tangents u_b
(B, T, d), one per branch, entering at the omitted products' inputs only (`TangentCredit`): its output tangent is
dX = sum_b J_b u_b, and J_hat_b = dX^T U_b / N over the N = B*T tokens. With the tangents independent, zero-mean
and of unit variance, every term pairing u_b with a different branch, token or channel has zero mean, so J_hat_b
is an unbiased estimate of the token-averaged J_{b,tt}; each teacher update's estimate (summed over its
micro-batches) is folded into M_b with momentum MOMENTUM (0.9: the weight of the past).

Choices:

* One pass for all branches, not one per branch. A branch's estimate is noisy through every term of dX but its
  own diagonal: its own other channels and tokens (in a per-branch pass as well) and, in a joint pass, the other
  branches. With every branch contributing alike to dX the joint pass has about `branches` times the variance of
  a per-branch pass at 1/branches of its cost, so per unit of compute the two are alike, and the joint pass keeps
  the estimator's cost at one forward-mode pass per teacher micro-batch.
* Tangent scales to make the branches contribute alike. The Jacobians differ a lot between branches (an MLP
  branch's can dwarf an attention branch's), and with unit tangents the largest ones drown the estimates of the
  smallest in their noise. So u_b = s_b r_b with r_b Rademacher and s_b inversely proportional to |M_b| (the
  current estimate's size; 1 before a branch has one), and J_hat_b = dX^T R_b / (N s_b): still unbiased, as s_b
  is fixed before the draw. The scales are powers of two, exact in every float format the pass may run in.
* Rademacher tangents (+-1): the diagonal term u_j^2 J_ij is then exact, where a Gaussian tangent would add noise
  of its own; and +-1 is exact in every float format the pass may run in.
* The tangents are regenerated from per-branch seeds for the products dX^T U_b, not kept from the pass: held
  together, one (B, T, d) tangent per branch would be the largest thing the estimator needs.
* The pass runs without gradients (dual tensors propagate under no_grad, so nothing is taped), with attention on
  the math kernel (the fused kernels have no forward-mode derivative) and the model's fused modules op by op
  (likewise; `GPT.op_by_op`).
* M_b starts at zero: nothing is injected before a branch's first estimate, and that first estimate is taken
  whole. An estimate that is exactly zero (a branch whose path to x_L is still zero-initialized) is no estimate:
  the branch keeps its operator and waits for one.

The teacher update itself is exact backprop, as for every fitted source. Its backward streams the true
corrections' moments (`FeedbackFitCredit`) only to report how well the operators predict them (the fit report's
error and cosine, measured before the update's estimate is folded in); nothing of them reaches M_b.
"""

from __future__ import annotations

import contextlib

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from creditlab.config import Config, CreditConfig
from creditlab.credit.feedback import FEEDBACK_SEED, FeedbackCredit, MeasuredFeedback
from creditlab.credit.sources import FittedSource
from creditlab.credit.teacher import FitReport, _fit_dtypes, wide_product
from creditlab.model import ExactCredit, GPT


MOMENTUM = 0.9  # the weight of the past in the running estimate of each feedback operator


def rademacher(shape, seed: int, device, dtype=torch.float32) -> torch.Tensor:
    """+-1 with equal odds, the same for the same (shape, seed, device)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 2, shape, generator=g, device=device, dtype=dtype).mul_(2).sub_(1)


class TangentCredit(ExactCredit):
    """Exact forward whose omitted products read n + delta_b, delta_b a zero carrying the tangent u_b: the
    perturbation travels only along the omitted path (the gate and the rest of the branch read n itself).
    `tangent(b, n)` returns u_b, or None for a branch left unperturbed."""

    def __init__(self, tangent):
        self.tangent = tangent

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        u = self.tangent(index, n)
        return n if u is None else n + fwAD.make_dual(torch.zeros_like(n), u.to(n.dtype))


def directional_derivative(model: GPT, idx: torch.Tensor, tangent, autocast=None) -> torch.Tensor:
    """dX = sum_b J_b u_b (B, T, d): the forward-mode derivative of x_L along tangents at the omitted products'
    inputs (see TangentCredit), in the dtype the pass ran in."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        # the fused Functions define no forward-mode derivative; their op-by-op forms compute the same functions
        stack.enter_context(model.op_by_op())
        stack.enter_context(autocast if autocast is not None else contextlib.nullcontext())
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))  # innermost: overrides an sdpa choice of the runtime
        stack.enter_context(fwAD.dual_level())
        x = model.hidden(idx, TangentCredit(tangent))
        dX = fwAD.unpack_dual(x).tangent
        return torch.zeros_like(x) if dX is None else dX.clone()


def jacobian_sums(model: GPT, idx: torch.Tensor, seeds: list[int], scales: list[float] | None = None,
                  autocast=None, low_precision: bool = False) -> torch.Tensor:
    """sum over tokens of dX^T U_b / s_b for every branch (branches, d, d), from one pass with tangents
    u_b = s_b r_b, r_b Rademacher drawn from seeds[b] and s_b = scales[b] (1 if None); divided by the token count
    it is J_hat_b. Float32 or wider."""
    scales = scales or [1.0] * len(seeds)
    dX = directional_derivative(model, idx, lambda b, n: scales[b] * rademacher(n.shape, seeds[b], n.device),
                                autocast)
    acc, mm = _fit_dtypes(dX, low_precision)
    draws = (rademacher(dX.shape, s, dX.device).flatten(0, 1) for s in seeds)  # as the pass drew them
    return torch.stack([wide_product(dX.flatten(0, 1).t(), r, acc, mm) / s for r, s in zip(draws, scales)])


class FDFASource(FittedSource):
    """c_b = e M_b, M_b a running forward-mode estimate of branch b's token-averaged diagonal Jacobian."""

    name, omits = "fdfa", True
    about = ("feedback operators estimated from forward-mode directional derivatives (no true gradients), on the "
             "schedule's exact updates")

    def __init__(self, width: int, branches: int, credit: CreditConfig):
        super().__init__(credit)
        self.register_buffer("operators", torch.zeros(branches, width, width))  # M_b: c_t = e_t M_b
        self.register_buffer("estimates", torch.zeros(branches, dtype=torch.long))  # folded in, per branch

    @classmethod
    def from_config(cls, cfg: Config) -> "FDFASource":
        return cls(cfg.model.width, cfg.model.branches, cfg.credit)

    def step(self) -> FeedbackCredit:
        return FeedbackCredit(lambda b: self.operators[b])

    def tangent_scales(self) -> list[float]:
        """s_b, powers of two with s_b |M_b| within sqrt(2) of the operators' geometric mean size (so the scales
        stay near 1); 1 for a branch with no estimate yet."""
        size = self.operators.flatten(1).norm(dim=1).double().cpu()
        seen = (self.estimates.cpu() > 0) & (size > 0)
        if not seen.any():
            return [1.0] * len(size)
        log2 = size.log2()
        exponent = torch.where(seen, (log2[seen].mean() - log2).round(), torch.zeros_like(log2))
        return exponent.exp2().tolist()

    def make_teacher(self) -> "FDFATeacher":
        return FDFATeacher(self, self.credit_cfg)

    @torch.no_grad()
    def fold(self, estimate: torch.Tensor) -> None:
        """M_b <- m M_b + (1 - m) J_hat_b for the branches with an estimate; a first one is taken whole."""
        seen = estimate.flatten(1).abs().amax(1) > 0
        m = torch.where(self.estimates > 0, MOMENTUM, 0.0).to(self.operators)[:, None, None]
        blended = m * self.operators + (1 - m) * estimate.to(self.operators)
        self.operators.copy_(torch.where(seen[:, None, None], blended, self.operators))
        self.estimates += seen.to(self.estimates.device)


class FDFATeacher(MeasuredFeedback):
    """The FDFA estimate on teacher updates, and as a diagnostic the fit report of the operators as they stood
    (MeasuredFeedback: the true corrections' moments, never used to move them). Nothing here is a parameter, so
    there is no optimizer."""

    def __init__(self, source: FDFASource, cfg: CreditConfig):
        super().__init__(lambda: source.operators, cfg)
        self.source = source
        self.sums: torch.Tensor | None = None  # this update's sum of dX^T U_b / s_b over its micro-batches
        self.tokens = 0
        self.scales: list[float] | None = None  # this update's tangent scales, fixed at its first micro-batch
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.seeds = torch.Generator().manual_seed(FEEDBACK_SEED + rank)  # each rank draws its own tangents

    def context(self, trainer, inputs: torch.Tensor, scale: float):
        self.estimate(trainer.model, inputs, trainer.runtime.autocast())
        return super().context(trainer, inputs, scale)

    def estimate(self, model: GPT, inputs: torch.Tensor, autocast=None) -> None:
        """One micro-batch's forward-mode pass, added to this update's sums."""
        branches = self.source.operators.shape[0]
        seeds = torch.randint(2 ** 62, (branches,), generator=self.seeds).tolist()
        if self.scales is None:
            self.scales = self.source.tangent_scales()
        sums = jacobian_sums(model, inputs, seeds, self.scales, autocast, self.low_precision)
        self.sums = sums if self.sums is None else self.sums + sums
        self.tokens += inputs.numel()

    def step(self) -> FitReport:
        """Report the fit of the operators as they stood on this update, then fold in its estimate."""
        summary = self.report()
        if self.sums is not None:
            sums = self.sums.double()
            tokens = torch.tensor(float(self.tokens), dtype=torch.float64, device=sums.device)
            if dist.is_available() and dist.is_initialized():  # every rank folds the same estimate
                dist.all_reduce(sums)
                dist.all_reduce(tokens)
            self.source.fold(sums / tokens)
        self.sums, self.tokens, self.scales = None, 0, None
        return summary

    def state_dict(self) -> dict:
        return {"seeds": self.seeds.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.seeds.set_state(state["seeds"].cpu())


__all__ = ["FDFASource", "FDFATeacher", "TangentCredit", "directional_derivative", "jacobian_sums"]
