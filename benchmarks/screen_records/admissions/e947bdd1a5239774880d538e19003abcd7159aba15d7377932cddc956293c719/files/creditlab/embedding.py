"""The model's embedding lookups as one operation (`model.embed=fused`).

The token embedding and the value-embedding tables are all read at the same token ids. Their forward is the
plain gather, left to the compiler to fuse into what reads it. Their backward sorts the ids once and, on CUDA,
sums each token's gradient rows before adding them to its table row (kernels/embedding_grad.py), where
autograd's form adds every element of every row atomically (benchmarks/native_seed.md). Elsewhere the
gradient is torch's index_add in the weights' dtype, so the CPU checks see the same sums in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from creditlab import kernels
from creditlab.kernels import embedding_grad as grad_kernel
from creditlab.runtime import cast


@torch.library.custom_op("creditlab::embedding_grads", mutates_args=())
def grads_op(ids: torch.Tensor, grads: list[torch.Tensor], vocab: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradient of each table read at ids (any shape), (vocab, width) in dtype, from the gradients of the
    lookups, each ids.shape + (width,)."""
    flat = ids.reshape(-1)
    if kernels.available(flat):
        sorted_ids, order = torch.sort(flat.to(torch.int32))
        return [grad_kernel.embedding_grad(sorted_ids, order, g.reshape(flat.numel(), -1), vocab).to(dtype)
                for g in grads]
    return [torch.zeros((vocab, g.shape[-1]), dtype=dtype, device=g.device)
            .index_add_(0, flat, g.reshape(flat.numel(), -1).to(dtype)) for g in grads]


@grads_op.register_fake
def _(ids, grads, vocab, dtype):
    return [g.new_empty((vocab, g.shape[-1]), dtype=dtype) for g in grads]


def _lookup(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    rows = F.embedding(ids, weight)
    return rows if dtype is None else cast(rows, dtype)


class _Lookups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, dtype, *weights):
        ctx.save_for_backward(ids)
        ctx.vocab, ctx.weight_dtype = weights[0].shape[0], weights[0].dtype
        return tuple(_lookup(ids, w, dtype) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        (ids,) = ctx.saved_tensors
        return (None, None, *grads_op(ids, list(grads), ctx.vocab, ctx.weight_dtype))


def lookups(ids: torch.Tensor, weights: list[torch.Tensor], dtype: torch.dtype | None = None,
            fused: bool = True) -> list[torch.Tensor]:
    """[table[ids] for each table in weights] (all of one vocabulary and dtype), cast to dtype when it is given.
    fused: their backward as one operation (above); else as autograd records each lookup."""
    if not fused:
        return [_lookup(ids, w, dtype) for w in weights]
    if len({(w.shape[0], w.dtype) for w in weights}) != 1:
        raise ValueError("fused lookups take tables of one vocabulary and dtype, got "
                         f"{[(tuple(w.shape), w.dtype) for w in weights]}")
    return list(_Lookups.apply(ids, dtype, *weights))
