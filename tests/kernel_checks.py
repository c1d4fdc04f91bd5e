"""Checks of the Triton kernels on the CPU through Triton's interpreter, one process per kernel file.

    python tests/kernel_checks.py KERNEL[:PART] [CHECK ...]

runs the checks of tests/kernel_checks_KERNEL.py (KERNEL: a file of creditlab/kernels; all of its checks but
those of its parts, or with :PART the checks of that part; or the checks named) and prints their results as one
JSON object, which tests/test_kernels.py reads. A part is a group of checks slow enough to want a process of its
own beside the kernel's others. The interpreter is chosen when a kernel is defined, so it cannot be switched on
inside a running test: each kernel's checks run in a process of their own, started with TRITON_INTERPRET=1 (set
here too, before the package is imported), and a failure there names its kernel.
"""

import importlib
import json
import os
import sys

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 (a NaN anywhere in got gives NaN, which fails any bound)."""
    return ((got.double().reshape(want.shape) - want).abs().max() / want.abs().max()).item()


def poisoned(*shape, dtype=torch.float32) -> torch.Tensor:
    """An output a kernel writes into, NaN everywhere: an element it leaves unwritten stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype)


def checks_of(spec: str) -> dict:
    """The checks `spec` (KERNEL or KERNEL:PART) names: {name: a function of no arguments returning its JSON-able
    result}."""
    kernel, _, part = spec.partition(":")
    module = importlib.import_module(f"kernel_checks_{kernel}")
    parts = getattr(module, "PARTS", {})
    if part and part not in parts:
        raise SystemExit(f"{kernel} has no part {part!r}; its parts: {', '.join(parts) or 'none'}")
    in_parts = {name for names in parts.values() for name in names}
    names = parts[part] if part else [name for name in module.CHECKS if name not in in_parts]
    return {name: module.CHECKS[name] for name in names}


def main(argv: list[str]) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    # several of these processes run at once, one a core: intra-op threads would only contend for the cores
    torch.set_num_threads(1)
    spec, names = argv[0], argv[1:]
    checks = checks_of(spec)
    unknown = sorted(set(names) - set(checks))
    if unknown:
        raise SystemExit(f"{spec} has no check named {', '.join(unknown)}; its checks: {', '.join(checks)}")
    json.dump({name: checks[name]() for name in names or checks}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
