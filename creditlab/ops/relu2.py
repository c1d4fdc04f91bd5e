"""The MLP's ReLU^2 fused into the two products around it.

The MLP computes y = relu(h)^2 W_proj^T with h = n W_fc^T. Written op by op, its activation costs passes of its
own over the (tokens, hidden) tensors: one in the forward (read h, write relu(h)^2), one in the backward (read h
and the gradient, write dL/dh), and a recompute or a kept copy. Here the forward's expansion squares each tile
before storing it (`expand_relu2`), and the backward's input-gradient product of the projection multiplies each
tile by 2 relu(h) = 2 sqrt(post) before storing it (`project_relu2`). Only post = relu(h)^2 is kept.

That requires one convention, and the two functions keep it between them: the tensor `expand_relu2` returns
holds post's *values*, but the gradient autograd hands back to it is dL/dh, the gradient of the pre-activation,
because `project_relu2`'s backward has already applied the activation's derivative. So the expansion's backward
is a plain linear backward (dL/dn = dL/dh W_fc, dL/dW_fc = dL/dh^T n), and a credit source that replaces the
expansion's input-gradient product (credit/sketch.py) keeps receiving dL/dh as before. Nothing but
`project_relu2` may read the expansion's output. The Functions define no forward-mode derivative (a custom
`jvp` would break the compiled graph at every MLP): FDFA's forward-mode pass runs the plain MLP
(credit/fdfa.py), which computes the same function.

On CUDA, in bf16/fp16, the products run as one Triton kernel each (ops/relu2_matmul.py; on Hopper the
derivative product as the Gluon kernel of ops/relu2_hopper.py, which brings the post tile in while the
products run); elsewhere (the CPU, float64 checks) as the torch arithmetic of the same formulas, so the
convention is checked in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from creditlab import ops
from creditlab.ops import relu2_hopper, relu2_matmul


def _kernel_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ops.available(a) and relu2_matmul.supported(a, b)


@torch.library.custom_op("creditlab::relu2_linear", mutates_args=())
def relu2_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """relu(x w^T)^2 for x (M, K), w (N, K)."""
    if _kernel_takes(x, w):
        return relu2_matmul.relu2_linear(x, w)
    r = torch.relu(x @ w.t())
    return r * r


def _linear_fake(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


relu2_linear.register_fake(_linear_fake)


def _gluon_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _kernel_takes(a, b) and relu2_hopper.available(a) and a.shape[1] % relu2_hopper.BLOCK_K == 0


@torch.library.custom_op("creditlab::relu2_dgrad", mutates_args=())
def relu2_dgrad(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """(dy w) * 2 sqrt(post) for dy (M, K), w (K, N), post (M, N): dL/dh through y = post w^T."""
    if _kernel_takes(dy, w) and post.dtype == dy.dtype:
        return relu2_matmul.relu2_dgrad(dy, w, post)
    return (dy @ w) * (2 * post.sqrt())


def _dgrad_fake(dy, w, post):
    return dy.new_empty((dy.shape[0], w.shape[1]))


relu2_dgrad.register_fake(_dgrad_fake)


@torch.library.custom_op("creditlab::relu2_dgrad_gluon", mutates_args=())
def relu2_dgrad_gluon(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """relu2_dgrad through the Gluon kernel where it runs (compute capability 9), else as relu2_dgrad (the
    Triton kernel, or the torch arithmetic off CUDA)."""
    if _gluon_takes(dy, w) and post.dtype == dy.dtype:
        return relu2_hopper.relu2_dgrad(dy, w, post)
    return relu2_dgrad(dy, w, post)


relu2_dgrad_gluon.register_fake(_dgrad_fake)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def expand_relu2_values(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post, x, w) with post = relu(x w^T)^2 and x, w cast as F.linear would cast them: the forward shared by
    every expansion that keeps the convention (this module's and the sketch's)."""
    dtype = ops.compute_dtype(x)
    x, w = x.to(dtype), w.to(dtype)
    post = relu2_linear(_rows(x), w).view(*x.shape[:-1], w.shape[0])
    return post, x, w


class _ExpandReLU2(torch.autograd.Function):
    # Both Functions keep the weight as cast for the forward (as autocast's F.linear does): the backward's products
    # read it without a cast of their own.
    @staticmethod
    def forward(ctx, x, weight):
        post, xc, wc = expand_relu2_values(x, weight)
        ctx.save_for_backward(xc, wc)
        ctx.weight_dtype = weight.dtype
        return post

    @staticmethod
    def backward(ctx, dh):  # dh: dL/dh, by the convention
        x, w = ctx.saved_tensors
        dx = dh @ w.to(dh.dtype) if ctx.needs_input_grad[0] else None
        dw = (_rows(dh).t() @ _rows(x).to(dh.dtype)).to(ctx.weight_dtype)
        return dx, dw


class _ProjectReLU2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post, weight):
        w = weight.to(post.dtype)
        ctx.save_for_backward(post, w)
        ctx.weight_dtype = weight.dtype
        return F.linear(post, w)

    @staticmethod
    def backward(ctx, dy):
        post, w = ctx.saved_tensors
        dh = None
        if ctx.needs_input_grad[0]:  # dL/dh, not dL/dpost: the convention
            dh = relu2_dgrad_gluon(_rows(dy), w.to(dy.dtype), _rows(post).to(dy.dtype)).view(post.shape)
        dw = (_rows(dy).t() @ _rows(post).to(dy.dtype)).to(ctx.weight_dtype)
        return dh, dw


def expand_relu2(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """relu(x W^T)^2, whose gradient is taken as dL/dh (h = x W^T): its output may be read by `project_relu2`
    alone."""
    return _ExpandReLU2.apply(x, weight)


class ReLU2:
    """What the fused MLP's expansion applies before its output leaves the chip: ReLU^2. The credit context's
    `product` takes it in place of an activation name, as it takes qk_norm.QKEpilogue (model.ExactCredit.product)."""

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return expand_relu2(x, weight)


def project_relu2(post: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """post W^T, handing `expand_relu2` dL/dh = (dL/dy W) * 2 sqrt(post)."""
    return _ProjectReLU2.apply(post, weight)
