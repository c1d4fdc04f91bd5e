"""The learned predictor's two skinny products, with the elementwise work on either side of them on chip.

* `state_gate(n, G)` = sigmoid(n G^T): a branch's state gate, (tokens, d) x (d, 2r) -> (tokens, 2r). It reads
  the branch input n (the bytes that set its time) and writes the gate with the sigmoid already applied.
* `gated_decode(code, gate, D)` = (code * gate) D^T: a branch's correction, (tokens, 2r) x (2r, d) -> (tokens,
  d). The gated code is formed in registers, so neither it nor the plain product's input is written.

Both are bound by memory: 2r = 64 columns against d = 512, so the tensor cores idle while a tile streams in. Each
program takes BLOCK_M rows, its tiles moved by TMA (host-built descriptors; rows past the end load as zeros and
are not stored); the gate walks K in BLOCK_K steps (software-pipelined loads); the decode holds its gated code
tile and writes the output in BLOCK_N column chunks against the decoder, which stays in L2.

Measured at the seed shape on an H200 they are no faster than cuBLAS's products alone, and in the step the
compiler folds the sigmoid and the gating into passes it makes anyway, so `credit.products=plain` stays the
default (benchmarks/predictor_cost.md).
"""

from __future__ import annotations

import dataclasses

import torch

from creditlab.kernels._triton import launcher, tl, triton

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor


# The fastest measured at the seed shape on an H200 (benchmarks/results/gate_decode_seed.md).
@dataclasses.dataclass(frozen=True)
class GateTiles:
    block_m: int = 64
    block_k: int = 128
    stages: int = 3
    warps: int = 4


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    block_m: int = 128
    block_n: int = 64
    warps: int = 4


GATE_TILES = GateTiles()
DECODE_TILES = DecodeTiles()


if triton is not None:

    @triton.jit
    def _state_gate(n_desc, weight_desc, out_desc, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    STAGES: tl.constexpr):
        off_m = tl.program_id(0) * BLOCK_M
        R: tl.constexpr = out_desc.block_shape[1]
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # rows past the end load as zeros
            acc = tl.dot(n_desc.load([off_m, k]), weight_desc.load([0, k]).T, acc)
        out_desc.store([off_m, 0], tl.sigmoid(acc).to(out_desc.dtype))  # rows past the end are not written

    @triton.jit
    def _gated_decode(code_desc, gate_desc, decoder_desc, out_desc, N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        off_m = tl.program_id(0) * BLOCK_M
        c = code_desc.load([off_m, 0])
        # rounded to the operands' dtype, as the plain path's elementwise product is before its matmul
        u = (c.to(tl.float32) * gate_desc.load([off_m, 0]).to(tl.float32)).to(c.dtype)
        for n0 in tl.static_range(0, N, BLOCK_N):
            out_desc.store([off_m, n0], tl.dot(u, decoder_desc.load([n0, 0]).T).to(out_desc.dtype))


def _power_of_two(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def takes(*operands: torch.Tensor, widths: tuple[int, ...] = ()) -> bool:
    """Whether the kernels run on these (tokens, width) operands and further `widths` (the other side of the
    weight): CUDA, one 16-bit float dtype, rows of unit stride starting on 16-byte boundaries (TMA), every width a
    power of two of at least 16 (tl.dot)."""
    def aligned(t):
        return all(x * t.element_size() % 16 == 0 for x in (t.storage_offset(), *t.stride()[:-1]))

    return (triton is not None and all(t.is_cuda and t.dtype == operands[0].dtype and t.stride(-1) == 1
                                       and aligned(t) for t in operands)
            and operands[0].dtype in (torch.bfloat16, torch.float16)
            and all(_power_of_two(w) for w in (*widths, *(t.shape[-1] for t in operands))))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (tokens, width) without a copy where its leading dimensions allow it (a column slice keeps its row
    stride)."""
    return t.reshape(-1, t.shape[-1])


def _run_gate(kernel, n: torch.Tensor, gate_weight: torch.Tensor, tiles: GateTiles = GATE_TILES,
              out: torch.Tensor | None = None) -> torch.Tensor:
    rows = _rows(n)
    tokens, d = rows.shape
    r = gate_weight.shape[0]
    if gate_weight.shape != (r, d):
        raise ValueError(f"the gate weight must be (2r, {d}), got {tuple(gate_weight.shape)}")
    result = torch.empty((*n.shape[:-1], r), dtype=n.dtype, device=n.device) if out is None else out
    block_k = min(tiles.block_k, d)
    kernel[(triton.cdiv(tokens, tiles.block_m),)](
        TensorDescriptor.from_tensor(rows, [tiles.block_m, block_k]),
        TensorDescriptor.from_tensor(gate_weight.to(n.dtype).contiguous(), [r, block_k]),
        TensorDescriptor.from_tensor(result.view(tokens, r), [tiles.block_m, r]), K=d, BLOCK_M=tiles.block_m,
        BLOCK_K=block_k, STAGES=tiles.stages, num_warps=tiles.warps)
    return result


def _run_decode(kernel, code: torch.Tensor, gate: torch.Tensor, decoder: torch.Tensor,
                tiles: DecodeTiles = DECODE_TILES, out: torch.Tensor | None = None) -> torch.Tensor:
    code_rows, gate_rows = _rows(code), _rows(gate)
    tokens, r = code_rows.shape
    d = decoder.shape[0]
    if gate_rows.shape != (tokens, r) or decoder.shape != (d, r):
        raise ValueError(f"code {tuple(code.shape)}, gate {tuple(gate.shape)} and decoder {tuple(decoder.shape)} "
                         "must be (..., 2r), (..., 2r) and (d, 2r)")
    result = torch.empty((*code.shape[:-1], d), dtype=code.dtype, device=code.device) if out is None else out
    block_n = min(tiles.block_n, d)
    kernel[(triton.cdiv(tokens, tiles.block_m),)](
        TensorDescriptor.from_tensor(code_rows, [tiles.block_m, r]),
        TensorDescriptor.from_tensor(gate_rows, [tiles.block_m, r]),
        TensorDescriptor.from_tensor(decoder.to(code.dtype).contiguous(), [block_n, r]),
        TensorDescriptor.from_tensor(result.view(tokens, d), [tiles.block_m, block_n]), N=d,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, num_warps=tiles.warps)
    return result


def state_gate(n: torch.Tensor, gate_weight: torch.Tensor, tiles: GateTiles = GATE_TILES,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """sigmoid(n G^T) in n's dtype (accumulated in float32) for n (..., d) and G (2r, d). The kernel launched
    directly; compiled code calls `state_gate_op`. `out`: the contiguous (..., 2r) output, preallocated (the tests poison
    it)."""
    return _run_gate(_state_gate, n, gate_weight, tiles, out)


def gated_decode(code: torch.Tensor, gate: torch.Tensor, decoder: torch.Tensor, tiles: DecodeTiles = DECODE_TILES,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(code * gate) D^T in code's dtype (the gated code rounded to it, the product accumulated in float32) for
    code and gate (..., 2r) and D (d, 2r). `out`: the contiguous (..., d) output, preallocated."""
    return _run_decode(_gated_decode, code, gate, decoder, tiles, out)


if triton is not None:

    @torch.library.triton_op("creditlab::state_gate", mutates_args=())
    def state_gate_op(n: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
        """`state_gate` as the compiler sees it: launched from its generated code, no Python dispatch per call."""
        return _run_gate(launcher(_state_gate, n), n, gate_weight)

    @torch.library.triton_op("creditlab::gated_decode", mutates_args=())
    def gated_decode_op(code: torch.Tensor, gate: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
        """`gated_decode` as the compiler sees it."""
        return _run_decode(launcher(_gated_decode, code), code, gate, decoder)
