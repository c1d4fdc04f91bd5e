"""The one-pass QK-norm and rotary kernels (creditlab/ops/qk_norm_rotary.py) on the CPU through Triton's
interpreter, against the float64 model arithmetic: run by tests/kernel_checks.py, read by tests/test_kernels.py."""

import functools

import torch


def qk_norm_rotary_errors(B, T, heads, hd, seed=0, wrong_eps=False, extra_columns=0):
    """The QK-norm + rotary kernels on fresh random float32 inputs, into NaN-poisoned outputs, against the plain
    float64 model arithmetic (norm, then rotary) and its autograd gradient; T not a multiple of the kernel's rows.
    `wrong_eps` runs the kernel's forward with eps 1e-2 instead of the model's 1e-6. `extra_columns` > 0 hands the
    forward qkv as the leading columns of a wider NaN-padded product (the kernel reads such a view in place): a
    read past qkv's own columns would bring NaN into q, k or v."""
    from creditlab.ops import qk_norm
    from creditlab.ops import qk_norm_rotary as qk_kernels
    from creditlab.model import Rotary, norm

    g = torch.Generator().manual_seed(seed)
    rot = Rotary(hd, T + 3, 10_000.0)
    qkv = torch.randn(B, T, 3 * heads * hd, generator=g) * 3
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    out = (nan(B, T, heads, hd), nan(B, T, heads, hd), nan(B, T, heads, hd), nan(B, T, 2, heads))
    given = qkv
    if extra_columns:
        wide = torch.cat([qkv, nan(B, T, extra_columns)], dim=-1)
        given = wide[..., :qkv.shape[-1]]
        assert not given.is_contiguous()
    q, k, v, scales = qk_kernels.qk_norm_rotary_forward(given, rot.cos, rot.sin, heads, 1e-2 if wrong_eps else 1e-6,
                                                        out=out)
    grads = [torch.randn(B, T, heads, hd, generator=g) for _ in range(3)]
    dqkv = qk_kernels.qk_norm_rotary_backward(*grads, q, k, scales, rot.cos, rot.sin,
                                              out=nan(B, T, 3 * heads * hd))
    x = qkv.double().requires_grad_(True)
    q64, k64, v64 = x.view(B, T, 3, heads, hd).unbind(2)
    rot64 = Rotary(hd, T + 3, 10_000.0).double()
    ref = (rot64(norm(q64)), rot64(norm(k64)), v64)
    ref_dqkv = torch.autograd.grad(ref, x, [gr.double() for gr in grads])[0]

    def err(got, want):
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    return {"q": err(q, ref[0]), "k": err(k, ref[1]), "v": err(v, ref[2]), "dqkv": err(dqkv, ref_dqkv),
            "scales": err(scales, qk_norm.reference_forward(x.detach(), rot64.cos, rot64.sin, heads)[3]),
            "all_written": bool(not any(t.isnan().any() for t in (q, k, v, scales, dqkv)))}


CHECKS = {
    "qk_even": functools.partial(qk_norm_rotary_errors, 2, 32, 2, 16),
    "qk_partial_rows": functools.partial(qk_norm_rotary_errors, 1, 37, 3, 8, seed=1),
    "qk_wrong_eps": functools.partial(qk_norm_rotary_errors, 2, 32, 2, 16, wrong_eps=True),
    "qk_strided_rows": functools.partial(qk_norm_rotary_errors, 2, 21, 2, 16, seed=2, extra_columns=12),
}
