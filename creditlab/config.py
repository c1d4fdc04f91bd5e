"""Typed configuration: dataclasses, presets, and `section.key=value` overrides.

One `Config` holds every knob of a run. Presets fix the few numbers that matter (the `seed` preset is the
d8/w512 decoder); `--set section.key=value` changes any field and an unknown key or a value
of the wrong type is an error that lists what is valid.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass, field

from creditlab.credit import registry, schedules


@dataclass
class ModelConfig:
    layers: int = 8
    width: int = 512
    heads: int = 4
    mlp_hidden: int = 2048
    seq_len: int = 2048
    vocab_size: int = 12_289  # 12,288 BPE tokens + 1 document separator
    value_embeds: int = 3  # tables mixed into V of the first and last `value_embeds` layers
    gate_dim: int = 12  # leading channels of the branch input that feed the per-head attention gate
    logit_cap: float = 15.0
    rope_base: float = 10_000.0
    # plain: the head's products in the autocast dtype; fp8: on FP8 tensor cores (loss.py), h and W in e4m3 and
    # the logits' gradient in e5m2, one scale each; a precision choice, not exact arithmetic, whose learning is
    # measured apart (benchmarks/native_seed.md). Evaluation keeps the plain precision either way.
    head: str = "plain"

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def branches(self) -> int:
        return 2 * self.layers

    @property
    def padded_vocab(self) -> int:
        """The head's rows: the vocabulary padded to a multiple of 64 for the products' tiles (FLOPs count the
        true vocabulary)."""
        return (self.vocab_size + VOCAB_PAD - 1) // VOCAB_PAD * VOCAB_PAD


@dataclass
class DataConfig:
    # "synthetic" (a deterministic token stream, no files), or a folder prepared by `creditlab data prepare`.
    source: str = "synthetic"
    dir: str = "data/prose"


@dataclass
class CreditConfig:
    source: str = "exact"  # a name of credit/registry.py: exact | oracle | zero | learned | typed | dfa | dni | ...
    rank: int = 32  # rank of the terminal-error projection
    teacher_every: int = 4  # one exact teacher update in K (the fitted sources; 0 = never), for `fixed`
    # Which updates are exact (credit/schedules.py): fixed | fixed:K | never | warmup:N[,K] | adaptive[:A,B].
    schedule: str = "fixed"
    predictor_lr: float = 1e-2  # held-out fit after 150 teacher steps (tiny): 3e-3 0.82, 1e-2 0.78, 3e-2 0.77, 1e-1 0.81
    # `dfa`'s scale: "none" (the random feedback as drawn) or "calibrated" (each branch's feedback scaled to the
    # RMS of its true corrections, measured on teacher updates: dfa then has teacher updates like a fitted source)
    dfa_scale: str = "none"
    # `sketch`: how each omitted product dY W is approximated at rank k (credit/sketch.py). "svd": (dY W V) V^T with
    # V the leading k right singular vectors of W, refreshed by a full SVD every sketch_every updates (biased: the
    # part of dY W outside span(V) is dropped); "subspace": the same sketch, its basis refreshed by two steps of
    # subspace iteration warm-started from the last basis (the first refresh a randomized range finder);
    # "sampled": the unbiased estimate (dY S)(S^T W)/k with S a fresh (m, k) Rademacher matrix every micro-batch,
    # drawn from train.seed, the update and the micro-batch (no basis, no refresh).
    sketch: str = "svd"
    sketch_rank: int = 32  # `sketch`: rank k of the factor of each omitted product's weight (directions sampled)
    sketch_every: int = 50  # `sketch`: updates between refreshes of the basis (svd, subspace; sampled has none)
    # How the fitted sources' decoders are fitted on teacher updates: "adam" (one gradient step per teacher update
    # on the regression loss) or "lstsq" (closed form: the features' Gram matrix and their cross moment with the
    # true corrections are streamed in the backward, averaged across teacher updates with weight fit_decay on the
    # past, and the ridge system solved; the ridge is fit_ridge times the Gram's mean diagonal). The state gates,
    # the projection and the mean gate keep their gradient fit either way.
    fit: str = "adam"
    fit_decay: float = 0.9
    fit_ridge: float = 1e-3


VOCAB_PAD = 64
HEADS = ("plain", "fp8")


def parse_budgets(spec: str) -> list[float]:
    """compare.native_budgets as sorted fractions; a ValueError says what is wrong."""
    try:
        values = [float(part) for part in spec.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"{spec!r} is not a comma-separated list of fractions of train.updates, e.g. "
                         "0.7,0.85,1.0,1.15") from None
    if any(not (math.isfinite(v) and v > 0) for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{spec!r}: give distinct positive fractions of train.updates, e.g. 0.7,0.85,1.0,1.15")
    return sorted(values)


@dataclass
class TrainConfig:
    micro_batch: int = 64
    grad_accum: int = 4
    updates: int = 12
    seed: int = 42261
    lr_muon: float = 0.02
    lr_embed: float = 0.3
    lr_head: float = 0.008
    lr_scalar: float = 0.02
    warmup: int = 0  # updates of linear warmup
    cooldown_frac: float = 0.4  # final fraction of updates with linear decay to zero
    # Tokens per chunk of the fused head loss. With the head loss as one operator, 8,192 and 16,384 peak and run
    # alike at the seed shape (benchmarks/native_seed.md); smaller chunks hold less on smaller models.
    loss_chunk: int = 8_192
    compile: str = "auto"  # auto (on CUDA) | on | off
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, float32 on CPU) | float32 | float64 | bf16
    log_every: int = 1
    # > 0: write checkpoint_<update>.pt into the record every this many updates (`compare`: 0 saves every arm at
    # each evaluation instead, so that `compare --resume` continues an interrupted comparison from there)
    checkpoint_every: int = 0
    keep_checkpoints: int = 2  # checkpoints kept in a record, newest first (0: keep all)
    # true: a run that finished removes its checkpoints once model.pt and result.json are written (all that a
    # resumed comparison and a held-out read need of it); for studies of wide models, whose checkpoints would
    # otherwise fill the disk
    drop_finished_checkpoints: bool = False
    # A loss within 2% of ln(vocab) (chance), or more than 1 nat above its running minimum, for this many updates
    # in a row writes a warning (0: never).
    stall_updates: int = 100
    out_dir: str = "runs"
    # DEV evaluation of `creditlab train` and `compare`: the loss on a fixed DEV subset of eval_tokens tokens every
    # eval_every updates (0: only before the first and after the last update); eval_tokens=0 turns it off.
    eval_every: int = 0
    eval_tokens: int = 1_048_576


@dataclass
class ScreenConfig:
    updates: int = 12  # the verdict reads the medians of the last six (protocol/gates.py WINDOW)
    # mean time of one teacher cycle over native; the synthetic/native ratio gate follows from it and
    # credit.teacher_every K: (1 + (K - 1) r) / K <= cycle_gate, r <= (K cycle_gate - 1) / (K - 1) = 0.9066667
    cycle_gate: float = 0.93
    peak_gate_mib: float = 23_400.0
    cap_gpu_s: float = 1_200.0
    memory_cap_mib: float = 0.0  # > 0: cap this process's GPU memory to emulate a smaller card


@dataclass
class CompareConfig:
    # Every align_every updates, each arm's gradient is compared with the exact gradient of the same batch (one
    # extra exact backward, outside the timed update); 0 = never. Alignment is measured on the update with
    # index u where u % align_every == align_every - 1, so with teacher_every dividing align_every it falls on
    # synthetic updates (teacher updates are exact by construction).
    align_every: int = 0
    reference: str = "learned"  # the arm whose GPU-seconds `intermittent` is given
    # Native backprop at these fractions of train.updates, each with its learning rate fully decayed within its
    # own budget: native's DEV loss against GPU-seconds, which each arm's speedup is read from ("" for none).
    native_budgets: str = "0.7,0.85,1.0,1.15"
    # Each arm with exact updates is judged against `zero` under the same schedule (its fair floor), added to the
    # comparison unless one of its arms is that floor already.
    floors: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    screen: ScreenConfig = field(default_factory=ScreenConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, written_by: str | None = None) -> "Config":
        """The config a record holds. Records are not migrated: one written by code with other keys is refused,
        naming the keys and `written_by` (the commit its env.json names), which reads it."""
        cfg, gone = cls(), []
        for section, values in d.items():
            for key, value in values.items():
                try:
                    _assign(cfg, f"{section}.{key}", value)
                except ConfigError:
                    if not _known(section, key):
                        gone.append(f"{section}.{key}")
                        continue
                    raise
        if gone:
            where = f"git checkout {written_by}" if written_by else "the commit its env.json names"
            raise ConfigError(f"this record was written by an earlier version with settings that no longer exist "
                              f"({', '.join(gone)}); read it with the code that wrote it ({where})")
        return cfg


def _known(section: str, key: str) -> bool:
    return f"{section}.{key}" in valid_keys()


def read_record_config(folder) -> Config:
    """A run record's config (config.json), refused with the commit to check out where it predates this code."""
    from pathlib import Path

    from creditlab.protocol.records import read_json

    folder = Path(folder)
    env = read_json(folder / "env.json") if (folder / "env.json").exists() else {}
    return Config.from_dict(read_json(folder / "config.json"), env.get("git_sha"))


class UserError(Exception):
    """A mistake the user can fix (a config, a path, data, a full disk): the CLI prints its message as one line
    and exits 2, without a traceback. Its message names what is wrong and how to fix it."""


class ConfigError(UserError, ValueError):
    pass


def _seed() -> Config:
    return Config()


def _tiny() -> Config:
    cfg = Config()
    cfg.model = ModelConfig(layers=4, width=64, heads=2, mlp_hidden=256, seq_len=64, vocab_size=12_289,
                            value_embeds=2, gate_dim=8)
    cfg.train = TrainConfig(micro_batch=8, grad_accum=2, updates=60, lr_muon=0.02, lr_embed=0.05,
                            lr_head=0.01, lr_scalar=0.02, warmup=5, loss_chunk=256, log_every=10,
                            eval_every=20, eval_tokens=16_384)
    cfg.credit = CreditConfig(rank=8)
    cfg.screen = ScreenConfig(updates=12)
    return cfg


# Config keys that change nothing an arm computes or measures: where records are written, how often a line is
# printed, how many checkpoints are kept, when a stalled loss is warned of. Two admissions that differ only in
# these are one experiment (admitting the second names the first and its verdict), and compare folders that
# differ only in these merge. Every other key counts, including any key added later, until it is listed here.
COSMETIC_KEYS = ("train.log_every", "train.out_dir", "train.keep_checkpoints", "train.drop_finished_checkpoints",
                 "train.stall_updates")


def seed_at_width(width: int) -> Config:
    """The seed model at another width, one knob: heads = width / 128 (the seed's head width), MLP 4 x width, the
    seed's depth, windows and tokens per update (256 windows of 2,048); the micro-batch shrinks as the width grows,
    the accumulation making up the tokens, so that one micro-batch's activations stay about the seed's: 64 windows
    at 512, 32 at 1,024, 16 from 1,536."""
    if width % 128 or width < 128:
        raise ConfigError(f"a seed width must be a positive multiple of 128 (one head each), got {width}")
    cfg = Config()
    cfg.model = ModelConfig(width=width, heads=width // 128, mlp_hidden=4 * width)
    windows = cfg.train.micro_batch * cfg.train.grad_accum
    micro = 64 if width <= 512 else 32 if width <= 1024 else 16
    cfg.train = TrainConfig(micro_batch=micro, grad_accum=windows // micro)
    return cfg


SEED_WIDTHS = (1024, 1536, 2048)  # the widths where the cost of the omitted products is measured against width

PRESETS: dict[str, typing.Callable[[], Config]] = {
    "seed": _seed, "tiny": _tiny, **{f"seed-w{w}": functools.partial(seed_at_width, w) for w in SEED_WIDTHS}}


def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def valid_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{k}" for s in _fields(cfg) for k in _fields(getattr(cfg, s))]


def _parse(raw, typ, key: str):
    if not isinstance(raw, str):
        # Values read back from JSON already carry their type.
        if typ is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, typ) and not (typ is int and isinstance(raw, bool)):
            return raw
        raise ConfigError(f"{key}: expected {typ.__name__}, got {raw!r}")
    try:
        if typ is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(raw.replace("_", ""))
        if typ is float:
            return float(raw.replace("_", ""))
        return raw
    except ValueError:
        raise ConfigError(f"{key}: {raw!r} is not a valid {typ.__name__}") from None


def _assign(cfg: Config, key: str, raw) -> None:
    section, _, name = key.partition(".")
    sections = _fields(cfg)
    if section not in sections or not name:
        raise ConfigError(f"unknown key {key!r}; valid keys: {', '.join(valid_keys())}")
    sub = getattr(cfg, section)
    fields = _fields(sub)
    if name not in fields:
        raise ConfigError(f"unknown key {key!r}; valid keys in [{section}]: "
                          f"{', '.join(f'{section}.{k}' for k in fields)}")
    hints = typing.get_type_hints(type(sub))
    setattr(sub, name, _parse(raw, hints[name], key))


def load(preset: str = "tiny", overrides: typing.Sequence[str] = ()) -> Config:
    """Build a config from a preset name and `section.key=value` overrides, validating both."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]()
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        _assign(cfg, key.strip(), value.strip())
    validate(cfg)
    return cfg


def range_problems(section, keys: typing.Iterable[str], low: float, high: float = math.inf,
                    low_open: bool = False) -> list[str]:
    """One problem for each of section's float keys whose value is not a finite number from low (excluded where
    low_open) to high; NaN and the infinities lie outside every range."""
    name = type(section).__name__.removesuffix("Config").lower()
    if high == math.inf:
        wanted = f"be a finite number {'>' if low_open else '>='} {low:g}"
    else:
        wanted = f"lie in {'(' if low_open else '['}{low:g}, {high:g}]"
    problems = []
    for key in keys:
        value = getattr(section, key)
        if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
            problems.append(f"{name}.{key} must {wanted}, got {value!r}")
    return problems


def validate(cfg: Config) -> None:
    m = cfg.model
    problems = []
    if m.width % m.heads:
        problems.append(f"model.width ({m.width}) must be divisible by model.heads ({m.heads})")
    elif m.head_dim % 2:
        problems.append(f"head dim width/heads = {m.head_dim} must be even for rotary positions")
    if not 1 <= m.gate_dim <= m.width:  # the gate reads the branch input's first gate_dim channels
        problems.append(f"model.gate_dim must lie in [1, model.width={m.width}], got {m.gate_dim}")
    if not 0 <= 2 * m.value_embeds <= m.layers:  # table i feeds layers i and layers - value_embeds + i
        problems.append(f"model.value_embeds must lie in [0, model.layers/2] (each table feeds one of the first "
                        f"and one of the last layers; model.layers={m.layers}), got {m.value_embeds}")
    for key in ("layers", "width", "heads", "mlp_hidden", "seq_len", "vocab_size"):
        if getattr(m, key) < 1:
            problems.append(f"model.{key} must be positive, got {getattr(m, key)}")
    problems += range_problems(m, ("logit_cap", "rope_base"), 0.0, low_open=True)
    if m.head not in HEADS:
        problems.append(f"model.head must be one of {'|'.join(HEADS)}, got {m.head!r}")
    if m.head == "fp8":  # FP8 tensor-core products take sizes in multiples of 16
        sizes = {"model.width": m.width, "the padded vocabulary": m.padded_vocab,
                 "model.seq_len": m.seq_len, "train.loss_chunk": cfg.train.loss_chunk}
        problems += [f"model.head=fp8 needs {name} to be a multiple of 16, got {size}"
                     for name, size in sizes.items() if size % 16]
    if cfg.data.source not in ("synthetic", "shards"):
        problems.append(f"data.source must be synthetic|shards, got {cfg.data.source!r} (shards are read from "
                        f"data.dir; prepare them with `creditlab data prepare`)")
    t = cfg.train
    for key in ("micro_batch", "grad_accum", "updates", "loss_chunk", "log_every"):
        if getattr(t, key) < 1:
            problems.append(f"train.{key} must be positive, got {getattr(t, key)}")
    for key in ("warmup", "eval_every", "eval_tokens", "checkpoint_every", "keep_checkpoints", "stall_updates"):
        if getattr(t, key) < 0:
            problems.append(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.warmup >= t.updates >= 1:
        problems.append(f"train.warmup ({t.warmup}) must be less than train.updates ({t.updates}): the learning rate "
                        f"would never leave its warmup; lower train.warmup")
    if not 0 <= t.seed < 2**63:
        problems.append(f"train.seed must lie in [0, 2**63), got {t.seed}")
    problems += range_problems(t, ("lr_muon", "lr_embed", "lr_head", "lr_scalar"), 0.0)
    if cfg.compare.align_every < 0:
        problems.append(f"compare.align_every must be >= 0, got {cfg.compare.align_every}")
    try:
        parse_budgets(cfg.compare.native_budgets)
    except ValueError as exc:
        problems.append(f"compare.native_budgets: {exc}")
    # compare.reference: an arm of one of the sources but exact backprop itself (intermittent is given its seconds)
    references = [name for name in registry.SOURCES if name != "exact"]
    if cfg.compare.reference.partition("@")[0].strip() not in references:
        problems.append(f"compare.reference must name an arm other than native and intermittent, as in --arms "
                        f"(name or name@section.key=value; names: {'|'.join(references)}), "
                        f"got {cfg.compare.reference!r}")
    if t.compile not in ("auto", "on", "off"):
        problems.append(f"train.compile must be auto|on|off, got {t.compile!r}")
    if t.device not in ("auto", "cpu", "cuda"):
        problems.append(f"train.device must be auto|cpu|cuda, got {t.device!r}")
    if t.dtype not in ("auto", "float32", "float64", "bf16"):
        problems.append(f"train.dtype must be auto|float32|float64|bf16, got {t.dtype!r}")
    elif t.dtype == "bf16" and t.device == "cpu":
        problems.append("train.dtype=bf16 (autocast) needs CUDA: with train.device=cpu use train.dtype=float32 "
                        "or float64")
    if not 0.0 <= t.cooldown_frac <= 1.0:
        problems.append(f"train.cooldown_frac must lie in [0, 1], got {t.cooldown_frac!r}")
    if not t.out_dir.strip():
        problems.append("train.out_dir is empty; name the folder for run records (default runs)")
    s = cfg.screen
    if s.updates < 1:
        problems.append(f"screen.updates must be positive, got {s.updates}")
    problems += range_problems(s, ("cycle_gate",), 0.0, low_open=True)
    problems += range_problems(s, ("peak_gate_mib", "cap_gpu_s", "memory_cap_mib"), 0.0)
    if cfg.credit.teacher_every < 0:
        problems.append(f"credit.teacher_every must be >= 0, got {cfg.credit.teacher_every}")
    if problems:  # said before the source's own checks, which import it (and torch): a plain mistake is quick
        raise ConfigError("invalid config: " + "; ".join(problems))
    problems += source_problems(cfg)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def source_problems(cfg: Config) -> list[str]:
    """What the credit source named by cfg (and its schedule) cannot run with."""
    problems = []
    c = cfg.credit  # the settings of one source are its own to check (CreditSource.config_problems)
    if c.source not in registry.SOURCES:
        problems.append(f"credit.source: unknown credit source {c.source!r}; valid: {', '.join(registry.SOURCES)}")
    else:
        source = registry.source_class(c.source)
        problems += source.config_problems(cfg)
        try:
            schedules.parse(c.schedule, c.teacher_every)
        except ValueError as exc:
            problems.append(f"credit.schedule: {exc}")
        else:
            if c.schedule.startswith("adaptive") and not source.fits_with(cfg):
                problems.append(f"credit.schedule={c.schedule}: adapts to the fit measured on teacher updates, and "
                                f"credit.source={c.source} fits nothing; use fixed:K or warmup:N,K")
            if source.fits_with(cfg) and c.schedule.strip() == "fixed" and c.teacher_every == 0:
                problems.append(f"credit.source={c.source} with credit.teacher_every=0 never has a teacher update, so "
                                f"it never fits and injects nothing; give credit.teacher_every >= 1, or "
                                f"credit.schedule=never to run its synthetic step unfitted on purpose")
    return problems
