"""The attention gate's thin products (creditlab/ops/thin_linear.py) on the CPU through Triton's interpreter,
against float64: run by tests/kernel_checks.py, read by tests/test_kernels.py."""

import functools

import torch

from creditlab import ops


def thin_linear_errors(tokens, width, K, N, seed=0, rows=32, drop_partials=False):
    """The attention gate's thin product (kernels/thin_linear.py) on fresh random float32 inputs, x the leading K
    channels of a wider NaN-padded tensor (read in place, as the gate reads the branch input), into NaN-poisoned
    outputs, against float64: y = x w^T, dx = dy w, dw = dy^T x; tokens not a multiple of the block's rows, K and
    N not powers of two. `drop_partials` compares dw against the sum of all partial blocks but the last."""
    from creditlab.ops import thin_linear

    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, width, generator=g)
    wide[:, K:] = float("nan")
    x, w, dy = wide[:, :K], torch.randn(N, K, generator=g), torch.randn(tokens, N, generator=g)
    y = thin_linear.thin_forward(x, w, rows=rows, out=torch.full((tokens, N), float("nan")))
    dx, dw = thin_linear.thin_backward(dy, x, w, rows=rows, out=torch.full((tokens, K), float("nan")))
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    want_dw = dy64.t() @ x64
    if drop_partials:
        last = (tokens - 1) // rows * rows
        want_dw = dy64[:last].t() @ x64[:last]

    def err(got, want):
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    return {"y": err(y, x64 @ w64.t()), "dx": err(dx, dy64 @ w64), "dw": err(dw, want_dw),
            "all_written": bool(not (y.isnan().any() or dx.isnan().any() or dw.isnan().any()))}


def attention_gate_through_kernel():
    """The model's attention-gate Function (attention_gate.gate_linear) with both passes through the kernels (CPU
    float32, the interpreter) against F.linear in float64, on a slice of the leading channels as the model takes
    it: y and the gradients of the whole input and of W."""
    from creditlab.ops import attention_gate
    from creditlab.ops import thin_linear

    available, launched = ops.available, []
    forward, backward = thin_linear.thin_forward, thin_linear.thin_backward
    ops.available = lambda t: True
    thin_linear.thin_forward = lambda *a, **k: launched.append("forward") or forward(*a, **k)
    thin_linear.thin_backward = lambda *a, **k: launched.append("backward") or backward(*a, **k)
    try:
        g = torch.Generator().manual_seed(7)
        n = torch.randn(2, 37, 24, generator=g, requires_grad=True)
        w = torch.randn(4, 12, generator=g, requires_grad=True)
        gy = torch.randn(2, 37, 4, generator=g)
        y = attention_gate.gate_linear(n[..., :12], w)
        grads = torch.autograd.grad(y, (n, w), gy)
        n64, w64 = (t.detach().double().requires_grad_(True) for t in (n, w))
        y64 = torch.nn.functional.linear(n64[..., :12], w64)
        ref = torch.autograd.grad(y64, (n64, w64), gy.double())
        errors = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
                  for name, a, b in zip(("y", "n", "w"), (y, *grads), (y64, *ref))}
        return {"errors": errors, "launched": launched}
    finally:
        ops.available, thin_linear.thin_forward, thin_linear.thin_backward = available, forward, backward


def attention_gate_opcheck():
    """The gate's two operators declare their outputs truthfully, through the kernels and the torch arithmetic."""
    from creditlab.ops import attention_gate

    g = torch.Generator().manual_seed(8)
    n, w, dy = torch.randn(2, 19, 24, generator=g), torch.randn(4, 12, generator=g), torch.randn(2, 19, 4, generator=g)
    x = n[..., :12]
    out, available = {}, ops.available
    try:
        for through_kernel in (False, True):
            ops.available = lambda t, use=through_kernel: use
            results = [torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
                       for op, args in ((attention_gate.thin_linear_op, (x, w)),
                                        (attention_gate.thin_linear_backward_op, (dy, x, w)))]
            out["kernel" if through_kernel else "torch"] = sorted({v for r in results for v in r.values()})
    finally:
        ops.available = available
    return out


CHECKS = {
    "thin_linear_gate": functools.partial(thin_linear_errors, 300, 40, 12, 4),
    "thin_linear_odd": functools.partial(thin_linear_errors, 45, 20, 7, 3, seed=1, rows=16),
    "thin_linear_one_block": functools.partial(thin_linear_errors, 20, 16, 16, 8, seed=2, rows=32),
    "thin_linear_dropped_partial": functools.partial(thin_linear_errors, 300, 40, 12, 4, drop_partials=True),
    "attention_gate": attention_gate_through_kernel,
    "attention_gate_opcheck": attention_gate_opcheck,
}
