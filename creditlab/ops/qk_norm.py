"""QK-norm and rotary positions as one operation on the Q/K/V projection's output.

Attention reads q and k RMS-normalized per head and rotated by their positions, and v as projected. Written op
by op, the compiler makes a pass over q and k each way and, in the backward, assembles the projection's output
gradient from the q, k and v gradients in another. Here the forward is one pass that also lays v out
contiguously, and the backward one pass that writes the projection's output gradient whole. It keeps the rotated
q and k (which attention keeps anyway: the same tensors) and one float32 scale per token and head, and recovers
the normalized q and k from the rotated ones by rotating back (R^T R = (cos^2 + sin^2) I, divided out).

On CUDA the passes are Triton kernels (ops/qk_norm_rotary.py); elsewhere the torch arithmetic of the same
formulas, so the backward's formula is checked against autograd in float64 on the CPU.

In the model the forward pass is not a pass of its own: the Q/K/V product normalizes and rotates each tile
before it stores it (ops/qkv_rotary.py; on Hopper, where the tokens are whole tiles, ops/qkv_hopper.py),
so the product's output is never written or read again (`product_norm_rotary`). Its backward is the same one
pass, then the product's own backward. A credit source that replaces the product's backward (the sketch)
applies `QKEpilogue.after` to the product it forms instead: the same function, in a pass of its own.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from creditlab import ops
from creditlab.ops import qk_norm_rotary as qk_kernels
from creditlab.ops import qkv_hopper, qkv_rotary

EPS = 1e-6  # as model.norm


def _halves_rotated(x1, x2, c, s, inverse: bool = False):
    return (x1 * c - x2 * s, x1 * s + x2 * c) if inverse else (x1 * c + x2 * s, x2 * c - x1 * s)


def reference_forward(qkv, cos, sin, heads: int, eps: float = EPS):
    """The torch arithmetic of the kernel's forward: (q, k, v, scales) as in qk_norm_rotary_forward."""
    B, T, three_width = qkv.shape
    hd = three_width // 3 // heads
    x = qkv.view(B, T, 3, heads, hd)
    acc = torch.promote_types(qkv.dtype, torch.float32)
    qk = x[:, :, :2].to(acc)
    scales = torch.rsqrt(qk.square().mean(-1) + eps)  # (B, T, 2, heads)
    n1, n2 = (qk * scales[..., None]).chunk(2, dim=-1)
    c, s = cos[:T, None, None, :].to(acc), sin[:T, None, None, :].to(acc)
    out = torch.cat(_halves_rotated(n1, n2, c, s), dim=-1).to(qkv.dtype)
    return out[:, :, 0].contiguous(), out[:, :, 1].contiguous(), x[:, :, 2].contiguous(), scales


def reference_backward(dq, dk, dv, q, k, scales, cos, sin):
    """The torch arithmetic of the kernel's backward: d loss / d qkv (B, T, 3 * width)."""
    B, T, heads, hd = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    c, s = cos[:T, None, :].to(acc), sin[:T, None, :].to(acc)
    grads = []
    for g, out, scale in ((dq, q, scales[:, :, 0]), (dk, k, scales[:, :, 1])):
        dn = torch.cat(_halves_rotated(*g.to(acc).chunk(2, dim=-1), c, s, inverse=True), dim=-1)
        # R^T R = (c^2 + s^2) I: not exactly I for rounded cos and sin, so divide it out to recover n
        n = torch.cat(_halves_rotated(*out.to(acc).chunk(2, dim=-1), c, s, inverse=True), dim=-1)
        n = n / torch.cat([c * c + s * s] * 2, dim=-1)
        mean = (dn * n).mean(-1, keepdim=True)
        grads.append((scale[..., None] * (dn - n * mean)).to(q.dtype))
    return torch.stack([*grads, dv.to(q.dtype)], dim=2).reshape(B, T, 3 * heads * hd)


def _kernel_takes(t: torch.Tensor) -> bool:
    return ops.available(t) and t.dtype in (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("creditlab::qk_norm_rotary_forward", mutates_args=())
def forward_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _kernel_takes(qkv):
        return qk_kernels.qk_norm_rotary_forward(qkv, cos, sin, heads, EPS)
    return reference_forward(qkv, cos, sin, heads)


def _forward_fake(like: torch.Tensor, B: int, T: int, three_width: int, heads: int):
    shape = (B, T, heads, three_width // 3 // heads)
    acc = torch.promote_types(like.dtype, torch.float32)
    return (like.new_empty(shape), like.new_empty(shape), like.new_empty(shape),
            like.new_empty((B, T, 2, heads), dtype=acc))


@forward_op.register_fake
def _(qkv, cos, sin, heads):
    return _forward_fake(qkv, *qkv.shape, heads)


@torch.library.custom_op("creditlab::qk_norm_rotary_backward", mutates_args=())
def backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                scales: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if _kernel_takes(q):
        return qk_kernels.qk_norm_rotary_backward(dq, dk, dv, q, k, scales, cos, sin)
    return reference_backward(dq, dk, dv, q, k, scales, cos, sin)


@backward_op.register_fake
def _(dq, dk, dv, q, k, scales, cos, sin):
    B, T, heads, hd = q.shape
    return q.new_empty((B, T, 3 * heads * hd))


class _QKNormRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, heads: int):
        q, k, v, scales = forward_op(qkv, cos, sin, heads)
        ctx.save_for_backward(q, k, scales, cos, sin)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        q, k, scales, cos, sin = ctx.saved_tensors
        return backward_op(dq, dk, dv, q, k, scales, cos, sin), None, None, None


def qk_norm_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    """(q, k, v), each (B, T, heads, head_dim): q and k of qkv (B, T, 3 * width) RMS-normalized per head and
    rotated (cos, sin: (>= T, head_dim / 2)), v as projected."""
    return _QKNormRotary.apply(qkv, cos, sin, heads)


@torch.library.custom_op("creditlab::qkv_product_norm_rotary", mutates_args=())
def product_forward_op(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv, scales): forward_op of x w^T for x (B, T, d), w (3 width, d), with q, k and v stacked in one
    (3, B, T, heads, head_dim) tensor (an operator's outputs may not alias one another, so the caller takes the
    three views). The product and the forward pass as one kernel on CUDA (the Gluon kernel on Hopper where it
    takes the operands, else the Triton one), the product and then forward_op elsewhere."""
    B, T, d = x.shape
    rows = x.reshape(B * T, d)
    hd = w.shape[0] // 3 // heads
    if qkv_hopper.supported(rows, w, heads):
        qkv, scales = qkv_hopper.qkv_norm_rotary(rows, w, cos, sin, heads, T, EPS)
        return qkv.view(3, B, T, heads, hd), scales.view(B, T, 2, heads)
    if ops.available(x) and qkv_rotary.supported(rows, w, heads):
        qkv, scales = qkv_rotary.qkv_norm_rotary(rows, w, cos, sin, heads, T, EPS)
        return qkv.view(3, B, T, heads, hd), scales.view(B, T, 2, heads)
    q, k, v, scales = forward_op(x @ w.t(), cos, sin, heads)
    return torch.stack((q, k, v)), scales


@product_forward_op.register_fake
def _(x, w, cos, sin, heads):
    q, _, _, scales = _forward_fake(x, x.shape[0], x.shape[1], w.shape[0], heads)
    return x.new_empty((3, *q.shape)), scales


@register_flop_formula(torch.ops.creditlab.qkv_product_norm_rotary)
def _product_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """The product's FLOPs, as aten.mm's are counted (the epilogue's pointwise work, as any pass's, is not), so
    that a FLOP count sees this operator's product as it sees F.linear's."""
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


class _ProductNormRotary(torch.autograd.Function):
    """(q, k, v) of n W^T as _QKNormRotary gives them, the product's output never formed. The backward hands the
    product's backward dL/d(n W^T) from the QK-norm's one pass: n's gradient only where n asks for one (an
    omitted product's n arrives detached), W's always."""

    @staticmethod
    def forward(ctx, n, weight, cos, sin, heads: int):
        dtype = ops.compute_dtype(n)
        x, w = n.to(dtype), weight.to(dtype)
        qkv, scales = product_forward_op(x, w, cos, sin, heads)
        q, k, v = qkv.unbind(0)
        ctx.save_for_backward(x, w, q, k, scales, cos, sin)
        ctx.weight_dtype = weight.dtype
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, w, q, k, scales, cos, sin = ctx.saved_tensors
        dqkv = backward_op(dq, dk, dv, q, k, scales, cos, sin)
        rows = dqkv.reshape(-1, dqkv.shape[-1])
        dn = (rows @ w.to(dqkv.dtype)).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = (rows.t() @ x.reshape(-1, x.shape[-1]).to(dqkv.dtype)).to(ctx.weight_dtype)
        return dn, dw, None, None, None


def product_norm_rotary(n: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int):
    """qk_norm_rotary(n W^T, cos, sin, heads) with the forward pass in the product's epilogue (on CUDA)."""
    return _ProductNormRotary.apply(n, weight, cos, sin, heads)


class QKEpilogue:
    """What a branch's product applies before its output leaves the chip, for attention's Q/K/V product: QK-norm
    and rotary with the attention's rotation tables. The credit context's `product` takes it in place of an
    activation name (model.ExactCredit.product)."""

    def __init__(self, rotary, heads: int):
        self.rotary, self.heads = rotary, heads  # the Rotary module: its tables follow the model's device

    def product(self, n: torch.Tensor, weight: torch.Tensor):
        """(q, k, v) of n W^T, the epilogue inside the product."""
        return product_norm_rotary(n, weight, self.rotary.cos, self.rotary.sin, self.heads)

    def after(self, qkv: torch.Tensor):
        """(q, k, v) of a product formed elsewhere: the same function as `product`, in a pass of its own."""
        return qk_norm_rotary(qkv, self.rotary.cos, self.rotary.sin, self.heads)
