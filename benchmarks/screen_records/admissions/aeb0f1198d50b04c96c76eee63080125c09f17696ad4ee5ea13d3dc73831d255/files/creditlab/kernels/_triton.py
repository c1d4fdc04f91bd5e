"""Triton, when it is installed (the CPU path never needs it)."""

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None
