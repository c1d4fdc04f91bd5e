"""Optimizers and the learning-rate schedule.

Muon for the hidden matrices (torch.optim.Muon's update, run on the matrices of one shape at once: GroupedMuon,
equal to torch's bit for bit); AdamW for embeddings, value embeddings, the head, scalars and gates. The schedule is warmup, constant,
then a linear cooldown to zero over the last `cooldown_frac`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.optim._muon import _adjust_lr

from creditlab.config import TrainConfig


def orthogonalize(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration on a stack of same-shaped matrices (n, A, B) at once:
    batched products instead of one small product after another. In `dtype` (bf16, as torch's, in training)."""
    a, b, c = coefficients
    x = updates.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class GroupedMuon(torch.optim.Muon):
    """torch.optim.Muon's update (momentum, Nesterov, Newton-Schulz, its learning-rate adjustment and weight
    decay) with the matrices of one shape orthogonalized together and the elementwise steps done for all matrices
    at once: tens of kernels a step where the per-matrix loop launches about twenty per matrix, which at the seed
    shape left the GPU waiting on the host (benchmarks/native_seed.md). Its state is torch's (a momentum buffer
    per matrix), so either loads the other's checkpoint."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("GroupedMuon.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.ndim != 2 or g.is_complex() for g in grads):
                raise ValueError("Muon takes real 2-D matrices only")
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            momentum, lr = group["momentum"], group["lr"]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            # one stack per shape and learning-rate adjustment (the adjustment may tell A x B from B x A)
            stacks = defaultdict(list)
            for i, p in enumerate(params):
                stacks[(tuple(p.shape), _adjust_lr(lr, group["adjust_lr_fn"], p.shape))].append(i)
            for (_, adjusted_lr), members in stacks.items():
                ortho = orthogonalize(torch.stack([updates[i] for i in members]), group["ns_coefficients"],
                                      group["ns_steps"], group["eps"])
                torch._foreach_add_([params[i] for i in members], list(ortho.unbind(0)), alpha=-adjusted_lr)
        return None


def parameter_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Partition the model's parameters by optimizer role; every parameter lands in exactly one group."""
    groups: dict[str, list[nn.Parameter]] = {"hidden": [], "embed": [], "head": [], "scalar": [], "gate": []}
    for name, p in model.named_parameters():
        if name.startswith("head."):
            groups["head"].append(p)
        elif name.startswith(("embed.", "value_embeds.")):
            groups["embed"].append(p)
        elif ".gate." in name:
            groups["gate"].append(p)
        elif p.ndim < 2:
            groups["scalar"].append(p)
        else:
            groups["hidden"].append(p)
    return groups


class Optimizers:
    """Muon + AdamW stepped together, with one schedule multiplying every group's base rate."""

    def __init__(self, model: nn.Module, cfg: TrainConfig):
        self.cfg = cfg
        g = parameter_groups(model)
        self.muon = GroupedMuon([{"params": g["hidden"], "lr": cfg.lr_muon}], lr=cfg.lr_muon, momentum=0.95,
                         weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
        adam_groups = [{"params": g["embed"], "lr": cfg.lr_embed}, {"params": g["head"], "lr": cfg.lr_head},
                       {"params": g["scalar"] + g["gate"], "lr": cfg.lr_scalar}]
        self.adam = torch.optim.AdamW([pg for pg in adam_groups if pg["params"]], betas=(0.8, 0.95), eps=1e-10,
                                      weight_decay=0.0, fused=next(model.parameters()).is_cuda or None)
        self.optimizers = [self.muon, self.adam]
        for opt in self.optimizers:
            for pg in opt.param_groups:
                pg["base_lr"] = pg["lr"]

    def lr_scale(self, update: int) -> float:
        return lr_scale(update, self.cfg.updates, self.cfg.warmup, self.cfg.cooldown_frac)

    def step(self, update: int) -> float:
        scale = self.lr_scale(update)
        for opt in self.optimizers:
            for pg in opt.param_groups:
                pg["lr"] = pg["base_lr"] * scale
            opt.step()
        return scale

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adam": self.adam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adam.load_state_dict(state["adam"])


def lr_scale(update: int, updates: int, warmup: int, cooldown_frac: float) -> float:
    """The learning rate's factor at `update` (0-based) of a run of `updates`: linear warmup over `warmup`
    updates, constant, then a linear cooldown to zero over the last `cooldown_frac` of the updates (so the rate
    is fully decayed at the run's own end, whatever its length)."""
    if update < warmup:
        return (update + 1) / warmup
    cooldown = round(cooldown_frac * updates)
    if cooldown and update >= updates - cooldown:
        return max(0.0, (updates - update) / cooldown)
    return 1.0
