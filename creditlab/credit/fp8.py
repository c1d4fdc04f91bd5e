"""The omitted products computed, not omitted, in FP8: the rival that keeps every product and makes it cheaper.

On a synthetic update each of the 16 products' input gradient c_b = dY_b W_b runs with FP8 operands: the output
gradient dY_b in e5m2 and the weight W_b in e4m3, each with one current per-tensor scale (ops/fp8.py: the
component the FP8 head shares), multiplied on FP8 tensor cores with float32 accumulation where the card has them
and in float32 (or float64) from the exact FP8 values elsewhere. Everything else is exact as in native: the weight
gradient dY_b^T n_b in the working precision, every other product, the norms, attention. This is the change
modded-nanogpt's records made to the MLP's expansion (FP8 input gradient, weight gradient kept in bf16),
SwitchBack (Wortsman et al. 2023) in int8, applied to all 16 products the other sources omit.

Current scaling (the scale from the tensor's own largest magnitude when it is cast) costs one reduction over dY_b
per product and keeps no state; delayed scaling (from the amax of earlier updates) would skip that reduction at
the price of a history to keep and an overflow to guard. The float64 check (`fp8_check`) holds every correction
under the entrywise bound of FP8 rounding (ops/fp8.py's `product_bound`) and above zero, and shows that a wrong
scale breaks the bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from creditlab.credit.sources import CreditSource
from creditlab.model import ExactCredit
from creditlab.ops.fp8 import E4M3, E5M2, has_fp8_products, quantize, scaled_mm
from creditlab.ops.qk_norm import QKEpilogue
from creditlab.ops.relu2 import ReLU2, expand_relu2_values

GRADIENT_FP8, WEIGHT_FP8 = E5M2, E4M3


def fp8_input_gradient(dy: torch.Tensor, weight: torch.Tensor, scale_mul: float = 1.0,
                       tensor_cores: bool | None = None) -> torch.Tensor:
    """dY W with dY (..., m) in e5m2 and W (m, d) in e4m3, in dY's dtype; on FP8 tensor cores if `tensor_cores`
    (None: where the device has them). `scale_mul` != 1 multiplies the scale the product dequantizes with (the
    wrong-scale variant the checks must catch)."""
    g8, g_scale = quantize(dy.flatten(0, -2), GRADIENT_FP8)
    w8, w_scale = quantize(weight, WEIGHT_FP8)
    # FP8 tensor cores read both operands with the summed index (m) contiguous: dY row-major, W column-major
    out = scaled_mm(g8.contiguous(), w8.t().contiguous().t(), g_scale * scale_mul, w_scale, dy.dtype,
                    tensor_cores)
    return out.view(*dy.shape[:-1], weight.shape[1])


class _Fp8InputGradientLinear(torch.autograd.Function):
    """F.linear(n, W) (or the fused MLP's expansion) whose backward gives W its exact gradient and n the FP8
    product dY W. `record`, a list in the float64 checks (None when training), receives (dY, W, c) per call."""

    @staticmethod
    def forward(ctx, n, weight, expand: bool, scale_mul: float, record, tensor_cores: bool):
        ctx.save_for_backward(n, weight)
        ctx.scale_mul, ctx.record, ctx.tensor_cores = scale_mul, record, tensor_cores
        if not expand:
            return F.linear(n, weight)
        return expand_relu2_values(n, weight)[0]  # the fused MLP's convention: dy below is dL/d(n W^T)

    @staticmethod
    def backward(ctx, dy):
        n, weight = ctx.saved_tensors
        grad_n = fp8_input_gradient(dy, weight, ctx.scale_mul, ctx.tensor_cores)
        if ctx.record is not None:
            ctx.record.append((dy.detach(), weight.detach(), grad_n.detach()))
        grad_weight = dy.flatten(0, -2).t() @ n.to(dy.dtype).flatten(0, -2)  # what F.linear's backward computes
        return grad_n.to(n.dtype), grad_weight.to(weight.dtype), None, None, None, None


class Fp8Credit(ExactCredit):
    """The synthetic step: every branch input keeps its gradient path; the 16 products' backward runs in FP8."""

    def __init__(self, tensor_cores: bool = False, scale_mul: float = 1.0, record: list | None = None):
        # tensor_cores: decided here, outside the compiled forward, from the batch's device (Fp8Source.context)
        self.tensor_cores, self.scale_mul, self.record = tensor_cores, scale_mul, record

    def _apply(self, n, weight, expand: bool):
        return _Fp8InputGradientLinear.apply(n, weight, expand, self.scale_mul, self.record, self.tensor_cores)

    def product(self, index: int, n: torch.Tensor, weight: torch.Tensor, activation=None):
        if isinstance(activation, QKEpilogue):  # the FP8 product needs dL/d(n W^T): the product, then the epilogue
            return activation.after(self._apply(n, weight, False))
        return self._apply(n, weight, isinstance(activation, ReLU2))


class Fp8Source(CreditSource):
    """Synthetic updates compute the 16 products in FP8; exact updates (where a schedule asks for them) are native."""

    name, omits = "fp8", True
    about = "the 16 omitted products computed in FP8 (dY e5m2, W e4m3, current per-tensor scales), dW exact"

    def step(self, tensor_cores: bool = False) -> Fp8Credit:
        return Fp8Credit(tensor_cores)

    def context(self, trainer, inputs, targets, kind: str, scale: float):
        if kind != "synthetic":
            return self.exact_step()
        return self.step(has_fp8_products(inputs.device))


__all__ = ["Fp8Source", "Fp8Credit", "fp8_input_gradient", "GRADIENT_FP8", "WEIGHT_FP8"]
