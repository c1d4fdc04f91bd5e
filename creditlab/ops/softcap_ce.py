"""`softcap_ce_rows`: the soft-capped cross-entropy of a chunk of logits and its gradient, one program per row. The
compiler's fused version of the same arithmetic (`loss.softcap_ce_rows`) made four passes over the
bf16 logits at about 0.8 TB/s on an H200; this kernel makes one read of each row from memory (the second
pass finds it in L2) and one write. Because z = cap * tanh(l / cap) never exceeds cap, the log-sum-exp needs
no running maximum: exp(z - cap) lies in [exp(-2 cap), 1].

The kernels run on CUDA tensors, and under TRITON_INTERPRET=1 on CPU tensors, which is how the tests check
them against the torch arithmetic without a GPU.
"""

from __future__ import annotations

import torch

from creditlab.ops._triton import tl, triton

DEFAULT_BLOCK, DEFAULT_WARPS, DEFAULT_STAGES = 1024, 4, 1  # fastest at the seed shape (benchmarks/softcap_ce.md)

if triton is not None:

    @triton.jit
    def _tanh(x, FAST: tl.constexpr):
        if FAST:  # one MUFU instruction (relative error ~2^-11, below the bf16 logits' own rounding)
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _load_row(row_ptr, cols, valid, padded: tl.constexpr, policy: tl.constexpr):
        """A block of a row's logits in float32, zero past the true vocabulary. The load is masked at the padded
        width, not at the vocabulary: a vocabulary such as 12,289 is odd, and a mask that can change at every
        column makes the compiler load one 2-byte element an instruction; at the padded width (a multiple of 64)
        each thread loads its columns in one wide load (benchmarks/softcap_ce.md)."""
        x = tl.load(row_ptr + cols, mask=cols < padded, other=0.0, eviction_policy=policy).to(tl.float32)
        return tl.where(valid, x, 0.0)

    @triton.jit
    def _softcap_ce_rows(logits_ptr, grad_ptr, targets_ptr, loss_ptr, stride, cap, scale, vocab: tl.constexpr,
                         padded: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, STAGES: tl.constexpr):
        LOG2E: tl.constexpr = 1.4426950408889634
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * stride
        grad_row = grad_ptr + row * stride
        target = tl.load(targets_ptr + row)
        inv_cap = 1.0 / cap
        # Pass 1: sum of exp(z - cap) over the true vocabulary, and the target's z. Its reads are kept in L2 for
        # pass 2 (evict_last), whose reads and the gradient's writes are not (evict_first).
        sum_e = tl.zeros([BLOCK], tl.float32)
        target_z = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, vocab, BLOCK, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < vocab
            z = cap * _tanh(_load_row(logits_row, cols, valid, padded, "evict_last") * inv_cap, FAST)
            sum_e += tl.where(valid, tl.exp2((z - cap) * LOG2E), 0.0)
            target_z += tl.where(cols == target, z, 0.0)
        lse = cap + tl.log(tl.sum(sum_e, axis=0))
        tl.store(loss_ptr + row, lse - tl.sum(target_z, axis=0))
        # Pass 2 (the row is in L2 by now): scale * (softmax(z) - onehot) * (1 - tanh^2); padding gets 0.
        for start in tl.range(0, padded, BLOCK, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < vocab
            t = _tanh(_load_row(logits_row, cols, valid, padded, "evict_first") * inv_cap, FAST)
            p = tl.where(valid, tl.exp2((cap * t - lse) * LOG2E), 0.0)
            g = (p - tl.where(cols == target, 1.0, 0.0)) * (1.0 - t * t) * scale
            tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < padded,
                     eviction_policy="evict_first")


def softcap_ce_rows(logits: torch.Tensor, targets: torch.Tensor, vocab: int, cap: float, scale: float,
                    block: int | None = None, num_warps: int | None = None, fast: bool | None = None,
                    stages: int | None = None, grad_dtype: torch.dtype | None = None):
    """Per-row loss (float32) and the gradient of scale * sum(loss) with respect to logits (in grad_dtype,
    logits' dtype by default; an FP8 dtype for the FP8 head, `loss.py`).

    logits: (n, padded) with columns >= vocab being padding; targets: (n,) int64 in [0, vocab). `block`
    (columns per step, a power of two) and `num_warps` default to the fastest measured at the seed shape
    (benchmarks/softcap_ce.py); `fast` (the hardware tanh) defaults to on for CUDA tensors (the interpreter
    cannot run it)."""
    if triton is None:
        raise RuntimeError("the Triton kernels need `triton` (pip install triton)")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-major (n, padded) matrix, got shape {tuple(logits.shape)} "
                         f"with strides {logits.stride()}")
    n, padded = logits.shape
    grad = torch.empty_like(logits, dtype=grad_dtype or logits.dtype)
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    block = block or min(triton.next_power_of_2(padded), DEFAULT_BLOCK)
    _softcap_ce_rows[(n,)](logits, grad, targets, loss, logits.stride(0), float(cap), float(scale),
                           vocab=vocab, padded=padded, BLOCK=block,
                           FAST=logits.is_cuda if fast is None else fast, STAGES=stages or DEFAULT_STAGES,
                           num_warps=num_warps or DEFAULT_WARPS)
    return loss, grad
