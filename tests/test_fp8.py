"""The `fp8` source: the 16 products computed with FP8 operands, everything else exact; the check of its band."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from creditlab import checks, config
from creditlab.checks import fp8 as fp8_checks
from creditlab.credit import fp8 as fp8_source
from creditlab.credit.registry import make_source
from creditlab.model import ExactCredit
from creditlab.ops import fp8


def tiny():
    return config.load("tiny", ["model.vocab_size=97"]).model


def test_quantize_puts_the_largest_entry_on_the_formats_largest_value_and_rounds_within_half_an_ulp():
    torch.manual_seed(0)
    x = torch.randn(64, 48, dtype=torch.float64) * 1e-3
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, s = fp8.quantize(x, dtype)
        assert q.dtype == dtype and q.to(torch.float64).abs().max().item() == torch.finfo(dtype).max
        err = (fp8.dequantize(q, s) - x).abs()
        assert (err <= fp8.rounding_bound(x, dtype, s)).all()
        assert err.max() > 0  # it did round


def test_the_emulated_product_is_the_product_of_the_fp8_values():
    torch.manual_seed(1)
    a, b = torch.randn(32, 48, dtype=torch.float64), torch.randn(48, 16, dtype=torch.float64)
    (a8, sa), (b8, sb) = fp8.quantize(a, fp8.E5M2), fp8.quantize(b, fp8.E4M3)
    got = fp8.scaled_mm(a8, b8, sa, sb, torch.float64)
    torch.testing.assert_close(got, fp8.dequantize(a8, sa) @ fp8.dequantize(b8, sb), rtol=1e-14, atol=0)


def test_fp8_corrections_lie_in_their_band_and_a_wrong_scale_leaves_it():
    r = checks.fp8_band_check(tiny(), seed=1)
    assert r["products"] == 8 and r["passed"], r
    assert 0.01 < r["rel_err_min"] <= r["rel_err_max"] < 0.15  # e5m2's three significant bits, not zero
    assert r["error_over_bound_max"] <= 1.0 < r["mutant_error_over_bound_max"]


def test_the_check_fails_when_the_products_are_not_in_fp8(monkeypatch):
    """Exact products in place of the FP8 ones: the band's 'not zero' side fails, so the check can fail."""
    monkeypatch.setattr(fp8_source, "fp8_input_gradient", lambda dy, weight, *rest: dy @ weight.to(dy.dtype))
    r = checks.fp8_band_check(tiny(), seed=1)
    assert not r["nonzero"] and not r["passed"]


def test_everything_but_the_16_products_is_native(monkeypatch):
    """With the FP8 product replaced by the exact one, the fp8 step's every trunk gradient is native's in float64:
    the weight gradients and every other product are exact, only the 16 input products go through FP8."""
    cfg = tiny()
    model = checks.randomized_model(cfg, 3)
    idx, targets = checks._batch(cfg, 3)
    native = checks._trunk_grads(model, idx, targets, ExactCredit())
    monkeypatch.setattr(fp8_source, "fp8_input_gradient", lambda dy, weight, *rest: dy @ weight.to(dy.dtype))
    exact_products = checks._trunk_grads(model, idx, targets, fp8_source.Fp8Credit())
    assert max(checks._rel_errors(exact_products, native).values()) <= checks.TOLERANCE
    monkeypatch.undo()
    in_fp8 = checks._rel_errors(checks._trunk_grads(model, idx, targets, fp8_source.Fp8Credit()), native)
    assert max(in_fp8.values()) > 1e-3  # and the FP8 products do move them
    last_mlp = [name for name in native if name.startswith(f"blocks.{cfg.layers - 1}.mlp")]
    assert last_mlp and all(in_fp8[name] <= checks.TOLERANCE for name in last_mlp)  # nothing after the last product to move


@pytest.mark.parametrize("expand", [False, True])
def test_the_fp8_product_compiles_without_a_graph_break_to_the_eager_gradients(expand):
    torch.manual_seed(2)
    n = torch.randn(2, 8, 32, requires_grad=True)
    weight = (torch.randn(64, 32) * 32 ** -0.5).requires_grad_()
    probe = torch.randn(2, 8, 64)

    def loss(n, weight):
        return (fp8_source._Fp8InputGradientLinear.apply(n, weight, expand, 1.0, None, False) * probe).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    eager = torch.autograd.grad(loss(n, weight), (n, weight))
    for got, want in zip(torch.autograd.grad(compiled(n, weight), (n, weight)), eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if not expand:  # and the weight gradient is F.linear's
        native = torch.autograd.grad((F.linear(n, weight) * probe).sum(), (n, weight))
        torch.testing.assert_close(eager[1], native[1], rtol=1e-6, atol=1e-6)


def test_the_source_is_registered_and_omits_no_teacher():
    source = make_source(config.load("tiny", ["credit.source=fp8"]))
    assert source.name == "fp8" and source.omits and not source.fits
    assert isinstance(source.step(), fp8_source.Fp8Credit)
