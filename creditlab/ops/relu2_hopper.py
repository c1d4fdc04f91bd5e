"""The fused MLP's two products for Hopper, written in Gluon: `relu2_linear` = relu(x w^T)^2 and `relu2_dgrad` =
(dy w) * 2 sqrt(post), the latter with the post tile brought in by TMA while the tile's products run.

The Triton kernel (`relu2_matmul.py`) reads the post tile after its K loop: the read cannot overlap the products,
and loaded before the loop the tile would sit in registers across it. Here the post tile lands in shared memory
by an asynchronous copy issued part-way through the tile's K loop, the epilogue writes the result over it in
shared memory and stores it with an asynchronous copy that drains while the next tile's products run. Each
program walks output tiles in the grouped order of the Triton kernel. The operand loads run a fixed number of K
steps ahead across tile boundaries, so the next tile's first operands are in flight during this tile's epilogue.
The K loop is unrolled within a tile: an accumulator carried across a loop edge while a product is in flight
makes ptxas wait for every product there (benchmarks/relu2_mlp.md).

Shared memory at 128 x 256 x 64 tiles, 3 stages: 48 KB of A, 96 KB of B and 64 KB for the post / result tile.
"""

from __future__ import annotations

import functools

import torch

from creditlab.ops._triton import multiprocessors, triton

try:  # Gluon ships with Triton 3.4 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - an install without Gluon
    gluon = None
else:  # Triton 3.9 renamed the TMA copies (the old names raise there)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # renamed in Triton 3.9 too

BLOCK_M, BLOCK_N, BLOCK_K, STAGES, WARPS, GROUP_M = 128, 256, 64, 3, 8, 16
EPILOGUE_NONE, EPILOGUE_RELU2, EPILOGUE_RELU2_GRAD = 0, 1, 2  # as in relu2_matmul.py

if gluon is not None:

    @gluon.jit
    def _tile_offsets(step, first, programs, tiles_m, tiles_n, BM: gl.constexpr, BN: gl.constexpr,
                      K_STEPS: gl.constexpr, GROUP: gl.constexpr):
        """The output tile of a program's flat step number, in the Triton kernel's grouped order."""
        tile = first + (step // K_STEPS) * programs
        in_group = GROUP * tiles_n
        first_m = (tile // in_group) * GROUP
        rows = min(tiles_m - first_m, GROUP)
        return (first_m + (tile % in_group) % rows) * BM, ((tile % in_group) // rows) * BN

    @gluon.jit
    def _issue_operands(step, total, off_m, off_n, a_desc, b_desc, a_bufs, b_bufs, ready, K_STEPS: gl.constexpr,
                        STAGES: gl.constexpr, B_IS_KN: gl.constexpr):
        """The TMA loads of step `step`'s A and B tiles into stage step % STAGES (none past the last step)."""
        BK: gl.constexpr = a_desc.block_type.shape[1]
        live = step < total
        stage = step % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=live)
        _tma_load(a_desc, [off_m, (step % K_STEPS) * BK], bar, a_bufs.index(stage), pred=live)
        if B_IS_KN:
            _tma_load(b_desc, [(step % K_STEPS) * BK, off_n], bar, b_bufs.index(stage), pred=live)
        else:
            _tma_load(b_desc, [off_n, (step % K_STEPS) * BK], bar, b_bufs.index(stage), pred=live)

    @gluon.jit
    def _k_step(k: gl.constexpr, tile, acc, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc,
                a_bufs, b_bufs, ready, BM: gl.constexpr, BN: gl.constexpr, K_STEPS: gl.constexpr,
                B_IS_KN: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr):
        """K step k of a program's `tile`-th tile: its product issued asynchronously once its operands have
        landed, the step before waited for, and the stage that step read refilled STAGES - 1 steps ahead (p_m
        and p_n, the tile the loads have reached, moved on at its first step). Returns (acc, p_m, p_n), acc with
        this step's product still in flight."""
        step = tile * K_STEPS + k
        stage = step % STAGES
        mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
        b = b_bufs.index(stage) if B_IS_KN else b_bufs.index(stage).permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(stage), b, acc, use_acc=k > 0, is_async=True)
        # the step before has finished reading its stage, which the load below refills
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if (k + STAGES - 1) % K_STEPS == 0:
            p_m, p_n = _tile_offsets(step + STAGES - 1, first, programs, tiles_m, tiles_n, BM, BN, K_STEPS, GROUP)
        _issue_operands(step + STAGES - 1, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready, K_STEPS, STAGES,
                        B_IS_KN)
        return acc, p_m, p_n

    @gluon.jit
    def _tile_products(tile, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs,
                       ready, post_desc, post_ready, tile_buf, acc_layout: gl.constexpr, K_STEPS: gl.constexpr,
                       B_IS_KN: gl.constexpr, LOAD_POST: gl.constexpr, POST_STEP: gl.constexpr,
                       STAGES: gl.constexpr, GROUP: gl.constexpr):
        """A program's `tile`-th output tile, accumulated in float32: (acc, off_m, off_n, p_m, p_n), p_m and p_n
        the offsets of the tile the operand loads have reached. At K step POST_STEP the previous tile's result
        has left the tile buffer (its store is waited for) and, with LOAD_POST, this tile's post tile is
        requested into it."""
        BM: gl.constexpr = tile_buf.shape[0]
        BN: gl.constexpr = tile_buf.shape[1]
        off_m, off_n = _tile_offsets(tile * K_STEPS, first, programs, tiles_m, tiles_n, BM, BN, K_STEPS, GROUP)
        # The K loop is unrolled and the accumulator starts afresh each tile, so no product's result crosses
        # a loop edge while in flight (where ptxas would wait for it).
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        for k in gl.static_range(K_STEPS):
            acc, p_m, p_n = _k_step(k, tile, acc, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc,
                                    a_bufs, b_bufs, ready, BM, BN, K_STEPS, B_IS_KN, STAGES, GROUP)
            if k == POST_STEP:
                tma.store_wait(pendings=0)
                if LOAD_POST:
                    mbarrier.expect(post_ready, post_desc.block_type.nbytes)
                    _tma_load(post_desc, [off_m, off_n], post_ready, tile_buf)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return acc, off_m, off_n, p_m, p_n

    @gluon.jit
    def _start_loads(a_desc, b_desc, tile_buf, M, N, K_STEPS: gl.constexpr, B_IS_KN: gl.constexpr,
                     STAGES: gl.constexpr, GROUP: gl.constexpr):
        """A program's operand buffers and barriers, with the first STAGES - 1 steps' loads issued: (a_bufs,
        b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n) for _tile_products. The
        loads run STAGES - 1 steps ahead of the products, into the next tile near a tile's end; a tile's offsets
        are worked out once, when the loads (then the products) reach its first step."""
        BM: gl.constexpr = tile_buf.shape[0]
        BN: gl.constexpr = tile_buf.shape[1]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        tiles_m = gl.cdiv(M, BM)
        tiles_n = gl.cdiv(N, BN)
        first = gl.program_id(0)
        programs = gl.num_programs(0)
        my_tiles = gl.cdiv(tiles_m * tiles_n - first, programs)
        total = my_tiles * K_STEPS
        for early in gl.static_range(STAGES - 1):
            p_m, p_n = _tile_offsets(early, first, programs, tiles_m, tiles_n, BM, BN, K_STEPS, GROUP)
            _issue_operands(early, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready, K_STEPS, STAGES,
                            B_IS_KN)
        p_m, p_n = _tile_offsets(STAGES - 2, first, programs, tiles_m, tiles_n, BM, BN, K_STEPS, GROUP)
        return a_bufs, b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n

    @gluon.constexpr_function
    def _accumulator_layout(BN, num_warps):
        """The accumulator's registers: one warpgroup instruction per 16 rows a warp, the whole tile's width."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])

    @gluon.jit
    def _end_program(ready, STAGES: gl.constexpr):
        """A program's last stores waited for and its operand barriers retired."""
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

    @gluon.jit
    def _mlp_kernel(a_desc, b_desc, post_desc, c_desc, M, N, K_STEPS: gl.constexpr, B_IS_KN: gl.constexpr,
                    EPILOGUE: gl.constexpr, POST_STEP: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                    num_warps: gl.constexpr):
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = _accumulator_layout(BN, num_warps)
        tile_buf = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)  # the post tile in, the result out
        post_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(post_ready, count=1)
        a_bufs, b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n = _start_loads(
            a_desc, b_desc, tile_buf, M, N, K_STEPS, B_IS_KN, STAGES, GROUP)
        for tile in range(my_tiles):
            acc, off_m, off_n, p_m, p_n = _tile_products(
                tile, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready,
                post_desc, post_ready, tile_buf, acc_layout, K_STEPS, B_IS_KN, EPILOGUE == 2, POST_STEP, STAGES,
                GROUP)
            if EPILOGUE == 2:
                mbarrier.wait(post_ready, tile & 1)
                post = tile_buf.load(acc_layout).to(gl.float32)
                out = acc * (2.0 * gl.sqrt(post))
            elif EPILOGUE == 1:
                r = gl.maximum(acc, 0.0)
                out = r * r
            else:
                out = acc
            tile_buf.store(out.to(dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], tile_buf)
        _end_program(ready, STAGES)
        mbarrier.invalidate(post_ready)


def available(t: torch.Tensor) -> bool:
    """Whether the Gluon kernel can run on t's device: a CUDA device of compute capability 9 with Gluon."""
    return gluon is not None and t.is_cuda and _major_capability(t.device.index or 0) == 9


@functools.cache
def _major_capability(index: int) -> int:  # asked at every MLP backward
    return torch.cuda.get_device_capability(index)[0]


def _descriptor(t: torch.Tensor, block: list[int]):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16
                                                                                       if t.dtype == torch.bfloat16
                                                                                       else gl.float16))


def _launch(a: torch.Tensor, b: torch.Tensor, b_is_kn: bool, epilogue: int, post: torch.Tensor | None = None,
            post_step: int = 3, group_m: int = GROUP_M, stages: int = STAGES, block_m: int = BLOCK_M,
            block_n: int = BLOCK_N, block_k: int = BLOCK_K, warps: int = WARPS,
            programs: int | None = None) -> torch.Tensor:
    M, K = a.shape
    N, b_k = (b.shape[1], b.shape[0]) if b_is_kn else b.shape
    if b_k != K or (post is not None and (post.shape != (M, N) or post.dtype != a.dtype)):
        raise ValueError(f"shapes differ: a {tuple(a.shape)}, b {tuple(b.shape)} (b_is_kn={b_is_kn}), post "
                         f"{None if post is None else tuple(post.shape)}")
    if K % block_k:
        raise ValueError(f"the inner dimension ({K}) must be a multiple of block_k ({block_k})")
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    c_desc = _descriptor(out, [block_m, block_n])
    post_desc = _descriptor(post.contiguous(), [block_m, block_n]) if post is not None else c_desc
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    grid = (min(tiles, programs or multiprocessors(a.device.index or 0)),)
    _mlp_kernel[grid](_descriptor(a, [block_m, block_k]),
                      _descriptor(b, [block_k, block_n] if b_is_kn else [block_n, block_k]), post_desc, c_desc, M, N,
                      K_STEPS=K // block_k, B_IS_KN=b_is_kn, EPILOGUE=epilogue,
                      POST_STEP=min(post_step, K // block_k - 1), STAGES=stages, GROUP=group_m, num_warps=warps)
    return out


def relu2_linear(x: torch.Tensor, w: torch.Tensor, **tiles) -> torch.Tensor:
    """relu(x w^T)^2 for x (M, K) and w (N, K), one 16-bit dtype (accumulated in float32)."""
    return _launch(x, w, False, EPILOGUE_RELU2, **tiles)


def relu2_dgrad(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor | None, **tiles) -> torch.Tensor:
    """(dy w) * 2 sqrt(post) for dy (M, K), w (K, N), post (M, N), one 16-bit dtype; with post None, dy w alone
    (the kernel's own speed). Keywords: the tiling (`post_step`, the K step of each tile at which its post tile is
    requested; `group_m`, `stages`, `block_m`, `block_n`, `block_k`, `warps` (4: one warpgroup, at most 64 x 256 or
    128 x 128 of accumulator), `programs`, more than the multiprocessors where two programs fit on one)."""
    return _launch(dy, w, True, EPILOGUE_NONE if post is None else EPILOGUE_RELU2_GRAD, post=post, **tiles)


def matmul(a: torch.Tensor, b: torch.Tensor, b_is_kn: bool, **tiles) -> torch.Tensor:
    """a b (b: (K, N)) or a b^T (b: (N, K)), no epilogue: the kernel's own speed."""
    return _launch(a, b, b_is_kn, EPILOGUE_NONE, **tiles)
