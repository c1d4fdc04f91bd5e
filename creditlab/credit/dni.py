"""The DNI rival (decoupled neural interfaces, rank-limited): each branch's correction predicted from its own
state alone, c_b = s_b D_b (sigma(G_b n_b) * U_b n_b), fitted on teacher updates as the learned predictor is."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from creditlab.config import Config, CreditConfig
from creditlab.credit.sources import FittedSource, InjectCredit
from creditlab.credit.teacher import STATS, FitReport, Teacher, _fit_dtypes, _moment_slots, rank_space_fit
from creditlab.model import ExactCredit


def gate_and_code(n: torch.Tensor, gate_weight: torch.Tensor, code_weight: torch.Tensor):
    """DNI's state gate sigmoid(n G^T) and code n U^T (each (B, T, 2r)), from one product: one read of n."""
    gate_pre, coded = (n @ torch.cat([gate_weight, code_weight]).to(n.dtype).t()).chunk(2, dim=-1)
    return torch.sigmoid(gate_pre), coded


class DNISource(FittedSource):
    """Decoupled neural interfaces, rank-limited: c_b = s_b D_b (sigma(G_b n_b) * U_b n_b), from the branch's own
    state only (no terminal error). Decoders start at zero and are fitted on teacher updates, as the learned
    predictor is, to the true corrections.

    s_b is the running RMS of branch b's true corrections, measured on teacher updates (zero until the first).
    The learned predictor's corrections scale with the terminal error by construction; a prediction from the
    state alone has no such scale, and without s_b its decoders would have to hold the corrections' magnitude
    (~1e-4 here): steps of the fit's Adam, about its learning rate in size, overshoot that at once."""

    name, omits = "dni", True
    about = "predicted from each branch's own state, fitted on teacher updates"

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        problems = super().config_problems(cfg)
        if 2 * cfg.credit.rank > cfg.model.width:
            problems.append(f"credit.rank={cfg.credit.rank}: dni codes each branch input in 2 * rank directions, at "
                            f"most model.width={cfg.model.width}; lower credit.rank")
        return problems

    def __init__(self, width: int, branches: int, credit: CreditConfig):
        super().__init__(credit)
        rank = credit.rank
        self.gates = nn.Parameter(torch.randn(branches, 2 * rank, width) * width ** -0.5)
        self.codes = nn.Parameter(torch.randn(branches, 2 * rank, width) * width ** -0.5)
        self.decoders = nn.Parameter(torch.zeros(branches, width, 2 * rank))
        self.register_buffer("scales", torch.zeros(branches))

    def decoder(self, b: int) -> torch.Tensor:
        """The effective decoder s_b D_b: the fit's gradient reaches D_b through it."""
        return self.scales[b] * self.decoders[b]

    def code(self, b: int, n: torch.Tensor) -> torch.Tensor:  # (B, T, 2r)
        gate, coded = gate_and_code(n, self.gates[b], self.codes[b])
        return gate * coded

    def predict(self, b: int, n: torch.Tensor) -> torch.Tensor:
        return self.code(b, n) @ self.decoder(b).to(n.dtype).t()

    def _term(self, b: int, n: torch.Tensor) -> torch.Tensor:
        # <n_b D_b, code_b> has gradient code_b D_b^T = c_b for n_b; decoded only when backward reaches b.
        code = self.code(b, n.detach()).detach()
        return ((n @ self.decoder(b).detach().to(n.dtype)) * code).sum()

    @torch.no_grad()
    def track_scales(self, rms: torch.Tensor, momentum: float = 0.9) -> None:
        """Fold one teacher update's RMS of each branch's true correction into s (a branch with none keeps its)."""
        seen = rms > 0
        blended = torch.where(self.scales > 0, momentum * self.scales + (1 - momentum) * rms, rms)
        self.scales.copy_(torch.where(seen, blended, self.scales))

    def step(self) -> InjectCredit:
        return InjectCredit(self._term)

    @classmethod
    def from_config(cls, cfg: Config) -> "DNISource":
        return cls(cfg.model.width, cfg.model.branches, cfg.credit)

    def make_teacher(self):
        return DNITeacher(self, self.credit_cfg)


# ---- the teacher ----------------------------------------------------------------------------------------------

class _FitLocal(torch.autograd.Function):
    """The DNI predictor's fit at one branch: gated = sigmoid(n G^T) * (n U^T), from the branch input alone."""

    @staticmethod
    def forward(ctx, n, gate_weight, code_weight, decoder, stats_sink, gram_sink, cross_sink, scale: float,
                low_precision: bool, fused: bool):
        """decoder: the effective s_b D_b; the caller's autograd carries its gradient on to D_b."""
        gate, coded = gate_and_code(n, gate_weight, code_weight)
        ctx.save_for_backward(n, gate, coded, decoder)
        ctx.scale, ctx.low_precision, ctx.fused, ctx.moments = scale, low_precision, fused, gram_sink is not None
        return n.view_as(n)

    @staticmethod
    def backward(ctx, true):
        n, gate, coded, decoder = ctx.saved_tensors
        acc, mm = _fit_dtypes(true, ctx.low_precision)
        fit = rank_space_fit(true, gate, coded, decoder, ctx.scale, acc, mm, ctx.fused)
        d_pre = torch.cat([fit.gate_grad.to(mm), fit.code_grad.to(mm)], dim=-1)  # (B, T, 4r), before the factor
        d_weights = fit.factor * (d_pre.flatten(0, 1).t() @ n.to(mm).flatten(0, 1)).to(acc)
        d_gate_weight, d_code_weight = d_weights.chunk(2)
        dtype = decoder.dtype
        moments = (fit.gram, fit.cross) if ctx.moments else (None, None)
        return (true, d_gate_weight.to(dtype), d_code_weight.to(dtype), fit.d_decoder.to(dtype), fit.stats,
                *moments, None, None, None)


class LocalFitCredit(ExactCredit):
    """Exact backprop that fits the DNI predictor on the fly: each branch's regression from its own input."""

    def __init__(self, dni, scale: float, stats_sink: torch.Tensor, low_precision: bool = False,
                 moment_sinks=None, fused: bool = True):
        self.dni, self.scale, self.stats_sink, self.low_precision = dni, scale, stats_sink, low_precision
        self.fused = fused
        self.moment_sinks = moment_sinks

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        d = self.dni
        return _FitLocal.apply(n, d.gates[index], d.codes[index], d.decoder(index), self.stats_sink[index],
                               *_moment_slots(self.moment_sinks, index), self.scale, self.low_precision,
                               self.fused)


class DNITeacher(Teacher):
    """The DNI source's teacher: each branch's regression, from its own input, done where its correction
    arrives; it also keeps the source's per-branch scale s_b (the running RMS of the true corrections)."""

    def __init__(self, dni, cfg: CreditConfig):
        super().__init__(dni, dni.decoders, cfg)
        self.correction_sizes: list[int] = []  # elements of one branch's correction, per micro-batch
        self.solved: torch.Tensor | None = None  # the effective decoders solved this update (lstsq)

    def fit_credit(self, trainer, inputs, scale, stats_sink, moment_sinks) -> LocalFitCredit:
        return LocalFitCredit(self.module, scale, stats_sink, self.low_precision, moment_sinks, self.fused)

    def effective_decoders(self) -> torch.Tensor:
        return self.module.scales[:, None, None] * self.decoders.detach()

    def set_decoders(self, solved: torch.Tensor) -> None:
        self.solved = solved  # applied once the scales are updated: D_b = solved_b / s_b

    def context(self, trainer, inputs, scale: float) -> LocalFitCredit:
        self.correction_sizes.append(inputs.numel() * trainer.model.cfg.width)
        return super().context(trainer, inputs, scale)

    def step(self) -> FitReport:
        true_sq = torch.stack([s[:, STATS.index("true_sq")] for s in self.stats]).double()  # (micro, branches)
        sizes = torch.tensor(self.correction_sizes, dtype=torch.float64, device=true_sq.device)[:, None]
        rms = (true_sq / sizes).mean(0).sqrt()
        if dist.is_available() and dist.is_initialized():  # the same scales on every rank
            dist.all_reduce(rms, op=dist.ReduceOp.AVG)
        self.correction_sizes = []
        summary = super().step()  # applies the gradients computed with the scales they were computed under
        self.module.track_scales(rms.to(self.module.scales.dtype))
        if self.solved is not None:
            with torch.no_grad():
                scales = self.module.scales.double()[:, None, None]
                decoders = torch.where(scales > 0, self.solved / scales.clamp_min(1e-300), self.decoders.double())
                self.decoders.copy_(decoders.to(self.decoders.dtype))
            self.solved = None
        return summary
