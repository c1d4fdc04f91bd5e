"""causal_attention: SDPA's backward always gets the output's gradient laid out as the output is."""

import pytest
import torch
import torch.nn.functional as F

from creditlab.ops.causal_attention import causal_attention


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    # (batch, sequence, heads, head dim), transposed to SDPA's order as the model hands them over
    return [torch.randn(2, 12, 3, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
            for _ in range(3)]


def _recording_sdpa(monkeypatch, seen):
    """SDPA as it is, recording the output's strides and those of the gradient its backward receives."""
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        out = real(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda grad: seen.append((out.stride(), grad.stride(), grad.data_ptr())))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)


AFTER = {  # what follows attention, each handing its gradient back in another layout
    "as the model": lambda y: y.transpose(1, 2).reshape(2, 12, 24),
    "a copy in SDPA's order": lambda y: y.contiguous().flatten(1),
    "a copy in the model's order": lambda y: y.transpose(1, 2).contiguous().transpose(1, 2).flatten(1),
    "a sum": lambda y: y.sum().expand(3),
}


@pytest.mark.parametrize("after", sorted(AFTER))
def test_the_backward_gets_the_gradient_laid_out_as_the_output(monkeypatch, after):
    q, k, v = _inputs()
    weights = torch.randn(AFTER[after](torch.zeros(2, 3, 12, 8, dtype=torch.float64)).shape,
                          generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(attend):
        return (AFTER[after](attend(q, k, v)) * weights).sum()

    want = torch.autograd.grad(loss(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                     scale=0.3)), (q, k, v))
    seen = []
    _recording_sdpa(monkeypatch, seen)
    got = torch.autograd.grad(loss(lambda q, k, v: causal_attention(q, k, v, scale=0.3)), (q, k, v))
    (out_stride, grad_stride, _), = seen
    assert grad_stride == out_stride
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # a copy: the same values


def test_the_check_sees_a_gradient_laid_out_otherwise(monkeypatch):
    # without the guard the same recording sees another layout: the test above can fail
    q, k, v = _inputs()
    seen = []
    _recording_sdpa(monkeypatch, seen)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.autograd.grad(AFTER["a copy in the model's order"](y).sum(), (q, k, v))
    (out_stride, grad_stride, _), = seen
    assert grad_stride != out_stride


def test_a_gradient_already_laid_out_so_passes_untouched(monkeypatch):
    q, k, v = _inputs()
    seen, handed = [], []
    _recording_sdpa(monkeypatch, seen)
    y = causal_attention(q, k, v, scale=0.3)
    y.register_hook(lambda grad: handed.append(grad.data_ptr()))
    torch.autograd.grad(y, (q, k, v), torch.ones_like(y))  # ones_like keeps the output's strides
    (out_stride, grad_stride, ptr), = seen
    assert grad_stride == out_stride and handed == [ptr]  # no copy


def test_no_graph_no_guard():
    # evaluation and FDFA's forward-mode passes run without a graph: the output is SDPA's own tensor
    q, k, v = (t.detach() for t in _inputs())
    with torch.no_grad():
        y = causal_attention(q, k, v, scale=0.3)
    assert y.grad_fn is None
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))


@pytest.mark.parametrize("op_by_op", [False, True])
def test_every_attention_of_the_model_goes_through_the_guard(monkeypatch, op_by_op):
    # on the CPU the model's own gradient already has the output's strides, so what pins the guard in the model is
    # that every block's attention is causal_attention's (called directly, SDPA would not be guarded on the GPU)
    from creditlab import config, model as model_module
    from creditlab.model import GPT

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return causal_attention(*args, **kwargs)

    monkeypatch.setattr(model_module, "causal_attention", counted)
    cfg = config.load("tiny", ["model.vocab_size=97"]).model
    model = GPT(cfg).double()
    import contextlib
    for p in model.parameters():  # the zero-initialized projections would stop the gradient before attention
        torch.nn.init.normal_(p, std=0.1)
    idx = torch.randint(0, 97, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    seen = []
    _recording_sdpa(monkeypatch, seen)
    with model.op_by_op() if op_by_op else contextlib.nullcontext():
        model(idx, idx).backward()
    assert len(calls) == len(seen) == cfg.layers
    assert all(grad_stride == out_stride for out_stride, grad_stride, _ in seen), seen
