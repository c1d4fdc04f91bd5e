"""Linear maps too thin for a matrix product: y = x w^T for x (tokens, K) and w (N, K) with K and N a few dozen
at most (the attention gate's 12 -> 4 per token).

cuBLAS runs such shapes as tensor-core kernels over tiles that are almost all padding, and the weight gradient,
a sum over every token into N x K numbers, as a split-K product with a reduction kernel after it: three products
and four launches per gate and micro-batch, each far from the bytes it moves. Here a program takes a block of
rows and does the arithmetic in registers:

* `thin_forward`: y = x w^T, one pass over x's K columns (read in place from a wider tensor: the gate reads the
  branch input's leading channels) writing y.
* `thin_backward`: dx = dy w and each block's partial sum of dy^T x in the same pass; the partial sums (a few
  hundred rows of N x K) are added after it. A fixed order, no atomics: the result does not depend on scheduling.

Arithmetic in float32; x, w and dy in their dtypes (the caller casts w as F.linear would).
"""

from __future__ import annotations

import torch

from creditlab.ops._triton import tl, triton

# tokens per program: the fastest backward at the seed shape on an H200, the forward as fast as any
# (benchmarks/results/attention_gate_seed.md)
ROWS, WARPS = 512, 4


if triton is not None:

    @triton.jit
    def _rows_block(x, x_stride, tokens, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr):
        """This program's rows, their mask, the padded column range and its mask, x's (ROWS, KP) block in float32."""
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        cols = tl.arange(0, KP)
        in_k = cols < K
        block = tl.load(x + rows[:, None] * x_stride + cols[None, :], mask=valid[:, None] & in_k[None, :],
                        other=0.0).to(tl.float32)
        return rows, valid, cols, in_k, block

    @triton.jit
    def _thin_forward(x, x_stride, w, y, tokens, K: tl.constexpr, N: tl.constexpr, KP: tl.constexpr,
                      NP: tl.constexpr, ROWS: tl.constexpr):
        rows, valid, cols, in_k, block = _rows_block(x, x_stride, tokens, K, KP, ROWS)
        outs = tl.arange(0, NP)
        result = tl.zeros((ROWS, NP), dtype=tl.float32)
        for j in tl.static_range(N):
            w_j = tl.load(w + j * K + cols, mask=in_k, other=0.0).to(tl.float32)
            y_j = tl.sum(block * w_j[None, :], axis=1)
            result = tl.where(outs[None, :] == j, y_j[:, None], result)
        tl.store(y + rows[:, None] * N + outs[None, :], result.to(y.dtype.element_ty),
                 mask=valid[:, None] & (outs[None, :] < N))

    @triton.jit
    def _thin_backward(dy, x, x_stride, w, dx, dw_partial, tokens, K: tl.constexpr, N: tl.constexpr,
                       KP: tl.constexpr, NP: tl.constexpr, ROWS: tl.constexpr):
        rows, valid, cols, in_k, block = _rows_block(x, x_stride, tokens, K, KP, ROWS)
        outs = tl.arange(0, NP)
        grads = tl.load(dy + rows[:, None] * N + outs[None, :], mask=valid[:, None] & (outs[None, :] < N),
                        other=0.0).to(tl.float32)
        dx_block = tl.zeros((ROWS, KP), dtype=tl.float32)
        for j in tl.static_range(N):
            dy_j = tl.sum(tl.where(outs[None, :] == j, grads, 0.0), axis=1)  # column j of dy
            w_j = tl.load(w + j * K + cols, mask=in_k, other=0.0).to(tl.float32)
            dx_block += dy_j[:, None] * w_j[None, :]
            tl.store(dw_partial + (tl.program_id(0) * N + j) * K + cols, tl.sum(dy_j[:, None] * block, axis=0),
                     mask=in_k)
        tl.store(dx + rows[:, None] * K + cols[None, :], dx_block.to(dx.dtype.element_ty),
                 mask=valid[:, None] & in_k[None, :])


def _padded(n: int) -> int:
    return max(triton.next_power_of_2(n), 2)


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernels take these: x (tokens, K) with unit column stride, w (N, K), K and N at most 64."""
    return (x.dim() == 2 and w.dim() == 2 and x.stride(1) == 1 and x.shape[1] == w.shape[1]
            and x.shape[1] <= 64 and w.shape[0] <= 64)


def _programs(tokens: int, rows: int) -> int:
    return triton.cdiv(tokens, rows)


def thin_forward(x: torch.Tensor, w: torch.Tensor, rows: int = ROWS, warps: int = WARPS, out=None) -> torch.Tensor:
    """x w^T (tokens, N) in x's dtype, for x (tokens, K) whose rows may lie further apart than K."""
    tokens, K = x.shape
    N = w.shape[0]
    y = torch.empty((tokens, N), dtype=x.dtype, device=x.device) if out is None else out
    _thin_forward[(_programs(tokens, rows),)](x, x.stride(0), w.contiguous(), y, tokens, K=K, N=N, KP=_padded(K),
                                              NP=_padded(N), ROWS=rows, num_warps=warps)
    return y


def thin_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rows: int = ROWS, warps: int = WARPS,
                  out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw): dy w (tokens, K) in x's dtype and dy^T x (N, K) in float32, for dy (tokens, N)."""
    tokens, K = x.shape
    N = w.shape[0]
    dx = torch.empty((tokens, K), dtype=x.dtype, device=x.device) if out is None else out
    programs = _programs(tokens, rows)
    partial = torch.empty((programs, N, K), dtype=torch.float32, device=x.device)
    _thin_backward[(programs,)](dy.contiguous(), x, x.stride(0), w.contiguous(), dx, partial, tokens, K=K, N=N,
                                KP=_padded(K), NP=_padded(N), ROWS=rows, num_warps=warps)
    return dx, partial.sum(0)
