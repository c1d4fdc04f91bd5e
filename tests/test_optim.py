"""Optimizers: the parameter partition, Muon's share, and the warmup / constant / cooldown schedule."""

from __future__ import annotations

import pytest
import torch

from creditlab import config
from creditlab.model import GPT
from creditlab.optim import Optimizers, parameter_groups

SMALL = ["model.vocab_size=97", "model.width=32", "model.heads=2", "model.mlp_hidden=64", "model.seq_len=16",
         "model.gate_dim=8", "model.layers=6", "model.value_embeds=2"]


def small_model():
    torch.manual_seed(0)
    return GPT(config.load("tiny", SMALL).model)


def test_parameter_groups_partition_every_parameter_exactly_once():
    model = small_model()
    groups = parameter_groups(model)
    assert set(groups) == {"hidden", "embed", "head", "scalar", "gate"}
    seen = [id(p) for ps in groups.values() for p in ps]
    assert len(seen) == len(set(seen))  # no parameter twice
    assert set(seen) == {id(p) for p in model.parameters()}  # none left out
    assert len(seen) == len(list(model.parameters()))


def test_groups_hold_the_roles_the_design_assigns():
    model = small_model()
    groups = {k: {id(p) for p in v} for k, v in parameter_groups(model).items()}
    role = {}
    for name, p in model.named_parameters():
        (role[name],) = [k for k, ids in groups.items() if id(p) in ids]
    L = model.cfg.layers
    assert role["head.weight"] == "head"
    assert role["embed.weight"] == "embed"
    assert all(role[f"value_embeds.{i}.weight"] == "embed" for i in range(2))
    assert role["skip_weights"] == "scalar"
    for i in range(L):
        assert role[f"blocks.{i}.attn.gate.weight"] == "gate"
        assert role[f"blocks.{i}.resid_mix"] == "scalar"
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"):
            assert role[f"blocks.{i}.{m}.weight"] == "hidden"
    for i in (0, 1, L - 2, L - 1):
        assert role[f"blocks.{i}.attn.value_mix"] == "scalar"
    assert len(groups["hidden"]) == 4 * L and len(groups["gate"]) == L


def test_muon_gets_only_the_two_dimensional_hidden_matrices():
    model = small_model()
    cfg = config.load("tiny", SMALL).train
    opt = Optimizers(model, cfg)
    muon = [p for pg in opt.muon.param_groups for p in pg["params"]]
    adam = [p for pg in opt.adam.param_groups for p in pg["params"]]
    hidden = parameter_groups(model)["hidden"]
    assert {id(p) for p in muon} == {id(p) for p in hidden}
    assert all(p.ndim == 2 for p in muon)
    names = {id(p): n for n, p in model.named_parameters()}
    assert not any(names[id(p)].startswith(("embed.", "value_embeds.", "head.")) or ".gate." in names[id(p)]
                   for p in muon)
    # AdamW has the rest; together exactly the model's parameters, each once.
    both = [id(p) for p in muon + adam]
    assert len(both) == len(set(both)) and set(both) == {id(p) for p in model.parameters()}
    lrs = {names[id(p)]: pg["lr"] for pg in opt.adam.param_groups for p in pg["params"]}
    assert lrs["embed.weight"] == cfg.lr_embed and lrs["head.weight"] == cfg.lr_head
    assert lrs["skip_weights"] == cfg.lr_scalar and lrs["blocks.0.attn.gate.weight"] == cfg.lr_scalar
    assert all(pg["lr"] == cfg.lr_muon for pg in opt.muon.param_groups)


def schedule(updates, warmup, cooldown_frac):
    cfg = config.load("tiny", [f"train.updates={updates}", f"train.warmup={warmup}",
                               f"train.cooldown_frac={cooldown_frac}"]).train
    return Optimizers(small_model(), cfg)


@pytest.mark.parametrize("update, scale", [
    (0, 0.1), (4, 0.5), (9, 1.0),          # warmup: (u + 1) / 10
    (10, 1.0), (35, 1.0), (60, 1.0),       # constant up to the cooldown's first update
    (61, 39 / 40), (80, 0.5), (90, 0.25), (99, 1 / 40),  # linear cooldown over the last 40
])
def test_schedule_warmup_constant_cooldown(update, scale):
    opt = schedule(100, 10, 0.4)
    assert opt.lr_scale(update) == pytest.approx(scale, rel=1e-12)


def test_schedule_shape_over_a_whole_run():
    opt = schedule(100, 10, 0.4)
    s = [opt.lr_scale(u) for u in range(100)]
    assert all(b > a for a, b in zip(s[:10], s[1:10]))  # rising during warmup
    assert s[9:61] == [1.0] * 52
    assert all(b < a for a, b in zip(s[60:], s[61:]))  # falling during cooldown
    assert all(0.0 < v <= 1.0 for v in s)
    assert opt.lr_scale(100) == 0.0  # past the end: zero, never negative
    assert opt.lr_scale(150) == 0.0


def test_schedule_without_warmup_or_cooldown_is_constant():
    opt = schedule(20, 0, 0.0)
    assert [opt.lr_scale(u) for u in range(20)] == [1.0] * 20


def test_schedule_full_cooldown():
    opt = schedule(10, 0, 1.0)
    assert [opt.lr_scale(u) for u in range(10)] == pytest.approx([(10 - u) / 10 for u in range(10)])


def test_cooldown_length_is_the_rounded_fraction():
    opt = schedule(100, 0, 0.29)
    assert opt.lr_scale(71) == 1.0
    assert opt.lr_scale(72) == pytest.approx(28 / 29)


def test_step_applies_the_scale_to_every_group():
    model = small_model()
    cfg = config.load("tiny", SMALL + ["train.updates=20", "train.warmup=4", "train.cooldown_frac=0.5"]).train
    opt = Optimizers(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    for update, want in [(0, 0.25), (5, 1.0), (15, 0.5)]:
        assert opt.step(update) == pytest.approx(want)
        for o in opt.optimizers:
            for pg in o.param_groups:
                assert pg["lr"] == pytest.approx(pg["base_lr"] * want)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_step_moves_every_parameter_with_a_gradient():
    model = small_model()
    opt = Optimizers(model, config.load("tiny", SMALL + ["train.warmup=0"]).train)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(0)
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


def test_state_dict_round_trip():
    model = small_model()
    cfg = config.load("tiny", SMALL).train
    opt = Optimizers(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(3)
    state = opt.state_dict()
    other = Optimizers(model, cfg)
    other.load_state_dict(state)
    a, b = other.state_dict(), state
    assert a["adam"]["param_groups"] == b["adam"]["param_groups"]
    assert a["muon"]["param_groups"] == b["muon"]["param_groups"]
    for k, v in b["adam"]["state"].items():
        torch.testing.assert_close(a["adam"]["state"][k]["exp_avg"], v["exp_avg"], rtol=0, atol=0)


def _muon_steps(optimizer_class, steps=4, adjust_lr_fn="match_rms_adamw", nesterov=True, **kw):
    """Parameters of three shapes (one the transpose of another) after `steps` Muon steps on the same random
    gradients, from the same start."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in [(96, 32), (32, 96), (32, 32), (96, 32), (32, 32)]]
    opt = optimizer_class(params, lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn,
                          nesterov=nesterov, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("adjust_lr_fn, nesterov", [("match_rms_adamw", True), ("original", True), (None, False)])
def test_grouped_muon_takes_torch_muons_steps_exactly(adjust_lr_fn, nesterov):
    """optim.GroupedMuon (the matrices of one shape orthogonalized together) against torch.optim.Muon: the same
    parameters bit for bit on the CPU, and the same optimizer state, so each loads the other's checkpoint. The
    "original" learning-rate adjustment tells 96 x 32 from 32 x 96."""
    from creditlab.optim import GroupedMuon

    want, torch_opt = _muon_steps(torch.optim.Muon, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov)
    got, grouped = _muon_steps(GroupedMuon, adjust_lr_fn=adjust_lr_fn, nesterov=nesterov)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    moved = max((a - b).abs().max().item() for a, b in zip(want, _muon_steps(torch.optim.Muon, steps=0)[0]))
    assert moved > 1e-3  # the steps moved the parameters
    mine, theirs = grouped.state_dict(), torch_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert all(torch.equal(mine["state"][i]["momentum_buffer"], theirs["state"][i]["momentum_buffer"])
               for i in theirs["state"])


def test_the_grouped_muon_comparison_fails_for_another_iteration_count():
    from creditlab.optim import GroupedMuon

    want, _ = _muon_steps(torch.optim.Muon)
    got, _ = _muon_steps(GroupedMuon, ns_steps=4)
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) > 1e-4


def test_the_trainer_steps_the_hidden_matrices_with_the_grouped_muon():
    from creditlab.optim import GroupedMuon

    assert type(Optimizers(small_model(), config.load("tiny", SMALL).train).muon) is GroupedMuon
