"""Configuration: presets, the seed preset's numbers, `section.key=value` overrides, validation, round trips."""

from __future__ import annotations

import json

import pytest
import torch

from creditlab import cli, config
from creditlab.experiments import arms
from creditlab import runtime as rt
from creditlab.config import Config, ConfigError, TrainConfig


def test_every_preset_loads_and_validates():
    assert set(config.PRESETS) >= {"seed", "tiny"}
    for name in config.PRESETS:
        cfg = config.load(name)
        assert isinstance(cfg, Config)
        config.validate(cfg)  # a preset is itself a valid config


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*seed.*tiny|unknown preset 'nope'.*tiny.*seed"):
        config.load("nope")


def test_seed_preset_matches_design_section_2():
    m, t = config.load("seed").model, config.load("seed").train
    assert (m.layers, m.width, m.heads, m.head_dim) == (8, 512, 4, 128)
    assert m.mlp_hidden == 2048
    assert m.seq_len == 2048
    assert m.vocab_size == 12_289  # 12,288 BPE tokens + 1 document separator
    assert m.branches == 16
    assert (t.micro_batch, t.grad_accum) == (64, 4)
    assert t.seed == 42261
    # The head may be padded for speed: a multiple of the pad size, at least the vocabulary, less than one pad more.
    assert m.padded_vocab % config.VOCAB_PAD == 0
    assert m.vocab_size <= m.padded_vocab < m.vocab_size + config.VOCAB_PAD
    assert m.padded_vocab == 12_352
    s = config.load("seed").screen
    assert (s.updates, s.cycle_gate) == (12, 0.93)
    assert s.peak_gate_mib == 23_400.0 and s.cycle_gate == 0.93


@pytest.mark.parametrize("width", [512, *config.SEED_WIDTHS])
def test_a_seed_width_derives_heads_mlp_and_micro_batch_and_keeps_the_tokens(width):
    cfg = config.seed_at_width(width)
    seed = config.load("seed")
    assert cfg.model.heads * 128 == width and cfg.model.mlp_hidden == 4 * width and cfg.model.head_dim == 128
    assert cfg.model.layers == seed.model.layers and cfg.model.seq_len == seed.model.seq_len
    assert cfg.train.micro_batch * cfg.train.grad_accum == seed.train.micro_batch * seed.train.grad_accum
    assert cfg.train.micro_batch * width <= seed.train.micro_batch * 512  # a micro-batch's activations: no more
    if width == 512:
        assert cfg == seed  # the seed itself
    else:
        assert config.load(f"seed-w{width}") == cfg
    with pytest.raises(ConfigError, match="multiple of 128"):
        config.seed_at_width(width + 64)


def test_presets_are_fresh_objects():
    a, b = config.load("tiny"), config.load("tiny")
    a.model.layers = 99
    assert b.model.layers != 99
    assert config.load("tiny").model.layers != 99


@pytest.mark.parametrize("override, section, key, value, typ", [
    ("model.layers=6", "model", "layers", 6, int),
    ("model.vocab_size=50_257", "model", "vocab_size", 50257, int),
    (" model.width = 128 ", "model", "width", 128, int),
    ("model.logit_cap=30", "model", "logit_cap", 30.0, float),
    ("train.lr_muon=1e-3", "train", "lr_muon", 1e-3, float),
    ("train.cooldown_frac=0.25", "train", "cooldown_frac", 0.25, float),
    ("compare.floors=true", "compare", "floors", True, bool),
    ("compare.floors=True", "compare", "floors", True, bool),
    ("compare.floors=yes", "compare", "floors", True, bool),
    ("compare.floors=1", "compare", "floors", True, bool),
    ("compare.floors=off", "compare", "floors", False, bool),
    ("compare.floors=0", "compare", "floors", False, bool),
    ("credit.source=dfa", "credit", "source", "dfa", str),
    ("data.dir=some/where=odd", "data", "dir", "some/where=odd", str),  # only the first '=' splits
    ("train.device=cpu", "train", "device", "cpu", str),
])
def test_overrides_parse_to_the_field_type(override, section, key, value, typ):
    cfg = config.load("tiny", [override])
    got = getattr(getattr(cfg, section), key)
    assert type(got) is typ
    assert got == value


def test_overrides_apply_in_order_and_leave_other_fields_alone():
    base = config.load("tiny")
    cfg = config.load("tiny", ["model.layers=2", "model.layers=6", "train.updates=7"])
    assert cfg.model.layers == 6 and cfg.train.updates == 7
    d, b = cfg.to_dict(), base.to_dict()
    d["model"]["layers"], d["train"]["updates"] = b["model"]["layers"], b["train"]["updates"]
    assert d == b


def test_unknown_key_in_a_known_section_lists_that_sections_keys():
    with pytest.raises(ConfigError) as exc:
        config.load("tiny", ["model.depth=3"])
    msg = str(exc.value)
    assert "model.depth" in msg
    for key in ("model.layers", "model.width", "model.heads", "model.vocab_size", "model.seq_len"):
        assert key in msg


def test_unknown_section_lists_every_valid_key():
    with pytest.raises(ConfigError) as exc:
        config.load("tiny", ["optimizer.lr=3"])
    msg = str(exc.value)
    assert "optimizer.lr" in msg
    for key in config.valid_keys():
        assert key in msg
    assert {"model.layers", "train.micro_batch", "credit.rank", "screen.cycle_gate", "data.source"} \
        <= set(config.valid_keys())


@pytest.mark.parametrize("override", ["layers=3", "model.=3", "model"])
def test_malformed_keys_are_config_errors(override):
    with pytest.raises(ConfigError):
        config.load("tiny", [override])


@pytest.mark.parametrize("override, words", [
    ("model.layers=abc", ["model.layers", "'abc'", "int"]),
    ("model.layers=2.5", ["model.layers", "int"]),
    ("train.lr_muon=fast", ["train.lr_muon", "float"]),
    ("compare.floors=maybe", ["compare.floors", "bool"]),
])
def test_bad_values_raise_a_clear_error(override, words):
    with pytest.raises(ConfigError) as exc:
        config.load("tiny", [override])
    for w in words:
        assert w in str(exc.value)


@pytest.mark.parametrize("overrides, fragment", [
    (["model.width=66", "model.heads=4"], "divisible"),
    (["model.width=48", "model.heads=16"], "even"),  # head dim 3: rotary needs pairs
    (["model.gate_dim=65"], "gate_dim"),
    (["model.layers=3", "model.value_embeds=2"], "value_embeds"),
    (["model.layers=0"], "model.layers"),
    (["model.vocab_size=0"], "model.vocab_size"),
    (["train.micro_batch=0"], "train.micro_batch"),
    (["train.grad_accum=0"], "train.grad_accum"),
    (["train.loss_chunk=0"], "train.loss_chunk"),
    (["train.compile=sometimes"], "train.compile"),
    (["train.device=tpu"], "train.device"),
    (["train.dtype=fp8"], "train.dtype"),
    (["train.cooldown_frac=1.5"], "cooldown_frac"),
    # a source's own settings are its own to check: a fitted source's, the sketch's, DFA's
    (["credit.source=learned", "credit.rank=0"], "credit.rank"),
    (["credit.source=dni", "credit.fit=exact"], "credit.fit must be one of adam|lstsq"),
    (["credit.source=learned", "credit.fit_decay=1"], "credit.fit_decay must lie in [0, 1)"),
    (["credit.source=sketch", "credit.sketch_every=0"], "credit.sketch_rank and credit.sketch_every must be positive"),
    (["credit.source=sketch", "credit.sketch=bogus"], "credit.sketch must be one of svd|subspace|sampled, got 'bogus'"),
    (["credit.source=dfa", "credit.dfa_scale=loud"], "credit.dfa_scale must be one of none|calibrated"),
    (["credit.teacher_every=-1"], "teacher_every"),
    (["model.head=fp16"], "model.head"),
    (["model.head=fp8", "train.loss_chunk=100"], "train.loss_chunk to be a multiple of 16"),
    (["model.head=fp8", "model.width=72", "model.heads=4"], "model.width to be a multiple of 16"),
    # out of range: each message names the key, the value and the range
    # learning rates: finite and >= 0 (what torch's optimizers take)
    (["train.lr_muon=-1"], "train.lr_muon must be a finite number >= 0, got -1.0"),
    (["train.lr_muon=nan"], "train.lr_muon must be a finite number >= 0, got nan"),
    (["train.lr_embed=-0.1"], "train.lr_embed must be a finite number >= 0, got -0.1"),
    (["train.lr_head=inf"], "train.lr_head must be a finite number >= 0, got inf"),
    (["train.lr_scalar=-1"], "train.lr_scalar must be a finite number >= 0, got -1.0"),
    (["credit.source=learned", "credit.predictor_lr=-1e-2"],
     "credit.predictor_lr must be a finite number >= 0, got -0.01"),
    (["credit.source=typed", "credit.fit_ridge=nan"], "credit.fit_ridge must be a finite number >= 0, got nan"),
    # the model's shape and numbers
    (["model.gate_dim=0"], "model.gate_dim must lie in [1, model.width=64], got 0"),
    (["model.gate_dim=-1"], "model.gate_dim must lie in [1, model.width=64], got -1"),
    (["model.gate_dim=65"], "model.gate_dim must lie in [1, model.width=64], got 65"),
    (["model.value_embeds=-1"], "model.value_embeds must lie in [0, model.layers/2]"),
    (["model.value_embeds=3"], "model.layers=4), got 3"),
    (["model.rope_base=0"], "model.rope_base must be a finite number > 0, got 0.0"),
    (["model.rope_base=-10000"], "model.rope_base must be a finite number > 0, got -10000.0"),
    (["model.logit_cap=0"], "model.logit_cap must be a finite number > 0, got 0.0"),
    (["model.logit_cap=inf"], "model.logit_cap must be a finite number > 0, got inf"),
    # the training loop
    (["train.log_every=0"], "train.log_every must be positive, got 0"),
    (["train.warmup=-5"], "train.warmup must be >= 0, got -5"),
    (["train.cooldown_frac=nan"], "train.cooldown_frac must lie in [0, 1], got nan"),
    (["train.device=cpu", "train.dtype=bf16"], "train.dtype=bf16 (autocast) needs CUDA"),
    # the screen's shape and gates
    (["screen.updates=0"], "screen.updates must be positive, got 0"),
    (["screen.cycle_gate=0"], "screen.cycle_gate must be a finite number > 0, got 0.0"),
    (["screen.peak_gate_mib=-1"], "screen.peak_gate_mib must be a finite number >= 0, got -1.0"),
    (["screen.cap_gpu_s=nan"], "screen.cap_gpu_s must be a finite number >= 0, got nan"),
    (["screen.memory_cap_mib=-1"], "screen.memory_cap_mib must be a finite number >= 0, got -1.0"),
    # compare's reference arm, checked whatever the arms
    (["compare.reference=bogus"], "compare.reference must name an arm other than native and intermittent"),
    (["compare.reference=bogus"], "got 'bogus'"),
    (["compare.reference=native"], "got 'native'"),
    (["compare.reference=intermittent"], "got 'intermittent'"),
    (["train.out_dir="], "train.out_dir is empty"),
])
def test_invalid_values_and_combinations_are_rejected_naming_the_key_and_value(overrides, fragment):
    with pytest.raises(ConfigError, match="invalid config") as exc:
        config.load("tiny", overrides)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("override", [
    "train.lr_muon=0", "train.lr_embed=0", "credit.predictor_lr=0", "model.gate_dim=1", "model.value_embeds=0",
    "train.warmup=0", "train.log_every=1",
    "model.rope_base=0.5", "model.logit_cap=1e-3", "screen.cap_gpu_s=0", "screen.memory_cap_mib=0",
    "screen.updates=1", "compare.reference=zero",
    "compare.reference=learned@credit.schedule=warmup:20,4", "train.device=cuda", "train.dtype=bf16",
])
def test_range_boundaries_are_accepted(override):
    # device and dtype are checked against the machine when a run starts, not here
    cfg = config.load("tiny", [override])
    key, _, value = override.partition("=")
    section, name = key.split(".")
    got = getattr(getattr(cfg, section), name)
    assert got == (type(got)(value) if not isinstance(got, str) else value), (override, got)


def test_every_source_is_an_arm_of_its_name_and_a_possible_reference():
    from creditlab.credit import registry

    assert set(arms.ARMS) == {*registry.SOURCES, "native", "intermittent"} - {"exact"}
    assert arms.ARMS["learned"].overrides == ("credit.source=learned",) and arms.ARMS["learned"].about
    for name in registry.SOURCES:
        if name != "exact":
            assert config.load("tiny", [f"compare.reference={name}"]).compare.reference == name


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("train, fragment", [
    (TrainConfig(device="cuda"), "train.device=cuda but no CUDA device is visible; use --set train.device=cpu"),
    (TrainConfig(device="auto", dtype="bf16"), "train.dtype=bf16 (autocast) needs CUDA"),
])
def test_a_device_or_dtype_this_machine_lacks_is_a_config_error(train, fragment):
    with pytest.raises(ConfigError) as exc:
        rt.resolve(train)
    assert fragment in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_on_cuda_without_cuda_exits_2_with_one_line(capsys):
    assert cli.main(["train", "--preset", "tiny", "--no-record", "--set", "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "creditlab: error: train.device=cuda but no CUDA device is visible; use --set train.device=cpu\n"


def test_validation_collects_every_problem():
    """Every problem of the generic keys at once; the source's own (which import it, and torch) once those pass."""
    with pytest.raises(ConfigError) as exc:
        config.load("tiny", ["model.width=66", "model.heads=4", "train.micro_batch=0", "credit.source=learned",
                             "credit.rank=0"])
    msg = str(exc.value)
    assert "divisible" in msg and "train.micro_batch" in msg and "credit.rank" not in msg
    with pytest.raises(ConfigError) as exc:
        config.load("tiny", ["credit.source=learned", "credit.rank=0", "credit.teacher_every=0"])
    msg = str(exc.value)
    assert "credit.rank" in msg and "never fits" in msg


def test_boundary_combinations_are_accepted():
    cfg = config.load("tiny", ["model.layers=4", "model.value_embeds=2", "model.gate_dim=64", "model.width=64"])
    assert cfg.model.value_embeds * 2 == cfg.model.layers and cfg.model.gate_dim == cfg.model.width
    config.load("tiny", ["model.value_embeds=0", "model.layers=1"])  # no tables needs no layers
    config.load("seed", ["model.head=fp8"])  # the seed shape's sizes are all multiples of 16


@pytest.mark.parametrize("preset", sorted(config.PRESETS))
def test_to_dict_from_dict_round_trip(preset):
    cfg = config.load(preset, ["model.logit_cap=20", "compare.floors=off", "data.dir=x/y",
                               "train.lr_embed=0.125"])
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    # Through JSON too (what a run record stores): ints written for floats come back as floats.
    back = Config.from_dict(json.loads(cfg.to_json()))
    assert back == cfg
    assert type(back.model.logit_cap) is float and type(back.compare.floors) is bool


def test_from_dict_coerces_int_to_float_and_rejects_wrong_types():
    cfg = Config.from_dict({"model": {"logit_cap": 20}})
    assert cfg.model.logit_cap == 20.0 and type(cfg.model.logit_cap) is float
    with pytest.raises(ConfigError, match="model.layers"):
        Config.from_dict({"model": {"layers": True}})  # a bool is not an int
    with pytest.raises(ConfigError, match="model.layers"):
        Config.from_dict({"model": {"layers": 2.0}})
    with pytest.raises(ConfigError, match="model.nope"):
        Config.from_dict({"model": {"nope": 1}})


def test_a_record_of_settings_that_no_longer_exist_names_the_commit_that_reads_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model": {"layers": 2, "recompute": "none"},
                                                      "train": {"overlap": False}}))
    (tmp_path / "env.json").write_text(json.dumps({"git_sha": "88f821f"}))
    with pytest.raises(ConfigError) as exc:
        config.read_record_config(tmp_path)
    assert "model.recompute, train.overlap" in str(exc.value) and "git checkout 88f821f" in str(exc.value)
    (tmp_path / "config.json").write_text(json.dumps({"model": {"layers": "two"}}))  # a bad value stays an error
    with pytest.raises(ConfigError, match="model.layers"):
        config.read_record_config(tmp_path)


def test_from_dict_reads_strings_as_overrides_do():
    cfg = Config.from_dict({"model": {"layers": "6"}, "compare": {"floors": "no"}})
    assert cfg.model.layers == 6 and cfg.compare.floors is False


