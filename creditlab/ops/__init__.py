"""The model's fused operators, each beside the kernels it runs (Triton, and Gluon on Hopper), written only where a
measured gap demanded one: the MLP with ReLU^2 in its products (relu2.py), QK-norm and rotary in the Q/K/V
product's epilogue (qk_norm.py), the attention gate's thin product (attention_gate.py), the head's soft-capped
cross-entropy (loss.py), and a teacher's fit of one branch (fit_rows.py).

Each Triton kernel runs on CUDA tensors, and under TRITON_INTERPRET=1 on CPU tensors, which is how the tests check
it against float64 arithmetic without a GPU (tests/kernel_checks_<kernel>.py); the Gluon kernels are compiled for
sm_90 on the CPU and checked on a GPU (tests/test_gpu_kernels.py). Callers choose a kernel only where `available`
says so and keep the torch arithmetic as the path everywhere else.
"""

from __future__ import annotations

import contextlib

import torch

from creditlab.ops._triton import triton
from creditlab.ops import tiled_transpose
from creditlab.ops.softcap_ce import softcap_ce_rows

__all__ = ["available", "compute_dtype", "off", "softcap_ce_rows", "transpose"]

_off = False


def available(t: torch.Tensor) -> bool:
    return not _off and triton is not None and t.is_cuda


@contextlib.contextmanager
def off():
    """Every caller of `available` takes its torch arithmetic inside this block (the step check's plain step in the
    training precision, creditlab/checks/step_check.py). Eager code only: a compiled graph keeps what it traced."""
    global _off
    was, _off = _off, True
    try:
        yield
    finally:
        _off = was


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in on t's device: the autocast dtype where autocast is on, else t's. The
    operators that stand in for a product (relu2.py, qk_norm.py, attention_gate.py, the merged state gates) cast
    their operands to it, as autocast's F.linear would."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def transpose(x: torch.Tensor) -> torch.Tensor:
    """x.t().contiguous() of a one-byte matrix: by tiles in Triton on CUDA (ops/tiled_transpose.py), torch's copy
    elsewhere."""
    return tiled_transpose.transpose(x) if available(x) else x.t().contiguous()
