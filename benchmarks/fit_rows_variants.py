"""Where the teacher's one-pass fit kernel loses its time: the kernel (`kernels/fit_rows.py`) against variants of
its loop structure at the seed shape, alternated, each variant's outputs checked against the kernel's and
against float64 first.

    python benchmarks/fit_rows_variants.py --out DIR [--tokens 131072] [--width 512] [--rank 32]

Writes DIR/fit_rows_variants.json and DIR/fit_rows_variants.md. Any CUDA machine with Triton.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from creditlab.ops import fit_rows  # noqa: E402
from creditlab.ops._triton import tl, triton  # noqa: E402
from creditlab.runtime import largest_relative_error, write_benchmark  # noqa: E402
from fit_rows import branch_problem  # noqa: E402
from fp8_head import alternated_rounds  # noqa: E402

# the kernels below stay plain functions where Triton is missing (the script then refuses to run)
jit = triton.jit if triton is not None else (lambda fn: fn)


@jit
def _epilogue(decoded, m, rows, valid, ks, gate, code, gated_out, code_grad, gate_grad, g, x, R2: tl.constexpr):
    small = rows[:, None] * R2 + ks[None, :]
    gated = g * x
    gated_m = tl.dot(gated, m)
    u = gated_m - decoded
    tl.store(gated_out + small, gated.to(gated_out.dtype.element_ty), mask=valid[:, None])
    tl.store(code_grad + small, (u * g).to(code_grad.dtype.element_ty), mask=valid[:, None])
    tl.store(gate_grad + small, (u * x * g * (1.0 - g)).to(gate_grad.dtype.element_ty), mask=valid[:, None])
    return gated, tl.sum(gated_m * gated, axis=1), tl.sum(decoded * gated, axis=1)


@jit
def _flat(c, gate, code, decoder, gram_weights, gated_out, code_grad, gate_grad, partial, tokens,
          D: tl.constexpr, R2: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
          SUMS: tl.constexpr, LEAN: tl.constexpr, GRAM_BF16: tl.constexpr):
    """Persistent: program p walks tiles p, p + programs, ...; the tile and K loops are one pipelined loop, so the
    next tile's loads are in flight during this tile's epilogue. LEAN: the lean epilogue, M loaded per tile."""
    pid = tl.program_id(0)
    KSTEPS: tl.constexpr = D // BK
    mine = tl.cdiv(tl.cdiv(tokens, ROWS) - pid, tl.num_programs(0))
    ks = tl.arange(0, R2)
    m_at = gram_weights + ks[:, None] * R2 + ks[None, :]
    if not LEAN:
        m = tl.load(m_at)
    gram = tl.zeros([R2, R2], tl.float32)
    c_sq = tl.zeros([ROWS], tl.float32)
    pred_sq = tl.zeros([ROWS], tl.float32)
    pred_dot = tl.zeros([ROWS], tl.float32)
    decoded = tl.zeros([ROWS, R2], tl.float32)
    for it in tl.range(0, mine * KSTEPS, num_stages=STAGES):
        tile = pid + (it // KSTEPS) * tl.num_programs(0)
        k0 = (it % KSTEPS) * BK
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        kk = k0 + tl.arange(0, BK)
        ct = tl.load(c + rows[:, None] * D + kk[None, :], mask=valid[:, None], other=0.0)
        # the accumulator restarts at each tile's first step (reset inside the epilogue's branch, it broke the
        # pipeliner)
        decoded = tl.dot(ct, tl.load(decoder + kk[:, None] * R2 + ks[None, :]), decoded * (k0 != 0).to(tl.float32))
        cf = ct.to(tl.float32)
        c_sq += tl.sum(cf * cf, axis=1)
        if k0 == D - BK:
            if LEAN:
                gated, pd = _lean_epilogue(decoded, tl.load(m_at), rows, valid, ks, gate, code, gated_out,
                                           code_grad, gate_grad, R2, False)
            else:
                small = rows[:, None] * R2 + ks[None, :]
                g = tl.load(gate + small, mask=valid[:, None], other=0.0).to(tl.float32)
                x = tl.load(code + small, mask=valid[:, None], other=0.0).to(tl.float32)
                gated, ps, pd = _epilogue(decoded, m, rows, valid, ks, gate, code, gated_out, code_grad, gate_grad,
                                          g, x, R2)
                pred_sq += ps
            pred_dot += pd
            if GRAM_BF16:
                narrow = gated.to(tl.bfloat16)
                gram = tl.dot(tl.trans(narrow), narrow, gram)
            else:
                gram = tl.dot(tl.trans(gated), gated, gram)
    row = partial + pid * (SUMS + R2 * R2)
    tl.store(row, tl.sum(c_sq, axis=0))
    if LEAN:
        tl.store(row + 1, tl.sum(tl.sum(tl.load(m_at) * gram, axis=1), axis=0))
    else:
        tl.store(row + 1, tl.sum(pred_sq, axis=0))
    tl.store(row + 2, tl.sum(pred_dot, axis=0))
    tl.store(row + SUMS + ks[:, None] * R2 + ks[None, :], gram)


@jit
def _lean_epilogue(decoded, m, rows, valid, ks, gate, code, gated_out, code_grad, gate_grad, R2: tl.constexpr,
                   M_BF16: tl.constexpr):
    """The epilogue with fewer live tiles: u = gated M - c D accumulated onto -c D in one product, and no
    per-token |pred|^2 (it is <M, Gram> summed over the tokens, formed once at the end)."""
    small = rows[:, None] * R2 + ks[None, :]
    g = tl.load(gate + small, mask=valid[:, None], other=0.0).to(tl.float32)
    x = tl.load(code + small, mask=valid[:, None], other=0.0).to(tl.float32)
    gated = g * x
    pred_dot = tl.sum(decoded * gated, axis=1)
    if M_BF16:
        u = tl.dot(gated.to(tl.bfloat16), m.to(tl.bfloat16), -decoded)
    else:
        u = tl.dot(gated, m, -decoded)
    tl.store(gated_out + small, gated.to(gated_out.dtype.element_ty), mask=valid[:, None])
    tl.store(code_grad + small, (u * g).to(code_grad.dtype.element_ty), mask=valid[:, None])
    tl.store(gate_grad + small, (u * x * g * (1.0 - g)).to(gate_grad.dtype.element_ty), mask=valid[:, None])
    return gated, pred_dot


@jit
def _lean(c, gate, code, decoder, gram_weights, gated_out, code_grad, gate_grad, partial, tokens,
          D: tl.constexpr, R2: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
          STAGES: tl.constexpr, SUMS: tl.constexpr, M_PER_TILE: tl.constexpr, PERSISTENT: tl.constexpr,
          GRAM_BF16: tl.constexpr = False, M_BF16: tl.constexpr = False):
    """The lean epilogue; M held for the program's life or loaded (from L2) per tile (M_PER_TILE); tiles
    p*TILES.. in order, or (PERSISTENT) tiles p, p + programs, ... over a grid of about the SM count."""
    pid = tl.program_id(0)
    ks = tl.arange(0, R2)
    m_at = gram_weights + ks[:, None] * R2 + ks[None, :]
    if not M_PER_TILE:
        m = tl.load(m_at)
    gram = tl.zeros([R2, R2], tl.float32)
    c_sq = tl.zeros([ROWS], tl.float32)
    pred_dot = tl.zeros([ROWS], tl.float32)
    if PERSISTENT:
        count = tl.cdiv(tl.cdiv(tokens, ROWS) - pid, tl.num_programs(0))
    else:
        count = TILES
    for i in range(count):
        if PERSISTENT:
            tile = pid + i * tl.num_programs(0)
        else:
            tile = pid * TILES + i
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        decoded = tl.zeros([ROWS, R2], tl.float32)
        for k0 in tl.range(0, D, BK, num_stages=STAGES):
            kk = k0 + tl.arange(0, BK)
            ct = tl.load(c + rows[:, None] * D + kk[None, :], mask=valid[:, None], other=0.0)
            decoded = tl.dot(ct, tl.load(decoder + kk[:, None] * R2 + ks[None, :]), decoded)
            cf = ct.to(tl.float32)
            c_sq += tl.sum(cf * cf, axis=1)
        if M_PER_TILE:
            m = tl.load(m_at)
        gated, pd = _lean_epilogue(decoded, m, rows, valid, ks, gate, code, gated_out, code_grad, gate_grad, R2,
                                   M_BF16)
        pred_dot += pd
        if GRAM_BF16:
            narrow = gated.to(tl.bfloat16)
            gram = tl.dot(tl.trans(narrow), narrow, gram)
        else:
            gram = tl.dot(tl.trans(gated), gated, gram)
    if M_PER_TILE:
        m = tl.load(m_at)
    row = partial + pid * (SUMS + R2 * R2)
    tl.store(row, tl.sum(c_sq, axis=0))
    tl.store(row + 1, tl.sum(tl.sum(m * gram, axis=1), axis=0))
    tl.store(row + 2, tl.sum(pred_dot, axis=0))
    tl.store(row + SUMS + ks[:, None] * R2 + ks[None, :], gram)


@jit
def _early(c, gate, code, decoder, gram_weights, gated_out, code_grad, gate_grad, partial, tokens,
           D: tl.constexpr, R2: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr, TILES: tl.constexpr,
           STAGES: tl.constexpr, SUMS: tl.constexpr, EARLY: tl.constexpr, GRAM: tl.constexpr = True,
           STORES: tl.constexpr = True, MDOT: tl.constexpr = True):
    """The kernel's loops, with the tile's gate and code loaded before its K loop (EARLY) or after it; with GRAM,
    STORES or MDOT off, the Gram product, the three token-wise stores or the product with M left out (wrong
    results: only to see what each costs)."""
    pid = tl.program_id(0)
    ks = tl.arange(0, R2)
    m = tl.load(gram_weights + ks[:, None] * R2 + ks[None, :])
    gram = tl.zeros([R2, R2], tl.float32)
    c_sq = tl.zeros([ROWS], tl.float32)
    pred_sq = tl.zeros([ROWS], tl.float32)
    pred_dot = tl.zeros([ROWS], tl.float32)
    for tile in range(TILES):
        rows = ((pid * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        small = rows[:, None] * R2 + ks[None, :]
        if EARLY:
            g = tl.load(gate + small, mask=valid[:, None], other=0.0).to(tl.float32)
            x = tl.load(code + small, mask=valid[:, None], other=0.0).to(tl.float32)
        decoded = tl.zeros([ROWS, R2], tl.float32)
        for k0 in tl.range(0, D, BK, num_stages=STAGES):
            kk = k0 + tl.arange(0, BK)
            ct = tl.load(c + rows[:, None] * D + kk[None, :], mask=valid[:, None], other=0.0)
            decoded = tl.dot(ct, tl.load(decoder + kk[:, None] * R2 + ks[None, :]), decoded)
            cf = ct.to(tl.float32)
            c_sq += tl.sum(cf * cf, axis=1)
        if not EARLY:
            g = tl.load(gate + small, mask=valid[:, None], other=0.0).to(tl.float32)
            x = tl.load(code + small, mask=valid[:, None], other=0.0).to(tl.float32)
        if STORES and MDOT:
            gated, ps, pd = _epilogue(decoded, m, rows, valid, ks, gate, code, gated_out, code_grad, gate_grad, g,
                                      x, R2)
        else:
            gated = g * x
            gated_m = tl.dot(gated, m) if MDOT else gated
            u = gated_m - decoded
            ps = tl.sum(gated_m * gated, axis=1)
            pd = tl.sum(decoded * gated, axis=1) + tl.sum(u * x * g, axis=1)
            if STORES:
                tl.store(gated_out + small, gated.to(gated_out.dtype.element_ty), mask=valid[:, None])
                tl.store(code_grad + small, (u * g).to(code_grad.dtype.element_ty), mask=valid[:, None])
                tl.store(gate_grad + small, (u * x * g * (1.0 - g)).to(gate_grad.dtype.element_ty),
                         mask=valid[:, None])
        pred_sq += ps
        pred_dot += pd
        if GRAM:
            gram = tl.dot(tl.trans(gated), gated, gram)
    row = partial + pid * (SUMS + R2 * R2)
    tl.store(row, tl.sum(c_sq, axis=0))
    tl.store(row + 1, tl.sum(pred_sq, axis=0))
    tl.store(row + 2, tl.sum(pred_dot, axis=0))
    tl.store(row + SUMS + ks[:, None] * R2 + ks[None, :], gram)


@jit
def _stream(c, decoder, decoded_out, partial, tokens, D: tl.constexpr, R2: tl.constexpr, ROWS: tl.constexpr,
            BK: tl.constexpr, TILES: tl.constexpr, STAGES: tl.constexpr, STRIDE: tl.constexpr):
    """Only what reads c: c D (written in float32) and |c|^2. The bytes the fit cannot avoid, at this loop's rate."""
    pid = tl.program_id(0)
    ks = tl.arange(0, R2)
    c_sq = tl.zeros([ROWS], tl.float32)
    for tile in range(TILES):
        rows = ((pid * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        decoded = tl.zeros([ROWS, R2], tl.float32)
        for k0 in tl.range(0, D, BK, num_stages=STAGES):
            kk = k0 + tl.arange(0, BK)
            ct = tl.load(c + rows[:, None] * D + kk[None, :], mask=valid[:, None], other=0.0)
            decoded = tl.dot(ct, tl.load(decoder + kk[:, None] * R2 + ks[None, :]), decoded)
            cf = ct.to(tl.float32)
            c_sq += tl.sum(cf * cf, axis=1)
        tl.store(decoded_out + rows[:, None] * R2 + ks[None, :], decoded, mask=valid[:, None])
    tl.store(partial + pid * STRIDE, tl.sum(c_sq, axis=0))


@jit
def _tokenwise(decoded_in, gate, code, gram_weights, gated_out, code_grad, gate_grad, partial, tokens,
               R2: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, SUMS: tl.constexpr):
    """The second kernel of a split fit: everything but the reads of c, from c D written in float32."""
    pid = tl.program_id(0)
    ks = tl.arange(0, R2)
    m_at = gram_weights + ks[:, None] * R2 + ks[None, :]
    gram = tl.zeros([R2, R2], tl.float32)
    pred_dot = tl.zeros([ROWS], tl.float32)
    for i in range(TILES):
        rows = ((pid * TILES + i) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        decoded = tl.load(decoded_in + rows[:, None] * R2 + ks[None, :], mask=valid[:, None], other=0.0)
        gated, pd = _lean_epilogue(decoded, tl.load(m_at), rows, valid, ks, gate, code, gated_out, code_grad,
                                   gate_grad, R2, False)
        pred_dot += pd
        gram = tl.dot(tl.trans(gated), gated, gram)
    row = partial + pid * (SUMS + R2 * R2)
    tl.store(row + 1, tl.sum(tl.sum(tl.load(m_at) * gram, axis=1), axis=0))
    tl.store(row + 2, tl.sum(pred_dot, axis=0))
    tl.store(row + SUMS + ks[:, None] * R2 + ks[None, :], gram)


def outputs(c, r2, programs):
    tokens = c.shape[0]
    return (c.new_empty(tokens, r2), torch.empty(tokens, r2, dtype=torch.float32, device=c.device),
            c.new_empty(tokens, r2),
            torch.empty(programs, fit_rows.SUMS + r2 * r2, dtype=torch.float32, device=c.device))


def main() -> int:
    problem = branch_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    _, out, N, d, r2 = problem
    torch.manual_seed(0)
    c = (torch.randn(N, d, device="cuda") * 1e-3).bfloat16()
    gate = torch.rand(N, r2, device="cuda").bfloat16()
    code = (torch.randn(N, r2, device="cuda") * 1e-2).bfloat16()
    decoder = (torch.randn(d, r2, device="cuda") * 0.05).bfloat16()
    m = decoder.float().t() @ decoder.float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = fit_rows.DEFAULT_TILES
    args_common = (c, gate, code, decoder, m)

    runs, outs = {}, {}

    def add(name, launch, programs):
        o = outputs(c, r2, programs)
        outs[name] = o
        runs[name] = lambda: launch(o)

    grid = fit_rows.programs(N)
    add("kernel", lambda o: fit_rows.fit_rows(*args_common, out=o), grid)
    info = {}

    def variant(name, warps=base.warps, rows=base.rows, tiles=base.tiles, stages=base.stages, **flags):
        programs = triton.cdiv(N, rows * tiles)

        def launch(o):
            compiled(name, _early[(programs,)](*args_common, *o, N, D=d, R2=r2, ROWS=rows, BK=base.block_k,
                                               TILES=tiles, STAGES=stages, SUMS=fit_rows.SUMS, num_warps=warps,
                                               **flags))
        add(name, launch, programs)

    variant("the kernel's loops (control)", EARLY=False)
    variant("gate and code loaded before the K loop", EARLY=True)
    variant("no Gram product (wrong)", EARLY=False, GRAM=False)
    variant("no token-wise stores (wrong)", EARLY=False, STORES=False)
    variant("no product with M (wrong)", EARLY=False, MDOT=False)
    variant("none of the three (wrong)", EARLY=False, GRAM=False, STORES=False, MDOT=False)
    variant("stores only (wrong)", EARLY=False, GRAM=False, MDOT=False)
    variant("32 rows a tile, 4 warps", EARLY=False, rows=32, warps=4, tiles=16)
    variant("the kernel's loops, 4 warps", EARLY=False, warps=4)
    variant("128 rows a tile, 8 warps", EARLY=False, rows=128, warps=8, tiles=4)

    def compiled(name, handle):
        info.setdefault(name, {"registers": handle.n_regs, "spills": handle.n_spills,
                               "shared_bytes": handle.metadata.shared})

    def lean(name, warps=8, stages=base.stages, maxnreg=None, persistent=0, **flags):
        programs = persistent * sms if persistent else grid
        extra = {"maxnreg": maxnreg} if maxnreg else {}

        def launch(o):
            compiled(name, _lean[(programs,)](*args_common, *o, N, D=d, R2=r2, ROWS=base.rows, BK=base.block_k,
                                              TILES=base.tiles, STAGES=stages, SUMS=fit_rows.SUMS,
                                              PERSISTENT=bool(persistent), num_warps=warps, **flags, **extra))
        add(name, launch, programs)

    lean("lean epilogue, M held", M_PER_TILE=False)
    lean("lean epilogue, M per tile", M_PER_TILE=True)
    lean("lean, M per tile, Gram in bf16", M_PER_TILE=True, GRAM_BF16=True)
    lean("lean, M per tile, both products in bf16", M_PER_TILE=True, GRAM_BF16=True, M_BF16=True)
    lean("lean, M per tile, 4 warps", M_PER_TILE=True, warps=4)
    lean("lean, M per tile, at most 168 registers", M_PER_TILE=True, maxnreg=168)
    lean("lean, M per tile, at most 128 registers", M_PER_TILE=True, maxnreg=128)
    lean("lean, M per tile, 4 warps, Gram in bf16", M_PER_TILE=True, warps=4, GRAM_BF16=True)
    lean("lean, M per tile, 4 warps, both products in bf16", M_PER_TILE=True, warps=4, GRAM_BF16=True, M_BF16=True)
    lean("lean, M held, 4 warps", M_PER_TILE=False, warps=4)
    for stages in (2, 3):
        lean(f"lean, M per tile, 4 warps, {stages} stages", M_PER_TILE=True, warps=4, stages=stages)
    for maxnreg in (168, 128):
        lean(f"lean, M per tile, 4 warps, at most {maxnreg} registers", M_PER_TILE=True, warps=4, maxnreg=maxnreg)
    lean("lean, M per tile, persistent (1 program an SM)", M_PER_TILE=True, persistent=1)
    lean("lean, M per tile, persistent (3 programs an SM), 4 warps", M_PER_TILE=True, persistent=3, warps=4)
    lean("lean, M per tile, persistent (2 programs an SM), 4 warps", M_PER_TILE=True, persistent=2, warps=4)

    def flat(name, per_sm=1, stages=3, block_k=base.block_k, warps=8, **flags):
        programs = per_sm * sms

        def launch(o):
            compiled(name, _flat[(programs,)](*args_common, *o, N, D=d, R2=r2, ROWS=base.rows, BK=block_k,
                                              STAGES=stages, SUMS=fit_rows.SUMS, num_warps=warps, **flags))
        add(name, launch, programs)

    for lean_epilogue in (False, True):
        tag = "lean" if lean_epilogue else "kernel's epilogue"
        for stages in (2, 3, 4):
            flat(f"one loop, {tag}, {stages} stages", stages=stages, LEAN=lean_epilogue, GRAM_BF16=False)
        flat(f"one loop, {tag}, 3 stages, 2 programs an SM", per_sm=2, LEAN=lean_epilogue, GRAM_BF16=False)
        flat(f"one loop, {tag}, 3 stages, 4 warps, 2 programs an SM", per_sm=2, warps=4, LEAN=lean_epilogue,
             GRAM_BF16=False)
        flat(f"one loop, {tag}, 128 columns a step, 2 stages", stages=2, block_k=128, LEAN=lean_epilogue,
             GRAM_BF16=False)
    flat("one loop, lean, Gram in bf16, 3 stages", LEAN=True, GRAM_BF16=True)

    def split(o, warps):
        gated, code_grad, gate_grad, partial = o
        _stream[(grid,)](c, decoder, split_decoded, partial, N, D=d, R2=r2, ROWS=base.rows, BK=base.block_k,
                         TILES=base.tiles, STAGES=base.stages, STRIDE=partial.shape[1], num_warps=base.warps)
        compiled(f"split in two kernels, the second {warps} warps",
                 _tokenwise[(grid,)](split_decoded, gate, code, m, gated, code_grad, gate_grad, partial, N, R2=r2,
                                     ROWS=base.rows, TILES=base.tiles, SUMS=fit_rows.SUMS, num_warps=warps))

    split_decoded = torch.empty(N, r2, dtype=torch.float32, device="cuda")
    for warps in (8, 4):
        add(f"split in two kernels, the second {warps} warps", lambda o, w=warps: split(o, w), grid)
    decoded = torch.empty(N, r2, dtype=torch.float32, device="cuda")
    stream_partial = torch.empty(grid, dtype=torch.float32, device="cuda")
    stream = lambda: _stream[(grid,)](c, decoder, decoded, stream_partial, N, D=d, R2=r2, ROWS=base.rows,  # noqa: E731
                                      BK=base.block_k, TILES=base.tiles, STAGES=base.stages, STRIDE=1,
                                      num_warps=base.warps)
    cublas = lambda: torch.mm(c, decoder, out_dtype=torch.float32)  # noqa: E731

    c64, g64, x64, d64 = c.double(), gate.double(), code.double(), decoder.double()
    gated64 = g64 * x64
    residual64 = gated64 @ (d64.t() @ d64) - c64 @ d64
    exact = {"gated": gated64, "code_grad": residual64 * g64, "gate_grad": residual64 * x64 * g64 * (1 - g64),
             "sums": torch.stack([c64.square().sum(), (residual64 + c64 @ d64).mul(gated64).sum(),
                                  (c64 @ d64).mul(gated64).sum()]), "gram": gated64.t() @ gated64}
    del c64, g64, x64, residual64

    def float64_errors(o):
        sums = o[3].double().sum(0)
        got = {"gated": o[0], "code_grad": o[1], "gate_grad": o[2], "sums": sums[:fit_rows.SUMS],
               "gram": sums[fit_rows.SUMS:].view(r2, r2)}
        return {k: largest_relative_error(got[k].double(), exact[k]) for k in exact}

    exact_errors = {}
    # every variant against the kernel: the token-wise outputs and the summed partials
    reference = outs["kernel"]
    runs["kernel"]()
    errors, failed = {}, {}
    for name in list(runs):
        try:
            runs[name]()
            torch.cuda.synchronize()
        except Exception as error:  # a launch shape past the chip's shared memory or registers
            failed[name] = f"{type(error).__name__}: {str(error)[:160]}"
            del runs[name]
            continue
        got = outs[name]
        if name.endswith("(wrong)"):
            continue
        errors[name] = max([largest_relative_error(a.float(), b.float()) for a, b in zip(got[:3], reference[:3])]
                           + [largest_relative_error(got[3].sum(0), reference[3].sum(0))])
        exact_errors[name] = float64_errors(got)
        print(f"{name}: max relative difference from the kernel {errors[name]:.2e}; against float64 "
              + ", ".join(f"{k} {v:.1e}" for k, v in exact_errors[name].items()), flush=True)
    runs["reads of c alone (c D and |c|^2)"] = stream
    runs["cuBLAS c D alone"] = cublas
    rounds = alternated_rounds(runs)
    times = {name: statistics.median(ms) for name, ms in rounds.items()}
    per_round = {name: statistics.median(a / b for a, b in zip(rounds[name], rounds["kernel"])) for name in rounds}
    moved = N * d * 2 + N * r2 * (2 + 2 + 2 + 4 + 2)
    result = {"shape": {"tokens": N, "width": d, "code_width": r2}, "times_ms": times, "rounds_ms": rounds,
              "per_round_over_kernel": per_round, "difference_from_kernel": errors, "float64_errors": exact_errors,
              "failed": failed,
              "compiled": info,
              "least_bytes": moved, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# The fit kernel's loops, {N} tokens x {d}, code width {r2} ({result['device']}, torch "
             f"{torch.__version__})", "", "Ten alternated rounds of five calls; least bytes of the fit "
             f"{moved / 1e6:.0f} MB.", "",
             "| variant | ms (median) | per round over the kernel | TB/s of the fit's least bytes | max rel. difference |",
             "|---|---|---|---|---|"]
    for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
        diff = f"{errors[name]:.1e}" if name in errors else "-"
        lines.append(f"| {name} | {ms:.4f} | {per_round[name]:.4f} | {moved / ms / 1e9:.2f} | {diff} |")
    lines += ["", "Error against float64 (largest entry's difference over the float64 result's largest entry):", "",
              "| variant | " + " | ".join(exact) + " |", "|---|" + "---|" * len(exact)]
    lines += [f"| {name} | " + " | ".join(f"{e[k]:.1e}" for k in exact) + " |" for name, e in exact_errors.items()]
    lines += ["", "| variant | registers | spills | shared bytes |", "|---|---|---|---|"]
    lines += [f"| {name} | {i['registers']} | {i['spills']} | {i['shared_bytes']} |" for name, i in info.items()]
    if failed:
        lines += ["", "Failed to launch:"] + [f"- {k}: {v}" for k, v in failed.items()]
    write_benchmark(out, "fit_rows_variants", result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
