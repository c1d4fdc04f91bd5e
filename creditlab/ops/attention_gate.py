"""The attention gate's product, n[..., :gate_dim] W_gate^T per token, one pass each way.

A product of 12 channels into 4 per token is too thin for the tensor cores: cuBLAS spends three products (the
forward, the input gradient and the weight gradient, the last split along the tokens with a reduction after it) of
16-23 us each on a few megabytes per gate and micro-batch, about 1.8 ms of a seed update
(benchmarks/results/profile_native_products_seed.md). Here one Triton pass computes the forward and one the input
gradient with the weight gradient's partial sums (ops/thin_linear.py). Written instead as an elementwise sum
the compiler fused the weight gradient into a far slower reduction (benchmarks/native_seed.md), so these passes
stay operators of their own.

On CUDA the passes are Triton kernels; elsewhere the torch arithmetic of the same products, so the float64
checks run through the same Function.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from creditlab import ops
from creditlab.ops import thin_linear


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., K) as (tokens, K), without a copy where its rows are evenly spaced (a slice of leading channels)."""
    if all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(t.dim() - 2)):
        return t.as_strided((t.numel() // t.shape[-1], t.shape[-1]), (t.stride(-2), t.stride(-1)))
    return t.reshape(-1, t.shape[-1])


def _kernel_takes(rows: torch.Tensor, w: torch.Tensor) -> bool:
    return ops.available(rows) and thin_linear.supported(rows, w)


@torch.library.custom_op("creditlab::thin_linear", mutates_args=())
def thin_linear_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x w^T for x (..., K), w (N, K): (..., N) in x's dtype."""
    rows = _rows(x)
    if _kernel_takes(rows, w):
        return thin_linear.thin_forward(rows, w).view(*x.shape[:-1], w.shape[0])
    return x @ w.t()


@thin_linear_op.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("creditlab::thin_linear_backward", mutates_args=())
def thin_linear_backward_op(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy w, dy^T x): the input gradient (..., K) in x's dtype and the weight gradient (N, K), float32 or better,
    of y = x w^T."""
    rows, dy_rows = _rows(x), dy.reshape(-1, dy.shape[-1])
    if _kernel_takes(rows, w):
        dx, dw = thin_linear.thin_backward(dy_rows, rows, w)
        return dx.view(x.shape), dw
    acc = torch.promote_types(x.dtype, torch.float32)
    return (dy @ w.to(dy.dtype)).to(x.dtype), dy_rows.t().to(acc) @ rows.to(acc)


@thin_linear_backward_op.register_fake
def _(dy, x, w):
    return x.new_empty(x.shape), w.new_empty(w.shape, dtype=torch.promote_types(x.dtype, torch.float32))


# The products' FLOPs, as aten.mm's are counted, so that a FLOP count sees these operators as it sees F.linear's
@register_flop_formula(torch.ops.creditlab.thin_linear)
def _forward_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


@register_flop_formula(torch.ops.creditlab.thin_linear_backward)
def _backward_flops(dy_shape, x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]  # dy w and dy^T x


class _ThinLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        dtype = ops.compute_dtype(x)
        xc, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, w)
        ctx.weight_dtype = weight.dtype
        return thin_linear_op(xc, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = thin_linear_backward_op(dy, x, w)
        return (dx if ctx.needs_input_grad[0] else None), dw.to(ctx.weight_dtype)


def gate_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T, what F.linear(x, weight) computes, one pass each way."""
    return _ThinLinear.apply(x, weight)
