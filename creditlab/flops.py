"""Nominal FLOP accounting (Kaplan et al. 2020 convention), with the derivation printed line by line.

Per target: 6*(N_trunk + N_head) + 6*L*T*d, with N_trunk = L*(3d^2 + d^2 + 2*d*h) (Q/K/V, output projection,
MLP expansion and projection) and N_head = d*V for the true vocabulary. The synthetic backward omits, per
layer and target, the input products of Q/K/V and of the MLP expansion: 2*d*3d + 2*d*h. The `sketch` source
computes them at rank k instead, through A = W V (m, k) and V (d, k): 2*k*(3d + d) + 2*k*(h + d) per layer and
target, and forms each A once per micro-batch, 2*m*d*k; its `sampled` form, (dY S)(S^T W)/k, costs the same. The
projected forms refresh V every sketch_every updates: a full SVD (`svd`, nominally 4*m*d^2 + 8*d^3 per weight) or
warm-started subspace iteration (`subspace`, 4*m*d*k + 4*d*k^2 per weight and step), amortized per target.
The `dropbp` control skips whole branches' backward at the rate that saves as many FLOPs in expectation as the
omitted products (`dropbp_rate`).
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


def omitted_per_token(model: ModelConfig) -> int:
    """The 16 omitted input products per target: each layer's Q/K/V (m = 3d) and MLP expansion (m = h), 2*m*d each."""
    return model.layers * 2 * model.width * (3 * model.width + model.mlp_hidden)


def flop_budget(model: ModelConfig, teacher_every: int = 4, cycle_gate: float = 0.93) -> FlopBudget:
    if teacher_every < 2:
        raise ValueError(f"teacher_every must be >= 2 for a teacher cycle, got {teacher_every}")
    L, d, h, T, V = model.layers, model.width, model.mlp_hidden, model.seq_len, model.vocab_size
    n_trunk = L * (3 * d * d + d * d + 2 * d * h)
    n_head = d * V
    attention = 6 * L * T * d
    return FlopBudget(layers=L, width=d, mlp_hidden=h, seq_len=T, vocab_size=V, teacher_every=teacher_every,
                      cycle_gate=cycle_gate, n_trunk=n_trunk, n_head=n_head, attention_per_token=attention,
                      total_per_token=6 * (n_trunk + n_head) + attention, omitted_per_token=omitted_per_token(model))


SKETCH_FORMS = ("svd", "subspace", "sampled")  # credit.sketch's forms (credit/sketch.py)
SUBSPACE_ITERATIONS = 2  # steps of warm-started subspace iteration per `subspace` refresh (credit/sketch.py)


@dataclass(frozen=True)
class SketchCost:
    """What the `sketch` source's synthetic backward adds back of the omitted products, at rank k, in its form
    (credit.sketch): per target, per micro-batch, and per refresh of the basis amortized over sketch_every updates.

    Every form costs 2k(m + d) per target and 2mdk per micro-batch per branch: `svd` and `subspace` through
    A = W V and V, `sampled` through S and S^T W / k (drawing S is no FLOPs). The refresh, per weight (m, d) with
    m >= d as both branch kinds have: `svd` a full SVD, counted as the Golub-Reinsch SVD's singular values and
    right singular vectors, 4md^2 + 8d^3 (Golub and Van Loan, Matrix Computations, sec. 5.4.5); `subspace` q steps
    of V <- orth(W^T (W V)), each 4mdk for the two products and 4dk^2 for the QR (Householder, with Q formed), the
    randomized first refresh of a run not counted (once per run); `sampled` none."""

    layers: int
    width: int
    mlp_hidden: int
    rank: int
    per_token: int
    per_micro_batch: int
    omitted_per_token: int
    form: str = "svd"
    every: int = 50
    refresh: int = 0  # FLOPs of one refresh of every branch's basis
    tokens_per_micro_batch: int = 0  # 0: not known, nothing amortized
    tokens_per_update: int = 0

    @property
    def omitted_share(self) -> float:
        return self.per_token / self.omitted_per_token

    @property
    def amortized_per_token(self) -> float | None:
        """Per target, everything: the thin products, the micro-batch's factors and the refresh at its share."""
        if not self.tokens_per_micro_batch or not self.tokens_per_update:
            return None
        return (self.per_token + self.per_micro_batch / self.tokens_per_micro_batch
                + self.refresh / (self.every * self.tokens_per_update))

    def to_json(self) -> dict:
        return {"form": self.form, "rank": self.rank, "per_token": self.per_token,
                "per_micro_batch": self.per_micro_batch, "omitted_share": self.omitted_share,
                "refresh": self.refresh, "every": self.every if self.refresh else None,
                "amortized_per_token": self.amortized_per_token}

    def derivation(self) -> str:
        L, d, h, k, q = self.layers, self.width, self.mlp_hidden, self.rank, SUBSPACE_ITERATIONS
        factors = "S^T W / k" if self.form == "sampled" else "A = W V"
        rows = [
            ("sketch / target", f"L*2k*((3d + d) + (h + d)) = {L}*2*{k}*((3*{d} + {d}) + ({h} + {d}))", self.per_token),
            ("sketch factors", f"L*2*d*k*(3d + h) = {L}*2*{d}*{k}*(3*{d} + {h}) per micro-batch ({factors})",
             self.per_micro_batch),
        ]
        if self.form == "svd":
            rows.append(("refresh (SVD)", f"L*(4d^2*(3d + h) + 2*8d^3) = {L}*(4*{d}^2*(3*{d} + {h}) + 16*{d}^3)",
                         self.refresh))
        elif self.form == "subspace":
            rows.append(("refresh (subsp.)", f"L*q*(4dk*(3d + h) + 2*4dk^2) = {L}*{q}*(4*{d}*{k}*(3*{d} + {h}) "
                                             f"+ 8*{d}*{k}^2)", self.refresh))
        w = max(len(r[1]) for r in rows)
        lines = [f"{self.form} (credit.sketch), rank {k}"]
        lines += [f"{name:<17} {formula:<{w}}  {value:>15,}" for name, formula, value in rows]
        lines.append(f"sketch share      {self.per_token:,} / {self.omitted_per_token:,} of the omitted = "
                     f"{100 * self.omitted_share:.2f}%")
        if self.amortized_per_token is not None:
            refresh = (f" + {self.refresh:,} / ({self.every} * {self.tokens_per_update:,})" if self.refresh
                       else " (no refresh)")
            lines.append(f"all, per target   {self.per_token:,} + {self.per_micro_batch:,} / "
                         f"{self.tokens_per_micro_batch:,}{refresh} = {self.amortized_per_token:,.0f}")
        return "\n".join(lines)


def sketch_cost(model: ModelConfig, rank: int, form: str = "svd", every: int = 50, tokens_per_micro_batch: int = 0,
                tokens_per_update: int = 0) -> SketchCost:
    """The rank-k sketch's FLOPs in `form`: per target, per micro-batch for the factors (A_b = W_b V_b, or
    S_b^T W_b / k), and per refresh (every `every` updates), amortized where the tokens are given."""
    L, d, h, k = model.layers, model.width, model.mlp_hidden, rank
    if not 1 <= k <= d:
        raise ValueError(f"the sketch's rank must lie in [1, model.width={d}], got {k}")
    if form not in SKETCH_FORMS:
        raise ValueError(f"the sketch's form must be one of {'|'.join(SKETCH_FORMS)}, got {form!r}")
    outputs = (3 * d, h)  # m of each layer's two weights (m, d): Q/K/V and the MLP's expansion, both m >= d
    if form == "svd":
        refresh = L * sum(4 * m * d * d + 8 * d ** 3 for m in outputs)
    elif form == "subspace":
        refresh = L * SUBSPACE_ITERATIONS * sum(4 * m * d * k + 4 * d * k * k for m in outputs)
    else:
        refresh = 0
    return SketchCost(layers=L, width=d, mlp_hidden=h, rank=k, per_token=L * 2 * k * ((3 * d + d) + (h + d)),
                      per_micro_batch=L * 2 * d * k * (3 * d + h), omitted_per_token=omitted_per_token(model),
                      form=form, every=every, refresh=refresh, tokens_per_micro_batch=tokens_per_micro_batch,
                      tokens_per_update=tokens_per_update)


@dataclass(frozen=True)
class DropBPRate:
    """The rate at which the `dropbp` control skips a branch's backward: the same expected FLOPs saved per target
    as the 16 omitted products.

    In the convention above a matmul of N weights costs 2N forward and 4N backward per target (input gradient and
    weight gradient, 2N each); of attention's 6*T*d per layer, 2*T*d is forward and 4*T*d backward. A branch's
    backward per target is then 4*4d^2 + 4*T*d for attention (Q/K/V and output projection, scores and values;
    the gate's few weights are not counted, as in N_trunk) and 4*2*d*h for the MLP. Each branch is dropped with
    the same probability p, so the expected saving is p times the sum over branches, and p = omitted / that sum."""

    layers: int
    width: int
    mlp_hidden: int
    seq_len: int
    attention_backward: int
    mlp_backward: int
    omitted_per_token: int

    @property
    def branches_backward(self) -> int:
        return self.layers * (self.attention_backward + self.mlp_backward)

    @property
    def rate(self) -> float:
        return self.omitted_per_token / self.branches_backward

    def to_json(self) -> dict:
        return {"attention_backward": self.attention_backward, "mlp_backward": self.mlp_backward,
                "branches_backward": self.branches_backward, "rate": self.rate}

    def derivation(self) -> str:
        L, d, h, T = self.layers, self.width, self.mlp_hidden, self.seq_len
        rows = [
            ("attn backward", f"4*4d^2 + 4*T*d = 16*{d}^2 + 4*{T}*{d} per layer", self.attention_backward),
            ("mlp backward", f"4*2*d*h = 8*{d}*{h} per layer", self.mlp_backward),
            ("branches bwd", f"L*(attn + mlp) = {L}*({self.attention_backward:,} + {self.mlp_backward:,})",
             self.branches_backward),
        ]
        w = max(len(r[1]) for r in rows)
        lines = [f"{name:<17} {formula:<{w}}  {value:>15,}" for name, formula, value in rows]
        lines.append(f"dropbp rate p     omitted / branches bwd = {self.omitted_per_token:,} / "
                     f"{self.branches_backward:,} = {self.rate:.5f}")
        return "\n".join(lines)


def dropbp_rate(model: ModelConfig) -> DropBPRate:
    """Each branch's backward FLOPs per target and the drop rate that saves the omitted products' FLOPs."""
    L, d, h, T = model.layers, model.width, model.mlp_hidden, model.seq_len
    return DropBPRate(layers=L, width=d, mlp_hidden=h, seq_len=T, attention_backward=4 * 4 * d * d + 4 * T * d,
                      mlp_backward=4 * 2 * d * h, omitted_per_token=omitted_per_token(model))
