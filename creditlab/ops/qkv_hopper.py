"""The Q/K/V product with QK-norm and rotary in its epilogue (`qkv_rotary.py`'s function) for Hopper, in Gluon.

The products run in relu2_hopper.py's loop: operand loads through TMA a fixed number of K steps ahead, across tile
boundaries, and the tile's result leaves through an asynchronous TMA store that drains while the next tile's
products run. Triton's loop in `qkv_rotary.py` cannot overlap its epilogue so, and its products alone ran 4-10%
behind cuBLAS on the MLP's shapes where this loop's ran within 2% (benchmarks/relu2_mlp.md).

The epilogue: the tile (one or two whole heads of q, k or v) goes to shared memory in the output dtype, as the
op-by-op path rounds the product before its norm; each head's two halves come back in a plain row layout, are
normalized and rotated in float32 and go back in place, and the whole tile leaves by one TMA store; a tile of v
leaves as the product made it. q, k and v are the slabs of one (3, tokens, width)
tensor, addressed as (3 tokens, width) rows, so the tokens must be a whole number of tiles (`supported`).
"""

from __future__ import annotations

import torch

from creditlab.ops import qkv_rotary, relu2_hopper
from creditlab.ops._triton import multiprocessors, triton
from creditlab.ops.relu2_hopper import gluon

BLOCK_M, BLOCK_K, STAGES, WARPS, GROUP_M, POST_STEP, HEADS_PER_TILE = 128, 64, 3, 8, 16, 3, 2
if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    from creditlab.ops.relu2_hopper import (_accumulator_layout, _barrier, _end_program, _start_loads,
                                                _tile_products, _tma_store)

    @gluon.constexpr_function
    def _half_head_rows(HALF, num_warps):
        """The epilogue's register layout: a half head a thread row of 8 columns (16-byte shared-memory reads)."""
        return gl.BlockedLayout([1, 8], [32 * 8 // HALF, HALF // 8], [num_warps, 1], [1, 0])

    @gluon.jit
    def _rows(off_m, M, part, BM: gl.constexpr, rows_layout: gl.constexpr):
        """BM rows from off_m: their indices, and whether each is a row of q or k (not v, not past the matrix)."""
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, rows_layout))
        return rows, rows < gl.where(part < 2, M, 0)

    @gluon.jit
    def _rotary_tables(cos, sin, rows, normed_rows, T, HALF: gl.constexpr, rows_layout: gl.constexpr):
        """The rows' rotary tables (c, s); for a row of v or past the matrix, c 1 and s 0, read from nowhere."""
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, rows_layout))
        at = gl.expand_dims(rows % T, 1) * HALF + gl.expand_dims(cols, 0)
        c = gl.load(cos + at, mask=gl.expand_dims(normed_rows, 1), other=1.0)
        s = gl.load(sin + at, mask=gl.expand_dims(normed_rows, 1), other=0.0)
        return c, s

    @gluon.jit
    def _tables(cos, sin, off_m, M, T, part, BM: gl.constexpr, HALF: gl.constexpr, rows_layout: gl.constexpr):
        """A tile's rows (_rows) and their rotary tables (_rotary_tables): (rows, normed_rows, c, s)."""
        rows, normed_rows = _rows(off_m, M, part, BM, rows_layout)
        c, s = _rotary_tables(cos, sin, rows, normed_rows, T, HALF, rows_layout)
        return rows, normed_rows, c, s

    @gluon.jit
    def _norm_rotate_head(block, h: gl.constexpr, scales, rows, normed_rows, c, s, off_n, part, eps,
                          WIDTH: gl.constexpr, HD: gl.constexpr, rows_layout: gl.constexpr):
        """Head h of the rows `block` holds in shared memory, normalized and rotated in place (in float32; in a
        tile of v at scale 1, with c 1 and s 0), the row scales of q and k stored."""
        HALF: gl.constexpr = HD // 2
        H: gl.constexpr = WIDTH // HD
        lo = block.slice(h * HD, HALF, dim=1)
        hi = block.slice(h * HD + HALF, HALF, dim=1)
        first_half = lo.load(rows_layout).to(gl.float32)
        second_half = hi.load(rows_layout).to(gl.float32)
        squares = gl.sum(first_half * first_half, axis=1) + gl.sum(second_half * second_half, axis=1)
        rms_scale = 1.0 / gl.sqrt(squares / HD + eps)
        head = (off_n % WIDTH) // HD + h
        gl.store(scales + rows * (2 * H) + part * H + head, rms_scale, mask=normed_rows)
        scale = gl.expand_dims(gl.where(part < 2, rms_scale, 1.0), 1)
        n1, n2 = first_half * scale, second_half * scale
        lo.store((n1 * c + n2 * s).to(block.dtype))
        hi.store((n2 * c - n1 * s).to(block.dtype))

    @gluon.jit
    def _norm_rotate(tile_buf, scales, rows, normed_rows, c, s, off_n, part, eps, WIDTH: gl.constexpr,
                     HD: gl.constexpr, rows_layout: gl.constexpr):
        """Every head of the tile in shared memory, as _norm_rotate_head."""
        for h in gl.static_range(tile_buf.shape[1] // HD):
            _norm_rotate_head(tile_buf, h, scales, rows, normed_rows, c, s, off_n, part, eps, WIDTH, HD,
                              rows_layout)

    @gluon.jit
    def _qkv_kernel(a_desc, b_desc, out_desc, scales, cos, sin, M, T, eps, WIDTH: gl.constexpr, HD: gl.constexpr,
                    K_STEPS: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, POST_STEP: gl.constexpr,
                    num_warps: gl.constexpr):
        BM: gl.constexpr = out_desc.block_type.shape[0]
        BN: gl.constexpr = out_desc.block_type.shape[1]
        HALF: gl.constexpr = HD // 2
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = _accumulator_layout(BN, num_warps)
        rows_layout: gl.constexpr = _half_head_rows(HALF, num_warps)
        tile_buf = gl.allocate_shared_memory(dtype, [BM, BN], out_desc.layout)
        a_bufs, b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n = _start_loads(
            a_desc, b_desc, tile_buf, M, 3 * WIDTH, K_STEPS, False, STAGES, GROUP)
        for tile in range(my_tiles):
            # no post tile to load (the descriptor and barrier passed for it go unused)
            acc, off_m, off_n, p_m, p_n = _tile_products(
                tile, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready,
                out_desc, ready, tile_buf, acc_layout, K_STEPS, False, False, POST_STEP, STAGES, GROUP)
            # the previous tile's store has drained (waited for at K step POST_STEP)
            tile_buf.store(acc.to(dtype))
            _barrier()
            part = off_n // WIDTH
            if part < 2:  # q and k normalized and rotated; a tile of v leaves as the product made it
                rows, normed_rows, c, s = _tables(cos, sin, off_m, M, T, part, BM, HALF, rows_layout)
                _norm_rotate(tile_buf, scales, rows, normed_rows, c, s, off_n, part, eps, WIDTH, HD, rows_layout)
            # every thread's writes made visible to the TMA engine, then all of them done before one thread
            # issues the store (a barrier before the fence would let the store overtake a late fence)
            fence_async_shared()
            _barrier()
            _tma_store(out_desc, [part * M + off_m, off_n % WIDTH], tile_buf)
        _end_program(ready, STAGES)


def supported(x: torch.Tensor, w: torch.Tensor, heads: int) -> bool:
    """Whether this kernel takes the operands on x's device: Hopper with Gluon, qkv_rotary's operands, tokens a
    whole number of tiles, d a whole number of K steps and a head_dim of 64 or 128 (a tile is two heads, at most
    256 columns wide)."""
    if not (relu2_hopper.available(x) and x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype == torch.bfloat16):
        return False
    width = w.shape[0] // 3
    hd = width // heads if heads and width % heads == 0 and heads % 2 == 0 else 0
    return (w.shape[0] % 3 == 0 and hd in (64, 128) and x.shape[1] == w.shape[1] and x.shape[1] % BLOCK_K == 0
            and x.shape[0] % BLOCK_M == 0)


def qkv_norm_rotary(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, T: int,
                    eps: float, heads_per_tile: int = HEADS_PER_TILE, group_m: int = GROUP_M, stages: int = STAGES,
                    post_step: int = POST_STEP, block_m: int = BLOCK_M, warps: int = WARPS,
                    programs: int | None = None):
    """qkv_rotary.qkv_norm_rotary's (qkv (3, tokens, width), scales (tokens, 2, heads)) through the Gluon kernel;
    operands as `supported` takes them. Keywords: the tiling (a tile one or two heads wide, `block_m` rows of
    which the tokens are a whole number; the rest as relu2_hopper's)."""
    x, w, M, K, width, hd = qkv_rotary.checked_operands(x, w, heads, supported(x, w, heads), "Gluon kernel")
    qkv, scales = qkv_rotary.empty_outputs(x, width, heads)
    if M % block_m:
        raise ValueError(f"the tokens ({M}) must be a whole number of {block_m}-row tiles")
    block_n = heads_per_tile * hd
    out_desc = relu2_hopper._descriptor(qkv.view(3 * M, width), [block_m, block_n])
    tiles = triton.cdiv(M, block_m) * (3 * width // block_n)
    grid = (min(tiles, programs or multiprocessors(x.device.index or 0)),)
    _qkv_kernel[grid](relu2_hopper._descriptor(x, [block_m, BLOCK_K]), relu2_hopper._descriptor(w, [block_n, BLOCK_K]),
                      out_desc, scales, cos.contiguous(), sin.contiguous(), M, T, eps, WIDTH=width, HD=hd,
                      K_STEPS=K // BLOCK_K, STAGES=stages, GROUP=group_m, POST_STEP=min(post_step, K // BLOCK_K - 1),
                      num_warps=warps)
    return qkv, scales
