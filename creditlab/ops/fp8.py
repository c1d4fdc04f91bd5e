"""FP8 products: one component for the FP8 head (loss.py) and the `fp8` credit source (credit/fp8.py).

A tensor goes to FP8 with one float32 scale, taken from its own largest magnitude at the time it is cast
(*current* per-tensor scaling: no history to keep, checkpoint or warm up, at the price of one reduction over the
tensor): q = round(x / s) in the FP8 format, s = max|x| / the format's largest value, so that q * s ~ x and the
largest entry lands on the format's largest value. Forward operands (activations, weights) go to e4m3 (3
mantissa bits, range 448); gradients to e5m2 (2 mantissa bits, range 57,344), whose spread of magnitudes is wider,
as in Micikevicius et al. 2022 and modded-nanogpt.

`scaled_mm(a8, b8, scale_a, scale_b, out_dtype)` is a8 @ b8 dequantized: on a card with FP8 tensor cores (compute capability 8.9 or
later) `torch._scaled_mm`, which accumulates in float32; elsewhere (the CPU, older cards) an emulation that
multiplies the FP8 values, exactly representable, in float32 or the wider dtype asked for. The emulation is what
the tests and the float64 checks run; the GPU tests check `torch._scaled_mm` against the same float64 reference.

`rounding_bound(x, dtype)` is the largest error rounding can make in each entry: half a unit in the last place of
the format, relative (u |x|, u = 2^-(mantissa bits + 1)), or half the smallest subnormal step, absolute, where
the scaled entry falls below the normal range. A product's error is then bounded entrywise (`product_bound`).
"""

from __future__ import annotations

import functools

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# mantissa bits and the smallest subnormal of each format: what bounds its rounding error
_MANTISSA = {E4M3: 3, E5M2: 2}
_SMALLEST = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}


def quantize_eager(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) with s = max|x| / dtype's largest value (float32, on x's device: no host sync) and q = x / s in
    dtype. An all-zero x (a zero-initialized weight) gets the smallest normal float32 as its scale."""
    amax = torch.linalg.vector_norm(x, float("inf")).float().clamp_min(torch.finfo(torch.float32).tiny)
    scale = amax / torch.finfo(dtype).max
    return (x.to(torch.promote_types(x.dtype, torch.float32)) / scale).to(dtype), scale


@functools.cache
def _compiled_quantize():
    return torch.compile(quantize_eager, dynamic=False)


def quantize(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_eager; called eagerly on CUDA (the FP8 head's operands), compiled into one reduction and one pass,
    because eager the float32 quotient alone is a round trip of 4 bytes an element. Inside a compiled graph (the
    `fp8` source's backward) the compiler fuses it anyway."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return quantize_eager(x, dtype)
    return _compiled_quantize()(x, dtype)


def has_fp8_products(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 on tensor cores (compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, tensor_cores: bool | None = None) -> torch.Tensor:
    """(a8 * scale_a) @ (b8 * scale_b) in out_dtype: a8 (M, K) row-major, b8 (K, N) column-major (the layout FP8
    tensor cores read: the summed index contiguous in both), K and N multiples of 16 on the GPU path.
    `tensor_cores`: whether to use them, decided by the caller outside a compiled region (the compiler need not
    trace a query of the device); None asks `has_fp8_products`."""
    if tensor_cores if tensor_cores is not None else has_fp8_products(a8.device):
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    acc = torch.promote_types(out_dtype, torch.float32)  # the emulation: exact FP8 values, a float32+ product
    return ((a8.to(acc) @ b8.to(acc)) * (scale_a.to(acc) * scale_b.to(acc))).to(out_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)


def rounding_bound(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """The largest |round(x / s) * s - x| per entry for a format without overflow (s from `quantize`): half an ulp
    relative, or half the smallest subnormal step times s, whichever is larger."""
    unit = 2.0 ** -(_MANTISSA[dtype] + 1)
    return torch.maximum(unit * x.abs(), 0.5 * _SMALLEST[dtype] * scale.to(x.dtype))


def product_bound(a: torch.Tensor, a_err: torch.Tensor, b: torch.Tensor, b_err: torch.Tensor) -> torch.Tensor:
    """An entrywise bound of |a' b' - a b| where |a' - a| <= a_err and |b' - b| <= b_err entrywise:
    a_err |b| + |a| b_err + a_err b_err (the products of the exact values of either side, so exact in float64
    up to its own rounding)."""
    return a_err @ b.abs() + a.abs() @ b_err + a_err @ b_err


__all__ = ["E4M3", "E5M2", "quantize", "quantize_eager", "scaled_mm", "has_fp8_products", "dequantize",
           "rounding_bound", "product_bound"]
