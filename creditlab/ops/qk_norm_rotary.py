"""QK-norm and rotary positions, one pass each way, over the Q/K/V projection's output.

Forward (`qk_norm_rotary_forward`): per token and head, q and k are RMS-normalized over the head dimension and
rotated by the token's position; v is copied out beside them, so that attention reads three contiguous
(tokens, heads, head_dim) tensors and nothing else of the projection's output is needed. The row scales
1/rms are kept for the backward.

Backward (`qk_norm_rotary_backward`): the gradients of the rotated q and k are rotated back, passed through the
norm's VJP, dx = s (dn - n mean(dn * n)) with n recovered from the rotated output by rotating back,
and written with v's gradient into one (tokens, 3 * width) gradient of the projection's output: no separate
pass assembles it.

Arithmetic in float32; inputs and outputs in the projection's dtype.
"""

from __future__ import annotations

import torch

from creditlab.ops._triton import tl, triton

# Tokens per program (a program handles one head of them) and warps: among the fastest at the seed shape on an
# H200 for both kernels (benchmarks/results/qk_norm_tiles_seed.txt).
ROWS, WARPS = 16, 4
BACKWARD_ROWS, BACKWARD_WARPS = 16, 4


if triton is not None:

    @triton.jit
    def _block(cos, sin, tokens, T, H: tl.constexpr, HD: tl.constexpr, ROWS: tl.constexpr):
        """This program's tokens and head: rows, their mask, the half-row columns, the rotation's cos and sin at
        their positions, and the offsets of the head's first half in a (tokens, heads, head_dim) tensor."""
        HALF: tl.constexpr = HD // 2
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        valid = rows < tokens
        cols = tl.arange(0, HALF)
        pos = (rows % T)[:, None] * HALF + cols[None, :]
        c = tl.load(cos + pos, mask=valid[:, None], other=1.0)  # 1, not 0: the backward divides by c^2 + s^2
        s = tl.load(sin + pos, mask=valid[:, None], other=0.0)
        out_at = rows[:, None] * (H * HD) + tl.program_id(1) * HD + cols[None, :]
        return rows, valid, cols, c, s, out_at

    @triton.jit
    def _qk_forward(qkv, q_out, k_out, v_out, scale_out, cos, sin, tokens, T, row_stride, H: tl.constexpr,
                    HD: tl.constexpr, eps, ROWS: tl.constexpr):
        HALF: tl.constexpr = HD // 2
        rows, valid, cols, c, s, out_at = _block(cos, sin, tokens, T, H, HD, ROWS)
        width = H * HD
        head = tl.program_id(1)
        for part in tl.static_range(2):  # q, then k
            at = rows[:, None] * row_stride + part * width + head * HD + cols[None, :]
            x1 = tl.load(qkv + at, mask=valid[:, None], other=0.0).to(tl.float32)
            x2 = tl.load(qkv + at + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
            scale = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)
            n1, n2 = x1 * scale[:, None], x2 * scale[:, None]
            if part == 0:
                dst = q_out
            else:
                dst = k_out
            tl.store(dst + out_at, (n1 * c + n2 * s).to(dst.dtype.element_ty), mask=valid[:, None])
            tl.store(dst + out_at + HALF, (n2 * c - n1 * s).to(dst.dtype.element_ty), mask=valid[:, None])
            tl.store(scale_out + (rows * 2 + part) * H + head, scale, mask=valid)
        at = rows[:, None] * row_stride + 2 * width + head * HD + cols[None, :]
        for half in tl.static_range(2):
            v = tl.load(qkv + at + half * HALF, mask=valid[:, None], other=0.0)
            tl.store(v_out + out_at + half * HALF, v, mask=valid[:, None])

    @triton.jit
    def _qk_backward(dq, dk, dv, q_out, k_out, scales, cos, sin, dqkv, tokens, T, H: tl.constexpr,
                  HD: tl.constexpr, ROWS: tl.constexpr):
        HALF: tl.constexpr = HD // 2
        rows, valid, cols, c, s, out_at = _block(cos, sin, tokens, T, H, HD, ROWS)
        width = H * HD
        head = tl.program_id(1)
        for part in tl.static_range(2):
            if part == 0:
                grad = dq
                out = q_out
            else:
                grad = dk
                out = k_out
            g1 = tl.load(grad + out_at, mask=valid[:, None], other=0.0).to(tl.float32)
            g2 = tl.load(grad + out_at + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
            o1 = tl.load(out + out_at, mask=valid[:, None], other=0.0).to(tl.float32)
            o2 = tl.load(out + out_at + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
            scale = tl.load(scales + (rows * 2 + part) * H + head, mask=valid, other=0.0)
            # the rotation's transpose, applied to the gradient and (to recover n) to the output
            dn1, dn2 = g1 * c - g2 * s, g1 * s + g2 * c
            inv = 1.0 / (c * c + s * s)  # R^T R = (c^2 + s^2) I for rounded cos and sin
            n1, n2 = (o1 * c - o2 * s) * inv, (o1 * s + o2 * c) * inv
            mean = (tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1)) / HD
            at = rows[:, None] * (3 * width) + part * width + head * HD + cols[None, :]
            dx1 = scale[:, None] * (dn1 - n1 * mean[:, None])
            dx2 = scale[:, None] * (dn2 - n2 * mean[:, None])
            tl.store(dqkv + at, dx1.to(dqkv.dtype.element_ty), mask=valid[:, None])
            tl.store(dqkv + at + HALF, dx2.to(dqkv.dtype.element_ty), mask=valid[:, None])
        at = rows[:, None] * (3 * width) + 2 * width + head * HD + cols[None, :]
        for half in tl.static_range(2):
            g = tl.load(dv + out_at + half * HALF, mask=valid[:, None], other=0.0)
            tl.store(dqkv + at + half * HALF, g.to(dqkv.dtype.element_ty), mask=valid[:, None])


def _grid(tokens: int, heads: int):
    return (triton.cdiv(tokens, ROWS), heads)


def qk_norm_rotary_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, eps: float = 1e-6,
                           out=None):
    """(q, k, v, scales) from qkv (B, T, 3 * width): q and k normalized and rotated, v copied, each (B, T, heads,
    head_dim) in qkv's dtype; scales (B, T, 2, heads) float32, the 1/rms of q and k. cos, sin: (>= T, head_dim/2)
    float32. `out`: the four outputs, preallocated (the tests poison them). qkv's rows may lie further apart than
    their width (a view of a wider product's columns): they are read in place."""
    B, T, three_width = qkv.shape
    hd = three_width // 3 // heads
    if not (qkv.stride(-1) == 1 and qkv.stride(0) == T * qkv.stride(1)):
        qkv = qkv.contiguous()
    if out is None:
        out = (*(qkv.new_empty((B, T, heads, hd)) for _ in range(3)),
               torch.empty((B, T, 2, heads), dtype=torch.float32, device=qkv.device))
    q, k, v, scales = out
    tokens = B * T
    _qk_forward[_grid(tokens, heads)](qkv, q, k, v, scales, cos.contiguous(), sin.contiguous(), tokens, T, qkv.stride(1),
                                      H=heads, HD=hd, eps=eps, ROWS=ROWS, num_warps=WARPS)
    return q, k, v, scales


def qk_norm_rotary_backward(dq, dk, dv, q, k, scales, cos, sin, out=None) -> torch.Tensor:
    """d loss / d qkv (B, T, 3 * width) from the gradients of the forward's q, k, v and its q, k and scales."""
    B, T, heads, hd = q.shape
    dqkv = q.new_empty((B, T, 3 * heads * hd)) if out is None else out
    tokens = B * T
    _qk_backward[(triton.cdiv(tokens, BACKWARD_ROWS), heads)](
        dq.contiguous(), dk.contiguous(), dv.contiguous(), q, k, scales, cos.contiguous(), sin.contiguous(), dqkv,
        tokens, T, H=heads, HD=hd, ROWS=BACKWARD_ROWS, num_warps=BACKWARD_WARPS)
    return dqkv
