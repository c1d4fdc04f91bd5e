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


def softcap_ce_rows(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float, scale: float):
    """Per-row loss of CE(cap * tanh(logits / cap)) over the first vocab_size columns, and the gradient of
    scale * sum(loss) with respect to logits (in logits' dtype; zero on the padding columns). The torch
    arithmetic: the reference for the Triton kernel (kernels.softcap_ce_rows) and the CPU path."""
    acc = torch.promote_types(logits.dtype, torch.float32)  # float32 or better for the softmax
    t = torch.tanh(logits.to(acc) / cap)
    z = cap * t
    columns = torch.arange(logits.shape[1], device=logits.device)
    z = z.masked_fill(columns >= vocab_size, float("-inf"))  # the padding columns take no probability
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    rows = lse - z.gather(1, targets[:, None])[:, 0]
    dz = torch.exp(z - lse[:, None]) - (columns == targets[:, None]).to(z.dtype)  # softmax - onehot
    return rows, (dz * (1.0 - t * t) * scale).to(logits.dtype)  # d(cap*tanh(l/cap))/dl = 1 - tanh^2


def _chunk_loss_and_grads(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                          cap: float, scale: float):
    """Sum of the chunk's losses, and d(scale * sum)/dh, d(scale * sum)/dW. h: (n, d); weight: (Vp, d)."""
    # On CUDA the pointwise work is one Triton kernel (kernels/softcap_ce.py); elsewhere the torch arithmetic.
    rows_fn = kernels.softcap_ce_rows if kernels.available(h) else softcap_ce_rows
    loss_rows, dlogits = rows_fn(h @ weight.t(), targets, vocab_size, cap, scale)
    return loss_rows.sum(), dlogits @ weight, dlogits.t() @ h


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


@torch.no_grad()
def head_loss_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float,
                  chunk: int) -> torch.Tensor:
    """Sum over targets of the same soft-capped cross-entropy, forward only: for evaluation. Chunk by chunk,
    with no gradient work and only one chunk's logits alive; the sum in float32 or better."""
    acc = torch.promote_types(h.dtype, torch.float32)
    w = weight[:vocab_size].to(h.dtype)
    total = torch.zeros((), dtype=acc, device=h.device)
    for start in range(0, h.shape[0], chunk):
        z = cap * torch.tanh((h[start:start + chunk] @ w.t()).to(acc) / cap)
        picked = z.gather(1, targets[start:start + chunk, None])[:, 0]
        total += (torch.logsumexp(z, dim=-1) - picked).sum()
    return total


def reference_head_loss(h, weight, targets, vocab_size: int, cap: float) -> torch.Tensor:
    """The same loss written plainly, for checks: materializes all logits."""
    logits = (h @ weight.t()).to(torch.promote_types(h.dtype, torch.float32))[:, :vocab_size]
    z = cap * torch.tanh(logits / cap)
    return torch.nn.functional.cross_entropy(z, targets)
