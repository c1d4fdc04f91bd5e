"""The `fp8` source's corrections against the exact ones, in float64 on the CPU.

FP8 is a precision choice, so its check is a band, not an equality: in the float64 model every branch's FP8
correction c_b' must differ from the exact c_b = dY_b W_b (the FP8 path really ran) and lie entrywise within the
bound FP8 rounding allows, |c_b' - c_b| <= E_g |W| + |dY| E_w + E_g E_w, with E the per-entry rounding bounds of
e5m2 and e4m3 under their scales (ops/fp8.py). The reference c_b = dY_b W_b is the float64 product of the same
dY_b the FP8 path received, formed here, not by the source. A dequantizing scale off by a factor of two (the
mutant) must break the bound. The whole trunk gradient's relative error against native's is reported beside it.
"""

from __future__ import annotations

import torch

from creditlab.credit.fp8 import GRADIENT_FP8, WEIGHT_FP8, Fp8Credit
from creditlab.model import ExactCredit
from creditlab.ops.fp8 import product_bound, quantize_eager, rounding_bound

WRONG_SCALE = 2.0  # the mutant's factor on the gradient's dequantizing scale


def _corrections(model, idx, targets, scale_mul: float) -> tuple[list, dict[str, torch.Tensor]]:
    record: list = []
    model.zero_grad(set_to_none=True)
    model(idx, targets, credit=Fp8Credit(scale_mul=scale_mul, record=record)).backward()
    grads = {name: p.grad.clone() for name, p in model.trunk_parameters() if p.grad is not None}
    return record, grads


def _band(record: list) -> dict:
    """Per recorded product: relative error against the float64 product and its largest |error| / bound."""
    rel, over = [], []
    for dy, weight, got in record:
        g = dy.flatten(0, -2)
        want = g @ weight
        _, g_scale = quantize_eager(g, GRADIENT_FP8)
        _, w_scale = quantize_eager(weight, WEIGHT_FP8)
        bound = product_bound(g, rounding_bound(g, GRADIENT_FP8, g_scale), weight,
                              rounding_bound(weight, WEIGHT_FP8, w_scale))
        err = (got.flatten(0, -2) - want).abs()
        rel.append((err.norm() / want.norm().clamp_min(1e-300)).item())
        over.append((err / bound.clamp_min(1e-300)).max().item())
    return {"rel_err": rel, "error_over_bound": over}


def fp8_check(model, idx, targets, native: dict[str, torch.Tensor], branches: int) -> dict:
    """The band on one randomized float64 model and batch, with native's trunk gradients of that batch."""
    record, grads = _corrections(model, idx, targets, 1.0)
    band = _band(record)
    mutant = _band(_corrections(model, idx, targets, WRONG_SCALE)[0])
    trunk = {name: _relative(grads.get(name, torch.zeros_like(g)), g) for name, g in native.items()}
    within = len(record) == branches and max(band["error_over_bound"]) <= 1.0
    nonzero = min(band["rel_err"]) > 0
    caught = max(mutant["error_over_bound"]) > 1.0
    return {"products": len(record), "rel_err_min": min(band["rel_err"]), "rel_err_max": max(band["rel_err"]),
            "error_over_bound_max": max(band["error_over_bound"]),
            "mutant_error_over_bound_max": max(mutant["error_over_bound"]),
            "trunk_rel_err_max": max(trunk.values()),
            "within_bound": within, "nonzero": nonzero, "mutant_caught": caught,
            "passed": bool(within and nonzero and caught)}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm().item()
    return (got - want).norm().item() / scale if scale > 0 else (got - want).norm().item()


__all__ = ["fp8_check", "WRONG_SCALE"]
