"""Typed configuration: dataclasses, presets, and `section.key=value` overrides.

One `Config` holds every knob of a run. Presets fix the few numbers that matter (the `seed` preset is the
d8/w512 model of the design brief); `--set section.key=value` changes any field and an unknown key or a value
of the wrong type is an error that lists what is valid.
"""

from __future__ import annotations

import dataclasses
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
    vocab_pad_multiple: int = 64  # the head is padded for speed; FLOPs count the true vocabulary
    # Pointwise work redone in the backward instead of kept: any of norm (the blocks' RMSNorms), qk (QK-norm and
    # rotary), mlp (ReLU^2 of the plain MLP; the fused one keeps only its output and recomputes nothing),
    # comma-separated; "all" or "none" (true/false read as all/none). Measured: benchmarks/native_seed.md.
    recompute: str = "none"
    # fused: ReLU^2 computed in the expansion's epilogue and its derivative in the epilogue of the projection's
    # input-gradient product (relu2.py, Triton on CUDA), keeping only the activation; plain: op by op, ReLU^2
    # recomputed in the backward where model.recompute names mlp (records from before the fused MLP read plain).
    mlp: str = "fused"
    # product: QK-norm and rotary's forward pass in the epilogue of the Q/K/V product itself, whose output is then
    # never written (kernels/qkv_rotary.py, qkv_hopper.py on CUDA), the backward as fused's; fused: one pass each way
    # over the Q/K/V product's output (qk_norm.py, Triton on CUDA), the rotated q and k kept (attention keeps them
    # anyway); plain: op by op (records from before the fused QK-norm read plain; benchmarks/qk_norm.md)
    qk: str = "product"
    # keep_output: the blocks' norms' backward reads n and the row scale, which the branch's product keeps anyway
    # (model.norm_backward); plain: as autograd records them, keeping their input too (records from before read
    # plain)
    norm: str = "keep_output"
    # plain: the head's products in the autocast dtype; fp8: on FP8 tensor cores (loss.py), h and W in e4m3 and
    # the logits' gradient in e5m2, one scale each; a precision choice, not exact arithmetic, whose learning is
    # measured apart (benchmarks/native_seed.md). Evaluation keeps the plain precision either way.
    head: str = "plain"
    # plain: each embedding lookup as autograd records it; fused: the token and value-embedding lookups as one
    # operation whose backward sorts the ids once and adds each token's summed gradient rows to its table row
    # (embedding.py, Triton on CUDA): twice as fast alone, no faster in the step (benchmarks/native_seed.md)
    embed: str = "plain"
    # The fused MLP's derivative product on CUDA: gluon, on compute capability 9 the Gluon kernel that brings the
    # post tile in by TMA during the K loop (kernels/relu2_hopper.py), elsewhere the same as triton; triton:
    # the Triton kernel, whose epilogue reads the post tile after the loop (kernels/relu2_matmul.py; records from
    # before the option read triton; benchmarks/relu2_mlp.md); gluon_overlapped: the Gluon kernel with each tile's
    # epilogue run in row pieces beside the next tile's products; gluon_specialized: with the epilogue on warps of
    # its own
    mlp_dgrad: str = "gluon"
    # The fused MLP's expansion on CUDA: triton, the Triton kernel with ReLU^2 in its epilogue
    # (kernels/relu2_matmul.py); gluon, on compute capability 9 the Gluon kernel of the derivative product with the
    # same epilogue (kernels/relu2_hopper.py), elsewhere the same as triton (benchmarks/relu2_mlp.md)
    mlp_expand: str = "triton"
    # fused: the attention gate's thin product (gate_dim -> heads per token) as one Triton pass forward and one
    # backward computing the input gradient and the weight gradient's partial sums (attention_gate.py); plain: as
    # F.linear, three cuBLAS products (records from before the option read plain; benchmarks/native_seed.md)
    attn_gate: str = "fused"
    # The Q/K/V product's kernel with model.qk=product on CUDA: triton (kernels/qkv_rotary.py); gluon: on compute
    # capability 9, where the tokens are whole tiles, the Gluon kernel whose epilogue's store drains while the
    # next tile's products run (kernels/qkv_hopper.py), elsewhere the same as triton (records from before the
    # option read triton); gluon_overlapped: the Gluon kernel with each tile's epilogue run in pieces beside the
    # next tile's products (qkv_hopper.EPILOGUE_OVERLAPPED, benchmarks/qk_norm.md)
    qk_kernel: str = "gluon"

    @property
    def recompute_parts(self) -> frozenset[str]:
        return parse_recompute(self.recompute)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def branches(self) -> int:
        return 2 * self.layers

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_pad_multiple
        return (self.vocab_size + m - 1) // m * m


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
    materialized: bool = False  # decode every correction at the tap (to measure what streaming saves)
    # streaming only: fused decodes each MLP branch's correction inside its norm's backward, which also adds the
    # residual gradient (kernels/norm_decode.py, Triton on CUDA; measured slower, benchmarks/predictor_cost.md);
    # plain decodes it in a product of its own, then autograd adds it to the norm's input
    decode: str = "plain"
    # streaming only: merged computes each attention branch's state gate in the branch's Q/K/V product (the gate's
    # rows appended to W_qkv), so the branch input is read once for both; separate gives the gate a product of its
    # own (no gain measured, benchmarks/predictor_cost.md). MLP branches keep their own product either way: their
    # expansion is the fused ReLU^2 kernel.
    gates: str = "separate"
    # streaming only: fused computes each branch's state gate sigmoid(n G^T) and its decode (code * g) D^T in Triton
    # kernels that keep the sigmoid and the gating on chip (kernels/gate_decode.py, CUDA; measured no faster,
    # benchmarks/predictor_cost.md); plain gives each a cuBLAS product, the compiler folding the rest into its passes
    products: str = "plain"
    predictor_lr: float = 1e-2  # held-out fit after 150 teacher steps (tiny): 3e-3 0.82, 1e-2 0.78, 3e-2 0.77, 1e-1 0.81
    # The teacher's fit products over (B, T, d): "auto" runs them in the gradient's dtype (bf16 under autocast,
    # with float32 sums); "float32" always in float32 or better.
    fit_precision: str = "auto"
    # fused: on CUDA each branch's regression reads its true correction once, in one Triton pass that does the
    # token-wise arithmetic on chip (kernels/fit_rows.py); plain: the same arithmetic op by op
    fit_rows: str = "fused"
    feedback_seed: int = 1234  # fixed random feedback of `dfa`
    # `dfa`'s scale: "none" (the random feedback as drawn) or "calibrated" (each branch's feedback scaled to the
    # RMS of its true corrections, measured on teacher updates: dfa then has teacher updates like a fitted source)
    dfa_scale: str = "none"
    fdfa_momentum: float = 0.9  # `fdfa`: weight of the past in the running estimate of each feedback operator
    sketch_rank: int = 32  # `sketch`: rank k of the factor of each omitted product's weight
    sketch_every: int = 50  # `sketch`: updates between refreshes of the factor (truncated SVD of the weight)
    # How the fitted sources' decoders are fitted on teacher updates: "adam" (one gradient step per teacher update
    # on the regression loss) or "lstsq" (closed form: the features' Gram matrix and their cross moment with the
    # true corrections are streamed in the backward, averaged across teacher updates with weight fit_decay on the
    # past, and the ridge system solved; the ridge is fit_ridge times the Gram's mean diagonal). The state gates,
    # the projection and the mean gate keep their gradient fit either way.
    fit: str = "adam"
    fit_decay: float = 0.9
    fit_ridge: float = 1e-3


RECOMPUTE_PARTS = ("norm", "qk", "mlp")
MLPS = ("fused", "plain")  # also the choices of model.embed, .attn_gate, credit.decode, .fit_rows and .products
NORMS = ("plain", "keep_output")
HEADS = ("plain", "fp8")
MLP_DGRADS = ("triton", "gluon", "gluon_overlapped", "gluon_specialized")
MLP_EXPANDS = ("triton", "gluon")
QK_KERNELS = ("triton", "gluon", "gluon_overlapped")
QKS = ("fused", "product", "plain")
MODEL_CHOICES = {"mlp": MLPS, "qk": QKS, "norm": NORMS, "head": HEADS, "embed": MLPS, "mlp_dgrad": MLP_DGRADS,
                 "mlp_expand": MLP_EXPANDS, "attn_gate": MLPS, "qk_kernel": QK_KERNELS}
# (key, values, recompute part, what it keeps): with model.<key> one of <values> that part has nothing to recompute
LEAN_MODULES = (("mlp", ("fused",), "mlp", "the fused MLP keeps only ReLU^2's output"),
                ("qk", ("fused", "product"), "qk", "the fused QK-norm keeps only what attention keeps"),
                ("norm", ("keep_output",), "norm", "norms keeping their output keep nothing of their own"))
FITS = ("adam", "lstsq")
GATES = ("separate", "merged")
DFA_SCALES = ("none", "calibrated")
# The arms of creditlab/arms.py that compare.reference may name (as name or name@section.key=value, the label of
# one of --arms): every arm but native backprop itself and intermittent, which is given the reference's seconds.
REFERENCE_ARMS = ("oracle", "zero", "learned", "typed", "fitted_feedback", "dfa", "fdfa", "sketch", "dni")


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


def parse_recompute(spec: str) -> frozenset[str]:
    """The parts named by model.recompute; a ValueError names the valid ones."""
    spec = spec.strip().lower()
    if spec in ("all", "true", "1", "on", "yes"):
        return frozenset(RECOMPUTE_PARTS)
    if spec in ("none", "false", "0", "off", "no", ""):
        return frozenset()
    parts = frozenset(p.strip() for p in spec.split(","))
    unknown = sorted(parts - set(RECOMPUTE_PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}: use all, none or a comma-separated subset of "
                         f"{','.join(RECOMPUTE_PARTS)}")
    return parts


COMPILE_MODES = ("default", "coordinate-descent", "pdl", "autotune-gemm", "max-autotune-no-cudagraphs")


@dataclass
class TrainConfig:
    micro_batch: int = 64
    grad_accum: int = 4
    updates: int = 12
    seed: int = 42261
    lr_muon: float = 0.02
    # grouped: torch.optim.Muon's update with the matrices of one shape orthogonalized together in batched
    # products (optim.GroupedMuon); torch: torch.optim.Muon, one matrix after another
    muon: str = "grouped"
    lr_embed: float = 0.3
    lr_head: float = 0.008
    lr_scalar: float = 0.02
    weight_decay: float = 0.0
    warmup: int = 0  # updates of linear warmup
    cooldown_frac: float = 0.4  # final fraction of updates with linear decay to zero
    # Tokens per chunk of the fused head loss. With the head loss as one operator, 8,192 and 16,384 peak and run
    # alike at the seed shape (benchmarks/native_seed.md); smaller chunks hold less on smaller models.
    loss_chunk: int = 8_192
    compile: str = "auto"  # auto (on CUDA) | on | off
    compile_mode: str = "default"  # default | coordinate-descent (tune fused kernels' launch configs) |
    # pdl (generated kernels launched as programmatic dependents: each may start while the one before finishes;
    # Hopper and later; no gain measured, benchmarks/native_seed.md) | autotune-gemm (each product the compiler
    # places benchmarked against its Triton templates, which can take a pointwise epilogue; the generated
    # pointwise kernels untuned; cuBLAS won, no gain measured) | max-autotune-no-cudagraphs (both tuned; compiles for many minutes)
    sdpa: str = "auto"  # attention kernel: auto | flash | cudnn | efficient | math
    # Make the next update's first micro-batch while the GPU still runs this update's last backward, not after
    # the synchronization that opens the next update (a loader's pure batch_at, so its position stays what a
    # checkpoint saves). Records from before read false.
    prefetch: bool = True
    # `train`'s loop queues the next update before it reads this one's loss and checks it is finite, so the GPU
    # need not wait for the host between updates; an update's seconds then come from CUDA events around its work.
    # Settled (read before the next is queued) where a checkpoint, an evaluation or the run's end follows. Off:
    # side by side with the settled loop it gained nothing beyond the spread (benchmarks/native_seed.md).
    overlap: bool = False
    activation_budget: float = 1.0  # < 1: ask the compiler to recompute activations to fit this fraction
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, float32 on CPU) | float32 | float64 | bf16
    log_every: int = 1
    checkpoint_every: int = 0  # > 0: write runs/<id>/checkpoint_<update>.pt every this many updates
    keep_checkpoints: int = 2  # checkpoints kept in a record, newest first (0: keep all)
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
    updates: int = 12
    seed: int = 42261
    window: int = 6  # verdict from medians of the last `window` updates
    cycle_gate: float = 0.93  # mean time of one teacher cycle over native
    ratio_gate: float = 0.9066667  # synthetic/native: (1 + 3r)/4 <= cycle_gate with one teacher in four
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
    # The shorter native budgets continue the longest one's run from the last update at which their learning
    # rates are still the same (its cooldown's start), instead of repeating those updates: the same numbers as
    # separate runs (tested on the CPU), fewer updates.
    fork_budgets: bool = True
    # Every arm's state is saved every checkpoint_every updates (0: at every evaluation, train.eval_every), so
    # that `compare --resume` continues an interrupted comparison from there.
    checkpoint_every: int = 0


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
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls()
        for fused in ("mlp", "qk", "norm", "embed", "attn_gate"):
            if "model" in d and fused not in d["model"]:
                setattr(cfg.model, fused, "plain")  # a record from before the lean module: it ran the plain one
        if "model" in d and "mlp_dgrad" not in d["model"]:
            cfg.model.mlp_dgrad = "triton"  # a record from before the Gluon kernel: it ran the Triton one
        if "model" in d and "qk_kernel" not in d["model"]:
            cfg.model.qk_kernel = "triton"  # a record from before the Gluon Q/K/V kernel
        if "train" in d and "muon" not in d["train"]:
            cfg.train.muon = "torch"  # a record from before the grouped Muon: it ran torch's
        if "train" in d and "prefetch" not in d["train"]:
            cfg.train.prefetch = False  # a record from before the prefetch: each update made its first batch
        if "train" in d and "overlap" not in d["train"]:
            cfg.train.overlap = False  # a record from before the overlap: each update was read before the next
        for section, values in d.items():
            for key, value in values.items():
                _assign(cfg, f"{section}.{key}", value)
        return cfg


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
COSMETIC_KEYS = ("train.log_every", "train.out_dir", "train.keep_checkpoints", "train.stall_updates",
                 "compare.checkpoint_every")


PRESETS: dict[str, typing.Callable[[], Config]] = {"seed": _seed, "tiny": _tiny}


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
        if typ is str and isinstance(raw, bool):  # a field that once was a flag (model.recompute) in old records
            return "true" if raw else "false"
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


def _range_problems(section, keys: typing.Iterable[str], low: float, high: float = math.inf,
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
    for key in ("layers", "width", "heads", "mlp_hidden", "seq_len", "vocab_size", "vocab_pad_multiple"):
        if getattr(m, key) < 1:
            problems.append(f"model.{key} must be positive, got {getattr(m, key)}")
    problems += _range_problems(m, ("logit_cap", "rope_base"), 0.0, low_open=True)
    try:
        parts = parse_recompute(m.recompute)
    except ValueError as exc:
        problems.append(f"model.recompute: {exc}")
    else:
        every_part = parts == frozenset(RECOMPUTE_PARTS)  # "all" names every part there is, idle ones too
        for key, values, part, kept in LEAN_MODULES:
            if getattr(m, key) in values and part in parts and not every_part:
                problems.append(f"model.recompute={part}: {kept}, so there is nothing to recompute; drop {part} "
                                f"from model.recompute or set model.{key}=plain")
    for key, choices in MODEL_CHOICES.items():
        if getattr(m, key) not in choices:
            problems.append(f"model.{key} must be one of {'|'.join(choices)}, got {getattr(m, key)!r}")
    if m.head == "fp8":  # FP8 tensor-core products take sizes in multiples of 16
        sizes = {"model.width": m.width, "the padded vocabulary (model.vocab_pad_multiple)": m.padded_vocab,
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
    problems += _range_problems(t, ("lr_muon", "lr_embed", "lr_head", "lr_scalar", "weight_decay"), 0.0)
    problems += _range_problems(t, ("activation_budget",), 0.0, 1.0, low_open=True)
    if cfg.compare.align_every < 0:
        problems.append(f"compare.align_every must be >= 0, got {cfg.compare.align_every}")
    if cfg.compare.checkpoint_every < 0:
        problems.append(f"compare.checkpoint_every must be >= 0, got {cfg.compare.checkpoint_every}")
    try:
        parse_budgets(cfg.compare.native_budgets)
    except ValueError as exc:
        problems.append(f"compare.native_budgets: {exc}")
    if cfg.compare.reference.partition("@")[0].strip() not in REFERENCE_ARMS:
        problems.append(f"compare.reference must name an arm other than native and intermittent, as in --arms "
                        f"(name or name@section.key=value; names: {'|'.join(REFERENCE_ARMS)}), "
                        f"got {cfg.compare.reference!r}")
    if t.compile not in ("auto", "on", "off"):
        problems.append(f"train.compile must be auto|on|off, got {t.compile!r}")
    if t.compile_mode not in COMPILE_MODES:
        problems.append(f"train.compile_mode must be one of {'|'.join(COMPILE_MODES)}, got {t.compile_mode!r}")
    if t.muon not in ("torch", "grouped"):
        problems.append(f"train.muon must be torch|grouped, got {t.muon!r}")
    if t.sdpa not in ("auto", "flash", "cudnn", "efficient", "math"):
        problems.append(f"train.sdpa must be auto|flash|cudnn|efficient|math, got {t.sdpa!r}")
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
    c = cfg.credit
    if c.rank < 1:
        problems.append(f"credit.rank must be positive, got {c.rank}")
    problems += _range_problems(c, ("predictor_lr",), 0.0)
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
    for key in ("fit_rows", "decode", "products"):
        if getattr(c, key) not in MLPS:
            problems.append(f"credit.{key} must be one of {'|'.join(MLPS)}, got {getattr(c, key)!r}")
    if c.gates not in GATES:
        problems.append(f"credit.gates must be one of {'|'.join(GATES)}, got {c.gates!r}")
    if c.fit_precision not in ("auto", "float32"):
        problems.append(f"credit.fit_precision must be auto|float32, got {c.fit_precision!r}")
    if c.teacher_every < 0:
        problems.append(f"credit.teacher_every must be >= 0, got {c.teacher_every}")
    if c.dfa_scale not in DFA_SCALES:
        problems.append(f"credit.dfa_scale must be one of {'|'.join(DFA_SCALES)}, got {c.dfa_scale!r}")
    if not 0.0 <= c.fdfa_momentum < 1.0:
        problems.append(f"credit.fdfa_momentum must lie in [0, 1), got {c.fdfa_momentum!r}")
    if c.sketch_rank < 1 or c.sketch_every < 1:
        problems.append("credit.sketch_rank and credit.sketch_every must be positive")
    if c.fit not in FITS:
        problems.append(f"credit.fit must be one of {'|'.join(FITS)}, got {c.fit!r}")
    if not 0.0 <= c.fit_decay < 1.0:
        problems.append(f"credit.fit_decay must lie in [0, 1), got {c.fit_decay!r}")
    problems += _range_problems(c, ("fit_ridge",), 0.0)
    s = cfg.screen
    for key in ("updates", "window"):
        if getattr(s, key) < 1:
            problems.append(f"screen.{key} must be positive, got {getattr(s, key)}")
    problems += _range_problems(s, ("cycle_gate", "ratio_gate"), 0.0, low_open=True)
    problems += _range_problems(s, ("peak_gate_mib", "cap_gpu_s", "memory_cap_mib"), 0.0)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
