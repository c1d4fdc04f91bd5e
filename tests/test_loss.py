"""The fused chunked head loss against the plain reference: values and gradients, any chunking, padded heads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from creditlab.loss import head_loss, reference_head_loss


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
    # (log-sum-exp minus the target's logit, softmax minus one): a loss or gradient of 1e-5 carries ~1e-16 of it.
    for got, want in ((fused.detach(), ref.detach()), (fh, rh), (fw, rw)):
        assert (got - want).norm().item() <= 1e-12 * want.norm().item() + 1e-15
    assert torch.count_nonzero(fw[vocab:]) == 0
