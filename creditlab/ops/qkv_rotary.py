"""The Q/K/V product with QK-norm and rotary positions in its epilogue.

`qkv_norm_rotary(x, w, cos, sin, T, eps)` computes x w^T for x (tokens, d) and w (3 width, d) and, before a tile
leaves the chip, RMS-normalizes each head of q and k over the head dimension and rotates it by its token's
position (t = row mod T), exactly what the one-pass QK-norm kernel (qk_norm_rotary.py) does to the product's
output. The product's output is never written: the kernel writes q, k and v laid out for attention, and the
per-token, per-head row scales that the QK-norm's backward (the same backward kernel) reads. q, k and v are
the three slabs of one (3, tokens, width) tensor, stored through one 3-D descriptor with the part as a coordinate,
so the epilogue has no branch on which part a tile holds.

An output tile spans one or two whole heads (BLOCK_N = head_dim or 2 head_dim) of one of q, k, v, so a head's
sum of squares is a row reduction inside the tile and each rotated pair (j, j + head_dim / 2) sits in the same
tile. The product loop is relu2_matmul's: a persistent program walks tiles grouped along M, operands through TMA.
"""

from __future__ import annotations

import dataclasses

import torch

from creditlab.ops._triton import tl, triton
from creditlab.ops.relu2_matmul import _programs

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from creditlab.ops.relu2_matmul import _tile_coordinates


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int = 128
    heads_per_tile: int = 2  # BLOCK_N = heads_per_tile * head_dim
    block_k: int = 64
    group_m: int = 16
    stages: int = 3
    warps: int = 8


# relu2_matmul's fastest expansion tiles (128 x 256 x 64, groups of 16) at the seed's head_dim 128; to be
# measured for this epilogue (benchmarks/qkv_rotary.py).
DEFAULT_TILES = TileConfig()


if triton is not None:

    @triton.jit
    def _store_head(x, out_desc, scales, cos, sin, part, head, off_m, M, T, eps,
                    BLOCK_M: tl.constexpr, HD: tl.constexpr, H: tl.constexpr):
        """One head's (BLOCK_M, HD) tile of part 0 (q), 1 (k) or 2 (v): q and k normalized and rotated, v as is
        (scale 1, no rotation). Branch-free on `part`: a branch inside the flattened tile loop fails Triton
        3.6's loop fusion, and one 3-D descriptor over (q, k, v) takes the part as a coordinate."""
        HALF: tl.constexpr = HD // 2
        first, second = x.reshape(BLOCK_M, 2, HALF).permute(0, 2, 1).split()
        rows = off_m + tl.arange(0, BLOCK_M)
        normed = part < 2
        normed_rows = rows < tl.where(normed, M, 0)  # rows of the matrix, in a tile of q or k
        # rows past M were loaded as zeros by TMA: a finite scale, never stored
        rms_scale = 1.0 / tl.sqrt((tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)) / HD + eps)
        tl.store(scales + rows * (2 * H) + part * H + head, rms_scale, mask=normed_rows)
        scale = tl.where(normed, rms_scale, 1.0)
        n1, n2 = first * scale[:, None], second * scale[:, None]
        at = (rows % T)[:, None] * HALF + tl.arange(0, HALF)[None, :]
        c = tl.load(cos + at, mask=normed_rows[:, None], other=1.0)
        s = tl.load(sin + at, mask=normed_rows[:, None], other=0.0)
        col = head * HD
        out_desc.store([part, off_m, col], (n1 * c + n2 * s).reshape(1, BLOCK_M, HALF).to(out_desc.dtype))
        out_desc.store([part, off_m, col + HALF], (n2 * c - n1 * s).reshape(1, BLOCK_M, HALF).to(out_desc.dtype))

    @triton.jit
    def _qkv_kernel(a_desc, b_desc, out_desc, scales, cos, sin, M, T, eps, K: tl.constexpr,
                    WIDTH: tl.constexpr, HD: tl.constexpr, HEADS_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
        H: tl.constexpr = WIDTH // HD
        BLOCK_N: tl.constexpr = HEADS_PER_TILE * HD
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n: tl.constexpr = 3 * WIDTH // BLOCK_N
        k_steps: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
            off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(k_steps):
                off_k = step * BLOCK_K
                acc = tl.dot(a_desc.load([off_m, off_k]), b_desc.load([off_n, off_k]).T, acc)
            part = off_n // WIDTH
            head = (off_n % WIDTH) // HD
            if HEADS_PER_TILE == 2:
                left, right = acc.reshape(BLOCK_M, 2, HD).permute(0, 2, 1).split()
                _store_head(left, out_desc, scales, cos, sin, part, head, off_m, M, T, eps, BLOCK_M, HD, H)
                _store_head(right, out_desc, scales, cos, sin, part, head + 1, off_m, M, T, eps, BLOCK_M, HD, H)
            else:
                _store_head(acc, out_desc, scales, cos, sin, part, head, off_m, M, T, eps, BLOCK_M, HD, H)


def supported(x: torch.Tensor, w: torch.Tensor, heads: int) -> bool:
    """Whether the kernel takes these operands: 2-D, one 16-bit float dtype, rows 16-byte aligned (TMA) and a head
    dimension that is a power of two of at least 16."""
    if x.dim() != 2 or w.dim() != 2 or x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return _shapes_fit(x, w, heads)


def _shapes_fit(x: torch.Tensor, w: torch.Tensor, heads: int) -> bool:
    width, rem = divmod(w.shape[0], 3)
    hd = width // heads if heads and width % heads == 0 else 0
    return rem == 0 and hd >= 16 and hd & (hd - 1) == 0 and x.shape[1] == w.shape[1] and x.shape[1] % 8 == 0


def checked_operands(x: torch.Tensor, w: torch.Tensor, heads: int, takes: bool, kernel: str):
    """(x, w, tokens, d, width, head_dim), x and w contiguous, where the kernel `takes` them; else one line naming
    what it does not take."""
    if not takes:
        raise ValueError(f"the {kernel} does not take x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} "
                         f"with {heads} heads on {x.device}")
    width = w.shape[0] // 3
    return x.contiguous(), w.contiguous(), x.shape[0], x.shape[1], width, width // heads


def empty_outputs(x: torch.Tensor, width: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels (this one and qkv_hopper's) write for x (tokens, d): qkv (3, tokens, width) in x's dtype
    and the row scales (tokens, 2, heads) in float32."""
    return (torch.empty((3, x.shape[0], width), dtype=x.dtype, device=x.device),
            torch.empty((x.shape[0], 2, heads), dtype=torch.float32, device=x.device))


def _tiles(config: TileConfig | None, heads: int) -> TileConfig:
    """The tiles asked for, one head a tile where two do not divide the heads."""
    cfg = config or DEFAULT_TILES
    return cfg if heads % cfg.heads_per_tile == 0 else dataclasses.replace(cfg, heads_per_tile=1)


def qkv_norm_rotary(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, T: int,
                    eps: float, config: TileConfig | None = None, out=None):
    """(qkv, scales) of x w^T, x (tokens, d) with tokens = batches of T, w (3 width, d): qkv (3, tokens, width) in
    x's dtype holds q and k RMS-normalized per head and rotated (cos, sin: (>= T, head_dim / 2), float32), then v
    as projected; scales (tokens, 2, heads) float32, 1 / rms of each head of q and k. `out`: the two tensors to
    write (a test poisons them)."""
    cfg = _tiles(config, heads)
    x, w, M, K, width, hd = checked_operands(x, w, heads, _shapes_fit(x, w, heads) and x.dtype == w.dtype, "kernel")
    qkv, scales = out if out is not None else empty_outputs(x, width, heads)
    a_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(w, [cfg.heads_per_tile * hd, cfg.block_k])
    out_desc = TensorDescriptor.from_tensor(qkv, [1, cfg.block_m, hd // 2])
    tiles = triton.cdiv(M, cfg.block_m) * (3 * heads // cfg.heads_per_tile)
    programs = _programs(x.device, tiles)
    _qkv_kernel[(programs,)](a_desc, b_desc, out_desc, scales, cos.contiguous(), sin.contiguous(), M, T, eps, K=K,
                             WIDTH=width, HD=hd, HEADS_PER_TILE=cfg.heads_per_tile, BLOCK_M=cfg.block_m,
                             BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PROGRAMS=programs, num_stages=cfg.stages,
                             num_warps=cfg.warps)
    return qkv, scales
