"""The MLP's two products that border its ReLU^2, with the activation in their epilogues.

* `relu2_linear(x, w)` = relu(x w^T)^2: the expansion, squared before the tile leaves the chip, so the
  pre-activation is never written to memory.
* `relu2_dgrad(dy, w, post)` = (dy w) * 2 sqrt(post): the output projection's input-gradient product with the
  activation's derivative applied to each tile as it is stored. With post = relu(h)^2, 2 relu(h) = 2 sqrt(post),
  so the backward needs neither the pre-activation nor a pass of its own over the (tokens, hidden) tensors.
* `matmul(a, b, b_is_kn)`: the same kernel with no epilogue, to measure the kernel against cuBLAS.

One persistent kernel serves all three: each program walks output tiles, grouped along M so that a group's
tiles find their B tiles in L2, loading A and B through TMA descriptors (host-built). The epilogue can run in
column halves, which halves the shared memory its store and the loaded `post` tile take.
"""

from __future__ import annotations

import dataclasses

import torch

from creditlab.ops._triton import multiprocessors, tl, triton

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

EPILOGUE_NONE, EPILOGUE_RELU2, EPILOGUE_RELU2_GRAD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    subtiles: int = 2  # the epilogue's column splits


# The fastest measured at the seed shape on an H200 (benchmarks/relu2_mlp.md), per product.
EXPAND_TILES = TileConfig(group_m=16)
DGRAD_TILES = TileConfig(group_m=16)


if triton is not None:

    @triton.jit
    def _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        in_group = GROUP_M * tiles_n
        first_m = (tile // in_group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % in_group) % rows, (tile % in_group) // rows

    @triton.jit
    def _store_tile(acc, c_desc, aux, off_m, off_n, EPILOGUE: tl.constexpr):
        if EPILOGUE == 1:
            r = tl.maximum(acc, 0.0)
            acc = r * r
        elif EPILOGUE == 2:  # aux: the post tile
            acc = acc * (2.0 * tl.sqrt(aux.to(tl.float32)))
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))

    @triton.jit
    def _matmul_kernel(a_desc, b_desc, c_desc, aux_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                       B_IS_KN: tl.constexpr, EPILOGUE: tl.constexpr, SUBTILES: tl.constexpr):
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        k_steps = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            pid_m, pid_n = _tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
            off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
            HALF: tl.constexpr = BLOCK_N // SUBTILES
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(k_steps):
                off_k = step * BLOCK_K
                a = a_desc.load([off_m, off_k])
                if B_IS_KN:
                    acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
                else:
                    acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
            # The post tile, after the K loop: loaded before it, it stays live across the loop and spills
            # registers (benchmarks/results/relu2_mlp_configs_seed.md: 12.9 ms instead of 0.58 ms).
            aux_left = None
            aux_right = None
            if EPILOGUE == 2:
                aux_left = aux_desc.load([off_m, off_n])
                if SUBTILES == 2:
                    aux_right = aux_desc.load([off_m, off_n + HALF])
            if SUBTILES == 2:
                left, right = acc.reshape(BLOCK_M, 2, HALF).permute(0, 2, 1).split()
                _store_tile(left, c_desc, aux_left, off_m, off_n, EPILOGUE)
                _store_tile(right, c_desc, aux_right, off_m, off_n + HALF, EPILOGUE)
            else:
                _store_tile(acc, c_desc, aux_left, off_m, off_n, EPILOGUE)


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: 2-D, one 16-bit float dtype, rows 16-byte aligned (TMA)."""
    return (a.dim() == 2 and b.dim() == 2 and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
            and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0)


def _programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        return min(tiles, multiprocessors(device.index if device.index is not None else 0))
    return min(tiles, 3)  # the interpreter: a few programs, so that one program walks several tiles


def _launch(a, b, b_is_kn: bool, epilogue: int, aux=None, config: TileConfig | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    cfg = config or (DGRAD_TILES if epilogue == EPILOGUE_RELU2_GRAD else EXPAND_TILES)
    a = a.contiguous()
    b = b.contiguous()
    M, K = a.shape
    N = b.shape[1] if b_is_kn else b.shape[0]
    if (b.shape[0] if b_is_kn else b.shape[1]) != K:
        raise ValueError(f"inner dimensions differ: a {tuple(a.shape)}, b {tuple(b.shape)} (b_is_kn={b_is_kn})")
    c = torch.empty((M, N), dtype=a.dtype, device=a.device) if out is None else out
    if c.shape != (M, N) or c.dtype != a.dtype or not c.is_contiguous():
        raise ValueError(f"out must be a contiguous ({M}, {N}) {a.dtype} matrix")
    epilogue_block = [cfg.block_m, cfg.block_n // cfg.subtiles]
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n] if b_is_kn else [cfg.block_n, cfg.block_k])
    c_desc = TensorDescriptor.from_tensor(c, epilogue_block)
    aux_desc = TensorDescriptor.from_tensor(aux.contiguous(), epilogue_block) if aux is not None else c_desc
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    programs = _programs(a.device, tiles)
    _matmul_kernel[(programs,)](a_desc, b_desc, c_desc, aux_desc, M, N, K, BLOCK_M=cfg.block_m,
                                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PROGRAMS=programs,
                                B_IS_KN=b_is_kn, EPILOGUE=epilogue, SUBTILES=cfg.subtiles,
                                num_stages=cfg.stages, num_warps=cfg.warps)
    return c


def relu2_linear(x: torch.Tensor, w: torch.Tensor, config: TileConfig | None = None, out=None) -> torch.Tensor:
    """relu(x w^T)^2 for x (M, K) and w (N, K), in x's dtype (accumulated in float32)."""
    return _launch(x, w, False, EPILOGUE_RELU2, config=config, out=out)


def relu2_dgrad(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor, config: TileConfig | None = None,
                out=None) -> torch.Tensor:
    """(dy w) * 2 sqrt(post) for dy (M, K), w (K, N) and post (M, N) = relu(h)^2: dL/dh through the ReLU^2."""
    if post.shape != (dy.shape[0], w.shape[1]) or post.dtype != dy.dtype:
        raise ValueError(f"post must be ({dy.shape[0]}, {w.shape[1]}) {dy.dtype}, got {tuple(post.shape)} "
                         f"{post.dtype}")
    return _launch(dy, w, True, EPILOGUE_RELU2_GRAD, aux=post, config=config, out=out)


def matmul(a: torch.Tensor, b: torch.Tensor, b_is_kn: bool, config: TileConfig | None = None,
           out=None) -> torch.Tensor:
    """a b (b: (K, N)) or a b^T (b: (N, K)), no epilogue: the kernel's own speed against cuBLAS."""
    return _launch(a, b, b_is_kn, EPILOGUE_NONE, config=config, out=out)
