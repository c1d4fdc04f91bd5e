"""Causal attention through SDPA, the output's gradient always handed to its backward in one layout.

PyTorch's cuDNN attention (2.11, cuDNN 9.19) caches the backward's cuDNN graph under the shapes and strides of q,
k and v, not those of the output's gradient. A process whose backward calls see one q, k, v layout with two
layouts of that gradient runs the second with the first's graph: it reads the gradient at the wrong strides and
returns wrong dq, dk, dv, with no error (`benchmarks/native_seed.md`, "Attention's kernels"). Autograd and the
compiler hand the model's gradient over laid out as the output is; here every call gets it so, whatever the ops
after attention are, and the check costs nothing where it already is (the compiler keeps the stride order traced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _GradientLaidOutAsOutput(torch.autograd.Function):
    """The identity; its backward copies a gradient whose strides differ from the output's into the output's."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        ctx.stride = out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == ctx.stride:
            return grad
        return torch.empty_strided(grad.shape, ctx.stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T scale, causal) v for q, k, v in SDPA's (batch, heads, sequence, head dim) order, by whichever
    kernel SDPA picks; the gradient reaching the kernel's backward has the output's strides."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    # no backward to guard without a graph (evaluation, FDFA's forward-mode passes, which a Function without a
    # `jvp` would refuse; a `jvp` would break the compiled graph)
    return _GradientLaidOutAsOutput.apply(out) if out.requires_grad else out
