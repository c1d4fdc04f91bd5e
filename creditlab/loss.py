"""The head loss: soft-capped logits and cross-entropy, fused and chunked.

A seed-shape micro-batch has 131,072 targets; its full float32 logits would take 6.4 GB. The fused loss walks
the targets in chunks, and for each chunk computes logits, the loss and the loss's gradient with respect to the
hidden state and the head weight, then drops the logits. The backward pass only scales the stored gradients.
This is the usual fused linear cross-entropy; the arithmetic is the exact gradient, so it is checked against
autograd in float64.
"""

from __future__ import annotations

import torch

from creditlab import kernels


def _chunk_loss_and_grads(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                          cap: float, scale: float):
    """Sum of the chunk's losses, and d(scale * sum)/dh, d(scale * sum)/dW. h: (n, d); weight: (Vp, d)."""
    if kernels.available(h):  # the same arithmetic in one Triton pass over the logits (kernels.py)
        loss_rows, dlogits = kernels.softcap_ce_rows(h @ weight.t(), targets, vocab_size, cap, scale)
        return loss_rows.sum(), dlogits @ weight, dlogits.t() @ h
    acc = torch.promote_types(h.dtype, torch.float32)  # float32 or better for the softmax
    logits = (h @ weight.t()).to(acc)  # (n, Vp)
    t = torch.tanh(logits / cap)
    z = cap * t
    padded = torch.arange(weight.shape[0], device=h.device) >= vocab_size
    z = z.masked_fill(padded, float("-inf"))  # the padding columns of the head take no probability
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    target_z = z.gather(1, targets[:, None])[:, 0]
    loss_sum = (lse - target_z).sum()
    is_target = torch.arange(weight.shape[0], device=h.device) == targets[:, None]
    dz = torch.exp(z - lse[:, None]) - is_target.to(z.dtype)  # softmax - onehot, one pointwise pass
    dlogits = (dz * (1.0 - t * t) * scale).to(h.dtype)  # d(cap*tanh(l/cap))/dl = 1 - tanh^2
    return loss_sum, dlogits @ weight, dlogits.t() @ h


@torch.library.custom_op("creditlab::fused_head_loss", mutates_args=())
def fused_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, d loss/dh, d loss/dW) over all targets, chunk by chunk.

    One operator the compiler cannot look into, on purpose: traced op by op, the products with the logits'
    gradient are needed only by the backward, so the compiler moved them there and kept every chunk's
    gradient of the logits for it (3 GB at the seed shape). As one operator, its small outputs are what is
    kept, and only one chunk's logits are alive at a time."""
    n_targets = h.shape[0]
    w = weight.to(h.dtype)
    grad_h = torch.empty_like(h)
    acc = torch.promote_types(h.dtype, torch.float32)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device)
    total = torch.zeros((), dtype=acc, device=h.device)
    for start in range(0, n_targets, chunk):
        stop = min(start + chunk, n_targets)
        loss_sum, gh, gw = _chunk_loss_and_grads(h[start:stop], w, targets[start:stop], vocab_size, cap,
                                                 1.0 / n_targets)
        total += loss_sum
        grad_h[start:stop] = gh
        grad_w += gw.to(acc)
    return total / n_targets, grad_h, grad_w


@fused_head_loss.register_fake
def _(h, weight, targets, vocab_size, cap, chunk):
    acc = torch.promote_types(h.dtype, torch.float32)
    return h.new_empty((), dtype=acc), torch.empty_like(h), weight.new_empty(weight.shape, dtype=acc)


class FusedHeadLoss(torch.autograd.Function):
    """mean over targets of CE(cap * tanh(h W^T / cap)); gradients computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size: int, cap: float, chunk: int):
        loss, grad_h, grad_w = fused_head_loss(h, weight, targets, vocab_size, cap, chunk)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None


def head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float,
              chunk: int) -> torch.Tensor:
    """Mean soft-capped cross-entropy of h: (N, d) against targets: (N,) through the (padded) head weight."""
    return FusedHeadLoss.apply(h, weight, targets, vocab_size, cap, chunk)


def reference_head_loss(h, weight, targets, vocab_size: int, cap: float) -> torch.Tensor:
    """The same loss written plainly, for checks: materializes all logits."""
    logits = (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))[:, :vocab_size]
    z = cap * torch.tanh(logits / cap)
    return torch.nn.functional.cross_entropy(z, targets)
