"""The learned credit source: corrections predicted from the terminal error, linear in it.

Given forward states, the predictor maps the terminal error e (B, T, d) to one correction per branch:

    p_t     = P e_t                                          rank-r projection            (B, T, r)
    m_t     = sum_{s>=t} a_s p_s / sum_{s>=t} a_s            content-gated reverse mean   (B, T, r)
    g_{b,t} = sigmoid(G_b n_{b,t})                           local state gate, forward    (B, T, 2r)
    c_{b,t} = D_b (g_{b,t} * [p_t ; m_t])                    decoder, zero-initialized    (B, T, d)

with a_s = sigmoid(w . norm(x_L)_s + beta) a forward state at the tap. Credit at position t only comes from
positions s >= t (the reverse mean), and c is linear in e because every gate is a forward state.

Streaming (the default) never builds the 16 corrections at the tap: it injects through the adjoint
(credit/sources.py; the tap hands the code of e to every branch's share), so each c_b is decoded by autograd
when the backward reaches branch b, and freed after its norm VJP consumed it. A source's `materialized = True`
decodes all 16 at the tap instead: a mode the float64 check sets (streaming == materialized), no longer a config
key (measured slower and heavier than streaming, benchmarks/predictor_cost.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from creditlab.config import Config, CreditConfig, ModelConfig
from creditlab.credit.sources import AdjointCredit, FittedSource, OmitCredit
from creditlab.credit.teacher import LearnedTeacher
from creditlab.model import ExactCredit, branch_kind, norm


def cumsum(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    if torch.compiler.is_compiling() or dim in (-1, x.dim() - 1):
        return x.cumsum(dim)
    # Eager CUDA scans along an outer axis run one serial thread per column (0.34 ms for a (64, 2048, 32)
    # float32 tensor on an H200); moved innermost, the scan is parallel. The compiler makes its own scan.
    return x.movedim(dim, -1).contiguous().cumsum(-1).movedim(-1, dim)


def reverse_cumsum(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return cumsum(x.flip(dim), dim).flip(dim)


def state_gate(n: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(n G^T) (..., 2r) in n's dtype."""
    return torch.sigmoid(n @ gate_weight.t().to(n.dtype))


def gated_decode(code: torch.Tensor, gate: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    """(code * gate) D^T (..., d) in code's dtype for the decoder D (d, 2r)."""
    return (code * gate) @ decoder.t().to(code.dtype)

class Predictor(nn.Module):
    """The parameters and the maps of the predictor; shared by every organization of the credit path."""

    def __init__(self, model: ModelConfig, rank: int):
        super().__init__()
        d, branches, self.rank = model.width, model.branches, rank
        self.projection = nn.Parameter(torch.randn(self.projection_rank, d) * d ** -0.5)  # P
        self.mean_gate = nn.Parameter(torch.randn(d) * d ** -0.5)  # w
        self.mean_bias = nn.Parameter(torch.zeros(()))  # beta
        self.state_gates = nn.Parameter(torch.randn(branches, 2 * rank, d) * d ** -0.5)  # G_b
        self.decoders = nn.Parameter(torch.zeros(branches, d, 2 * rank))  # D_b

    # ---- the layout of the code ------------------------------------------------------------------------
    @property
    def projection_rank(self) -> int:
        return self.rank

    @property
    def code_width(self) -> int:
        """The width of the code shared by all branches (B, T, code_width)."""
        return 2 * self.rank

    def code_slice(self, b: int) -> slice:
        """The part of the shared code that branch b's gates and decoder read (2r wide)."""
        return slice(0, 2 * self.rank)

    def widen(self, b: int, share: torch.Tensor) -> torch.Tensor:
        """Branch b's (B, T, 2r) term placed at its slice of the code width: the adjoint of `code[..., slice]`."""
        s = self.code_slice(b)
        return share if s.stop - s.start == self.code_width else F.pad(share, (s.start, self.code_width - s.stop))

    # ---- forward states ---------------------------------------------------------------------------------
    def gate(self, b: int, n: torch.Tensor) -> torch.Tensor:  # (B, T, 2r)
        return state_gate(n, self.state_gates[b])

    def mean_weights(self, x_terminal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """a_s (B, T, 1) and its reverse cumulative sum A_t, in float32 or better."""
        h = norm(x_terminal)
        acc = torch.promote_types(h.dtype, torch.float32)
        a = torch.sigmoid(h.to(acc) @ self.mean_gate.to(acc) + self.mean_bias.to(acc))[..., None]
        return a, reverse_cumsum(a)

    # ---- the map e -> corrections ------------------------------------------------------------------------
    def code(self, e: torch.Tensor, a: torch.Tensor, a_rev: torch.Tensor) -> torch.Tensor:
        """[p ; m] (B, T, 2r): the part of every correction shared by all branches."""
        # The product in e's dtype (bf16 under autocast: e is carried in it) with a float32 result; a float32
        # copy of e first would only move twice the bytes.
        p = (e @ self.projection.to(e.dtype).t()).to(a.dtype)
        m = reverse_cumsum(a * p) / a_rev
        return torch.cat([p, m], dim=-1)

    def decode(self, b: int, code: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_decode(code[..., self.code_slice(b)].to(gate.dtype), gate, self.decoders[b])

    # ---- its adjoint, for streaming injection -----------------------------------------------------------
    def branch_adjoint(self, b: int, n: torch.Tensor) -> torch.Tensor:
        """g_b * (n_b D_b): the branch's share of the adjoint, (B, T, code_width). Only n carries gradient."""
        return self.widen(b, _GatedAdjoint.apply(n, self.state_gates[b].detach(), self.decoders[b].detach()))

    def tap(self, x_terminal: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """x_L unchanged, carrying the adjoint term for the branches' summed shares `total` (B, T, code_width).

        The term is Z = (h1 + a * cumsum(h2 / A)) P for total = [h1 ; h2], since <total, [p ; m]> =
        sum_s p_s . (h1_s + a_s sum_{t<=s} h2_t / A_t). Its VJP with e, handed to total, is the code [p ; m]
        itself, so the tap computes that in the backward and never forms Z in the forward."""
        with torch.no_grad():
            a, a_rev = self.mean_weights(x_terminal)
        return _CodeTap.apply(x_terminal, total, self, a, a_rev)


class _CodeTap(torch.autograd.Function):
    """The identity on x_L; its backward hands the terminal error on and gives the summed branch terms the
    code of the terminal error: the gradients of adding Z - Z.detach(), without Z."""

    @staticmethod
    def forward(ctx, x, total, predictor, a, a_rev):
        ctx.predictor, ctx.total_dtype = predictor, total.dtype
        ctx.save_for_backward(a, a_rev)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, e):
        a, a_rev = ctx.saved_tensors
        return e, ctx.predictor.code(e, a, a_rev).to(ctx.total_dtype), None, None, None


class _GatedAdjoint(torch.autograd.Function):
    """The branch's share of the adjoint, g * (n D) for the state gate g = sigmoid(n G^T), as far as autograd sees
    it: its backward is the branch's decode, (grad * g) D^T. Its forward value is never read (the tap, _CodeTap,
    passes x_L through and uses only the gradient path of the summed shares), so the forward returns zeros of the
    share's shape: n D is never formed."""

    @staticmethod
    def forward(ctx, n, gate_weight, decoder):
        gate = state_gate(n, gate_weight)  # (B, T, 2r)
        ctx.save_for_backward(gate, decoder)
        return torch.zeros_like(gate)

    @staticmethod
    def backward(ctx, grad):
        gate, decoder = ctx.saved_tensors
        return gated_decode(grad, gate, decoder), None, None


class LearnedCredit(AdjointCredit):
    """The streaming injection of the learned source."""

    def __init__(self, predictor: "Predictor"):
        super().__init__(predictor.branch_adjoint, predictor.tap)
        self.predictor = predictor


class LearnedSource(FittedSource):
    name, omits = "learned", True
    about = "learned predictor, one exact teacher update in credit.teacher_every"
    predictor_class = Predictor
    directions_per_rank = 1  # the terminal error's projection has rank directions

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        problems = super().config_problems(cfg)
        directions = cls.directions_per_rank * cfg.credit.rank
        if directions > cfg.model.width:
            times = f"{cls.directions_per_rank} x " if cls.directions_per_rank > 1 else ""
            problems.append(f"credit.rank ({cfg.credit.rank}) is too large for model.width ({cfg.model.width}): "
                            f"{cls.name} projects the terminal error onto {times}rank directions, at most the width; "
                            f"lower credit.rank")
        return problems

    def __init__(self, model: ModelConfig, credit: CreditConfig):
        super().__init__(credit)
        self.predictor = self.predictor_class(model, credit.rank)
        self.materialized = False  # True: every correction decoded at the tap (the float64 check sets it)

    @classmethod
    def from_config(cls, cfg: Config) -> "LearnedSource":
        return cls(cfg.model, cfg.credit)

    def step(self) -> OmitCredit:
        if self.materialized:
            return MaterializedCredit(self.predictor)
        return LearnedCredit(self.predictor)

    def make_teacher(self):
        return LearnedTeacher(self.predictor, self.credit_cfg)


class TypedPredictor(Predictor):
    """The code laid out by branch kind: an MLP acts on each token alone, so its credit is mostly its own
    token's error, while credit reaches an attention branch's input from the later positions that attend to it.
    So from one projection of rank 2r, the MLP branches read p (all 2r directions, no reverse mean), and the
    attention branches read [m ; p_{:r}] (the leading r directions and their content-gated reverse mean):

        code = [m ; p],  p = P e (2r),  m = reverse mean of p_{:r}          (B, T, 3r)
        attention branch: code[..., 0:2r]      MLP branch: code[..., r:3r]

    Gates, decoders and their cost per branch are the seed predictor's (2r features each); only P is twice as
    tall, one product per token for all branches."""

    @property
    def projection_rank(self) -> int:
        return 2 * self.rank

    @property
    def code_width(self) -> int:
        return 3 * self.rank

    def code_slice(self, b: int) -> slice:
        r = self.rank
        return slice(0, 2 * r) if branch_kind(b) == "attn" else slice(r, 3 * r)

    def code(self, e: torch.Tensor, a: torch.Tensor, a_rev: torch.Tensor) -> torch.Tensor:
        p = (e @ self.projection.to(e.dtype).t()).to(a.dtype)
        m = reverse_cumsum(a * p[..., :self.rank]) / a_rev
        return torch.cat([m, p], dim=-1)


class TypedSource(LearnedSource):
    name = "typed"
    about = "learned predictor with its code laid out by branch kind (attention: [m ; p], MLP: p of rank 2r)"
    predictor_class = TypedPredictor

    directions_per_rank = 2  # a taller projection: MLP branches read all 2r directions


class _DecodeAllAtTap(torch.autograd.Function):
    """Identity on x_L; its backward decodes all 16 corrections at once and returns them as the gradients
    of the branch inputs: the organization that holds every correction at the same time."""

    @staticmethod
    def forward(ctx, x, predictor, a, a_rev, gates, *branch_inputs):
        ctx.predictor = predictor
        ctx.save_for_backward(a, a_rev, *gates)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, e):
        a, a_rev, *gates = ctx.saved_tensors
        code = ctx.predictor.code(e, a, a_rev)
        corrections = [ctx.predictor.decode(b, code, g).to(e.dtype) for b, g in enumerate(gates)]
        return (e, None, None, None, None, *corrections)


class MaterializedCredit(OmitCredit):
    def __init__(self, predictor: Predictor):
        self.predictor = predictor
        self.inputs: list[torch.Tensor] = []
        self.gates: list[torch.Tensor] = []

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.gates.append(self.predictor.gate(index, n))
        self.inputs.append(n)
        return n.detach()

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            a, a_rev = self.predictor.mean_weights(x)
        return _DecodeAllAtTap.apply(x, self.predictor, a, a_rev, self.gates, *self.inputs)


def decode_all(predictor: Predictor, e: torch.Tensor, x_terminal: torch.Tensor,
               branch_inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every branch's correction for terminal error e, explicitly: for checks and fit metrics."""
    a, a_rev = predictor.mean_weights(x_terminal)
    code = predictor.code(e, a, a_rev)
    return [predictor.decode(b, code, predictor.gate(b, n)) for b, n in enumerate(branch_inputs)]


class StateCredit(ExactCredit):
    """Exact backprop that also keeps the forward states the predictor reads (branch inputs, x_L)."""

    def __init__(self):
        self.branch_inputs: list[torch.Tensor] = []
        self.x_terminal = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        self.branch_inputs.append(n.detach())
        return n

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        self.x_terminal = x.detach()
        return x


__all__ = ["Predictor", "TypedPredictor", "LearnedSource", "TypedSource", "MaterializedCredit", "decode_all", "StateCredit"]
