"""The head loss: soft-capped logits and cross-entropy, fused and chunked.

A seed-shape micro-batch has 131,072 targets; its full float32 logits would take 6.4 GB. The fused loss walks
the targets in chunks, and for each chunk computes logits, the loss and the loss's gradient with respect to the
hidden state and the head weight, then drops the logits. The backward pass only scales the stored gradients.
This is the usual fused linear cross-entropy; the arithmetic is the exact gradient, so it is checked against
autograd in float64.

With `model.head=fp8` the three products of a chunk run on FP8 tensor cores with float32 accumulation
(`torch._scaled_mm` through ops/fp8.py, the component the `fp8` credit source shares), as modded-nanogpt runs its head: h and W in e4m3 with one scale each, from their largest
magnitude, and the logits' gradient in e5m2 with a fixed scale, since that gradient is bounded (below). This is a
precision choice, not exact arithmetic: its tests check that it computes the products of the quantized operands
and how far those are from float64, and whether a model trained with it learns as well is a `compare` run's
question (benchmarks/native_seed.md). Evaluation (`head_loss_sum`) keeps the plain precision.
"""

from __future__ import annotations

import torch

from creditlab import ops
from creditlab.ops.fp8 import E4M3, E5M2, quantize, scaled_mm


HEAD_INPUT_FP8, HEAD_GRAD_FP8 = E4M3, E5M2  # the FP8 component's formats (ops/fp8.py)
# Each row's d loss / d logit = (softmax - onehot) * (1 - tanh^2) lies in [-1, 1]: times 2^15 it stays under
# e5m2's largest value (57,344), and entries down to 2^-31 (e5m2's smallest, 2^-16, over 2^15) survive.
HEAD_GRAD_SCALE = 2.0 ** 15


def softcap_ce_rows(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float, scale: float,
                    grad_dtype: torch.dtype | None = None):
    """Per-row loss of CE(cap * tanh(logits / cap)) over the first vocab_size columns, and the gradient of
    scale * sum(loss) with respect to logits (in grad_dtype, logits' dtype by default; zero on the padding
    columns). The torch arithmetic: the reference for the Triton kernel (ops.softcap_ce_rows) and the CPU
    path."""
    acc = torch.promote_types(logits.dtype, torch.float32)  # float32 or better for the softmax
    t = torch.tanh(logits.to(acc) / cap)
    z = cap * t
    columns = torch.arange(logits.shape[1], device=logits.device)
    z = z.masked_fill(columns >= vocab_size, float("-inf"))  # the padding columns take no probability
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    rows = lse - z.gather(1, targets[:, None])[:, 0]
    dz = torch.exp(z - lse[:, None]) - (columns == targets[:, None]).to(z.dtype)  # softmax - onehot
    # d(cap*tanh(l/cap))/dl = 1 - tanh^2
    return rows, (dz * (1.0 - t * t) * scale).to(grad_dtype or logits.dtype)


def _rows_fn(h: torch.Tensor):
    # On CUDA the pointwise work is one Triton kernel (ops/softcap_ce.py); elsewhere the torch arithmetic.
    return ops.softcap_ce_rows if ops.available(h) else softcap_ce_rows


class PlainHead:
    """A micro-batch's operands of the head in h's dtype (bf16 under autocast), chunk by chunk."""

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, scale: float):
        self.h, self.w, self.scale = h, weight.to(h.dtype), scale

    def chunk(self, start: int, stop: int, targets: torch.Tensor, vocab_size: int, cap: float,
              grad_h: torch.Tensor, grad_w: torch.Tensor) -> torch.Tensor:
        """The losses of rows start:stop; writes d(scale * sum)/dh into grad_h's rows and adds d(scale * sum)/dW
        into grad_w, each straight from its product: no copy of a chunk's result, no separate sum."""
        h = self.h[start:stop]
        loss_rows, dlogits = _rows_fn(h)(h @ self.w.t(), targets, vocab_size, cap, self.scale)
        torch.mm(dlogits, self.w, out=grad_h[start:stop])
        add_product(grad_w, dlogits.t(), h)
        return loss_rows


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc as the product's addend, in acc's dtype: on CUDA bf16 operands accumulate into a
    float32 acc inside the product (cuBLAS's float32 output); elsewhere a float32-or-wider product is added."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # the CPU has no mixed-dtype product
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class Fp8Head:
    """A micro-batch's operands of the FP8 head, quantized once: h (N, d) and W (Vp, d) in e4m3, each also
    transposed, because FP8 tensor-core products take both operands with the summed index contiguous."""

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, scale: float):
        self.out_dtype = h.dtype
        # the scale of the products with the e5m2 gradient: the loss's own over the gradient's fixed one
        self.g_scale = torch.full((), scale / HEAD_GRAD_SCALE, dtype=torch.float32, device=h.device)
        self.h8, self.h_scale = quantize(h)
        self.h8_t = ops.transpose(self.h8)  # (d, N): its column blocks are the chunks' rows, summed over in dW
        self.w8, self.w_scale = quantize(weight)
        self.w8_t = ops.transpose(self.w8)  # (d, Vp): W with the vocabulary contiguous, summed over in dh

    def chunk(self, start: int, stop: int, targets: torch.Tensor, vocab_size: int, cap: float,
              grad_h: torch.Tensor, grad_w: torch.Tensor) -> torch.Tensor:
        """PlainHead.chunk through FP8 products with float32 accumulation (W quantized from its own dtype)."""
        h8 = self.h8[start:stop]
        logits = scaled_mm(h8, self.w8.t(), self.h_scale, self.w_scale, self.out_dtype)
        loss_rows, g8 = _rows_fn(h8)(logits, targets, vocab_size, cap, HEAD_GRAD_SCALE, grad_dtype=HEAD_GRAD_FP8)
        gh = scaled_mm(g8, self.w8_t.t(), self.g_scale, self.w_scale, self.out_dtype)
        gw = scaled_mm(ops.transpose(g8), self.h8_t[:, start:stop].t(), self.g_scale, self.h_scale, torch.float32)
        grad_h[start:stop] = gh
        grad_w += gw
        return loss_rows


@torch.library.custom_op("creditlab::fused_head_loss", mutates_args=())
def fused_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float,
                    chunk: int, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, d loss/dh, d loss/dW) over all targets, chunk by chunk; fp8: the products in FP8 (Fp8Head).

    One operator the compiler cannot look into, on purpose: traced op by op, the products with the logits'
    gradient are needed only by the backward, so the compiler moved them there and kept every chunk's
    gradient of the logits for it (3 GB at the seed shape). As one operator, its small outputs are what is
    kept, and only one chunk's logits are alive at a time."""
    n_targets = h.shape[0]
    head = (Fp8Head if fp8 else PlainHead)(h, weight, 1.0 / n_targets)
    grad_h = torch.empty_like(h)
    acc = torch.promote_types(h.dtype, torch.float32)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device)
    rows = [head.chunk(start, min(start + chunk, n_targets), targets[start:start + chunk], vocab_size, cap,
                       grad_h, grad_w) for start in range(0, n_targets, chunk)]
    # one sum at the end, not two small kernels a chunk
    return torch.cat(rows).to(acc).sum() / n_targets, grad_h, grad_w


@fused_head_loss.register_fake
def _(h, weight, targets, vocab_size, cap, chunk, fp8=False):
    acc = torch.promote_types(h.dtype, torch.float32)
    return h.new_empty((), dtype=acc), torch.empty_like(h), weight.new_empty(weight.shape, dtype=acc)


class FusedHeadLoss(torch.autograd.Function):
    """mean over targets of CE(cap * tanh(h W^T / cap)); gradients computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size: int, cap: float, chunk: int, fp8: bool = False):
        loss, grad_h, grad_w = fused_head_loss(h, weight, targets, vocab_size, cap, chunk, fp8)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None, None


def head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, cap: float,
              chunk: int, fp8: bool = False) -> torch.Tensor:
    """Mean soft-capped cross-entropy of h: (N, d) against targets: (N,) through the (padded) head weight;
    fp8: its products in FP8 (Fp8Head)."""
    return FusedHeadLoss.apply(h, weight, targets, vocab_size, cap, chunk, fp8)


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
