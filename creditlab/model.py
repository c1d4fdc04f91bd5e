"""The GPT: a causal decoder in the style of the 2025 modded-nanogpt records, scaled to d8/w512.

Read it top to bottom. Each block has two *branches*, attention and MLP; each reads `n = norm(x)` from the
residual stream, and its omitted product reads `credit.branch(b, n)`. The products the synthetic backward omits
are the ones the credit context computes, `credit.product(b, n_b, W)`: the Q/K/V projection of attention (which
also applies QK-norm and rotary in its epilogue: qk_norm.py) and the expansion of the MLP (which also applies
ReLU^2: relu2.py). Everything else in a branch (the attention gate, the value embeddings, the output projections)
reads `n` itself and stays exact. What the residual stream adds of a branch's output passes `credit.output(b, y)`
(a source may detach it, skipping that branch's whole backward: credit/dropbp.py). The residual stream entering
the final norm passes `credit.terminal(x)`: the tap where the terminal error appears in backward;
`credit.finish(loss)` may add exactly-zero terms that carry injected corrections (credit/sources.py).

The fused modules (the norms that keep only their output, the Q/K/V product with its epilogue, the attention
gate's thin product, the MLP's ReLU^2 inside its products) compute the same functions as their op-by-op forms,
which `GPT.op_by_op()` switches to: for forward-mode derivatives, which the fused Functions do not define
(credit/fdfa.py), and as the step check's plain reference (step_check.py).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from creditlab.ops.attention_gate import gate_linear
from creditlab.ops.causal_attention import causal_attention
from creditlab.config import ModelConfig
from creditlab.ops.loss import head_loss, head_loss_sum
from creditlab.ops.qk_norm import QKEpilogue
from creditlab.ops.relu2 import ReLU2, project_relu2
from creditlab.runtime import cast


def norm_with_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, s): RMSNorm without weights, n = x s with the row scale s = 1 / rms(x), computed in float32 and n
    returned in x's dtype (autocast would keep float32)."""
    x32 = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    scale = torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)
    return cast(x32 * scale, x.dtype), scale


def norm(x: torch.Tensor) -> torch.Tensor:
    return norm_with_scale(x)[0]


def norm_backward(dn: torch.Tensor, n: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dL/dx of n = norm(x) from dL/dn, n and its row scale: s (dn - n mean(dn * n)), in n's dtype."""
    acc = torch.promote_types(n.dtype, torch.float32)
    g, n32 = dn.to(acc), n.to(acc)
    return (scale * (g - n32 * (g * n32).mean(-1, keepdim=True))).to(n.dtype)


class _NormKeepingOutput(torch.autograd.Function):
    """norm(x) whose backward reads n and the row scale instead of x: a branch's product keeps n anyway (for its
    weight gradient), so the norm keeps no tensor of its own."""

    @staticmethod
    def forward(ctx, x):
        n, scale = norm_with_scale(x)
        ctx.save_for_backward(n, scale)
        return n

    @staticmethod
    def backward(ctx, dn):
        return norm_backward(dn, *ctx.saved_tensors)


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    # r * r, not r.square(): square is pow, which CUDA autocast runs in float32. A float32 ReLU^2 then needs a
    # bf16 copy for the next product, and the compiled graph kept both that copy and the pre-activation.
    r = F.relu(h)
    return r * r


class ExactCredit:
    """Native backprop: nothing omitted, nothing injected. Credit sources subclass this (credit/sources.py; the
    contract of its five methods: credit/README.md)."""

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        """What branch `index`'s omitted product reads of its input n."""
        return n

    def product(self, index: int, n: torch.Tensor, weight: torch.Tensor, activation: ReLU2 | QKEpilogue | None = None):
        """Branch `index`'s product n W^T, whose input gradient the synthetic backward omits. With a ReLU2 (the
        fused MLP) it returns relu(n W^T)^2 and takes the gradient of n W^T back (relu2.py): a source that replaces
        the product's backward sees the same gradient either way. With a QKEpilogue it returns attention's
        (q, k, v), normalized and rotated in the product's epilogue; a source that forms the product itself applies
        `activation.after` to it. With None (op by op) it is n W^T."""
        if activation is None:
            return F.linear(n, weight)
        if not isinstance(activation, (ReLU2, QKEpilogue)):
            raise ValueError(f"unknown activation {activation!r}")
        return activation.product(n, weight)

    def output(self, index: int, y: torch.Tensor) -> torch.Tensor:
        """What the residual stream adds of branch `index`'s output y: y, or y.detach() to skip the branch's whole
        backward (its input and weight gradients) while the residual path stays exact (credit/dropbp.py)."""
        return y

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


EXACT = ExactCredit()


class Rotary(nn.Module):
    def __init__(self, head_dim: int, seq_len: int, base: float):
        super().__init__()
        freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)  # (T, hd/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, H, hd)
        T = x.size(1)
        cos, sin = self.cos[None, :T, None, :].to(x.dtype), self.sin[None, :T, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, has_value_embed: bool):
        super().__init__()
        d, self.heads, self.head_dim = cfg.width, cfg.heads, cfg.head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # the omitted input product: W_q^T dQ + W_k^T dK + W_v^T dV
        self.proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(cfg.gate_dim, cfg.heads, bias=False)  # per-head sigmoid gate from the branch input
        self.gate_dim = cfg.gate_dim
        # v <- a*v + b*ve: how much of this layer's value embedding to mix in.
        self.value_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if has_value_embed else None
        self.rotary = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_base)
        # QK-norm and rotary in the Q/K/V product's epilogue, the product's output never written (qk_norm.py)
        self.qk_epilogue = QKEpilogue(self.rotary, self.heads)
        self.op_by_op = False  # GPT.op_by_op

    def epilogue(self) -> QKEpilogue | None:
        """What the Q/K/V product applies in its epilogue, for the credit context's product."""
        return None if self.op_by_op else self.qk_epilogue

    def forward(self, n: torch.Tensor, qkv, ve: torch.Tensor | None) -> torch.Tensor:
        """qkv: the credit context's product with W_qkv (the omitted product): (q, k, v), QK-norm and rotary
        applied in its epilogue; op by op, n W_qkv^T."""
        B, T, d = n.shape
        if self.op_by_op:
            q, k, v = qkv.view(B, T, 3, self.heads, self.head_dim).unbind(2)
            q, k = self.rotary(norm(q)), self.rotary(norm(k))  # QK-norm, then rotary positions
        else:
            q, k, v = qkv
        if ve is not None:
            v = self.value_mix[0] * v + self.value_mix[1] * ve.view_as(v)
        y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.12)
        y = y.transpose(1, 2)  # (B, T, H, hd)
        gate_input = n[..., :self.gate_dim]  # the gate's thin product one pass each way (attention_gate.py)
        gate = self.gate(gate_input) if self.op_by_op else gate_linear(gate_input, self.gate.weight)
        y = y * torch.sigmoid(gate)[..., None]
        return self.proj(y.reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, cfg.mlp_hidden, bias=False)  # the omitted input product: W_fc^T dH
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.width, bias=False)
        self.relu2 = ReLU2()  # ReLU^2 in the epilogues of the products on either side of it, only its output kept
        self.op_by_op = False  # GPT.op_by_op

    @property
    def activation(self) -> ReLU2 | None:
        """What the expansion applies in its epilogue, for the credit context's product."""
        return None if self.op_by_op else self.relu2

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: the credit context's product with W_fc (the omitted product): relu(n W_fc^T)^2; op by op n W_fc^T."""
        if self.op_by_op:
            return self.proj(relu_squared(h))
        return project_relu2(h, self.proj.weight)


BRANCH_KINDS = ("attn", "mlp")  # each block's two branches, in branch order: index 2i is attention, 2i+1 its MLP


def branch_kind(index: int) -> str:
    return BRANCH_KINDS[index % 2]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, has_value_embed: bool):
        super().__init__()
        self.index = index
        self.attn = Attention(cfg, has_value_embed)
        self.mlp = MLP(cfg)
        self.resid_mix = nn.Parameter(torch.tensor([1.0, 0.0]))  # x <- a*x + b*x0
        self.op_by_op = False  # GPT.op_by_op

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x) if self.op_by_op else _NormKeepingOutput.apply(x)

    def forward(self, x, x0, ve, credit: ExactCredit):
        x = self.resid_mix[0] * x + self.resid_mix[1] * x0
        a, m = 2 * self.index, 2 * self.index + 1  # the block's branches
        n = self.norm(x)
        y = self.attn(n, credit.product(a, credit.branch(a, n), self.attn.qkv.weight, self.attn.epilogue()), ve)
        x = x + credit.output(a, y)
        n = self.norm(x)
        y = self.mlp(credit.product(m, credit.branch(m, n), self.mlp.fc.weight, self.mlp.activation))
        x = x + credit.output(m, y)
        return x


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        L, k = cfg.layers, cfg.value_embeds
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.width) for _ in range(k))
        # Table i feeds layer i and layer L-k+i: the first and last k layers.
        self.value_embed_of_layer = [i if i < k else (i - (L - k) if i >= L - k else None) for i in range(L)]
        self.blocks = nn.ModuleList(
            Block(cfg, i, self.value_embed_of_layer[i] is not None) for i in range(L))
        # U-net skips: the outputs of the first half feed the second half, weighted.
        self.skip_weights = nn.Parameter(torch.ones(L // 2))
        self.head = nn.Linear(cfg.width, cfg.padded_vocab, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight)
            elif isinstance(module, nn.Linear):
                bound = 3 ** 0.5 * module.in_features ** -0.5
                nn.init.uniform_(module.weight, -bound, bound)
        for block in self.blocks:  # zero-initialized output projections and head, as in modded-nanogpt
            block.attn.proj.weight.zero_()
            block.mlp.proj.weight.zero_()
        self.head.weight.zero_()

    @contextlib.contextmanager
    def op_by_op(self):
        """Every fused module op by op for the duration (the same functions: the norms, QK-norm and rotary after
        the Q/K/V product, the attention gate through F.linear, ReLU^2 between the MLP's products), then as it
        was."""
        modules = [m for m in self.modules() if hasattr(m, "op_by_op") and not isinstance(m, GPT)]
        kept = [m.op_by_op for m in modules]
        try:
            for m in modules:
                m.op_by_op = True
            yield self
        finally:
            for m, was in zip(modules, kept):
                m.op_by_op = was

    def branch_names(self) -> list[str]:
        return [f"layer{i}.{kind}" for i in range(self.cfg.layers) for kind in BRANCH_KINDS]

    def branch_modules(self) -> list[nn.Linear]:
        """The linear maps whose input products the synthetic backward omits, in branch order."""
        return [lin for blk in self.blocks for lin in (blk.attn.qkv, blk.mlp.fc)]

    def trunk_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self.named_parameters() if not name.startswith("head.")]

    def hidden(self, idx: torch.Tensor, credit: ExactCredit = EXACT) -> torch.Tensor:
        """The residual stream x_L entering the final norm, (B, T, d), after the terminal tap."""
        # Under autocast the residual stream is carried in the autocast dtype, as modded-nanogpt does in bf16:
        # it halves what the backward keeps and what every pointwise op moves.
        dtype = torch.get_autocast_dtype("cuda") if idx.is_cuda and torch.is_autocast_enabled("cuda") else None
        x0, *ves = [F.embedding(idx, table.weight) if dtype is None else cast(F.embedding(idx, table.weight), dtype)
                    for table in [self.embed, *self.value_embeds]]
        x = x0 = norm(x0)
        skips = []
        L = self.cfg.layers
        for i, block in enumerate(self.blocks):
            if i >= L - L // 2 and skips:
                x = x + self.skip_weights[i - (L - L // 2)] * skips.pop()
            slot = self.value_embed_of_layer[i]
            x = block(x, x0, ves[slot] if slot is not None else None, credit)
            if i < L // 2:
                skips.append(x)
        return credit.terminal(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, credit: ExactCredit = EXACT,
                loss_chunk: int = 8_192) -> torch.Tensor:
        """Mean next-token loss of idx: (B, T) against targets: (B, T)."""
        h = norm(self.hidden(idx, credit)).flatten(0, 1)
        loss = head_loss(h, self.head.weight, targets.flatten(), self.cfg.vocab_size, self.cfg.logit_cap,
                         loss_chunk, fp8=self.cfg.head == "fp8")
        return credit.finish(loss)

    def loss_sum(self, idx: torch.Tensor, targets: torch.Tensor, loss_chunk: int = 8_192) -> torch.Tensor:
        """Summed next-token loss over all targets, forward only (evaluation): no gradient work in the head."""
        h = norm(self.hidden(idx)).flatten(0, 1)
        return head_loss_sum(h, self.head.weight, targets.flatten(), self.cfg.vocab_size, self.cfg.logit_cap,
                             loss_chunk)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Soft-capped logits over the true vocabulary (B, T, V): for evaluation and tests, not training."""
        z = self.head(norm(self.hidden(idx)))[..., :self.cfg.vocab_size]
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        return self.cfg.logit_cap * torch.tanh(z / self.cfg.logit_cap)
