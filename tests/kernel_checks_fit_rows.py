"""The teacher's rank-space kernel (creditlab/ops/fit_rows.py) on the CPU through Triton's interpreter, against
float64: run by tests/kernel_checks.py, read by tests/test_kernels.py."""

import functools

import torch

from creditlab import ops


def fit_rows_errors(tokens, d, r2, seed=0, wrong_gate_derivative=False):
    """The teacher's rank-space kernel (kernels/fit_rows.py) on fresh random float32 inputs, into NaN-poisoned
    outputs, against the same quantities in float64; tokens not a multiple of a program's tokens, several
    programs. `wrong_gate_derivative` compares gate_grad with sigmoid's derivative taken as gate instead of
    gate (1 - gate)."""
    from creditlab.ops import fit_rows

    tiles = fit_rows.FitTiles(rows=16, block_k=16, tiles=2, warps=4, stages=2)
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(tokens, d, generator=g)
    gate, code = torch.rand(tokens, r2, generator=g), torch.randn(tokens, r2, generator=g)
    decoder = torch.randn(d, r2, generator=g) * 0.3
    m = decoder.double().t() @ decoder.double()
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    rows = fit_rows.programs(tokens, tiles)
    got = fit_rows.fit_rows(c, gate, code, decoder, m.float(), tiles,
                            out=(nan(tokens, r2), nan(tokens, r2), nan(tokens, r2), nan(rows, fit_rows.SUMS + r2 * r2)))
    c64, g64, x64, d64 = c.double(), gate.double(), code.double(), decoder.double()
    gated = g64 * x64
    residual = gated @ m - c64 @ d64
    derivative = g64 if wrong_gate_derivative else g64 * (1 - g64)
    sums = got[3].double().sum(0)
    ref_sums = torch.stack([c64.square().sum(), ((gated @ m) * gated).sum(), ((c64 @ d64) * gated).sum()])

    def err(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    return {"gated": err(got[0], gated), "code_grad": err(got[1], residual * g64),
            "gate_grad": err(got[2], residual * x64 * derivative),
            "sums": err(sums[:fit_rows.SUMS], ref_sums), "gram": err(sums[fit_rows.SUMS:].view(r2, r2), gated.t() @ gated),
            "programs": rows, "all_written": bool(not any(t.isnan().any() for t in got))}


def rank_space_fit_through_kernel():
    """teacher.rank_space_fit with the kernel (CPU float32 through the interpreter) against its op-by-op path in
    float64: every output, on a (B, T, d) correction."""
    from creditlab.credit import teacher
    from creditlab.ops import fit_rows

    available, tiles = ops.available, fit_rows.DEFAULT_TILES
    launched = []
    real = fit_rows._run
    fit_rows._run = lambda *a, **k: launched.append(1) or real(*a, **k)
    fit_rows.DEFAULT_TILES = fit_rows.FitTiles(16, 16, 2, 4, 2)  # several programs at these shapes
    try:
        g = torch.Generator().manual_seed(4)
        B, T, d, r2 = 2, 37, 32, 16
        true = torch.randn(B, T, d, generator=g)
        gate, code = torch.rand(B, T, r2, generator=g), torch.randn(B, T, r2, generator=g)
        decoder = torch.randn(d, r2, generator=g) * 0.3
        ops.available = lambda t: True
        fast = teacher.rank_space_fit(true, gate, code, decoder, 0.5, torch.float32, torch.float32)
        ops.available = lambda t: False
        ref = teacher.rank_space_fit(*(t.double() for t in (true, gate, code, decoder)), 0.5, torch.float64,
                                     torch.float64)
        errors = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
                  for name, a, b in zip(teacher.RankSpaceFit._fields, fast, ref)}
        return {"errors": errors, "launched": len(launched)}
    finally:
        ops.available, fit_rows._run, fit_rows.DEFAULT_TILES = available, real, tiles


def fit_rows_opcheck():
    """The teacher's fit_rows operator has a valid schema. (Its fake, which the compiler plans with, is its own
    body with the launch skipped, so its shapes are the real ones by construction; under the interpreter the
    fake check would run the kernel on fake tensors, so it is not run here.)"""
    from creditlab.ops import fit_rows

    tiles, fit_rows.DEFAULT_TILES = fit_rows.DEFAULT_TILES, fit_rows.FitTiles(16, 16, 2, 4, 2)
    try:
        g = torch.Generator().manual_seed(5)
        c, decoder = torch.randn(40, 32, generator=g), torch.randn(32, 16, generator=g)
        args = (c, torch.rand(40, 16, generator=g), torch.randn(40, 16, generator=g), decoder, decoder.t() @ decoder)
        result = torch.library.opcheck(fit_rows.fit_rows_op, args, test_utils=("test_schema",))
        return {k: v == "SUCCESS" for k, v in result.items()}
    finally:
        fit_rows.DEFAULT_TILES = tiles


CHECKS = {
    "fit_rows": functools.partial(fit_rows_errors, 70, 64, 16),
    "fit_rows_one_program": functools.partial(fit_rows_errors, 20, 32, 32, seed=1),
    "fit_rows_wrong_derivative": functools.partial(fit_rows_errors, 70, 64, 16, wrong_gate_derivative=True),
    "rank_space_fit": rank_space_fit_through_kernel,
    "fit_rows_opcheck": fit_rows_opcheck,
}
