"""The fused MLP's Triton products (creditlab/ops/relu2_matmul.py) on the CPU through Triton's interpreter,
against float64: run by tests/kernel_checks.py, read by tests/test_kernels.py."""

import functools

import torch

from creditlab import ops
from creditlab.ops import relu2_matmul

SMALL_TILES = relu2_matmul.TileConfig(block_m=32, block_n=32, block_k=16, group_m=2, stages=2, warps=4)


def relu2_errors(M, K, N, subtiles, seed=0, reference_derivative=2.0):
    """The three products of the fused-MLP kernel on fresh random float32 inputs, written into NaN-poisoned
    outputs (an element the kernel leaves unwritten stays NaN), against float64; partial tiles in M, N and K.
    `reference_derivative` other than 2 compares the derivative epilogue with a wrong formula."""
    import dataclasses

    cfg = dataclasses.replace(SMALL_TILES, subtiles=subtiles)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    dy, w_kn = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    h = x.double() @ w.double().t()
    poisoned = lambda: torch.full((M, N), float("nan"))  # noqa: E731
    post = relu2_matmul.relu2_linear(x, w, cfg, out=poisoned())
    dh = relu2_matmul.relu2_dgrad(dy, w_kn, post, cfg, out=poisoned())
    plain = relu2_matmul.matmul(x, w, False, cfg, out=poisoned())
    plain_kn = relu2_matmul.matmul(dy, w_kn, True, cfg, out=poisoned())

    def err(got, ref):
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()  # NaN anywhere: NaN, fails a bound

    return {"relu2_linear": err(post, torch.relu(h) ** 2),
            "relu2_dgrad": err(dh, (dy.double() @ w_kn.double()) * reference_derivative * torch.relu(h)),
            "matmul_nk": err(plain, h), "matmul_kn": err(plain_kn, dy.double() @ w_kn.double()),
            "all_written": bool(not post.isnan().any() and not dh.isnan().any())}


def fused_mlp_through_kernel():
    """relu2.expand_relu2 / project_relu2 with the kernel (CPU tensors through the interpreter) against the
    plain float64 MLP: output and every gradient, in float32."""
    from creditlab.ops import relu2

    available, supported, launch = ops.available, relu2_matmul.supported, relu2_matmul._launch
    launched = []
    ops.available = lambda t: True
    tiles = relu2_matmul.EXPAND_TILES, relu2_matmul.DGRAD_TILES
    relu2_matmul.EXPAND_TILES = relu2_matmul.DGRAD_TILES = SMALL_TILES
    relu2_matmul.supported = lambda a, b: a.dtype == b.dtype == torch.float32  # the interpreter's dtype
    relu2_matmul._launch = lambda *a, **k: launched.append(a[3]) or launch(*a, **k)
    try:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(2, 20, 24, generator=g, requires_grad=True)
        w1 = torch.randn(40, 24, generator=g, requires_grad=True)
        w2 = torch.randn(24, 40, generator=g, requires_grad=True)
        gy = torch.randn(2, 20, 24, generator=g)
        y = relu2.project_relu2(relu2.expand_relu2(x, w1), w2)
        grads = torch.autograd.grad(y, (x, w1, w2), gy)
        x64, w164, w264 = (t.detach().double().requires_grad_(True) for t in (x, w1, w2))
        y64 = torch.relu(x64 @ w164.t()).square() @ w264.t()
        ref = torch.autograd.grad(y64, (x64, w164, w264), gy.double())
        out = {"y": ((y.double() - y64).abs().max() / y64.abs().max()).item()}
        for name, a, b in zip(("x", "w_fc", "w_proj"), grads, ref):
            out[name] = ((a.double() - b).abs().max() / b.abs().max()).item()
        return {"errors": out, "epilogues_launched": sorted(launched)}
    finally:
        ops.available, relu2_matmul.supported, relu2_matmul._launch = available, supported, launch
        relu2_matmul.EXPAND_TILES, relu2_matmul.DGRAD_TILES = tiles


CHECKS = {
    "relu2_even": functools.partial(relu2_errors, 64, 32, 64, 2),
    "relu2_partial": functools.partial(relu2_errors, 100, 40, 72, 2, seed=1),
    "relu2_one_subtile": functools.partial(relu2_errors, 100, 40, 72, 1, seed=2),
    "relu2_wrong_derivative": functools.partial(relu2_errors, 64, 32, 64, 2, reference_derivative=1.0),
    "fused_mlp": fused_mlp_through_kernel,
}
