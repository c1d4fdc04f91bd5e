"""`transpose`: a row-major copy of a matrix's transpose, for one-byte (FP8) matrices.

The FP8 head's weight-gradient product sums over tokens, and FP8 tensor-core products take both operands with
the summed index contiguous, so each chunk's (tokens, vocabulary) e5m2 gradient of the logits is also needed
transposed. torch's strided copy moves one-byte elements one at a time; this kernel moves square tiles, each
read and written in full rows.
"""

from __future__ import annotations

import torch

from creditlab.ops._triton import tl, triton

BLOCK, WARPS = 64, 4

if triton is not None:

    @triton.jit
    def _transpose(src, dst, rows, cols, BLOCK: tl.constexpr):
        r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        tile = tl.load(src + r[:, None] * cols + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < cols))
        tl.store(dst + c[:, None] * rows + r[None, :], tl.trans(tile), mask=(c[:, None] < cols) & (r[None, :] < rows))


def transpose(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x.t().contiguous() for a row-major (rows, cols) matrix of one-byte elements, by tiles; `out` (cols, rows):
    the output, preallocated (the tests poison it)."""
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose takes a contiguous matrix of one-byte elements, got {x.dtype} of shape "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    rows, cols = x.shape
    out = x.new_empty((cols, rows)) if out is None else out
    grid = (triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK))
    _transpose[grid](x.view(torch.uint8), out.view(torch.uint8), rows, cols, BLOCK=BLOCK, num_warps=WARPS)
    return out
