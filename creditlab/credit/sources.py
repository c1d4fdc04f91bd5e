"""Credit sources: where the omitted input-gradient products' replacements come from.

A source is a module whose `context()` returns the per-micro-batch context the model threads through its
forward pass (`branch`, `product`, `terminal`, `finish`); the model never knows which source it runs. Adding a
source is one class and one line in registry.py. The trainer runs every micro-batch the same way: the source's
context for the update's kind (schedules.py decides it), the trainer's one forward and backward, then the source's
`after_backward`; after the optimizer step, `end_update`. A source that learns (`fits = True`) gives a teacher
update a fitting context (credit/teacher.py) and applies and reports the fit in `end_update`.

How a correction reaches the residual gradient without a second backward pass or hooks:

* The omitted product reads `n.detach()`: autograd then never computes `W^T dY` for it, while the weight
  gradient `dY^T n` and every other use of `n` (gate, norms, residual) stay exact.
* A correction linear in the terminal error e = dL/dx_L, c_b = M_b(e), enters through its *adjoint*: the
  forward adds `Z - Z.detach()` (exactly zero) to x_L with `Z = sum_b M_b^T(n_b)`, so the backward, handed
  e at the tap, computes `dL/dn_b += M_b(e)` itself, branch by branch, when it reaches that branch. No
  correction exists before its branch's backward runs, and nothing outside autograd holds state: this is
  the streaming organization, and it compiles.
* A correction that does not depend on e (recorded, or predicted from the branch's own state) enters
  through `finish(loss)`, which adds `S - S.detach()` with `S = sum_b <n_b, c_b>`.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct

import torch
import torch.nn as nn

from creditlab.config import Config, CreditConfig
from creditlab.model import ExactCredit, GPT


def zero_valued(t: torch.Tensor) -> torch.Tensor:
    """Exactly zero in the forward pass; the identity for gradients."""
    return t - t.detach()


class OmitCredit(ExactCredit):
    """The synthetic backward with nothing injected: the `zero` source, and the base of the others."""

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        return n.detach()


class InjectCredit(OmitCredit):
    """Inject corrections that do not depend on the terminal error: dL/dn_b += c_b.

    `correction_term(b, n)` returns a scalar whose gradient with respect to n is c_b. The terms are summed as
    the forward goes, so the context holds one scalar, never a list of branch inputs (which under
    torch.compile would become graph outputs, kept alive until the step ends)."""

    def __init__(self, correction_term):
        self.correction_term = correction_term
        self.total = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        term = self.correction_term(index, n)
        if term is not None:
            self.total = term if self.total is None else self.total + term
        return n.detach()

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.total is None else loss + zero_valued(self.total).to(loss.dtype)


class RecordCredit(ExactCredit):
    """Exact backprop that records each branch's true correction: the gradient reaching n_b through the
    omitted product only (not through the gate or anything else that reads n_b)."""

    def __init__(self, branches: int):
        self.corrections: list[torch.Tensor | None] = [None] * branches

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        n_omit = n.view_as(n)  # a separate node, so its gradient is the omitted product's alone

        def record(grad):
            self.corrections[index] = grad.detach()

        n_omit.register_hook(record)
        return n_omit


class BranchInputCredit(ExactCredit):
    """Exact backprop that keeps, per branch, the separate node the omitted product reads: the gradient of the
    loss with respect to it is that branch's true correction (torch.autograd.grad, no parameter gradients)."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        n_omit = n.view_as(n)
        self.inputs.append(n_omit)
        return n_omit


class TerminalTapCredit(BranchInputCredit):
    """Also keeps each branch input n_b (detached: what a state gate reads) and x_L, whose gradient is the
    terminal error: everything a fit of a predictor needs from one exact pass."""

    def __init__(self):
        super().__init__()
        self.states: list[torch.Tensor] = []
        self.x_terminal = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        self.states.append(n.detach())
        return super().branch(index, n)

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        self.x_terminal = x
        return x


def stream_seed(*parts: int) -> int:
    """A seed in [0, 2**63) from integers (a hash, so that nearby tuples give unrelated streams): how a source
    draws from its config's seed and where it stands (update, micro-batch, ...) with no generator state to save."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class CreditSource(nn.Module):
    """Base: the exact source. Subclasses override `step` and, where they need the batch, `context`."""

    name = "exact"
    about = "exact backpropagation"  # one line, for the arm of this source in reports
    omits = False  # whether the source's steps omit the 16 products
    fits = False  # whether the source fits a predictor on exact teacher updates

    @classmethod
    def from_config(cls, cfg: Config) -> "CreditSource":
        return cls()

    @classmethod
    def fits_with(cls, cfg: Config) -> bool:
        """Whether the source, built from `cfg`, has teacher updates."""
        return cls.fits

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        """What in `cfg` this source cannot run with (checked when the config is built)."""
        return []

    def step(self) -> ExactCredit:
        """The context of one synthetic micro-batch."""
        return ExactCredit()

    def exact_step(self) -> ExactCredit:
        """The context of one exact micro-batch."""
        return ExactCredit()

    def context(self, trainer, inputs: torch.Tensor, targets: torch.Tensor, kind: str, scale: float) -> ExactCredit:
        """The context of one micro-batch of an update of `kind`, whose loss is scaled by `scale` in the backward.
        Sources whose corrections depend on the batch itself (`oracle`) read it here; the others ignore it."""
        return self.step() if kind == "synthetic" else self.exact_step()

    def after_backward(self, trainer, credit: ExactCredit, kind: str) -> None:
        """Called after each micro-batch's backward with the context it ran under."""

    def end_update(self, kind: str) -> dict | None:
        """Called after each update's optimizer step; a fitting source applies its fit and reports it."""
        return None

    def recorded_kind(self, update: int, kind: str) -> str:
        """The kind an update of the schedule's `kind` is recorded and costed as, once its micro-batches ran:
        the schedule's, or a name of the source's own for an update that did more work than the others of its
        kind (the sketch's refresh), so that costs count that work at its own median, not at the kind's."""
        return kind


class FittedSource(CreditSource):
    """A source fitted on exact teacher updates by its `Teacher` (credit/teacher.py), made on first use."""

    fits = True

    @classmethod
    def config_problems(cls, cfg: Config) -> list[str]:
        from creditlab.config import range_problems

        c, problems = cfg.credit, []
        if c.rank < 1:
            problems.append(f"credit.rank must be positive, got {c.rank}")
        if c.fit not in ("adam", "lstsq"):
            problems.append(f"credit.fit must be one of adam|lstsq, got {c.fit!r}")
        if not 0.0 <= c.fit_decay < 1.0:
            problems.append(f"credit.fit_decay must lie in [0, 1), got {c.fit_decay!r}")
        return problems + range_problems(c, ("predictor_lr", "fit_ridge"), 0.0)

    def __init__(self, credit: CreditConfig):
        super().__init__()
        self.credit_cfg = credit
        self.teacher = None

    def make_teacher(self):
        raise NotImplementedError

    def context(self, trainer, inputs, targets, kind: str, scale: float) -> ExactCredit:
        if kind != "teacher":
            return super().context(trainer, inputs, targets, kind, scale)
        if self.teacher is None:
            self.teacher = self.make_teacher()
        return self.teacher.context(trainer, inputs, scale)

    def after_backward(self, trainer, credit: ExactCredit, kind: str) -> None:
        if kind == "teacher":
            self.teacher.collect(trainer, credit)

    def teach(self, trainer, inputs, targets, scale: float) -> torch.Tensor:
        """One teacher micro-batch outside a training update (the ceiling, benchmarks, tests)."""
        if self.teacher is None:
            self.teacher = self.make_teacher()
        return self.teacher.teach(trainer, inputs, targets, scale)

    def end_update(self, kind: str) -> dict | None:
        return self.teacher.step() if kind == "teacher" else None


class ZeroSource(CreditSource):
    name, omits = "zero", True
    about = "the 16 products omitted, nothing injected"

    def step(self) -> OmitCredit:
        return OmitCredit()


class OracleSource(CreditSource):
    """True corrections of the same batch, recorded from an exact pass over it, then injected: the synthetic
    backward must then give native's gradients, so an `oracle` arm trains as native does (a sanity arm). The
    recording pass costs one more forward and backward and holds all 16 corrections: it is a check, not a
    method."""

    name, omits = "oracle", True
    about = "true corrections of the same batch injected (trains as native)"

    def __init__(self):
        super().__init__()
        self.corrections: list[torch.Tensor | None] | None = None

    def record(self, model: GPT, idx: torch.Tensor, targets: torch.Tensor, autocast=None, **kw) -> torch.Tensor:
        """Record the true corrections of (idx, targets) without touching any parameter's gradient."""
        rec = BranchInputCredit()
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = model(idx, targets, credit=rec, **kw)
        self.corrections = [g.detach() for g in torch.autograd.grad(loss, rec.inputs)]
        return loss.detach()

    def context(self, trainer, inputs, targets, kind: str, scale: float) -> ExactCredit:
        if kind != "synthetic":
            return self.exact_step()
        self.record(trainer.model, inputs, targets, trainer.runtime.autocast(),
                    loss_chunk=trainer.cfg.train.loss_chunk)
        return self.step()

    def step(self) -> InjectCredit:
        if self.corrections is None:
            raise RuntimeError("the oracle source has no corrections: call record(model, idx, targets) first")
        corrections = self.corrections

        def term(b, n):  # <n_b, c_b> has gradient c_b
            return None if corrections[b] is None else (n * corrections[b].to(n.dtype)).sum()

        return InjectCredit(term)


class AdjointCredit(OmitCredit):
    """Corrections linear in the terminal error, c_b = M_b(e), injected through the adjoint term at the tap.

    `branch_term(b, n)` returns this branch's share of the adjoint (any shape the source likes, summed over
    branches as the forward goes); `tap(x, total)` returns x_L carrying `Z(total) - Z(total).detach()`, or
    anything with the same gradients, so that the VJP with e gives M_b(e) for every n_b."""

    def __init__(self, branch_term, tap):
        self.branch_term, self.tap = branch_term, tap
        self.total = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        term = self.branch_term(index, n)
        self.total = term if self.total is None else self.total + term
        return n.detach()

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        return self.tap(x, self.total)
