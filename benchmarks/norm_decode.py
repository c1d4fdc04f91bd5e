"""One MLP branch's synthetic backward on the GPU at the seed shape: the correction decoded inside the branch
norm's backward, with the residual gradient added, in one Triton pass (`credit.decode=fused`), against what the
compiler makes of the plain streaming path (the decode as a product of its own, then the norm's backward and
the residual add), in time and in bf16 error against float64.

    python benchmarks/norm_decode.py --out DIR [--tokens 131072] [--width 512] [--rank 32]

Writes DIR/norm_decode.json and DIR/norm_decode.md. Any CUDA machine with Triton.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from creditlab.credit.predictor import norm_decode_backward  # noqa: E402
from creditlab.kernels import norm_decode  # noqa: E402
from creditlab.model import norm_backward, norm_with_scale  # noqa: E402
from creditlab.runtime import cuda_ms, largest_relative_error, write_benchmark  # noqa: E402
from fit_rows import branch_problem  # noqa: E402


def plain(residual, n, scale, code, gate, decoder):
    """The plain streaming path's arithmetic for an MLP branch: c = (code * gate) D^T, then the norm's backward
    and the residual gradient added (autograd's sum of the stream's two uses)."""
    c = (code * gate) @ decoder.to(code.dtype).t()
    return residual + norm_backward(c, n, scale[:, None])


def main() -> int:
    problem = branch_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    _, out, N, d, r2 = problem
    torch.manual_seed(0)
    n, scale = norm_with_scale(torch.randn(N, d, device="cuda").bfloat16())
    scale = scale.reshape(-1)
    residual = (torch.randn(N, d, device="cuda") * 1e-3).bfloat16()
    code = (torch.randn(N, r2, device="cuda") * 1e-2).bfloat16()
    gate = torch.rand(N, r2, device="cuda").bfloat16()
    decoder = (torch.randn(d, r2, device="cuda") * 0.05).bfloat16()  # a correction about as large as the residual
    inputs = (residual, n, scale, code, gate, decoder)
    paths = {"plain (decode product, compiled norm backward and add)": torch.compile(plain),
             "fused (one Triton pass)": torch.compile(
                 lambda res, n_, s, c, g, dec: norm_decode_backward(None, res, n_, s, c, g, dec))}
    ref = plain(*(t.double() for t in inputs))
    times, errors = {}, {}
    for name, fn in paths.items():
        times[name] = cuda_ms(lambda: fn(*inputs))
        got = fn(*inputs)
        errors[name] = largest_relative_error(got, ref)
    kernel_ms = cuda_ms(lambda: norm_decode.norm_decode_backward(None, n, scale, code, gate, decoder, residual))
    # the kernel's bytes: n and the residual gradient read, the stream's gradient written, code and gate read
    moved = 3 * N * d * 2 + 2 * N * r2 * 2 + N * 4
    result = {"shape": {"tokens": N, "width": d, "code_width": r2}, "times_ms": times, "kernel_ms": kernel_ms,
              "kernel_tb_per_s": moved / kernel_ms / 1e9, "bf16_rel_err": errors,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# One MLP branch's backward, {N} tokens x {d}, code width {r2} (bf16, {result['device']}, "
             f"torch {torch.__version__})", "", "| path | ms | bf16 error vs float64 (largest entry) |", "|---|---|---|"]
    lines += [f"| {name} | {times[name]:.3f} | {errors[name]:.2e} |" for name in paths]
    lines += ["", f"The kernel alone: {kernel_ms:.3f} ms, {result['kernel_tb_per_s']:.2f} TB/s of its least bytes "
              f"({moved / 1e6:.0f} MB)."]
    write_benchmark(out, "norm_decode", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
