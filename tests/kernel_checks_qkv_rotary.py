"""The Q/K/V product with QK-norm and rotary in its epilogue (creditlab/ops/qkv_rotary.py) on the CPU through
Triton's interpreter, against the float64 product and model arithmetic: run by tests/kernel_checks.py, read by
tests/test_kernels.py."""

import functools

import torch

from creditlab import ops

QKV_SMALL_TILES = dict(block_m=16, block_k=16, group_m=2, stages=2, warps=4)


def qkv_rotary_errors(B, T, heads, hd, d, heads_per_tile, seed=0, wrong_eps=False):
    """The Q/K/V product with QK-norm and rotary in its epilogue (kernels/qkv_rotary.py) on fresh random float32
    inputs, into NaN-poisoned outputs, against the float64 product followed by the plain model arithmetic (norm,
    then rotary); B T not a multiple of the tile's rows and d not of its K step, one or two heads a tile.
    `wrong_eps` runs the kernel with eps 1e-2 instead of the model's 1e-6."""
    from creditlab.ops import qk_norm
    from creditlab.ops import qkv_rotary
    from creditlab.model import Rotary, norm

    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(B * T, d, generator=g), torch.randn(3 * heads * hd, d, generator=g) * 0.5
    rot, rot64 = Rotary(hd, T + 3, 10_000.0), Rotary(hd, T + 3, 10_000.0).double()
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    out = (nan(3, B * T, heads * hd), nan(B * T, 2, heads))
    cfg = qkv_rotary.TileConfig(heads_per_tile=heads_per_tile, **QKV_SMALL_TILES)
    qkv_out, scales = qkv_rotary.qkv_norm_rotary(x, w, rot.cos, rot.sin, heads, T, 1e-2 if wrong_eps else 1e-6,
                                                 cfg, out=out)
    q, k, v = qkv_out.unbind(0)
    qkv = (x.double() @ w.double().t()).view(B, T, 3 * heads * hd)
    q64, k64, v64 = qkv.view(B, T, 3, heads, hd).unbind(2)
    ref = (rot64(norm(q64)), rot64(norm(k64)), v64)

    def err(got, want):
        return ((got.double().view(want.shape) - want).abs().max() / want.abs().max()).item()

    return {"q": err(q, ref[0]), "k": err(k, ref[1]), "v": err(v, ref[2]),
            "scales": err(scales, qk_norm.reference_forward(qkv, rot64.cos, rot64.sin, heads)[3].view(B * T, 2, heads)),
            "all_written": bool(not any(t.isnan().any() for t in (q, k, v, scales)))}


def qkv_product_through_kernel():
    """The model's Q/K/V Function (qk_norm.product_norm_rotary) with its forward through the kernel (CPU float32,
    the interpreter) against the product and the plain QK-norm and rotary in float64: q, k, v and the gradients
    of n and W, whose backward runs the QK-norm's backward and the product's."""
    from creditlab.ops import qk_norm
    from creditlab.ops import qkv_rotary
    from creditlab.model import Rotary, norm

    available, supported, launch = ops.available, qkv_rotary.supported, qkv_rotary.qkv_norm_rotary
    tiles, launched = qkv_rotary.DEFAULT_TILES, []
    ops.available = lambda t: True
    qkv_rotary.DEFAULT_TILES = qkv_rotary.TileConfig(heads_per_tile=2, **QKV_SMALL_TILES)
    qkv_rotary.supported = lambda x, w, heads: x.dtype == w.dtype == torch.float32  # the interpreter's dtype
    qkv_rotary.qkv_norm_rotary = lambda *a, **k: launched.append(1) or launch(*a, **k)
    try:
        g = torch.Generator().manual_seed(4)
        B, T, heads, hd, d = 2, 21, 2, 16, 24
        rot = Rotary(hd, T, 10_000.0)
        n = torch.randn(B, T, d, generator=g, requires_grad=True)
        w = (torch.randn(3 * heads * hd, d, generator=g) * 0.5).requires_grad_(True)
        grads_out = [torch.randn(B, T, heads, hd, generator=g) for _ in range(3)]
        outs = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads)
        grads = torch.autograd.grad(outs, (n, w), grads_out)
        n64, w64 = (t.detach().double().requires_grad_(True) for t in (n, w))
        rot64 = Rotary(hd, T, 10_000.0).double()
        q64, k64, v64 = (n64 @ w64.t()).view(B, T, 3, heads, hd).unbind(2)
        ref = (rot64(norm(q64)), rot64(norm(k64)), v64)
        ref_grads = torch.autograd.grad(ref, (n64, w64), [gr.double() for gr in grads_out])
        errors = {}
        for name, a, b in zip(("q", "k", "v", "n", "w"), (*outs, *grads), (*ref, *ref_grads)):
            errors[name] = ((a.double() - b).abs().max() / b.abs().max()).item()
        return {"errors": errors, "launched": len(launched)}
    finally:
        ops.available, qkv_rotary.supported, qkv_rotary.qkv_norm_rotary = available, supported, launch
        qkv_rotary.DEFAULT_TILES = tiles


def qkv_product_opcheck():
    """The Q/K/V product's operator declares its outputs truthfully, through the kernel and through the torch
    arithmetic."""
    from creditlab.ops import qk_norm
    from creditlab.ops import qkv_rotary
    from creditlab.model import Rotary

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 19, 24, generator=g), torch.randn(96, 24, generator=g)
    rot = Rotary(16, 19, 10_000.0)
    out = {}
    available, supported, tiles = ops.available, qkv_rotary.supported, qkv_rotary.DEFAULT_TILES
    try:
        for through_kernel in (False, True):
            ops.available = lambda t, use=through_kernel: use
            qkv_rotary.supported = lambda x, w, heads: x.dtype == w.dtype == torch.float32
            qkv_rotary.DEFAULT_TILES = qkv_rotary.TileConfig(heads_per_tile=2, **QKV_SMALL_TILES)
            result = torch.library.opcheck(qk_norm.product_forward_op, (x, w, rot.cos, rot.sin, 2),
                                           test_utils=("test_schema", "test_faketensor"))
            out["kernel" if through_kernel else "torch"] = sorted(set(result.values()))
    finally:
        ops.available, qkv_rotary.supported, qkv_rotary.DEFAULT_TILES = available, supported, tiles
    return out


CHECKS = {
    "qkv_two_heads_a_tile": functools.partial(qkv_rotary_errors, 2, 21, 4, 16, 40, 2),
    "qkv_one_head_a_tile": functools.partial(qkv_rotary_errors, 1, 37, 3, 32, 24, 1, seed=1),
    # two heads a tile asked for three heads: one taken
    "qkv_odd_heads": functools.partial(qkv_rotary_errors, 2, 19, 3, 16, 24, 2, seed=2),
    "qkv_wrong_eps": functools.partial(qkv_rotary_errors, 2, 21, 4, 16, 40, 2, wrong_eps=True),
    "qkv_product": qkv_product_through_kernel,
    "qkv_opcheck": qkv_product_opcheck,
}
