"""Nominal FLOP accounting (Kaplan et al. 2020 convention), with the derivation printed line by line.

Per target: 6*(N_trunk + N_head) + 6*L*T*d, with N_trunk = L*(3d^2 + d^2 + 2*d*h) (Q/K/V, output projection,
MLP expansion and projection) and N_head = d*V for the true vocabulary. The synthetic backward omits, per
layer and target, the input products of Q/K/V and of the MLP expansion: 2*d*3d + 2*d*h. The `sketch` source
computes them at rank k instead, through A = W V (m, k) and V (d, k): 2*k*(3d + d) + 2*k*(h + d) per layer and
target, and forms each A once per micro-batch, 2*m*d*k.
"""

from __future__ import annotations

from dataclasses import dataclass

from creditlab.config import ModelConfig


@dataclass(frozen=True)
class FlopBudget:
    layers: int
    width: int
    mlp_hidden: int
    seq_len: int
    vocab_size: int
    teacher_every: int
    cycle_gate: float
    n_trunk: int
    n_head: int
    attention_per_token: int
    total_per_token: int
    omitted_per_token: int

    @property
    def omitted_fraction(self) -> float:
        return self.omitted_per_token / self.total_per_token

    @property
    def ceiling_fraction(self) -> float:
        """Saving with one exact teacher update in K: (K-1)/K of the omitted fraction."""
        k = self.teacher_every
        return self.omitted_fraction * (k - 1) / k

    @property
    def gate_ratio(self) -> float:
        """Largest synthetic/native time ratio r with (1 + (K-1) r)/K <= cycle_gate."""
        k = self.teacher_every
        return (self.cycle_gate * k - 1) / (k - 1)

    def to_json(self) -> dict:
        return {"total_per_token": self.total_per_token, "omitted_per_token": self.omitted_per_token,
                "omitted_fraction": self.omitted_fraction, "teacher_every": self.teacher_every,
                "ceiling_fraction": self.ceiling_fraction, "gate_ratio": self.gate_ratio}

    def derivation(self) -> str:
        L, d, h, T, V, K = self.layers, self.width, self.mlp_hidden, self.seq_len, self.vocab_size, self.teacher_every
        rows = [
            ("N_trunk", f"L*(3d^2 + d^2 + 2*d*h) = {L}*(3*{d}^2 + {d}^2 + 2*{d}*{h})", self.n_trunk),
            ("N_head", f"d*V = {d}*{V}", self.n_head),
            ("6*N_trunk", "", 6 * self.n_trunk),
            ("6*N_head", "", 6 * self.n_head),
            ("attention", f"6*L*T*d = 6*{L}*{T}*{d}", self.attention_per_token),
            ("total / target", "6*(N_trunk + N_head) + 6*L*T*d", self.total_per_token),
            ("omitted / target", f"L*2*d*(3d + h) = {L}*2*{d}*(3*{d} + {h})", self.omitted_per_token),
        ]
        w = max(len(r[1]) for r in rows)
        lines = [f"{name:<17} {formula:<{w}}  {value:>15,}" for name, formula, value in rows]
        lines += [
            f"omitted fraction  {self.omitted_per_token:,} / {self.total_per_token:,} = "
            f"{100 * self.omitted_fraction:.2f}%",
            f"ceiling           one exact teacher in {K}: {K - 1}/{K} * {100 * self.omitted_fraction:.2f}% = "
            f"{100 * self.ceiling_fraction:.2f}%",
            f"timing gate       (1 + {K - 1}r)/{K} <= {self.cycle_gate:g}  <=>  r <= "
            f"{self.gate_ratio:.7f}",
        ]
        return "\n".join(lines)


def flop_budget(model: ModelConfig, teacher_every: int = 4, cycle_gate: float = 0.93) -> FlopBudget:
    if teacher_every < 2:
        raise ValueError(f"teacher_every must be >= 2 for a teacher cycle, got {teacher_every}")
    L, d, h, T, V = model.layers, model.width, model.mlp_hidden, model.seq_len, model.vocab_size
    n_trunk = L * (3 * d * d + d * d + 2 * d * h)
    n_head = d * V
    attention = 6 * L * T * d
    return FlopBudget(layers=L, width=d, mlp_hidden=h, seq_len=T, vocab_size=V, teacher_every=teacher_every,
                      cycle_gate=cycle_gate, n_trunk=n_trunk, n_head=n_head, attention_per_token=attention,
                      total_per_token=6 * (n_trunk + n_head) + attention,
                      omitted_per_token=L * 2 * d * (3 * d + h))


@dataclass(frozen=True)
class SketchCost:
    """What the `sketch` source's synthetic backward adds back of the omitted products, at rank k."""

    layers: int
    width: int
    mlp_hidden: int
    rank: int
    per_token: int
    per_micro_batch: int
    omitted_per_token: int

    @property
    def omitted_share(self) -> float:
        return self.per_token / self.omitted_per_token

    def to_json(self) -> dict:
        return {"rank": self.rank, "per_token": self.per_token, "per_micro_batch": self.per_micro_batch,
                "omitted_share": self.omitted_share}

    def derivation(self) -> str:
        L, d, h, k = self.layers, self.width, self.mlp_hidden, self.rank
        rows = [
            ("sketch / target", f"L*2k*((3d + d) + (h + d)) = {L}*2*{k}*((3*{d} + {d}) + ({h} + {d}))", self.per_token),
            ("sketch factors", f"L*2*d*k*(3d + h) = {L}*2*{d}*{k}*(3*{d} + {h}) per micro-batch", self.per_micro_batch),
        ]
        w = max(len(r[1]) for r in rows)
        lines = [f"{name:<17} {formula:<{w}}  {value:>15,}" for name, formula, value in rows]
        lines.append(f"sketch share      {self.per_token:,} / {self.omitted_per_token:,} of the omitted = "
                     f"{100 * self.omitted_share:.2f}%")
        return "\n".join(lines)


def sketch_cost(model: ModelConfig, rank: int) -> SketchCost:
    """The rank-k sketch's FLOPs: per target, and per micro-batch for the factors A_b = W_b V_b."""
    L, d, h, k = model.layers, model.width, model.mlp_hidden, rank
    if not 1 <= k <= d:
        raise ValueError(f"the sketch's rank must lie in [1, model.width={d}], got {k}")
    return SketchCost(layers=L, width=d, mlp_hidden=h, rank=k, per_token=L * 2 * k * ((3 * d + d) + (h + d)),
                      per_micro_batch=L * 2 * d * k * (3 * d + h), omitted_per_token=L * 2 * d * (3 * d + h))
