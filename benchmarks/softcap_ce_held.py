"""The head loss's soft-capped cross-entropy kernel against variants: one pass (the row held on chip); two
passes with the next block's load issued ahead, cache hints that keep a row in L2 for its second pass, or the
second pass's exp2 on the FMA units; the two passes as two kernels (the second over a 2-D grid of gradient
blocks); on one chunk of the step, alternated in one process, each variant's loss and gradient checked against
float64 first.

    python benchmarks/softcap_ce_held.py --out DIR [--rows 8192] [--vocab 12289] [--padded 12352]

Writes DIR/softcap_ce_held.json and DIR/softcap_ce_held.md. Any CUDA machine with Triton.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from creditlab.ops import softcap_ce  # noqa: E402
from creditlab.ops._triton import tl, triton  # noqa: E402
from creditlab.ops.loss import HEAD_GRAD_FP8, HEAD_GRAD_SCALE, softcap_ce_rows as torch_rows  # noqa: E402
from creditlab.runtime import gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402
from fp8_head import alternated_rounds  # noqa: E402
from softcap_ce import chunk_problem  # noqa: E402

CAP = 15.0
# the kernels below stay plain functions where Triton is missing (the script then refuses to run)
jit = triton.jit if triton is not None else (lambda fn: fn)


@jit
def _exp2_fma(x):
    """2^x for x <= 0 on the FMA units: 2^floor(x) from the exponent bits times a degree-5 polynomial of the
    fraction (least squares in relative error on [0, 1): at most 1.6e-7)."""
    x = tl.maximum(x, -125.0)
    whole = tl.floor(x)
    f = x - whole
    p = 1.8762336e-3
    p = p * f + 8.9925891e-3
    p = p * f + 5.5823594e-2
    p = p * f + 2.4015453e-1
    p = p * f + 6.9315296e-1
    p = p * f + 9.9999994e-1
    bits = p.to(tl.int32, bitcast=True) + (whole.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@jit
def _load_hinted(row_ptr, cols, vocab, padded, WIDE: tl.constexpr, POLICY: tl.constexpr):
    """A block of logits in float32, zero past the vocabulary: WIDE, the kernel's own load (masked at the padded
    width); else the load the kernel made before, masked at the vocabulary (the same SASS: 2-byte loads and
    stores)."""
    valid = cols < vocab
    if WIDE:
        return softcap_ce._load_row(row_ptr, cols, valid, padded, POLICY)
    return tl.load(row_ptr + cols, mask=valid, other=0.0, eviction_policy=POLICY).to(tl.float32)


@jit
def _held_piece(row_ptr, start, SIZE: tl.constexpr, vocab, padded, cap, inv_cap, target, FAST: tl.constexpr,
                WIDE: tl.constexpr):
    """One piece of a row: (e * (1 - t^2) per column, sum of e, the target's z and 1 - t^2 if it lies here),
    e = exp(z - cap), z = cap * t, t = tanh(l / cap); zero past the true vocabulary."""
    LOG2E: tl.constexpr = 1.4426950408889634
    cols = start + tl.arange(0, SIZE)
    valid = cols < vocab
    t = softcap_ce._tanh(_load_hinted(row_ptr, cols, vocab, padded, WIDE, "") * inv_cap, FAST)
    e = tl.where(valid, tl.exp2((cap * t - cap) * LOG2E), 0.0)
    slope = 1.0 - t * t
    here = cols == target
    return (e * slope, tl.sum(e, axis=0), tl.sum(tl.where(here, cap * t, 0.0), axis=0),
            tl.sum(tl.where(here, slope, 0.0), axis=0))


@jit
def _held_store(grad_row, start, SIZE: tl.constexpr, padded, weighted, per_e, target, target_term):
    cols = start + tl.arange(0, SIZE)
    g = weighted * per_e - tl.where(cols == target, target_term, 0.0)
    tl.store(grad_row + cols, g.to(grad_row.dtype.element_ty), mask=cols < padded)


@jit
def _softcap_ce_rows_held(logits_ptr, grad_ptr, targets_ptr, loss_ptr, stride, cap, scale, vocab: tl.constexpr,
                          padded: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
                          FAST: tl.constexpr, WIDE: tl.constexpr):
    """The whole row held on chip in up to three power-of-two pieces (P1 + P2 + P3 >= padded): each logit read
    once and each transcendental computed once. Only e (1 - t^2) is held per column: with p = e / sum(e),
    the gradient is scale (p - onehot)(1 - t^2) = (scale / sum(e)) e (1 - t^2) - onehot scale (1 - t_target^2)."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride
    grad_row = grad_ptr + row * stride
    target = tl.load(targets_ptr + row)
    inv_cap = 1.0 / cap
    w1, sum_e, target_z, target_slope = _held_piece(logits_row, 0, P1, vocab, padded, cap, inv_cap, target, FAST, WIDE)
    if P2 > 0:
        w2, s2, z2, d2 = _held_piece(logits_row, P1, P2, vocab, padded, cap, inv_cap, target, FAST, WIDE)
        sum_e, target_z, target_slope = sum_e + s2, target_z + z2, target_slope + d2
    if P3 > 0:
        w3, s3, z3, d3 = _held_piece(logits_row, P1 + P2, P3, vocab, padded, cap, inv_cap, target, FAST, WIDE)
        sum_e, target_z, target_slope = sum_e + s3, target_z + z3, target_slope + d3
    tl.store(loss_ptr + row, cap + tl.log(sum_e) - target_z)
    per_e, target_term = scale / sum_e, scale * target_slope
    _held_store(grad_row, 0, P1, padded, w1, per_e, target, target_term)
    if P2 > 0:
        _held_store(grad_row, P1, P2, padded, w2, per_e, target, target_term)
    if P3 > 0:
        _held_store(grad_row, P1 + P2, P3, padded, w3, per_e, target, target_term)


def held_pieces(padded: int) -> tuple[int, int, int]:
    """A row of `padded` columns as up to three power-of-two pieces covering it, the last one masked: 12,352 ->
    8,192 + 4,096 + 64, where one power of two would hold 16,384 columns."""
    first = 1 << (padded.bit_length() - 1)
    rest = padded - first
    second = 1 << (rest.bit_length() - 1) if rest else 0
    third = triton.next_power_of_2(rest - second) if rest > second else 0
    return first, second, third


def held(logits, targets, vocab, cap, scale, warps=8, max_registers=None, wide=True, grad_dtype=None):
    n, padded = logits.shape
    grad = torch.empty_like(logits, dtype=grad_dtype or logits.dtype)
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    first, second, third = held_pieces(padded)
    launch = dict(num_warps=warps) | ({"maxnreg": max_registers} if max_registers else {})
    _softcap_ce_rows_held[(n,)](logits, grad, targets, loss, logits.stride(0), float(cap), float(scale), vocab=vocab,
                                padded=padded, P1=first, P2=second, P3=third, FAST=logits.is_cuda, WIDE=wide,
                                **launch)
    return loss, grad


@jit
def _block(row_ptr, cols, ahead, vocab, padded, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, WIDE: tl.constexpr,
           POLICY: tl.constexpr):
    """(this block, the one loaded ahead): with PREFETCH the block loaded one step before and the next one's load
    issued now; else this block's load, now."""
    if PREFETCH:
        return ahead, _load_hinted(row_ptr, cols + BLOCK, vocab, padded, WIDE, POLICY)
    return _load_hinted(row_ptr, cols, vocab, padded, WIDE, POLICY), ahead


@jit
def _two_pass(logits_ptr, grad_ptr, targets_ptr, loss_ptr, stride, cap, scale, vocab: tl.constexpr,
              padded: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, HINTS: tl.constexpr,
              FMA_EXP2: tl.constexpr, FAST: tl.constexpr, WIDE: tl.constexpr):
    """The kernel's two passes (kernels/softcap_ce.py), its loads masked at the padded width (WIDE) or, as before,
    at the vocabulary; with PREFETCH: each block's load issued one block ahead;
    HINTS: the first pass's loads kept in L2 (evict_last), the second's and the gradient's stores streamed
    (evict_first); FMA_EXP2: the second pass's exp2 by polynomial, one MUFU op less an element."""
    LOG2E: tl.constexpr = 1.4426950408889634
    FIRST: tl.constexpr = "evict_last" if HINTS else ""
    SECOND: tl.constexpr = "evict_first" if HINTS else ""
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride
    grad_row = grad_ptr + row * stride
    target = tl.load(targets_ptr + row)
    inv_cap = 1.0 / cap
    sum_e = tl.zeros([BLOCK], tl.float32)
    target_z = tl.zeros([BLOCK], tl.float32)
    cols = tl.arange(0, BLOCK)
    ahead = _load_hinted(logits_row, cols, vocab, padded, WIDE, FIRST)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        x, ahead = _block(logits_row, cols, ahead, vocab, padded, BLOCK, PREFETCH, WIDE, FIRST)
        z = cap * softcap_ce._tanh(x * inv_cap, FAST)
        sum_e += tl.where(valid, tl.exp2((z - cap) * LOG2E), 0.0)
        target_z += tl.where(cols == target, z, 0.0)
    lse = cap + tl.log(tl.sum(sum_e, axis=0))
    tl.store(loss_ptr + row, lse - tl.sum(target_z, axis=0))
    cols = tl.arange(0, BLOCK)
    ahead = _load_hinted(logits_row, cols, vocab, padded, WIDE, SECOND)
    for start in range(0, padded, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        x, ahead = _block(logits_row, cols, ahead, vocab, padded, BLOCK, PREFETCH, WIDE, SECOND)
        t = softcap_ce._tanh(x * inv_cap, FAST)
        if FMA_EXP2:
            p = tl.where(valid, _exp2_fma((cap * t - lse) * LOG2E), 0.0)
        else:
            p = tl.where(valid, tl.exp2((cap * t - lse) * LOG2E), 0.0)
        g = (p - tl.where(cols == target, 1.0, 0.0)) * (1.0 - t * t) * scale
        tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < padded, eviction_policy=SECOND)


def two_pass(logits, targets, vocab, cap, scale, block=512, warps=4, prefetch=False, hints=False, fma_exp2=False,
             wide=True, grad_dtype=None):
    n, padded = logits.shape
    grad = torch.empty_like(logits, dtype=grad_dtype or logits.dtype)
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    _two_pass[(n,)](logits, grad, targets, loss, logits.stride(0), float(cap), float(scale), vocab=vocab,
                    padded=padded, BLOCK=block, PREFETCH=prefetch, HINTS=hints, FMA_EXP2=fma_exp2,
                    FAST=logits.is_cuda, WIDE=wide, num_warps=warps)
    return loss, grad


@jit
def _split_lse(logits_ptr, targets_ptr, loss_ptr, lse_ptr, stride, n, cap, vocab: tl.constexpr,
               padded: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The first pass as a kernel of its own: ROWS rows a program, each row's log-sum-exp and loss."""
    LOG2E: tl.constexpr = 1.4426950408889634
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n
    row_ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride
    target = tl.load(targets_ptr + rows, mask=row_ok, other=0)
    inv_cap = 1.0 / cap
    sum_e = tl.zeros([ROWS, BLOCK], tl.float32)
    target_z = tl.zeros([ROWS, BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = (cols < vocab)[None, :]
        x = tl.load(row_ptrs + cols[None, :], mask=row_ok[:, None] & (cols < padded)[None, :], other=0.0)
        z = cap * softcap_ce._tanh(tl.where(valid, x.to(tl.float32), 0.0) * inv_cap, FAST)
        sum_e += tl.where(valid, tl.exp2((z - cap) * LOG2E), 0.0)
        target_z += tl.where(cols[None, :] == target[:, None], z, 0.0)
    lse = cap + tl.log(tl.sum(sum_e, axis=1))
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(loss_ptr + rows, lse - tl.sum(target_z, axis=1), mask=row_ok)


@jit
def _split_grad(logits_ptr, grad_ptr, targets_ptr, lse_ptr, stride, n, cap, scale, vocab: tl.constexpr,
                padded: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """The second pass as a kernel of its own, one (ROWS x BLOCK) block of the gradient a program: no loop, so
    every block's load is in flight at once."""
    LOG2E: tl.constexpr = 1.4426950408889634
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < n
    offsets = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    inside = row_ok[:, None] & (cols < padded)[None, :]
    valid = (cols < vocab)[None, :]
    target = tl.load(targets_ptr + rows, mask=row_ok, other=0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    x = tl.load(logits_ptr + offsets, mask=inside, other=0.0, eviction_policy="evict_first")
    t = softcap_ce._tanh(tl.where(valid, x.to(tl.float32), 0.0) * (1.0 / cap), FAST)
    p = tl.where(valid, tl.exp2((cap * t - lse[:, None]) * LOG2E), 0.0)
    g = (p - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)) * (1.0 - t * t) * scale
    tl.store(grad_ptr + offsets, g.to(grad_ptr.dtype.element_ty), mask=inside, eviction_policy="evict_first")


def split(logits, targets, vocab, cap, scale, rows=1, block=1024, warps=4, grad_rows=1, grad_block=1024,
          grad_warps=4, grad_dtype=None):
    """The two passes as two kernels: the log-sum-exp of `rows` rows a program, then the gradient in
    (grad_rows x grad_block) blocks over a 2-D grid."""
    n, padded = logits.shape
    grad = torch.empty_like(logits, dtype=grad_dtype or logits.dtype)
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    fast = logits.is_cuda
    _split_lse[(triton.cdiv(n, rows),)](logits, targets, loss, lse, logits.stride(0), n, float(cap), vocab=vocab,
                                         padded=padded, ROWS=rows, BLOCK=block, FAST=fast, num_warps=warps)
    _split_grad[(triton.cdiv(n, grad_rows), triton.cdiv(padded, grad_block))](
        logits, grad, targets, lse, logits.stride(0), n, float(cap), float(scale), vocab=vocab, padded=padded,
        ROWS=grad_rows, BLOCK=grad_block, FAST=fast, num_warps=grad_warps)
    return loss, grad


# (name, keyword arguments of kernels.softcap_ce_rows); the first is the base of every ratio
VARIANTS = [
    ("the kernel: 1024 columns a step, 4 warps, wide loads, L2 hints", dict()),
    ("the kernel at 512 columns a step", dict(block=512)),
    ("the kernel at 2048 columns a step, 8 warps", dict(block=2048, num_warps=8)),
    ("the kernel before: 512 columns, loads masked at the vocabulary, no hints", dict(variant=dict(wide=False))),
    ("two passes, wide loads, 512 columns", dict(variant=dict())),
    ("two passes, wide loads, 1024 columns", dict(variant=dict(block=1024))),
    ("two passes, wide loads, 1024 columns, L2 hints (the kernel's arithmetic: control)",
     dict(variant=dict(block=1024, hints=True))),
    ("the control with the next block loaded ahead", dict(variant=dict(block=1024, hints=True, prefetch=True))),
    ("the control with the second exp2 on the FMA units", dict(variant=dict(block=1024, hints=True, fma_exp2=True))),
    ("one pass, 4 warps", dict(held=dict(warps=4))),
    ("one pass, 8 warps, 128 registers", dict(held=dict(warps=8, max_registers=128))),
    ("one pass, 16 warps, 64 registers", dict(held=dict(warps=16, max_registers=64))),
    ("one pass, 8 warps, 128 registers, loads masked at the vocabulary", dict(held=dict(warps=8, max_registers=128,
                                                                                        wide=False))),
    ("two kernels: 1 row x 1024 a step, then 1 x 1024 gradient blocks", dict(split=dict())),
    ("two kernels: 2 rows x 1024, then 1 x 1024", dict(split=dict(rows=2))),
    ("two kernels: 4 rows x 512, then 4 x 512", dict(split=dict(rows=4, block=512, grad_rows=4, grad_block=512))),
    ("two kernels: 2 rows x 1024 at 8 warps, then 2 x 2048 at 8 warps",
     dict(split=dict(rows=2, warps=8, grad_rows=2, grad_block=2048, grad_warps=8))),
]


def launcher(kw: dict):
    """The callable of a variant: kernels.softcap_ce_rows with its keywords, or one of the variants' kernels."""
    if "held" in kw:
        return lambda *a, grad_dtype=None: held(*a, grad_dtype=grad_dtype, **kw["held"])
    if "split" in kw:
        return lambda *a, grad_dtype=None: split(*a, grad_dtype=grad_dtype, **kw["split"])
    if "variant" in kw:
        return lambda *a, grad_dtype=None: two_pass(*a, grad_dtype=grad_dtype, **kw["variant"])
    return lambda *a, grad_dtype=None: softcap_ce.softcap_ce_rows(*a, grad_dtype=grad_dtype, **kw)


def main() -> int:
    problem = chunk_problem(__doc__.splitlines()[0], rows=8_192)
    if problem is None:
        return 2
    out, args, logits, targets = problem
    scale = 1.0 / args.rows
    ref_rows, ref_grad = torch_rows(logits.double(), targets, args.vocab, CAP, scale)
    ref_fp8 = ref_grad * (HEAD_GRAD_SCALE / scale)
    gbytes = 2 * logits.numel() * logits.element_size() / 1e9  # one read of the logits, one write of the gradient

    runs, checks = {}, {}
    for name, kw in VARIANTS:
        for grad in ("bf16", "e5m2"):
            key = f"{name}, {grad} gradient"
            fn = launcher(kw)
            if grad == "bf16":
                call = lambda fn=fn: fn(logits, targets, args.vocab, CAP, scale)  # noqa: E731
                want = ref_grad
            else:
                call = lambda fn=fn: fn(logits, targets, args.vocab, CAP, HEAD_GRAD_SCALE,  # noqa: E731
                                        grad_dtype=HEAD_GRAD_FP8)
                want = ref_fp8
            rows, g = call()
            checks[key] = {"loss": largest_relative_error(rows, ref_rows),
                           "grad": largest_relative_error(g.float(), want),
                           "padding_zero": bool((g[:, args.vocab:].float() == 0).all())}
            runs[key] = call
    times = alternated_rounds(runs)
    base = {grad: f"{VARIANTS[0][0]}, {grad} gradient" for grad in ("bf16", "e5m2")}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows,
              "vocab": args.vocab, "padded": args.padded, "pieces": held_pieces(args.padded),
              "variants": {}}
    lines = [f"# The soft-capped cross-entropy, one chunk: {args.rows:,} rows x {args.padded:,} columns, bf16 logits "
             f"({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "Ten alternated rounds of five calls. TB/s: one read of the logits and one write of the gradient "
             "(bf16; the e5m2 gradient writes half). Errors: the largest entry's difference from float64 over the "
             "float64 result's largest entry.", "",
             "| variant | ms | TB/s | over the kernel, per round (range) | loss error | gradient error "
             "| padding zero |",
             "|---|---|---|---|---|---|---|"]
    for key, ms in times.items():
        grad = "bf16" if key.endswith("bf16 gradient") else "e5m2"
        ratios = [t / b for t, b in zip(ms, times[base[grad]])]
        median = statistics.median(ms)
        moved = gbytes if grad == "bf16" else gbytes * 0.75
        result["variants"][key] = {"ms": ms, "median_ms": median, "ratio_per_round": statistics.median(ratios),
                                   "ratio_range": [min(ratios), max(ratios)], **checks[key]}
        c = checks[key]
        lines.append(f"| {key} | {median:.4f} | {moved / median:.2f} | {statistics.median(ratios):.3f} "
                     f"({min(ratios):.3f} .. {max(ratios):.3f}) | {c['loss']:.1e} | {c['grad']:.1e} | "
                     f"{'yes' if c['padding_zero'] else 'NO'} |")
    write_benchmark(out, "softcap_ce_held", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
