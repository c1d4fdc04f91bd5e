"""Recomputing pointwise work in the backward changes what is kept, never the gradients."""

import torch

from creditlab import checks


def _saved_bytes_and_grads(cfg, recompute: bool):
    cfg.recompute = recompute
    model = checks.randomized_model(cfg, 0)
    idx, targets = checks._batch(cfg, 0)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    loss.backward()
    return sum(saved), {n: p.grad for n, p in model.named_parameters()}


def test_recompute_keeps_less_and_changes_no_gradient():
    cfg = checks.seed_structure()
    kept_on, grads_on = _saved_bytes_and_grads(cfg, True)
    kept_off, grads_off = _saved_bytes_and_grads(cfg, False)
    assert kept_on < 0.9 * kept_off  # measured 0.81 in eager mode (0.68 compiled)
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-13, atol=1e-15)
