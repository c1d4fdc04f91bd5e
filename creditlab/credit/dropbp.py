"""DropBP (Woo et al. 2024) as a control: skip whole branches' backward at random, the 16 products kept.

On a synthetic update each of the 16 branches is dropped with probability p, independently: the residual stream
adds its output detached (`output(b, y)` returns `y.detach()`), so autograd forms neither its input gradient nor
its weight gradient, while the residual path and every kept branch stay exact. p saves as many FLOPs in
expectation as leaving out the 16 products does (flops.dropbp_rate), so that a comparison with `zero` says
whether *which* backward work is skipped matters at the same cost.

The pattern is one per update (DropBP drops per iteration), the same for each of its micro-batches, drawn from a
CPU generator seeded from train.seed and the update index alone: a resumed run, a forked budget and the step
check's several trainers draw what an unbroken run would, with no state to save.

Compilation: the pattern is a Python choice per update, and a whole-model graph would be specialized on all 16
flags at once (up to 2^16 graphs). `compile_per_block` asks the trainer to compile each block on its own instead,
so that each block has at most four variants (attention kept or dropped, MLP kept or dropped; train.py).
"""

from __future__ import annotations

import torch

from creditlab.config import Config
from creditlab.credit.sources import CreditSource, stream_seed
from creditlab.flops import dropbp_rate
from creditlab.model import ExactCredit


class DropCredit(ExactCredit):
    """Exact, but the dropped branches' outputs enter the residual stream as constants."""

    def __init__(self, dropped: list[bool]):
        self.dropped = dropped  # one flag per branch; compiled code guards only on the flags it reads

    def output(self, index: int, y: torch.Tensor) -> torch.Tensor:
        return y.detach() if self.dropped[index] else y


class DropBPSource(CreditSource):
    """Synthetic updates drop each branch's backward with probability p; exact updates are native."""

    # `omits` makes the schedule give this source synthetic updates (schedules.Plan): it leaves out backward work,
    # though whole branches' rather than the 16 products. It fits nothing, so it has no teacher updates.
    name, omits, fits = "dropbp", True, False
    about = "whole branches' backward skipped at random, as many FLOPs in expectation as the omitted products"
    # read by the trainer: compile each block on its own, with up to this many graphs each (attention and MLP each
    # kept or dropped; module docstring)
    compile_per_block = 4
    unused_parameters = True  # read by the trainer: a dropped branch's parameters get no gradient (DDP must know)

    SALT = 0x6472_6F70  # keeps the pattern's stream apart from other generators seeded from train.seed

    def __init__(self, branches: int, rate: float, seed: int):
        super().__init__()
        self.branches, self.rate, self.seed = branches, rate, seed
        self.last_dropped: list[int] = []  # the branches the last synthetic context dropped, for tests and checks

    @classmethod
    def from_config(cls, cfg: Config) -> "DropBPSource":
        return cls(cfg.model.branches, dropbp_rate(cfg.model).rate, cfg.train.seed)

    def pattern(self, update: int) -> list[bool]:
        """Which branches update `update` drops: i.i.d. Bernoulli(rate), from the seed and the update alone."""
        g = torch.Generator().manual_seed(stream_seed(self.seed, update, self.SALT))
        return (torch.rand(self.branches, generator=g, dtype=torch.float64) < self.rate).tolist()

    def dropping(self, dropped: list[bool]) -> DropCredit:
        self.last_dropped = [b for b, drop in enumerate(dropped) if drop]
        return DropCredit(dropped)

    def context(self, trainer, inputs, targets, kind: str, scale: float) -> ExactCredit:
        if kind != "synthetic":
            return self.exact_step()
        return self.dropping(self.pattern(trainer.update_index))

    def warming_contexts(self) -> list[DropCredit]:
        """Contexts that between them meet every variant of every block (its attention and its MLP each kept or
        dropped: the same choice in every block), for a timed benchmark to compile before it times: drawn
        patterns meet new variants for dozens of updates, and an update that compiles times the compiler."""
        return [DropCredit([attn if b % 2 == 0 else mlp for b in range(self.branches)])
                for attn in (False, True) for mlp in (False, True)]

    def step(self) -> DropCredit:
        """A synthetic context outside a training run (the checks): the pattern of update 0."""
        return self.dropping(self.pattern(0))


__all__ = ["DropBPSource", "DropCredit"]
