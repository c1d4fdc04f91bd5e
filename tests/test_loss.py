"""The fused chunked head loss against the plain reference: values and gradients, any chunking, padded heads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditlab.ops.loss import head_loss, reference_head_loss


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.norm().item()
    return (a - b).norm().item() / (scale if scale > 0 else 1.0)


def problem(n, d, vocab, pad, scale, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    w = torch.randn(vocab + pad, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t


def both(h, w, t, vocab, cap, chunk, upstream=1.0):
    fused = head_loss(h, w, t, vocab, cap, chunk)
    fh, fw = torch.autograd.grad(fused * upstream, [h, w])
    ref = reference_head_loss(h, w, t, vocab, cap)
    rh, rw = torch.autograd.grad(ref * upstream, [h, w])
    return (fused, fh, fw), (ref, rh, rw)


N, D, V, PAD = 37, 8, 50, 14  # 37 targets: prime, so most chunk sizes do not divide it; head padded 50 -> 64


@pytest.mark.parametrize("chunk", [1, 2, 5, 8, 36, 37, 38, 1000])
def test_fused_matches_reference_in_value_and_gradients(chunk):
    h, w, t = problem(N, D, V, PAD, scale=2.0, seed=chunk)
    (fused, fh, fw), (ref, rh, rw) = both(h, w, t, V, cap=15.0, chunk=chunk)
    assert fused.dtype == torch.float64
    assert rel_err(fused.detach(), ref.detach()) <= 1e-12
    assert rel_err(fh, rh) <= 1e-12
    assert rel_err(fw, rw) <= 1e-12
    assert fh.shape == h.shape and fw.shape == w.shape


def test_padded_columns_get_exactly_zero_gradient_and_no_probability():
    h, w, t = problem(N, D, V, PAD, scale=2.0, seed=11)
    loss = head_loss(h, w, t, V, 15.0, 6)
    gw, = torch.autograd.grad(loss, [w])
    assert torch.count_nonzero(gw[V:]) == 0
    assert torch.count_nonzero(gw[:V]) > 0
    # Whatever the padding rows hold, the loss does not see them.
    with torch.no_grad():
        w2 = w.detach().clone()
        w2[V:] = 100.0 * torch.randn(PAD, D, dtype=torch.float64)
    assert head_loss(h.detach(), w2, t, V, 15.0, 6).item() == loss.item()
    # Treating the padding as vocabulary would change it (the check can fail).
    assert abs(head_loss(h.detach(), w.detach(), t, V + PAD, 15.0, 6).item() - loss.item()) > 1e-3


def test_upstream_gradient_scales_the_stored_gradients():
    h, w, t = problem(N, D, V, PAD, scale=1.0, seed=12)
    (_, fh, fw), (_, rh, rw) = both(h, w, t, V, cap=15.0, chunk=10, upstream=-0.37)
    assert rel_err(fh, rh) <= 1e-12 and rel_err(fw, rw) <= 1e-12
    (_, fh1, _), _ = both(h, w, t, V, cap=15.0, chunk=10, upstream=1.0)
    assert rel_err(fh, -0.37 * fh1) <= 1e-14


def test_soft_cap_is_active_and_matched():
    """Large logits: the cap saturates (the loss differs from an uncapped one) and fused still matches."""
    h, w, t = problem(N, D, V, PAD, scale=8.0, seed=13)
    (fused, fh, fw), (ref, rh, rw) = both(h, w, t, V, cap=5.0, chunk=4)
    assert rel_err(fused.detach(), ref.detach()) <= 1e-12
    assert rel_err(fh, rh) <= 1e-12 and rel_err(fw, rw) <= 1e-12
    uncapped = torch.nn.functional.cross_entropy((h @ w.t())[:, :V], t)
    assert abs(uncapped.item() - fused.item()) > 1.0


def test_gradcheck_against_finite_differences():
    h, w, t = problem(9, 4, 11, 5, scale=1.5, seed=14)
    assert torch.autograd.gradcheck(lambda h_, w_: head_loss(h_, w_, t, 11, 3.0, 4), (h, w), eps=1e-6, atol=1e-8)


def test_float32_is_close_to_float64():
    h, w, t = problem(N, D, V, PAD, scale=2.0, seed=15)
    ref = reference_head_loss(h, w, t, V, 15.0).item()
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = head_loss(h32, w32, t, V, 15.0, 7)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    gh, gw = torch.autograd.grad(loss, [h32, w32])
    rh, rw = torch.autograd.grad(reference_head_loss(h, w, t, V, 15.0), [h, w])
    assert rel_err(gh.double(), rh) <= 1e-5 and rel_err(gw.double(), rw) <= 1e-5


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), d=st.integers(1, 6), vocab=st.integers(2, 30), pad=st.integers(0, 9),
       chunk=st.integers(1, 45), cap=st.floats(1.0, 30.0), scale=st.floats(0.1, 6.0), seed=st.integers(0, 2**31))
def test_fused_matches_reference_for_any_shape(n, d, vocab, pad, chunk, cap, scale, seed):
    h, w, t = problem(n, d, vocab, pad, scale, seed)
    (fused, fh, fw), (ref, rh, rw) = both(h, w, t, vocab, cap, chunk)
    # Relative to the result, and absolute at float64 rounding of the O(1) terms a confident prediction cancels
    # (log-sum-exp minus the target's logit, softmax minus one), carried by operands of magnitude `scale` into the
    # gradients: a loss or gradient of 1e-5 carries ~1e-16 * scale^2 of it (measured 2.1e-15 at scale 6).
    atol = 1e-15 * (1 + scale) ** 2
    for got, want in ((fused.detach(), ref.detach()), (fh, rh), (fw, rw)):
        assert (got - want).norm().item() <= 1e-12 * want.norm().item() + atol
    assert torch.count_nonzero(fw[vocab:]) == 0


# ---- the FP8 head (model.head=fp8) ---------------------------------------------------------------------------

def fp8_expected(h, w, t, vocab, cap):
    """What the FP8 head computes, in float64: the loss and gradients of the quantized operands, with the logits'
    gradient rounded to e5m2 at its fixed scale, as the products receive it."""
    from creditlab.ops.fp8 import quantize as fp8_quantize
    from creditlab.ops.loss import HEAD_GRAD_FP8, HEAD_GRAD_SCALE, softcap_ce_rows
    (h8, sh), (w8, sw) = fp8_quantize(h), fp8_quantize(w)
    hq, wq = h8.double() * sh.double(), w8.double() * sw.double()
    rows, g = softcap_ce_rows(hq @ wq.t(), t, vocab, cap, HEAD_GRAD_SCALE)
    gq = g.to(HEAD_GRAD_FP8).double() / (HEAD_GRAD_SCALE * h.shape[0])
    return rows.mean(), gq @ wq, gq.t() @ hq


def fp8_problem(seed, weight_scale=0.3):
    g = torch.Generator().manual_seed(seed)
    h = torch.nn.functional.rms_norm(torch.randn(64, 32, generator=g), (32,))  # the head reads norm(x)
    w = torch.randn(112, 32, generator=g) * weight_scale
    return h, w, torch.randint(0, 100, (64,), generator=g)


@pytest.mark.parametrize("chunk", [16, 48, 64])
def test_fp8_head_computes_the_products_of_its_quantized_operands(chunk):
    h, w, t = fp8_problem(seed=chunk)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = head_loss(hh, ww, t, 100, 15.0, chunk, fp8=True)
    gh, gw = torch.autograd.grad(loss, [hh, ww])
    e_loss, e_gh, e_gw = fp8_expected(h, w, t, 100, 15.0)
    assert loss.item() == pytest.approx(e_loss.item(), rel=1e-6)
    assert rel_err(gh.double(), e_gh) <= 1e-4 and rel_err(gw.double(), e_gw) <= 1e-4
    # The plain head's gradients are not these (the check can fail): the quantization is really there.
    ph, pw = torch.autograd.grad(head_loss(hh, ww, t, 100, 15.0, chunk), [hh, ww])
    assert rel_err(ph.double(), e_gh) > 1e-2 and rel_err(pw.double(), e_gw) > 1e-2


def test_fp8_head_is_near_the_exact_head_and_further_than_float32():
    h, w, t = fp8_problem(seed=3)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_head_loss(hd, wd, t, 100, 15.0)
    rh, rw = torch.autograd.grad(ref, [hd, wd])
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = head_loss(hh, ww, t, 100, 15.0, 32, fp8=True)
    gh, gw = torch.autograd.grad(loss, [hh, ww])
    assert loss.item() == pytest.approx(ref.item(), rel=2e-3)
    assert 1e-3 < rel_err(gh.double(), rh) < 0.1 and 1e-3 < rel_err(gw.double(), rw) < 0.1


def test_fp8_head_with_the_zero_initialized_weight_is_finite():
    h, w, t = fp8_problem(seed=4, weight_scale=0.0)
    ww = w.clone().requires_grad_()
    loss = head_loss(h, ww, t, 100, 15.0, 32, fp8=True)
    gw, = torch.autograd.grad(loss, [ww])
    assert loss.item() == pytest.approx(torch.log(torch.tensor(100.0)).item(), rel=1e-6)  # uniform over 100
    assert torch.isfinite(gw).all() and gw[:100].abs().sum() > 0 and torch.count_nonzero(gw[100:]) == 0


def test_fp8_quantize_uses_the_whole_range_and_never_overflows():
    from creditlab.ops.fp8 import quantize as fp8_quantize
    from creditlab.ops.loss import HEAD_INPUT_FP8
    x = torch.randn(300, 17) * 1e-3
    q, s = fp8_quantize(x)
    assert q.dtype == HEAD_INPUT_FP8 and q.float().abs().max().item() == torch.finfo(HEAD_INPUT_FP8).max
    assert rel_err(q.float() * s, x) < 0.05 and torch.isfinite(q.float()).all()


def test_a_product_is_added_into_its_accumulator_in_the_accumulators_dtype():
    from creditlab.ops.loss import add_product

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    acc = torch.randn(7, 4, generator=g, dtype=torch.float64)
    want = acc + a @ b
    add_product(acc, a, b)
    assert torch.allclose(acc, want, rtol=1e-14, atol=1e-14)
    # bf16 operands into a float32 accumulator: the operands' exact product, rounded once to float32
    a16, b16, acc32 = a.bfloat16(), b.bfloat16(), torch.zeros(7, 4)
    add_product(acc32, a16, b16)
    add_product(acc32, a16, b16)
    assert acc32.dtype == torch.float32
    assert torch.allclose(acc32.double(), 2 * a16.double() @ b16.double(), rtol=1e-6, atol=1e-6)


def test_bf16_hidden_states_accumulate_the_weights_gradient_in_float32():
    h, w, t = problem(N, D, V, PAD, scale=2.0, seed=16)
    h16, w32 = h.detach().bfloat16().requires_grad_(), w.detach().float().requires_grad_()
    gh, gw = torch.autograd.grad(head_loss(h16, w32, t, V, 15.0, 5), [h16, w32])
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.float32
    rh, rw = torch.autograd.grad(reference_head_loss(h16.double(), w32.bfloat16().double(), t, V, 15.0), [h16, w32])
    assert rel_err(gh.double(), rh) <= 2e-2 and rel_err(gw.double(), rw) <= 2e-2
