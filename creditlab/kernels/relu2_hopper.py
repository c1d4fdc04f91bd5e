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

from creditlab.kernels._triton import multiprocessors, triton

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
                       STAGES: gl.constexpr, GROUP: gl.constexpr, SEPARATE_POST: gl.constexpr):
        """A program's `tile`-th output tile, accumulated in float32: (acc, off_m, off_n, p_m, p_n), p_m and p_n
        the offsets of the tile the operand loads have reached. At K step POST_STEP the previous tile's result
        has left the tile buffer (its store is waited for) and, with LOAD_POST, this tile's post tile is
        requested into it; with SEPARATE_POST, `tile_buf` is a buffer of the post tile's own, and the store is
        not waited for here."""
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
                if not SEPARATE_POST:
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
                    SEPARATE_POST: gl.constexpr, num_warps: gl.constexpr):
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = _accumulator_layout(BN, num_warps)
        tile_buf = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)  # the post tile in, the result out
        if SEPARATE_POST:  # the post tile in a buffer of its own, requested before the result's store has drained
            post_buf = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)
        else:
            post_buf = tile_buf
        post_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(post_ready, count=1)
        a_bufs, b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n = _start_loads(
            a_desc, b_desc, tile_buf, M, N, K_STEPS, B_IS_KN, STAGES, GROUP)
        for tile in range(my_tiles):
            acc, off_m, off_n, p_m, p_n = _tile_products(
                tile, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready,
                post_desc, post_ready, post_buf, acc_layout, K_STEPS, B_IS_KN, EPILOGUE == 2, POST_STEP, STAGES,
                GROUP, SEPARATE_POST)
            if EPILOGUE == 2:
                mbarrier.wait(post_ready, tile & 1)
                post = post_buf.load(acc_layout).to(gl.float32)
                out = acc * (2.0 * gl.sqrt(post))
            elif EPILOGUE == 1:
                r = gl.maximum(acc, 0.0)
                out = r * r
            else:
                out = acc
            if SEPARATE_POST:
                # the previous result has left the tile buffer (the thread that issued its store waits, the rest
                # wait for it), and every thread has read its post values before the next tile's request
                # overwrites them
                tma.store_wait(pendings=0)
                _barrier()
            tile_buf.store(out.to(dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], tile_buf)
        _end_program(ready, STAGES)
        mbarrier.invalidate(post_ready)


    @gluon.jit
    def _post_rows(post, off_m, off_n, piece: gl.constexpr, M, N, PIECE: gl.constexpr, BN: gl.constexpr,
                   rows_layout: gl.constexpr):
        """Rows piece * PIECE .. + PIECE of the post tile at (off_m, off_n), loaded from global memory (zeros past
        the matrix); a piece's loads are issued one piece ahead, so their latency passes during a product."""
        rows = off_m + piece * PIECE + gl.arange(0, PIECE, layout=gl.SliceLayout(1, rows_layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, rows_layout))
        at = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
        inside = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
        return gl.load(post + at, mask=inside, other=0.0)

    @gluon.jit
    def _derivative_piece(piece: gl.constexpr, tile_buf, rows_desc, post_rows, off_m, off_n,
                          rows_layout: gl.constexpr):
        """Rows piece * PIECE .. + PIECE of the tile's raw product in shared memory times 2 sqrt(post), written in
        place and sent out by their own TMA store."""
        PIECE: gl.constexpr = rows_desc.block_type.shape[0]
        block = tile_buf.slice(piece * PIECE, PIECE, dim=0)
        raw = block.load(rows_layout).to(gl.float32)
        block.store((raw * (2.0 * gl.sqrt(post_rows.to(gl.float32)))).to(block.dtype))
        fence_async_shared()
        _barrier()
        _tma_store(rows_desc, [off_m + piece * PIECE, off_n], block)

    @gluon.jit
    def _next_post_rows(piece: gl.constexpr, post, prev_m, prev_n, off_m, off_n, M, N, PIECE: gl.constexpr,
                        PIECES: gl.constexpr, BN: gl.constexpr, rows_layout: gl.constexpr):
        """The post rows of the piece after `piece` of the tile at (prev_m, prev_n): the next piece's, or after
        the last, the first piece's of the tile at (off_m, off_n)."""
        if piece + 1 < PIECES:
            rows = _post_rows(post, prev_m, prev_n, piece + 1, M, N, PIECE, BN, rows_layout)
        else:
            rows = _post_rows(post, off_m, off_n, 0, M, N, PIECE, BN, rows_layout)
        return rows

    @gluon.jit
    def _dgrad_kernel_overlapped(a_desc, b_desc, c_desc, rows_desc, post, M, N, K_STEPS: gl.constexpr,
                                 STAGES: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr):
        """(dy w) * 2 sqrt(post) with each tile's epilogue run in row pieces during the next tile's products (the
        last tile's after them), as qkv_hopper's overlapped kernel runs its epilogue: the tile's raw product waits
        in shared memory in the output dtype (rounded there, as a product stored by cuBLAS before a separate
        derivative pass is), each piece reads its post rows from global memory, loaded a piece ahead, and
        leaves by its own TMA store; the next product enters the buffer when those stores have drained."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        PIECE: gl.constexpr = rows_desc.block_type.shape[0]
        PIECES: gl.constexpr = BM // PIECE
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = _accumulator_layout(BN, num_warps)
        # a warp a row, 8 contiguous entries a thread
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0])
        tile_buf = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)
        a_bufs, b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n = _start_loads(
            a_desc, b_desc, tile_buf, M, N, K_STEPS, True, STAGES, GROUP)
        # the first tile's products alone (no store is pending: the store wait at K step 0 returns at once)
        acc, prev_m, prev_n, p_m, p_n = _tile_products(
            0, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready, c_desc,
            ready, tile_buf, acc_layout, K_STEPS, True, False, 0, STAGES, GROUP, False)
        post_rows = _post_rows(post, prev_m, prev_n, 0, M, N, PIECE, BN, rows_layout)
        tile_buf.store(acc.to(dtype))
        _barrier()
        for tile in range(1, my_tiles):
            off_m, off_n = _tile_offsets(tile * K_STEPS, first, programs, tiles_m, tiles_n, BM, BN, K_STEPS, GROUP)
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
            for k in gl.static_range(K_STEPS):
                acc, p_m, p_n = _k_step(k, tile, acc, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc,
                                        b_desc, a_bufs, b_bufs, ready, BM, BN, K_STEPS, True, STAGES, GROUP)
                if k < PIECES:
                    _derivative_piece(k, tile_buf, rows_desc, post_rows, prev_m, prev_n, rows_layout)
                    post_rows = _next_post_rows(k, post, prev_m, prev_n, off_m, off_n, M, N, PIECE, PIECES, BN,
                                                rows_layout)
            for piece in gl.static_range(K_STEPS, PIECES):
                _derivative_piece(piece, tile_buf, rows_desc, post_rows, prev_m, prev_n, rows_layout)
                post_rows = _next_post_rows(piece, post, prev_m, prev_n, off_m, off_n, M, N, PIECE, PIECES, BN,
                                            rows_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            # the previous tile's pieces have left the buffer (the issuing thread waits, the rest wait for it)
            tma.store_wait(pendings=0)
            _barrier()
            tile_buf.store(acc.to(dtype))
            _barrier()
            prev_m, prev_n = off_m, off_n
        for piece in gl.static_range(PIECES):
            _derivative_piece(piece, tile_buf, rows_desc, post_rows, prev_m, prev_n, rows_layout)
            if piece + 1 < PIECES:
                post_rows = _post_rows(post, prev_m, prev_n, piece + 1, M, N, PIECE, BN, rows_layout)
        _end_program(ready, STAGES)


    @gluon.jit
    def _products_partition(a_desc, b_desc, a_bufs, b_bufs, ready, raw_buf, raw_ready, raw_empty, first, programs,
                            tiles_m, tiles_n, my_tiles, total, p_m, p_n, K_STEPS: gl.constexpr, STAGES: gl.constexpr,
                            GROUP: gl.constexpr, num_warps: gl.constexpr):
        """The specialized kernel's product warps: each tile's K loop (operand loads as in _mlp_kernel), its
        product handed to the epilogue's warps through `raw_buf` once they have emptied it."""
        BN: gl.constexpr = raw_buf.shape[1]
        acc_layout: gl.constexpr = _accumulator_layout(BN, num_warps)
        for tile in range(my_tiles):
            acc, off_m, off_n, p_m, p_n = _tile_products(
                tile, first, programs, tiles_m, tiles_n, total, p_m, p_n, a_desc, b_desc, a_bufs, b_bufs, ready,
                a_desc, raw_ready, raw_buf, acc_layout, K_STEPS, True, False, 0, STAGES, GROUP, True)
            # a barrier starts with its phase 1 complete: the first tile does not wait
            mbarrier.wait(raw_empty, (tile & 1) ^ 1)
            raw_buf.store(acc.to(raw_buf.dtype))
            fence_async_shared()
            mbarrier.arrive(raw_ready, count=1)

    @gluon.jit
    def _derivative_partition(c_desc, post, raw_buf, raw_ready, raw_empty, first, programs, tiles_m, tiles_n,
                              my_tiles, M, N, K_STEPS: gl.constexpr, GROUP: gl.constexpr, PIECE: gl.constexpr,
                              WARPS: gl.constexpr):
        """The specialized kernel's epilogue warps: each tile's product, as the product warps hand it over, times
        2 sqrt(post) in row pieces (each piece's post rows loaded while the piece before is worked), written in
        place and stored by TMA; the buffer is handed back once the store has drained."""
        BM: gl.constexpr = raw_buf.shape[0]
        BN: gl.constexpr = raw_buf.shape[1]
        PIECES: gl.constexpr = BM // PIECE
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [WARPS, 1], [1, 0])
        for tile in range(my_tiles):
            off_m, off_n = _tile_offsets(tile * K_STEPS, first, programs, tiles_m, tiles_n, BM, BN, K_STEPS, GROUP)
            post_rows = _post_rows(post, off_m, off_n, 0, M, N, PIECE, BN, rows_layout)
            mbarrier.wait(raw_ready, tile & 1)
            for piece in gl.static_range(PIECES):
                block = raw_buf.slice(piece * PIECE, PIECE, dim=0)
                raw = block.load(rows_layout).to(gl.float32)
                factor = 2.0 * gl.sqrt(post_rows.to(gl.float32))
                if piece + 1 < PIECES:
                    post_rows = _post_rows(post, off_m, off_n, piece + 1, M, N, PIECE, BN, rows_layout)
                block.store((raw * factor).to(raw_buf.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], raw_buf)
            tma.store_wait(pendings=0)
            mbarrier.arrive(raw_empty, count=1)

    @gluon.jit
    def _dgrad_kernel_specialized(a_desc, b_desc, c_desc, post, M, N, K_STEPS: gl.constexpr, STAGES: gl.constexpr,
                                  GROUP: gl.constexpr, PIECE: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
                                  EPILOGUE_REGISTERS: gl.constexpr, num_warps: gl.constexpr):
        """(dy w) * 2 sqrt(post) with warps specialized: `num_warps` warps issue the loads and the products and
        hand each tile's product (rounded to the output dtype, as a product stored before a derivative pass is)
        through shared memory to EPILOGUE_WARPS other warps, which apply the derivative and store the result
        while the next tile's products run."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        raw_buf = gl.allocate_shared_memory(a_desc.dtype, [BM, BN], c_desc.layout)
        raw_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        raw_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(raw_ready, count=1)
        mbarrier.init(raw_empty, count=1)
        a_bufs, b_bufs, ready, first, programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n = _start_loads(
            a_desc, b_desc, raw_buf, M, N, K_STEPS, True, STAGES, GROUP)
        gl.warp_specialize([
            (_products_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, raw_buf, raw_ready, raw_empty, first,
                                   programs, tiles_m, tiles_n, my_tiles, total, p_m, p_n, K_STEPS, STAGES, GROUP,
                                   num_warps)),
            (_derivative_partition, (c_desc, post, raw_buf, raw_ready, raw_empty, first, programs, tiles_m, tiles_n,
                                     my_tiles, M, N, K_STEPS, GROUP, PIECE, EPILOGUE_WARPS)),
        ], [EPILOGUE_WARPS], [EPILOGUE_REGISTERS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(raw_ready)
        mbarrier.invalidate(raw_empty)


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
            programs: int | None = None, separate_post: bool = False) -> torch.Tensor:
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
                      POST_STEP=min(post_step, K // block_k - 1), STAGES=stages, GROUP=group_m,
                      SEPARATE_POST=separate_post and post is not None, num_warps=warps)
    return out


# The derivative product's forms: the epilogue after each tile's products (the default); in row pieces beside the
# next tile's products (_dgrad_kernel_overlapped); on warps of its own (_dgrad_kernel_specialized)
DGRAD_FORMS = ("whole_tile", "overlapped", "specialized")


def specialized_registers(epilogue_warps: int) -> int:
    """The registers a thread the specialized kernel launches with: the multiprocessor's 65,536 shared by all its
    warps (a multiple of 8), which the partitions then trade among themselves."""
    return 65536 // (32 * (WARPS + epilogue_warps)) // 8 * 8


def _launch_dgrad_apart(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor, form: str, piece_rows: int = 16,
                        group_m: int = GROUP_M, stages: int = STAGES, epilogue_warps: int = 4,
                        epilogue_registers: int = 152) -> torch.Tensor:
    """relu2_dgrad through _dgrad_kernel_overlapped or _dgrad_kernel_specialized (`form`), at 128 x 256 x 64 tiles
    and epilogue pieces of `piece_rows` rows; the specialized kernel with `epilogue_warps` epilogue warps at
    `epilogue_registers` registers a thread (the product warps take the rest of the register file)."""
    M, K = dy.shape
    N = w.shape[1]
    if w.shape[0] != K or post.shape != (M, N) or post.dtype != dy.dtype:
        raise ValueError(f"shapes differ: dy {tuple(dy.shape)}, w {tuple(w.shape)}, post {tuple(post.shape)}")
    if K % BLOCK_K or BLOCK_M % piece_rows:
        raise ValueError(f"the inner dimension ({K}) must be a multiple of {BLOCK_K} and {BLOCK_M} rows a whole "
                         f"number of pieces ({piece_rows})")
    dy, w, post = dy.contiguous(), w.contiguous(), post.contiguous()
    out = torch.empty((M, N), dtype=dy.dtype, device=dy.device)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    grid = (min(tiles, multiprocessors(dy.device.index or 0)),)
    a_desc, b_desc = _descriptor(dy, [BLOCK_M, BLOCK_K]), _descriptor(w, [BLOCK_K, BLOCK_N])
    c_desc = _descriptor(out, [BLOCK_M, BLOCK_N])
    if form == "overlapped":
        _dgrad_kernel_overlapped[grid](a_desc, b_desc, c_desc, _descriptor(out, [piece_rows, BLOCK_N]), post, M, N,
                                       K_STEPS=K // BLOCK_K, STAGES=stages, GROUP=group_m, num_warps=WARPS)
    else:
        _dgrad_kernel_specialized[grid](a_desc, b_desc, c_desc, post, M, N, K_STEPS=K // BLOCK_K, STAGES=stages,
                                        GROUP=group_m, PIECE=piece_rows, EPILOGUE_WARPS=epilogue_warps,
                                        EPILOGUE_REGISTERS=epilogue_registers, num_warps=WARPS,
                                        maxnreg=specialized_registers(epilogue_warps))
    return out


def relu2_linear(x: torch.Tensor, w: torch.Tensor, **tiles) -> torch.Tensor:
    """relu(x w^T)^2 for x (M, K) and w (N, K), one 16-bit dtype (accumulated in float32)."""
    return _launch(x, w, False, EPILOGUE_RELU2, **tiles)


def relu2_dgrad(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor | None, form: str = "whole_tile",
                **tiles) -> torch.Tensor:
    """(dy w) * 2 sqrt(post) for dy (M, K), w (K, N), post (M, N), one 16-bit dtype; with post None, dy w alone
    (the kernel's own speed). Keywords: the tiling (`post_step`, the K step of each tile at which its post tile is
    requested; `group_m`, `stages`, `block_m`, `block_n`, `block_k`, `warps` (4: one warpgroup, at most 64 x 256 or
    128 x 128 of accumulator), `programs`, more than the multiprocessors where two programs fit on one;
    `separate_post`, the post tile in a shared-memory buffer of its own, so that it can be requested at any K step
    without waiting for the previous result's store: 64 KB more, which fits at 2 stages of 64-wide K steps or 4 of
    32-wide ones)). `form` (DGRAD_FORMS, with a post): `overlapped`, each tile's epilogue in row pieces beside the
    next tile's products; `specialized`, on warps of its own (keywords: _launch_dgrad_apart's)."""
    if form not in DGRAD_FORMS:
        raise ValueError(f"no derivative form {form!r}; forms: {', '.join(DGRAD_FORMS)}")
    if form != "whole_tile" and post is not None:
        return _launch_dgrad_apart(dy, w, post, form, **tiles)
    return _launch(dy, w, True, EPILOGUE_NONE if post is None else EPILOGUE_RELU2_GRAD, post=post, **tiles)


def matmul(a: torch.Tensor, b: torch.Tensor, b_is_kn: bool, **tiles) -> torch.Tensor:
    """a b (b: (K, N)) or a b^T (b: (N, K)), no epilogue: the kernel's own speed."""
    return _launch(a, b, b_is_kn, EPILOGUE_NONE, **tiles)
