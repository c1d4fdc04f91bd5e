"""Triton, when it is installed (the CPU path never needs it)."""

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def launcher(kernel, t):
    """How a Triton operator's body (torch.library.triton_op) launches `kernel` on t's device: wrapped for the
    compiler on a GPU; under the interpreter (CPU tensors) as it is, since wrap_triton needs a compiled kernel."""
    return kernel if t.device.type == "cpu" else torch.library.wrap_triton(kernel)


@functools.cache
def multiprocessors(index: int) -> int:
    """How many multiprocessors CUDA device `index` has: the program count of a persistent kernel."""
    return torch.cuda.get_device_properties(index).multi_processor_count
