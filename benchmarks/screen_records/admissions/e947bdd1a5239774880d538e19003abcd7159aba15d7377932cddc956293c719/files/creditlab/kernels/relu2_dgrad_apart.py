"""The MLP's derivative product (relu2_hopper.relu2_dgrad) with its epilogue apart from the warps' products: two
forms that each measured slower than relu2_hopper's kernel, kept so that their records can be re-run
(benchmarks/relu2_mlp.md; the step's options model.mlp_dgrad=gluon_overlapped and gluon_specialized).

In both the tile's product waits in shared memory, rounded to the output dtype (as a product stored by cuBLAS
before a separate derivative pass is), and its epilogue reads the post rows by plain loads: the overlapped form
runs the epilogue in row pieces between the next tile's K steps on the warps that issue the products; the
specialized form hands the tile to a warpgroup of its own (gl.warp_specialize), which stores it while the product
warps go on.
"""

from __future__ import annotations

import torch

from creditlab.kernels._triton import multiprocessors, triton
from creditlab.kernels.relu2_hopper import BLOCK_K, BLOCK_M, BLOCK_N, GROUP_M, STAGES, WARPS, _descriptor, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

    from creditlab.kernels.relu2_hopper import (_accumulator_layout, _barrier, _end_program, _k_step, _start_loads,
                                                _tile_offsets, _tile_products, _tma_store)

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


# The forms: each tile's epilogue in row pieces beside the next tile's products (_dgrad_kernel_overlapped); on
# warps of its own (_dgrad_kernel_specialized)
FORMS = ("overlapped", "specialized")


def specialized_registers(epilogue_warps: int) -> int:
    """The registers a thread the specialized kernel launches with: the multiprocessor's 65,536 shared by all its
    warps (a multiple of 8), which the partitions then trade among themselves."""
    return 65536 // (32 * (WARPS + epilogue_warps)) // 8 * 8


def relu2_dgrad(dy: torch.Tensor, w: torch.Tensor, post: torch.Tensor, form: str, piece_rows: int = 16,
                group_m: int = GROUP_M, stages: int = STAGES, epilogue_warps: int = 4,
                epilogue_registers: int = 152) -> torch.Tensor:
    """relu2_hopper.relu2_dgrad's (dy w) * 2 sqrt(post) through _dgrad_kernel_overlapped or
    _dgrad_kernel_specialized (`form`, one of FORMS), at 128 x 256 x 64 tiles and epilogue pieces of `piece_rows`
    rows; the specialized kernel with `epilogue_warps` epilogue warps at `epilogue_registers` registers a thread
    (the product warps take the rest of the register file)."""
    if form not in FORMS:
        raise ValueError(f"no derivative form {form!r}; forms: {', '.join(FORMS)}")
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
