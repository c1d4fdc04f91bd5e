"""Checks of the Triton kernels on the CPU, run by tests/test_kernels.py in a process with TRITON_INTERPRET=1
(the interpreter is chosen when a kernel is defined, so it cannot be switched on inside a running test)."""

import json
import sys

import torch

from creditlab import kernels, loss


def reference(logits, targets, vocab, cap, scale):
    """Per-row loss and d(scale * sum)/dlogits by float64 autograd on the true vocabulary."""
    l = logits.double().clone().requires_grad_(True)
    z = cap * torch.tanh(l[:, :vocab] / cap)
    rows = torch.nn.functional.cross_entropy(z, targets, reduction="none")
    (scale * rows.sum()).backward()
    return rows.detach(), l.grad


def kernel_errors(n, vocab, padded, block, spread, dtype, cap=15.0, ref_cap=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, padded, generator=g) * spread).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[0], targets[-1] = 0, vocab - 1
    rows, grad = kernels.softcap_ce_rows(logits, targets, vocab, cap, 0.25, block=block)
    ref_rows, ref_grad = reference(logits, targets, vocab, ref_cap or cap, 0.25)
    return {"loss_rel": ((rows.double() - ref_rows).abs() / ref_rows.abs()).max().item(),
            "grad_abs": (grad.double() - ref_grad).abs().max().item() / ref_grad.abs().max().item(),
            "padding_grad_zero": bool((grad[:, vocab:] == 0).all()), "grad_dtype": str(grad.dtype)}


def head_loss_errors():
    """FusedHeadLoss with its chunks routed through the kernel vs the torch arithmetic, float32."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(50, 16, generator=g)
    w = torch.randn(104, 16, generator=g) * 0.5
    targets = torch.randint(0, 100, (50,), generator=g)
    out = {}
    for use_kernel in (False, True):
        kernels.available = lambda t, use=use_kernel: use
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        value = loss.head_loss(hh, ww, targets, 100, 15.0, 16)
        value.backward()
        out[use_kernel] = (value.detach(), hh.grad, ww.grad)
    return {name: ((a - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("loss", "grad_h", "grad_w"), out[True], out[False])}


def opcheck():
    g = torch.Generator().manual_seed(2)
    logits, targets = torch.randn(4, 64, generator=g), torch.randint(0, 60, (4,), generator=g)
    result = torch.library.opcheck(kernels.softcap_ce, (logits, targets, 60, 15.0, 0.5),
                                   test_utils=("test_schema", "test_faketensor"))
    return {k: v == "SUCCESS" for k, v in result.items()}


if __name__ == "__main__":
    report = {
        "one_block": kernel_errors(8, 97, 128, None, 20.0, torch.float32),
        "many_blocks": kernel_errors(8, 300, 320, 64, 20.0, torch.float32),
        "saturated": kernel_errors(8, 97, 128, 32, 400.0, torch.float32),
        "near_zero": kernel_errors(8, 97, 128, None, 1e-3, torch.float32),
        "bf16": kernel_errors(8, 300, 320, 128, 20.0, torch.bfloat16),
        "wrong_cap": kernel_errors(8, 97, 128, None, 20.0, torch.float32, cap=15.0, ref_cap=14.0),
        "head_loss": head_loss_errors(),
        "opcheck": opcheck(),
    }
    json.dump(report, sys.stdout)
