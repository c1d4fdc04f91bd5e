"""The head loss's soft-capped cross-entropy kernel (creditlab/ops/softcap_ce.py) on the CPU through Triton's
interpreter, against float64 autograd: run by tests/kernel_checks.py, read by tests/test_kernels.py."""

import functools
import sys
from pathlib import Path

import torch

from creditlab import ops
from creditlab.ops import loss


def reference(logits, targets, vocab, cap, scale):
    """Per-row loss and d(scale * sum)/dlogits by float64 autograd on the true vocabulary."""
    l = logits.double().clone().requires_grad_(True)
    z = cap * torch.tanh(l[:, :vocab] / cap)
    rows = torch.nn.functional.cross_entropy(z, targets, reduction="none")
    (scale * rows.sum()).backward()
    return rows.detach(), l.grad


def kernel_errors(n, vocab, padded, block, spread, dtype, cap=15.0, ref_cap=None, seed=0, poison_padding=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, padded, generator=g) * spread).to(dtype)
    if poison_padding:
        logits[:, vocab::2], logits[:, vocab + 1::2] = float("nan"), float("inf")
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[0], targets[-1] = 0, vocab - 1
    rows, grad = ops.softcap_ce_rows(logits, targets, vocab, cap, 0.25, block=block)
    ref_rows, ref_grad = reference(logits, targets, vocab, ref_cap or cap, 0.25)
    return {"loss_rel": ((rows.double() - ref_rows).abs() / ref_rows.abs()).max().item(),
            "grad_abs": (grad.double() - ref_grad).abs().max().item() / ref_grad.abs().max().item(),
            "padding_grad_zero": bool((grad[:, vocab:] == 0).all()), "grad_dtype": str(grad.dtype)}


def softcap_variant_errors():
    """The one-pass and two-pass variants of benchmarks/softcap_ce_held.py against float64, on rows whose pieces
    (256 + 64, 1,024 + 64 + 16) and targets (the first and the last column) reach every part of the kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import softcap_ce_held as bench

    out = {}
    for n, vocab, padded in ((4, 300, 320), (3, 1090, 1100)):
        g = torch.Generator().manual_seed(vocab)
        logits = torch.randn(n, padded, generator=g) * 10
        targets = torch.randint(0, vocab, (n,), generator=g)
        targets[0], targets[-1] = 0, vocab - 1
        ref_rows, ref_grad = reference(logits, targets, vocab, 15.0, 0.25)
        for name, kw in bench.VARIANTS:
            if not {"variant", "held", "split"} & set(kw):  # the package's kernel, checked above
                continue
            rows, grad = bench.launcher(kw)(logits, targets, vocab, 15.0, 0.25)
            key = f"{name} ({padded})"
            out[key] = {"loss_rel": ((rows.double() - ref_rows).abs() / ref_rows.abs()).max().item(),
                        "grad_abs": (grad.double() - ref_grad).abs().max().item() / ref_grad.abs().max().item(),
                        "padding_grad_zero": bool((grad[:, vocab:] == 0).all())}
    return out


def head_loss_errors():
    """FusedHeadLoss with its chunks routed through the kernel vs the torch arithmetic, float32."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(50, 16, generator=g)
    w = torch.randn(104, 16, generator=g) * 0.5
    targets = torch.randint(0, 100, (50,), generator=g)
    out = {}
    for use_kernel in (False, True):
        ops.available = lambda t, use=use_kernel: use
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        value = loss.head_loss(hh, ww, targets, 100, 15.0, 16)
        value.backward()
        out[use_kernel] = (value.detach(), hh.grad, ww.grad)
    return {name: ((a - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("loss", "grad_h", "grad_w"), out[True], out[False])}


def opcheck():
    """The fused head-loss operator, with its chunks through the kernel, declares its outputs truthfully."""
    ops.available = lambda t: True
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(12, 8, generator=g), torch.randn(64, 8, generator=g)
    targets = torch.randint(0, 60, (12,), generator=g)
    result = torch.library.opcheck(loss.fused_head_loss, (h, w, targets, 60, 15.0, 5),
                                   test_utils=("test_schema", "test_faketensor"))
    return {k: v == "SUCCESS" for k, v in result.items()}


@torch.library.custom_op("creditlab_test::softcap_ce_rows", mutates_args=())
def _softcap_ce_rows_op(logits: torch.Tensor, targets: torch.Tensor, vocab: int, cap: float,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _KERNEL_ROWS(logits, targets, vocab, cap, scale)


@_softcap_ce_rows_op.register_fake
def _(logits, targets, vocab, cap, scale):
    return logits.new_empty(logits.shape[0], dtype=torch.float32), torch.empty_like(logits)


_KERNEL_ROWS = ops.softcap_ce_rows


def logits_shaped_kept_by_compiled_model(products_traced_op_by_op: bool) -> int:
    """How many tensors shaped like a chunk of logits a compiled two-layer model keeps for its backward, with
    the head loss's
    chunks through the kernel. `products_traced_op_by_op` replays the earlier structure, where the compiler
    saw the chunk loop op by op (and kept every chunk's logits gradient for the backward)."""
    from creditlab import config
    from creditlab.model import GPT

    ops.available = lambda t: True
    real_op = loss.fused_head_loss
    if products_traced_op_by_op:  # the kernel as its own operator, the loop around it traced
        loss.fused_head_loss = real_op._init_fn
        ops.softcap_ce_rows = _softcap_ce_rows_op
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = config.load("tiny", ["model.layers=2", "model.value_embeds=1"])
        model = GPT(cfg.model)
        idx = torch.randint(0, cfg.model.vocab_size, (2, 32))
        forward = torch.compile(model)
        owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        chunk_of_logits = (32, cfg.model.padded_vocab)
        found = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in owned and tuple(t.shape) == chunk_of_logits:
                found.append(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = forward(idx, idx, loss_chunk=32)
        value.backward()
        return len(set(found))
    finally:
        loss.fused_head_loss = real_op
        ops.softcap_ce_rows = _KERNEL_ROWS


CHECKS = {
    "one_block": functools.partial(kernel_errors, 8, 97, 128, None, 20.0, torch.float32),
    "many_blocks": functools.partial(kernel_errors, 8, 300, 320, 64, 20.0, torch.float32),
    "saturated": functools.partial(kernel_errors, 8, 97, 128, 32, 400.0, torch.float32),
    "near_zero": functools.partial(kernel_errors, 8, 97, 128, None, 1e-3, torch.float32),
    "nan_padding": functools.partial(kernel_errors, 8, 300, 320, 64, 20.0, torch.float32, poison_padding=True),
    "bf16": functools.partial(kernel_errors, 8, 300, 320, 128, 20.0, torch.bfloat16),
    "wrong_cap": functools.partial(kernel_errors, 8, 97, 128, None, 20.0, torch.float32, cap=15.0, ref_cap=14.0),
    "softcap_variants": softcap_variant_errors,
    "head_loss": head_loss_errors,
    "opcheck": opcheck,
    "logits_kept_fused": functools.partial(logits_shaped_kept_by_compiled_model, False),
    "logits_kept_op_by_op": functools.partial(logits_shaped_kept_by_compiled_model, True),
}

# a model through the compiler, most of these checks' time: a process of its own, beside the kernel's others
PARTS = {"compiled": ["logits_kept_fused", "logits_kept_op_by_op"]}
