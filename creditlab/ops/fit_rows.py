"""`fit_rows`: the token-wise half of a fitted source's regression onto one branch's true correction, in one pass.

The teacher regresses the prediction D gated (tokens, d) onto the true correction c in rank space
(`credit.teacher.rank_space_fit`): per token it needs c D and gated M (M = D^T D), and over all tokens |c|^2,
|pred|^2 (= <M, Gram>), <pred, c> and the features' Gram matrix. The compiler's version reads c three times
(c D, |c|^2, and c^T gated) and makes a split reduction over a dozen (tokens, 2r) float32 tensors. This kernel
reads each tile of c once for c D and |c|^2, forms gated = gate * code on chip, and writes only what the rest of
the fit reads: gated (for c^T gated, a product of its own) and the two token-wise gradients of the regression
before its scalar factor 2 scale / |c|^2, which is known only once every tile is summed:

    u = gated M - c D,   code_grad = u * gate,   gate_grad = u * code * gate * (1 - gate)

(the gradients with respect to the code and to the gate's pre-activation). Each program sums its tiles'
|c|^2, |pred|^2, <pred, c> and Gram matrix into one row of `partial`; the caller sums the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditlab.ops._triton import launcher, tl, triton

SUMS = 3  # partial's leading columns: |c|^2, |pred|^2, <pred, c>; then the (2r, 2r) Gram matrix


@dataclass(frozen=True)
class FitTiles:
    rows: int = 64  # tokens per tile
    # columns of c per step of the c D product; a whole (rows, d) tile per step, with the next tile's load issued
    # ahead, ran at half the speed (benchmarks/predictor_cost.md)
    block_k: int = 64
    tiles: int = 8  # tiles per program: the partial sums get one row per rows * tiles tokens
    # at 8 warps the epilogue's registers left one program per SM, its latency exposed; at 4, two
    # (benchmarks/results/fit_rows_variants_seed.md)
    warps: int = 4
    stages: int = 4


DEFAULT_TILES = FitTiles()


if triton is not None:

    @triton.jit
    def _fit_rows(c, gate, code, decoder, gram_weights, gated_out, code_grad, gate_grad, partial, tokens,
                  D: tl.constexpr, R2: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
                  STAGES: tl.constexpr, SUMS: tl.constexpr):
        pid = tl.program_id(0)
        ks = tl.arange(0, R2)
        # M = D^T D (R2, R2) float32, loaded where it is used (an L2 hit) rather than held in registers for the
        # program's life; the two were not compared with this epilogue (benchmarks/predictor_cost.md)
        m_at = gram_weights + ks[:, None] * R2 + ks[None, :]
        gram = tl.zeros([R2, R2], tl.float32)
        c_sq = tl.zeros([ROWS], tl.float32)
        pred_dot = tl.zeros([ROWS], tl.float32)
        for tile in range(TILES):
            rows = ((pid * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            valid = rows < tokens
            decoded = tl.zeros([ROWS, R2], tl.float32)  # c D
            for k0 in tl.range(0, D, BK, num_stages=STAGES):
                kk = k0 + tl.arange(0, BK)
                ct = tl.load(c + rows[:, None] * D + kk[None, :], mask=valid[:, None], other=0.0)
                decoded = tl.dot(ct, tl.load(decoder + kk[:, None] * R2 + ks[None, :]), decoded)
                cf = ct.to(tl.float32)
                c_sq += tl.sum(cf * cf, axis=1)
            small = rows[:, None] * R2 + ks[None, :]
            g = tl.load(gate + small, mask=valid[:, None], other=0.0).to(tl.float32)
            x = tl.load(code + small, mask=valid[:, None], other=0.0).to(tl.float32)
            gated = g * x  # zero on rows past the end: they add nothing below
            pred_dot += tl.sum(decoded * gated, axis=1)
            u = tl.dot(gated, tl.load(m_at), -decoded)
            # the Gram matrix of gated as stored (c's dtype), the features the cross product c^T gated reads; in
            # bf16 it was both faster and closer to float64 than the TF32 product (benchmarks/predictor_cost.md)
            stored = gated.to(gated_out.dtype.element_ty)
            gram = tl.dot(tl.trans(stored), stored, gram)
            tl.store(gated_out + small, stored, mask=valid[:, None])
            tl.store(code_grad + small, (u * g).to(code_grad.dtype.element_ty), mask=valid[:, None])
            tl.store(gate_grad + small, (u * x * g * (1.0 - g)).to(gate_grad.dtype.element_ty), mask=valid[:, None])
        row = partial + pid * (SUMS + R2 * R2)
        tl.store(row, tl.sum(c_sq, axis=0))
        # |pred|^2 summed over the tokens is <M, Gram>: no per-token product kept for it
        tl.store(row + 1, tl.sum(tl.sum(tl.load(m_at) * gram, axis=1), axis=0))
        tl.store(row + 2, tl.sum(pred_dot, axis=0))
        tl.store(row + SUMS + ks[:, None] * R2 + ks[None, :], gram)


def takes(width: int, code_width: int, dtype: torch.dtype, tiles: FitTiles | None = None) -> bool:
    """Whether the kernel computes a correction of this width and dtype with this code width (the device is the
    caller's to check): a width that is a multiple of block_k, a power-of-two code width of at least 16 (tl.dot)."""
    tiles = tiles or DEFAULT_TILES
    return (triton is not None and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and width % tiles.block_k == 0 and code_width & (code_width - 1) == 0 and code_width >= 16)


def programs(tokens: int, tiles: FitTiles | None = None) -> int:
    tiles = tiles or DEFAULT_TILES
    return -(-tokens // (tiles.rows * tiles.tiles))


def fit_rows(c: torch.Tensor, gate: torch.Tensor, code: torch.Tensor, decoder: torch.Tensor,
             gram_weights: torch.Tensor, tiles: FitTiles | None = None, out=None):
    """(gated, code_grad, gate_grad, partial) from c (tokens, d), gate and code (tokens, 2r), decoder (d, 2r) and
    gram_weights = D^T D (2r, 2r) float32. gated in c's dtype; code_grad float32; gate_grad in c's dtype (it
    feeds a product in that dtype); partial (programs, 3 + (2r)^2) float32, see SUMS. `out`: the four outputs,
    preallocated (the tests poison them). The kernel launched directly; the compiled teacher calls
    `fit_rows_op`."""
    return _run(_fit_rows, c, gate, code, decoder, gram_weights, tiles, out)


def _run(kernel, c, gate, code, decoder, gram_weights, tiles=None, out=None):
    tokens, d = c.shape
    r2, tiles = code.shape[1], tiles or DEFAULT_TILES
    if out is None:
        out = (c.new_empty(tokens, r2), torch.empty(tokens, r2, dtype=torch.float32, device=c.device),
               c.new_empty(tokens, r2),
               torch.empty(programs(tokens, tiles), SUMS + r2 * r2, dtype=torch.float32, device=c.device))
    gated, code_grad, gate_grad, partial = out
    kernel[(partial.shape[0],)](
        c.contiguous(), gate.contiguous(), code.contiguous(), decoder.to(c.dtype).contiguous(),
        gram_weights.float().contiguous(), gated, code_grad, gate_grad, partial, tokens, D=d, R2=r2,
        ROWS=tiles.rows, BK=tiles.block_k, TILES=tiles.tiles, STAGES=tiles.stages, SUMS=SUMS,
        num_warps=tiles.warps)
    return gated, code_grad, gate_grad, partial


if triton is not None:

    @torch.library.triton_op("creditlab::fit_rows", mutates_args=())
    def fit_rows_op(c: torch.Tensor, gate: torch.Tensor, code: torch.Tensor, decoder: torch.Tensor,
                    gram_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`fit_rows` as the compiler sees it: a Triton operator, which the compiled backward launches from its own
        code (an opaque custom operator costs a Python dispatch and launch per call, and the teacher makes one
        per branch and micro-batch)."""
        return _run(launcher(_fit_rows, c), c, gate, code, decoder, gram_weights)
