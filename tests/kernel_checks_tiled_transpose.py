"""The FP8 head's tiled transpose (creditlab/ops/tiled_transpose.py) on the CPU through Triton's interpreter:
run by tests/kernel_checks.py, read by tests/test_kernels.py."""

import functools

import torch


def transpose_checks(rows, cols, seed=0):
    """The tiled transpose of a one-byte matrix into a poisoned output: exact, against torch's, and against the
    untransposed matrix read as (cols, rows) (what a kernel that copied without transposing would give)."""
    from creditlab.ops import tiled_transpose

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=g).view(torch.float8_e5m2)
    out = torch.full((cols, rows), 0x7F, dtype=torch.uint8).view(torch.float8_e5m2)  # 0x7F: e5m2 NaN
    got = tiled_transpose.transpose(x, out=out).view(torch.uint8)
    return {"exact": torch.equal(got, x.t().contiguous().view(torch.uint8)),
            "equals_untransposed": torch.equal(got, x.view(torch.uint8).reshape(cols, rows)),
            "dtype": str(out.dtype)}


CHECKS = {
    "transpose_partial": functools.partial(transpose_checks, 70, 130),
    "transpose_one_tile": functools.partial(transpose_checks, 16, 48, seed=1),
}
