"""Optimizers and the learning-rate schedule.

Muon (torch.optim.Muon) for the hidden matrices; AdamW for embeddings, value embeddings, the head, scalars and
gates. The schedule is warmup, constant, then a linear cooldown to zero over the last `cooldown_frac`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from creditlab.config import TrainConfig


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
        self.muon = torch.optim.Muon([{"params": g["hidden"], "lr": cfg.lr_muon}], lr=cfg.lr_muon, momentum=0.95,
                                     weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
        adam_groups = [{"params": g["embed"], "lr": cfg.lr_embed}, {"params": g["head"], "lr": cfg.lr_head},
                       {"params": g["scalar"] + g["gate"], "lr": cfg.lr_scalar}]
        self.adam = torch.optim.AdamW([pg for pg in adam_groups if pg["params"]], betas=(0.8, 0.95), eps=1e-10,
                                      weight_decay=0.0, fused=next(model.parameters()).is_cuda or None)
        self.optimizers = [self.muon, self.adam]
        for opt in self.optimizers:
            for pg in opt.param_groups:
                pg["base_lr"] = pg["lr"]

    def lr_scale(self, update: int) -> float:
        total, warmup = self.cfg.updates, self.cfg.warmup
        if update < warmup:
            return (update + 1) / warmup
        cooldown = round(self.cfg.cooldown_frac * total)
        if cooldown and update >= total - cooldown:
            return max(0.0, (total - update) / cooldown)
        return 1.0

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
