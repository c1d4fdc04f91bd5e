"""Teacher acquisition: on an exact update, fit the predictor to the true corrections as they stream past.

The teacher update is ordinary exact backprop. Hooks see the terminal error when the backward leaves the
head, and each branch's true correction when the backward reaches that branch; the predictor's regression
loss for that branch (normalized squared error) is differentiated right there and its gradient accumulated,
so no step holds more than one true correction. The part of the gradient that flows back through the shared
code [p ; m] is summed in code space (B, T, 2r) and pushed through the projection once, after the backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from creditlab.config import CreditConfig
from creditlab.model import ExactCredit


class FitCredit(ExactCredit):
    """Exact backprop with the hooks that fit a predictor on the fly."""

    def __init__(self, teacher: "Teacher", scale: float):
        self.teacher, self.scale = teacher, scale
        self.branch_inputs: dict[int, torch.Tensor] = {}
        self.x_terminal = None
        self.code = None  # [p ; m] for this micro-batch's terminal error, a leaf
        self.code_grad = None

    def branch(self, index: int, n: torch.Tensor) -> torch.Tensor:
        self.branch_inputs[index] = n.detach()
        n_omit = n.view_as(n)  # its gradient is the true correction: the omitted product's alone
        n_omit.register_hook(lambda grad: self._on_correction(index, grad))
        return n_omit

    def terminal(self, x: torch.Tensor) -> torch.Tensor:
        self.x_terminal = x.detach()
        x.register_hook(self._on_terminal_error)
        return x

    def _on_terminal_error(self, e: torch.Tensor) -> None:
        self.e = e.detach()
        predictor = self.teacher.predictor
        with torch.no_grad():
            a, a_rev = predictor.mean_weights(self.x_terminal.float())
            self.code = predictor.code(self.e.float(), a, a_rev)
        self.code_grad = torch.zeros_like(self.code)

    def _on_correction(self, index: int, true: torch.Tensor) -> None:
        predictor = self.teacher.predictor
        n = self.branch_inputs.pop(index).float()
        true = true.detach().float()
        with torch.enable_grad():
            code = self.code.detach().requires_grad_(True)
            predicted = predictor.decode(index, code, predictor.gate(index, n))
            denom = true.square().sum().clamp_min(1e-30)
            error = (predicted - true).square().sum() / denom
            params = [predictor.state_gates, predictor.decoders]
            grads = torch.autograd.grad(error * self.scale, params + [code])
        for p, g in zip(params, grads[:2]):
            p.grad = g if p.grad is None else p.grad + g
        self.code_grad += grads[2]
        cosine = F.cosine_similarity(predicted.detach().flatten(), true.flatten(), dim=0).item()
        self.teacher.record(index, error.item(), cosine)

    def push_code_gradient(self) -> None:
        """Send the code-space gradient through [p ; m] into the projection and the mean gate."""
        predictor = self.teacher.predictor
        with torch.enable_grad():
            a, a_rev = predictor.mean_weights(self.x_terminal.float())
            code = predictor.code(self.e.float(), a, a_rev)
            code.backward(self.code_grad)


class Teacher:
    """Owns the predictor's optimizer and the per-branch fit metrics of the current teacher update."""

    def __init__(self, predictor, cfg: CreditConfig):
        self.predictor = predictor
        self.optimizer = torch.optim.Adam(predictor.parameters(), lr=cfg.predictor_lr, betas=(0.9, 0.99))
        self.metrics: dict[int, list[tuple[float, float]]] = {}

    def record(self, branch: int, error: float, cosine: float) -> None:
        self.metrics.setdefault(branch, []).append((error, cosine))

    def teach(self, trainer, inputs: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
        """One exact micro-batch (gradients accumulate into the model) that also fits the predictor."""
        credit = FitCredit(self, scale)
        model = trainer.ddp or trainer.model  # eager: the fit's hooks would break compiled graphs
        with trainer.runtime.autocast():
            loss = model(inputs, targets, credit=credit, loss_chunk=trainer.cfg.train.loss_chunk)
        (loss * scale).backward()
        missing = sorted(credit.branch_inputs)
        if missing or credit.code is None:
            raise RuntimeError(f"teacher backward did not reach branches {missing}: the fit is incomplete")
        credit.push_code_gradient()
        return loss.detach()

    def step(self) -> dict:
        """Apply the accumulated fit gradient; return per-branch mean normalized error and cosine."""
        if dist.is_available() and dist.is_initialized():  # every rank fits the same predictor
            for p in self.predictor.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        summary = {b: (sum(e for e, _ in v) / len(v), sum(c for _, c in v) / len(v))
                   for b, v in sorted(self.metrics.items())}
        self.metrics = {}
        errors = [e for e, _ in summary.values()]
        return {"fit_error": sum(errors) / len(errors) if errors else math.nan,
                "fit_cosine": sum(c for _, c in summary.values()) / max(len(summary), 1),
                "fit_branches": {str(b): {"error": e, "cosine": c} for b, (e, c) in summary.items()}}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
