"""`creditlab ceiling`: the fit ceiling of each predictor family at one model state (the least-squares optimum's
held-out error: what a family can represent, apart from how well training fits it).

Every family below is linear in the terminal error e given the forward states, so its best decoders are a
least-squares problem per branch b: with features F_b (N, k) and the true corrections C_b (N, d) of N tokens,
the sufficient statistics are the Gram F_b^T F_b (k, k), the cross moment C_b^T F_b (d, k) and |C_b|^2. They are
summed per micro-batch and the batch's tensors freed, so memory stays at one micro-batch whatever K is.
Batches 1..K-1 fit, batch K scores; for decoders D, |pred|^2 = tr(D G D^T) and <pred, c> = tr(D X^T), so
every score comes from the statistics without forming a prediction.

Families (r = credit.rank):
  seed         g_b * [p ; m], p = P e, P the leading r principal directions of e, gates as initialized
  seed_nogate  [p ; m], the same P and mean gate, no state gates
  seed_rank4x  as seed with rank 4r (at most d)
  typed        the `typed` source's layout: attention branches g_b * [m ; p_{:r}], MLP branches g_b * p, with p
               the leading 2r principal directions (2r features per branch, as seed)
  full         e_t itself: any linear map of the token's own terminal error (d features): `fitted_feedback`
  trained      the configured `learned` or `typed` source's own P, gates and decoders, scored as they are
  trained_refit  its P and gates, least-squares decoders
  sketchK      the `sketch` source at rank K (--sketch, default 16,32,64): c_b V_b V_b^T, V_b the leading K right singular
               vectors of W_b at this state (just after a refresh); nothing fitted
The ceiling separates "the fit is poor" (trained far below trained_refit) from "the family cannot represent
the correction" (trained_refit, or seed, far below full).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from creditlab import config as config_mod
from creditlab.config import Config, CreditConfig, ModelConfig
from creditlab.credit.feedback import FittedFeedbackSource
from creditlab.credit.predictor import LearnedSource, Predictor, TypedPredictor
from creditlab.credit.sketch import leading_basis
from creditlab.credit.sources import TerminalTapCredit
from creditlab.model import GPT
from creditlab.protocol.records import read_json

RIDGES = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # relative to the Gram's mean diagonal
FAMILIES = ("seed", "seed_nogate", "seed_rank4x", "typed", "full", "trained", "trained_refit")
SKETCH_RANKS = (16, 32, 64)  # the default of --sketch; each capped at the width


# ---- recording one micro-batch -----------------------------------------------------------------------------

@dataclass
class Recorded:
    """One micro-batch's forward states and exact credit; each (B, T, d) except as noted."""
    e: torch.Tensor  # dL/dx_L
    x_terminal: torch.Tensor
    states: list[torch.Tensor]  # n_b, one per branch
    corrections: list[torch.Tensor]  # c_b, the gradient through the omitted product only


def record_batch(model: GPT, inputs: torch.Tensor, targets: torch.Tensor, autocast=None,
                 loss_chunk: int = 8_192, with_corrections: bool = True) -> Recorded:
    """One exact forward and torch.autograd.grad w.r.t. x_L and the omitted products' inputs (or x_L alone,
    without `with_corrections`: the backward then stops at the tap): no parameter's .grad is touched, so the model
    state being measured stays as it was."""
    tap = TerminalTapCredit()
    with autocast if autocast is not None else contextlib.nullcontext():
        loss = model(inputs, targets, credit=tap, loss_chunk=loss_chunk)
    e, *corrections = torch.autograd.grad(loss, [tap.x_terminal, *(tap.inputs if with_corrections else [])])
    return Recorded(e.detach(), tap.x_terminal.detach(), tap.states, [c.detach() for c in corrections])


# ---- families: features per branch -------------------------------------------------------------------------

class CodeFamily:
    """Features of a predictor's code: g_b * [p ; m] per branch, or the shared [p ; m] without gates."""

    def __init__(self, predictor: Predictor, gated: bool = True, decoders: torch.Tensor | None = None):
        self.predictor, self.gated = predictor, gated
        # every branch sees the same features (then their Gram is formed once per batch)
        self.shared = not gated and all(predictor.code_slice(b) == predictor.code_slice(0)
                                        for b in range(predictor.decoders.shape[0]))
        self.decoders = decoders  # (branches, d, 2r) fixed decoders, or None: fitted by least squares

    @property
    def size(self) -> int:
        return 2 * self.predictor.rank

    def features(self, rec: Recorded):
        """b -> branch b's features (N, 2r) in float64, made when asked: at the seed shape all 16 at once would
        be gigabytes. The shared code is computed once; without gates every branch gets the same tensor."""
        p = self.predictor
        a, a_rev = p.mean_weights(rec.x_terminal.double())
        code = p.code(rec.e.double(), a, a_rev)  # (B, T, code_width)
        if self.shared:
            shared = code[..., p.code_slice(0)].flatten(0, 1)
            return lambda b: shared
        if not self.gated:
            return lambda b: code[..., p.code_slice(b)].flatten(0, 1)
        return lambda b: (p.gate(b, rec.states[b].double()) * code[..., p.code_slice(b)]).flatten(0, 1)


class FullFamily:
    """Features e_t (N, d): the best map of the token's own terminal error, state-independent."""

    shared = True

    def __init__(self, width: int, decoders: torch.Tensor | None = None):
        self.size, self.decoders = width, decoders  # fixed (branches, d, d) decoders, or None: least squares

    def features(self, rec: Recorded):
        shared = rec.e.double().flatten(0, 1)
        return lambda b: shared


class SketchFamily:
    """The sketched product at rank k, as a family with fixed decoders V_b and features c_b V_b.

    The sketch (dY_b W_b V_b) V_b^T, with W_b V_b taken from the current weight as the source takes it, is the true
    correction projected onto span(V_b), c_b V_b V_b^T, since c_b = dY_b W_b exactly. So its features come from
    the recorded corrections and no output gradient dY_b (wider than c_b) needs recording."""

    shared = False

    def __init__(self, bases: torch.Tensor):
        self.decoders = bases  # (branches, d, k) float64, orthonormal columns
        self.size = bases.shape[-1]

    def features(self, rec: Recorded):
        return lambda b: rec.corrections[b].double().flatten(0, 1) @ self.decoders[b]


def sketch_families(model: GPT, ranks) -> dict:
    """`sketchK` for each rank K, capped at the width (duplicates dropped); one SVD per branch serves all."""
    ranks = sorted({min(int(k), model.cfg.width) for k in ranks})
    if not ranks:
        return {}
    bases = torch.stack([leading_basis(lin.weight.double(), ranks[-1]) for lin in model.branch_modules()])
    return {f"sketch{k}": SketchFamily(bases[..., :k].contiguous()) for k in ranks}


def principal_projection(second_moment: torch.Tensor, rank: int) -> torch.Tensor:
    """The leading `rank` eigenvectors of sum_t e_t e_t^T as rows, (rank, d), leading first.

    Why this P for the seed family: the projection is shared by all 16 branches and the jointly optimal one
    (reduced-rank regression through gates and the reverse mean) is a non-convex problem. Without looking at
    the corrections, the rank-r subspace keeping the most of e's energy (Eckart-Young) is the natural choice: a
    decoder can use only what P keeps of e, and this keeps the most of it. The configured init (random rows)
    keeps a random r/d share of it instead."""
    _, vectors = torch.linalg.eigh(second_moment)  # ascending eigenvalues
    return vectors[:, -rank:].flip(-1).t().contiguous()


def initialized_predictor(model: ModelConfig, rank: int, seed: int, projection: torch.Tensor,
                          kind: type[Predictor] = Predictor) -> Predictor:
    """A predictor with gates and mean gate drawn as the configured one draws them (its init, seeded), in
    float64, with projection P replaced."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        predictor = kind(model, rank).double()
    with torch.no_grad():
        predictor.projection.copy_(projection)
    return predictor.to(projection.device).requires_grad_(False)  # measured, never trained here


def build_families(model: ModelConfig, credit: CreditConfig, seed: int, second_moment: torch.Tensor,
                   trained: Predictor | torch.Tensor | None) -> dict:
    r, d = credit.rank, model.width
    wide = min(4 * r, d)  # more principal directions than d do not exist
    seed_p = initialized_predictor(model, r, seed, principal_projection(second_moment, r))
    families = {
        "seed": CodeFamily(seed_p),
        "seed_nogate": CodeFamily(seed_p, gated=False),
        "seed_rank4x": CodeFamily(initialized_predictor(model, wide, seed, principal_projection(second_moment, wide))),
    }
    if 2 * r <= d:  # the typed layout projects onto 2r directions
        families["typed"] = CodeFamily(initialized_predictor(model, r, seed, principal_projection(second_moment, 2 * r),
                                                             TypedPredictor))
    families["full"] = FullFamily(d)
    if isinstance(trained, torch.Tensor):  # a fitted feedback's decoders: the full family's own state
        families["trained"] = FullFamily(d, decoders=trained.detach().double().to(second_moment.device))
    elif trained is not None:
        own = copy.deepcopy(trained).double().to(second_moment.device).requires_grad_(False)
        families["trained"] = CodeFamily(own, decoders=own.decoders.detach())
        families["trained_refit"] = CodeFamily(own)
    return families


# ---- least-squares statistics ------------------------------------------------------------------------------

@dataclass
class Moments:
    """Per branch: Gram (branches, k, k), cross moment (branches, d, k), |c|^2 (branches,), float64."""
    gram: torch.Tensor
    cross: torch.Tensor
    true_sq: torch.Tensor

    @classmethod
    def zeros(cls, branches: int, width: int, size: int, device) -> "Moments":
        z = dict(dtype=torch.float64, device=device)
        return cls(torch.zeros(branches, size, size, **z), torch.zeros(branches, width, size, **z),
                   torch.zeros(branches, **z))

    def add(self, b: int, features: torch.Tensor, correction: torch.Tensor, gram: torch.Tensor | None = None):
        """Branch b's features (N, k) against its correction (N, d), float64; `gram`: features^T features when
        the caller has it (features shared by all branches: formed once per batch)."""
        self.gram[b] += features.t() @ features if gram is None else gram
        self.cross[b] += correction.t() @ features
        self.true_sq[b] += correction.square().sum()


def ridge_solutions(m: Moments, ridges) -> torch.Tensor:
    """D = X (G + ridge * mean(diag G) I)^+ for every ridge, (len(ridges), branches, d, k); one eigensolve per
    branch serves every ridge. Ridge 0 is the minimum-norm least-squares solution (pseudo-inverse)."""
    w, V = torch.linalg.eigh(m.gram)  # (branches, k), (branches, k, k)
    scale = torch.diagonal(m.gram, dim1=1, dim2=2).mean(-1, keepdim=True)  # (branches, 1)
    # Eigenvalues below rounding of the largest are null directions, not signal to be inverted.
    cutoff = w.amax(-1, keepdim=True).clamp_min(0) * w.shape[-1] * torch.finfo(w.dtype).eps
    xv = m.cross @ V  # (branches, d, k)
    out = []
    for ridge in ridges:
        shifted = w + ridge * scale
        inverse = torch.where(shifted > cutoff, 1.0 / shifted.clamp_min(1e-300), torch.zeros_like(w))
        out.append((xv * inverse[:, None, :]) @ V.transpose(1, 2))
    return torch.stack(out)


def score(decoders: torch.Tensor, m: Moments) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized error |pred - c|^2 / |c|^2 and cosine per branch (NaN without a signal), from the statistics."""
    pred_sq = torch.einsum("bdk,bkl,bdl->b", decoders, m.gram, decoders)
    dot = (decoders * m.cross).sum((1, 2))
    signal = m.true_sq > 0
    nan = torch.full_like(dot, math.nan)
    error = torch.where(signal, (pred_sq - 2 * dot + m.true_sq) / m.true_sq.clamp_min(1e-300), nan)
    # A zero prediction has no direction: cosine 0 (not NaN), as it is no help.
    norms = (pred_sq.clamp_min(0) * m.true_sq).sqrt()
    cosine = torch.where(signal, torch.where(norms > 0, dot / norms.clamp_min(1e-300), torch.zeros_like(dot)), nan)
    return error, cosine


@dataclass
class FamilyFit:
    decoders: torch.Tensor  # (branches, d, k), as scored
    ridge: torch.Tensor  # (branches,), NaN for fixed decoders
    in_error: torch.Tensor
    in_cosine: torch.Tensor
    heldout_error: torch.Tensor
    heldout_cosine: torch.Tensor
    signal: torch.Tensor  # (branches,) bool: a non-zero correction in both the fit and the held-out batches


def fit_family(fit: Moments, held: Moments, ridges=RIDGES, fixed: torch.Tensor | None = None) -> FamilyFit:
    """Least-squares decoders on the fit statistics, the ridge chosen per branch by held-out error (so the
    held-out figures are a ceiling with one hyperparameter tuned on them); or `fixed` decoders scored as are."""
    branches = fit.true_sq.shape[0]
    if fixed is not None:
        decoders, ridge = fixed.double(), torch.full((branches,), math.nan, dtype=torch.float64)
    else:
        candidates = ridge_solutions(fit, ridges)
        errors = torch.stack([score(D, held)[0] for D in candidates])  # (ridges, branches)
        best = torch.nan_to_num(errors, nan=math.inf).argmin(0)
        decoders = candidates[best, torch.arange(branches, device=best.device)]
        ridge = torch.tensor(ridges, dtype=torch.float64)[best.cpu()]
    in_error, in_cosine = score(decoders, fit)
    heldout_error, heldout_cosine = score(decoders, held)
    signal = (fit.true_sq > 0) & (held.true_sq > 0)
    return FamilyFit(decoders, ridge, in_error, in_cosine, heldout_error, heldout_cosine, signal)


# ---- the measurement ---------------------------------------------------------------------------------------

@dataclass
class Ceiling:
    families: dict  # name -> CodeFamily | FullFamily
    fits: dict[str, FamilyFit]
    branch_names: list[str]
    state: dict = field(default_factory=dict)


def ceiling(model: GPT, batches: list[tuple[torch.Tensor, torch.Tensor]], credit: CreditConfig, seed: int,
            trained: Predictor | torch.Tensor | None = None, autocast=None, loss_chunk: int = 8_192, ridges=RIDGES,
            sketch_ranks=()) -> Ceiling:
    """The families' ceilings at this model state: fit on batches[:-1], scored on batches[-1]; with
    `sketch_ranks`, beside them the sketched product at those ranks (SketchFamily), which needs no fit.

    Two passes: the seed families' P needs e's second moment over all fit batches before any of their features
    exist, and keeping the batches' (B, T, d) errors instead would grow memory with K. The first pass costs
    K-1 more forward passes and head backwards (it stops at the tap); only the token ids are kept between."""
    if len(batches) < 2:
        raise config_mod.ConfigError("the ceiling needs at least 2 micro-batches (fit on K-1, score on 1)")
    record = lambda *batch, **kw: record_batch(model, *batch, autocast, loss_chunk, **kw)  # noqa: E731
    d, branches = model.cfg.width, model.cfg.branches
    device = batches[0][0].device
    second = torch.zeros(d, d, dtype=torch.float64, device=device)  # sum over fit tokens of e e^T
    for inputs, targets in batches[:-1]:
        e = record(inputs, targets, with_corrections=False).e.double().flatten(0, 1)
        second += e.t() @ e
    families = build_families(model.cfg, credit, seed, second, trained) | sketch_families(model, sketch_ranks)
    moments = {name: [Moments.zeros(branches, d, fam.size, device) for _ in range(2)]  # [fit, held-out]
               for name, fam in families.items()}
    for i, (inputs, targets) in enumerate(batches):
        rec = record(inputs, targets)
        held = i == len(batches) - 1
        features = {name: fam.features(rec) for name, fam in families.items()}
        grams: dict = {}  # name -> the Gram of a family whose features all branches share
        for b in range(branches):  # branch-outer: one float64 correction and one branch's features at a time
            c = rec.corrections[b].double().flatten(0, 1)  # (N, d)
            for name, of_branch in features.items():
                f = of_branch(b)
                if families[name].shared and name not in grams:
                    grams[name] = f.t() @ f
                moments[name][held].add(b, f, c, grams.get(name))
        del rec, features, grams
    fits = {name: fit_family(*moments[name], ridges, fixed=families[name].decoders) for name in families}
    return Ceiling(families, fits, model.branch_names())


def _number(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None  # JSON has no NaN: a branch without signal has no score


def family_summary(f: FamilyFit) -> dict:
    """Means over the branches with a signal (None when there is none: nothing to fit yet)."""
    pick = lambda t: _number(t[f.signal].mean()) if bool(f.signal.any()) else None  # noqa: E731
    return {"heldout_cosine": pick(f.heldout_cosine), "heldout_error": pick(f.heldout_error),
            "in_cosine": pick(f.in_cosine), "in_error": pick(f.in_error)}


def to_json(result: Ceiling) -> dict:
    families = {}
    for name, f in result.fits.items():
        rows = [{"branch": branch, "in_cosine": _number(f.in_cosine[b]), "in_error": _number(f.in_error[b]),
                 "heldout_cosine": _number(f.heldout_cosine[b]), "heldout_error": _number(f.heldout_error[b]),
                 "ridge": _number(f.ridge[b]) if f.signal[b] else None}
                for b, branch in enumerate(result.branch_names)]
        families[name] = family_summary(f) | {"features": int(f.decoders.shape[-1]), "branches": rows}
    return {"families": families, "state": result.state}


# ---- the model state ---------------------------------------------------------------------------------------

def _run_config(run: Path) -> Config:
    if not (run / "config.json").exists():
        raise config_mod.ConfigError(f"{run} is not a training record (no config.json)")
    cfg = Config.from_dict(read_json(run / "config.json"))
    config_mod.validate(cfg)
    return cfg


def model_state(args):
    """(trainer at the state, where its predictor came from or None, state record). The trainer's loader is
    positioned after the state (a checkpoint's or --updates' data position), or fresh for a bare model.pt."""
    from creditlab.train import Trainer, newest_readable_checkpoint

    if (args.run is None) == (args.updates is None):
        raise config_mod.ConfigError("ceiling needs exactly one of --run RUN and --updates N")
    if args.batches < 2:
        raise config_mod.ConfigError(f"--batches {args.batches}: need at least 2 (fit on K-1, score on the last)")
    if args.run is not None:
        if args.overrides or args.preset is not None:
            raise config_mod.ConfigError("--run takes its config from the run's config.json; drop --preset and --set")
        run = Path(args.run)
        if run.is_file():  # one checkpoint of a run
            if not (run.name.startswith("checkpoint_") and run.suffix == ".pt"):
                raise config_mod.ConfigError(f"--run {run}: give a run folder or one of its checkpoint_*.pt files")
            run, checkpoints = run.parent, [run]
        else:
            checkpoints = sorted(run.glob("checkpoint_*.pt"))
        cfg = _run_config(run)
        if not checkpoints and not (run / "model.pt").exists():
            raise config_mod.ConfigError(f"{run} has no model.pt and no checkpoint_*.pt: no model state to measure")
        trainer = Trainer(cfg)
        if checkpoints:
            checkpoint = newest_readable_checkpoint(checkpoints, cfg.to_dict(),
                                                    say=lambda line: print(line, file=sys.stderr))
            trainer.load_checkpoint(checkpoint)
            origin, loaded = "checkpoint", checkpoint["_name"]
        else:
            saved = torch.load(run / "model.pt", map_location=trainer.runtime.device, weights_only=True)
            trainer.model.load_state_dict(saved["model"])
            trainer.update_index = int(saved.get("update", 0))
            origin, loaded = None, "model.pt"  # the source's state is not in model.pt
        state = {"run": str(run), "loaded": loaded, "updates": None, "preset": None, "overrides": []}
    else:
        if args.updates < 0:
            raise config_mod.ConfigError(f"--updates {args.updates}: give a count >= 0")
        preset = args.preset or "tiny"
        cfg = config_mod.load(preset, args.overrides)
        # Native updates are the exact source's: the model's init and data order do not depend on the source,
        # and an untaught predictor would only be the configured init, so `trained` is left out.
        native = copy.deepcopy(cfg)
        native.credit.source = "exact"
        trainer = Trainer(native)
        for _ in range(args.updates):
            trainer.train_update()
        origin = None
        state = {"run": None, "loaded": None, "updates": args.updates, "preset": preset,
                 "overrides": list(args.overrides)}
    trained = None
    if origin and isinstance(trainer.source, LearnedSource):
        trained = trainer.source.predictor
    elif origin and isinstance(trainer.source, FittedFeedbackSource):
        trained = trainer.source.decoders
    state |= {"update": trainer.update_index, "source": cfg.credit.source,
              "trained": origin if trained is not None else None}
    return trainer, trained, state


def measure(args) -> Ceiling:
    trainer, trained, state = model_state(args)
    cfg = trainer.cfg
    position = trainer.loader.state_dict().get("position")  # the first measured micro-batch of TRAIN
    batches = [trainer._batch() for _ in range(args.batches)]  # noqa: SLF001 - the trainer's own data path
    result = ceiling(trainer.model, batches, cfg.credit, cfg.train.seed, trained, trainer.runtime.autocast(),
                     cfg.train.loss_chunk, sketch_ranks=args.sketch or ())
    B, T = batches[0][0].shape
    result.state = state | {"batches": args.batches, "fit_batches": args.batches - 1, "tokens": args.batches * B * T,
                            "data_position": position, "rank": cfg.credit.rank, "ridges": list(RIDGES),
                            "device": str(trainer.runtime.device)}
    return result


# ---- output ------------------------------------------------------------------------------------------------

def _cell(x, width: int = 8) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.3f}"


def table(report: dict) -> list[str]:
    fams = report["families"]
    s = report["state"]
    where = s["run"] or f"{s['updates']} native updates from {s['preset']}"
    lines = [f"fit ceiling at update {s['update']} ({where}); fit on {s['fit_batches']} micro-batches, "
             f"scored on 1 ({s['tokens']:,} tokens); normalized error |pred-c|^2/|c|^2, cosine; "
             f"means over branches with a non-zero correction (-: none)",
             f"{'family':<14} {'features':>8} {'held cos':>8} {'held err':>8} {'in cos':>8} {'in err':>8}"]
    for name, f in fams.items():
        lines.append(f"{name:<14} {f['features']:>8} {_cell(f['heldout_cosine'])} {_cell(f['heldout_error'])} "
                     f"{_cell(f['in_cosine'])} {_cell(f['in_error'])}")
    names = list(fams)
    lines += ["", "held-out cosine per branch", f"{'branch':<14} " + " ".join(f"{n[:13]:>13}" for n in names)]
    for b, row in enumerate(next(iter(fams.values()))["branches"]):
        lines.append(f"{row['branch']:<14} " + " ".join(_cell(fams[n]["branches"][b]["heldout_cosine"], 13)
                                                        for n in names))
    return lines


def figure(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = report["families"]
    branches = [row["branch"] for row in next(iter(fams.values()))["branches"]]
    width = 0.8 / len(fams)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(branches) * len(fams) / 3), 4.2))
    for i, (name, f) in enumerate(fams.items()):
        values = [math.nan if row["heldout_cosine"] is None else row["heldout_cosine"] for row in f["branches"]]
        ax.bar([b + (i - (len(fams) - 1) / 2) * width for b in range(len(branches))], values, width, label=name)
    ax.set_xticks(range(len(branches)), branches, rotation=60, ha="right", fontsize=7)
    ax.set(ylabel="held-out cosine", title=f"fit ceiling per branch at update {report['state']['update']}")
    ax.axhline(0, color="black", lw=0.5)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_ceiling(args) -> int:
    from creditlab.protocol.records import write_once

    out = Path(args.out)
    for name in ("ceiling.json", "ceiling.png"):
        if (out / name).exists():
            raise config_mod.ConfigError(f"{out / name} exists and records are append-only: choose a new --out")
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)  # before the measurement: a file in the way fails now, not after it
    try:
        report = to_json(measure(args))
    except BaseException:
        if made:
            out.rmdir()  # bad input leaves no folder behind
        raise
    write_once(out / "ceiling.json", report)
    figure(report, out / "ceiling.png")
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(table(report)))
        print(f"written: {out / 'ceiling.json'}, {out / 'ceiling.png'}", file=sys.stderr)
    return 0


def add_commands(sub, config_args) -> None:
    p = sub.add_parser("ceiling", help="least-squares fit ceiling of each predictor family per branch at a model "
                                       "state: what the family can represent, apart from how well training fits it")
    config_args(p)
    p.set_defaults(preset=None)  # None: not given (with --run the config is the run's); tiny for --updates
    p.add_argument("--run", default=None, help="a run folder (its newest checkpoint_*.pt, else its model.pt), or one "
                                               "checkpoint_*.pt of a run")
    p.add_argument("--updates", type=int, default=None, help="instead: N native updates from the preset's init")
    p.add_argument("--batches", type=int, default=4, help="TRAIN micro-batches K: fit on K-1, score on 1 (default 4)")
    p.add_argument("--sketch", type=_ranks, default=SKETCH_RANKS, metavar="K,K,...|none",
                   help="the sketched product (credit.source=sketch) at these ranks, as families sketchK beside the "
                        f"fitted ones (default {','.join(map(str, SKETCH_RANKS))}, each capped at the width)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", required=True, help="folder for ceiling.json and ceiling.png")
    p.set_defaults(func=cmd_ceiling)


def _ranks(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    try:
        ranks = tuple(int(k) for k in text.split(","))
    except ValueError:
        ranks = ()
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive ranks")
    return ranks


__all__ = ["ceiling", "record_batch", "Moments", "ridge_solutions", "score", "fit_family", "principal_projection",
           "sketch_families", "SketchFamily", "to_json", "table", "figure", "add_commands", "FAMILIES", "RIDGES",
           "SKETCH_RANKS"]
