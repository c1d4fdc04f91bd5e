"""The branch norm's backward with the learned correction decoded inside it, and the residual gradient added.

The backward of n = x / rms(x) maps dL/dn to dL/dx = s (dn - n mean(dn * n)), s = 1 / rms(x). For a branch of
the learned source, dL/dn is the gradient of n's exact uses plus the branch's correction c = (code * gate) D^T, a
rank-2r decode. This kernel forms c tile by tile on chip from the (tokens, 2r) code and gate and the (d, 2r)
decoder, adds it to the exact part, applies the norm's backward and adds the gradient the residual stream carries
past the branch: one read of n and of the residual gradient, one write of the stream's gradient before the
branch. The unfused step writes c and reads it back in the compiler's pass that does the same arithmetic.
"""

from __future__ import annotations

import torch

from creditlab.kernels._triton import launcher, tl, triton

ROWS, WARPS = 32, 8  # tokens per program; the (ROWS, d) float32 tile of c lives in registers


if triton is not None:

    @triton.jit
    def _norm_decode_backward(dn, residual, n, scale, code, gate, decoder, dx, tokens, D: tl.constexpr,
                              R2: tl.constexpr, ROWS: tl.constexpr, HAS_DN: tl.constexpr,
                              HAS_RESIDUAL: tl.constexpr):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        valid = rows < tokens
        cols = tl.arange(0, D)
        ks = tl.arange(0, R2)
        small = rows[:, None] * R2 + ks[None, :]
        u = (tl.load(code + small, mask=valid[:, None], other=0.0).to(tl.float32) *
             tl.load(gate + small, mask=valid[:, None], other=0.0).to(tl.float32))
        decoder_t = tl.load(decoder + cols[None, :] * R2 + ks[:, None])  # (R2, D): D_b^T
        grad = tl.dot(u.to(decoder_t.dtype), decoder_t)  # c (ROWS, D), float32 accumulation
        wide = rows[:, None] * D + cols[None, :]
        if HAS_DN:
            grad += tl.load(dn + wide, mask=valid[:, None], other=0.0).to(tl.float32)
        nv = tl.load(n + wide, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.load(scale + rows, mask=valid, other=0.0)
        mean = tl.sum(grad * nv, axis=1) / D
        out = s[:, None] * (grad - nv * mean[:, None])
        if HAS_RESIDUAL:
            out += tl.load(residual + wide, mask=valid[:, None], other=0.0).to(tl.float32)
        tl.store(dx + wide, out.to(dx.dtype.element_ty), mask=valid[:, None])


def takes(n: torch.Tensor, code: torch.Tensor) -> bool:
    """Whether the kernel runs these: CUDA, a power-of-two width and code width of at least 16 (tl.dot)."""
    d, r2 = n.shape[-1], code.shape[-1]
    return (triton is not None and n.is_cuda and n.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and d & (d - 1) == 0 and r2 & (r2 - 1) == 0 and r2 >= 16 and d >= 16)


def _run(kernel, dn, residual, n, scale, code, gate, decoder, out=None):
    tokens, d = n.shape
    dx = torch.empty_like(n) if out is None else out
    kernel[(triton.cdiv(tokens, ROWS),)](
        dn if dn is not None else n, residual if residual is not None else n, n, scale, code.contiguous(),
        gate.contiguous(), decoder.to(code.dtype).contiguous(), dx, tokens, D=d, R2=code.shape[1], ROWS=ROWS,
        HAS_DN=dn is not None, HAS_RESIDUAL=residual is not None, num_warps=WARPS)
    return dx


def norm_decode_backward(dn: torch.Tensor | None, n: torch.Tensor, scale: torch.Tensor, code: torch.Tensor,
                         gate: torch.Tensor, decoder: torch.Tensor, residual: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """residual + dL/dx (tokens, d) in n's dtype from dn (tokens, d) or None (no exact use of n), n (tokens, d),
    scale (tokens,) float32, code and gate (tokens, 2r), decoder (d, 2r) in code's dtype, and the residual
    stream's gradient past the branch (tokens, d) or None. The kernel launched directly; compiled code calls
    `norm_decode_op`. `out`: the output, preallocated (the tests poison it)."""
    return _run(_norm_decode_backward, dn, residual, n, scale, code, gate, decoder, out)


if triton is not None:

    @torch.library.triton_op("creditlab::norm_decode", mutates_args=())
    def norm_decode_op(dn: torch.Tensor | None, residual: torch.Tensor | None, n: torch.Tensor,
                       scale: torch.Tensor, code: torch.Tensor, gate: torch.Tensor,
                       decoder: torch.Tensor) -> torch.Tensor:
        """`norm_decode_backward` as the compiler sees it: a Triton operator its backward launches from its own code
        (an opaque custom operator costs a Python dispatch per call, one per branch and micro-batch)."""
        return _run(launcher(_norm_decode_backward, n), dn, residual, n, scale, code, gate, decoder)
