"""`embedding_grad`: an embedding table's gradient from the token ids sorted, shared by the tables read at them.

A table's gradient adds each token's output-gradient row into that token's table row. Autograd's form, as the
compiler generates it, is one floating-point atomic add per element of every row (measured: its time is the same
for ids drawn as text repeats them and for ids that each come about eleven times). Here the ids are sorted once
for all the tables; each program takes a block of sorted positions and a block of columns, gathers
the gradient rows, sums each run of equal ids (a product with the runs' indicator matrix) and adds only the
run's total: one atomic row per distinct token in a block instead of one per position.

The kernel runs on CUDA tensors, and under TRITON_INTERPRET=1 on CPU tensors, which is how the tests check it
against float64 arithmetic without a GPU.
"""

from __future__ import annotations

import torch

from creditlab.kernels._triton import tl, triton

BLOCK_ROWS, BLOCK_COLS, WARPS = 64, 128, 4  # the fastest at the seed shape (benchmarks/native_seed.md)

if triton is not None:

    @triton.jit
    def _embedding_grads(sorted_ids_ptr, order_ptr, grad_ptr, out_ptr, n, width: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, FLOAT32: tl.constexpr):
        local = tl.arange(0, BLOCK_ROWS)
        pos = tl.program_id(0) * BLOCK_ROWS + local
        cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        valid = pos < n
        ids = tl.load(sorted_ids_ptr + pos, mask=valid, other=-1)
        before = tl.load(sorted_ids_ptr + pos - 1, mask=valid & (pos > 0), other=-1)
        starts = valid & ((ids != before) | (local == 0))
        run = tl.cumsum(starts.to(tl.int32), 0) - 1  # each row's run of equal ids within the block
        source = tl.load(order_ptr + pos, mask=valid, other=0).to(tl.int64)
        col_ok = cols < width
        rows = tl.load(grad_ptr + source[:, None] * width + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                       other=0.0)
        # run k's sum as a product with the (runs x rows) indicator: exact products, float32 accumulation, on
        # the tensor cores (a segmented scan of the same sums ran at a fraction of this; benchmarks/native_seed.md)
        member = run[None, :] == local[:, None]
        if FLOAT32:
            sums = tl.dot(member.to(tl.float32), rows.to(tl.float32), input_precision="ieee")
        else:
            sums = tl.dot(member.to(rows.dtype), rows)
        run_ids = tl.max(tl.where(member, ids[None, :], -1), axis=1)  # -1: no run k in this block
        tl.atomic_add(out_ptr + run_ids.to(tl.int64)[:, None] * width + cols[None, :], sums,
                      mask=(run_ids >= 0)[:, None] & col_ok[None, :], sem="relaxed")


def embedding_grad(sorted_ids: torch.Tensor, order: torch.Tensor, grad: torch.Tensor, vocab: int,
                   block_rows: int = BLOCK_ROWS, block_cols: int = BLOCK_COLS, warps: int = WARPS) -> torch.Tensor:
    """(vocab, width) float32: row v the sum of grad's rows at the positions whose id is v, given the ids sorted
    (sorted_ids, int32 or int64) and the permutation that sorts them (order[i]: the position of the i-th sorted
    id); grad (positions, width) in any float dtype."""
    n, width = grad.shape
    if sorted_ids.shape != (n,) or order.shape != (n,):
        raise ValueError(f"sorted_ids and order must have the {n} positions of grad {tuple(grad.shape)}, got "
                         f"{tuple(sorted_ids.shape)} and {tuple(order.shape)}")
    out = torch.zeros((vocab, width), dtype=torch.float32, device=grad.device)
    # The run sums in float32 arithmetic for float32 rows, and on the CPU: the interpreter's bf16 product is wrong
    # (it gave sums of 1e6 for rows of unit scale), and bf16 values times 0 or 1 are exact either way.
    float32 = grad.dtype == torch.float32 or grad.device.type == "cpu"
    grid = (triton.cdiv(n, block_rows), triton.cdiv(width, block_cols))
    _embedding_grads[grid](sorted_ids.contiguous(), order.contiguous(), grad.contiguous(), out, n, width=width,
                           BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, FLOAT32=float32, num_warps=warps)
    return out
