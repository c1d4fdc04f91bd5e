"""Gradient alignment: an arm's gradient of each trunk parameter group against the exact gradient of the batch.

Groups gather a kind of parameter across layers (`attn.qkv` = every layer's Q/K/V map, `scalars` = residual
mixes, value mixes and skip weights), so a figure shows where credit goes wrong: the omitted products feed the
branch inputs, and through them everything upstream. Per group: the cosine of the two gradients (as flat
vectors) and the norm ratio |g_arm| / |g_exact|; `trunk` is every trunk parameter together.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^blocks\.\d+\.")
_SCALARS = ("resid_mix", "attn.value_mix", "skip_weights")


def group_of(name: str) -> str:
    """'blocks.3.attn.qkv.weight' -> 'attn.qkv'; 'value_embeds.1.weight' -> 'value_embeds'; scalars -> 'scalars'."""
    name = _LAYER.sub("", name)
    name = re.sub(r"\.weight$", "", name)
    name = re.sub(r"^value_embeds\.\d+$", "value_embeds", name)
    return "scalars" if name in _SCALARS else name


def alignment(arm: dict[str, torch.Tensor | None], exact: dict[str, torch.Tensor | None]) -> dict[str, dict]:
    """{group: {"cosine", "norm_ratio"}} over the names of `exact` (a missing gradient counts as zero)."""
    sums: dict[str, torch.Tensor] = {}  # group -> [<a, e>, |a|^2, |e|^2]
    for name, e in exact.items():
        a = arm.get(name)
        if a is None and e is None:
            continue
        e = torch.zeros(a.numel(), dtype=torch.float64) if e is None else e.detach().double().flatten()
        a = torch.zeros_like(e) if a is None else a.detach().double().flatten().to(e.device)
        part = torch.stack([(a * e).sum(), (a * a).sum(), (e * e).sum()]).cpu()
        for group in (group_of(name), "trunk"):
            sums[group] = sums[group] + part if group in sums else part
    out = {}
    for group, (dot, aa, ee) in sums.items():
        cosine = float(dot / (aa * ee).sqrt()) if aa > 0 and ee > 0 else float("nan")
        ratio = float((aa / ee).sqrt()) if ee > 0 else float("nan")
        out[group] = {"cosine": cosine, "norm_ratio": ratio}
    return out
