"""A recorder of the operators dispatched while it is entered, for tests that pin which ops a piece of code runs."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """`seen`: each dispatched operator's overload name (e.g. aten.stack.default, creditlab.relu2_linear.default),
    in order."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
