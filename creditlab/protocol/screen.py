"""The resource screen: native and synthetic arms, side by side, under one admission (or exploratory).

Two arms of `screen.updates` updates each, seed `train.seed`, in one process on one device:

* native: `credit.source=exact`;
* synthetic: the candidate source with `credit.schedule=never` (for `learned`: zero decoders, every predictor
  operation executing, no fitting). The candidate is `credit.source` of the config, or `learned` when the
  config says `exact` (the presets do); another source (`zero`, `dfa`, ...) makes a stand-in screen, marked so.

The arms run interleaved, through the arms runner benchmarks/arms.py uses too (creditlab/experiments/arms_runner.py): both
are built first, then each round runs one update of each, the order rotated each round, so a host or GPU whose
speed drifts during the screen slows both arms alike instead of whichever ran second.

Both arms start from the same state-dict bytes (the SHA256 of each arm's initial state dict is recorded and must
be equal), read the same TRAIN micro-batches (a SHA256 of every micro-batch's tokens is recorded per arm and the
sequences must be equal; checked as they are read) and use the same optimizers. Per update: synchronized wall
time, loss, peak allocated memory (the arm's own: the other arm's resident bytes are taken off) and the round
and position it ran in. The screen also records the device's free memory before it starts and the occupied
device-seconds, and stops once `screen.cap_gpu_s` is exceeded. `screen.memory_cap_mib` caps this process's
GPU memory to emulate a smaller card.

An out-of-memory error in either arm is a recorded capacity miss and stops the screen: message, allocator
figures, a memory snapshot (memory history is recorded for the whole screen on CUDA) and the exact traceback.
Rows are appended as they are measured, so nothing measured before a failure is lost. The gates are gates.py's.

Only a screen under an admission, on a device that can decide (`cannot_decide`: not the CPU), records a
verdict. Any other is exploratory: it reports what the gates say about what it measured (`measured`) and
records no verdict. Under an admission, a screen is known to it from its start (screens.jsonl); one that
never finished, or failed, makes the next screen a retry that names it.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import pickle
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from creditlab import config as config_mod
from creditlab import runtime as rt
from creditlab.experiments.arms_runner import (OwnMemory, Step, cuda_allocated, keep_compiled_side_by_side, round_ratio,
                                   run_rounds)
from creditlab.config import Config
from creditlab.protocol import admission as adm_mod
from creditlab.protocol.gates import EXIT_ERROR, EXIT_INVALID, ArmSummary, Gates, decide
from creditlab.protocol.records import append_jsonl, copy_once, new_record_dir, write_bytes_once, write_once

ARMS = ("native", "synthetic")
CANDIDATE = "learned"
HISTORY_ENTRIES = 100_000
ALLOCATOR_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                  "reserved_bytes.all.peak", "active_bytes.all.current", "inactive_split_bytes.all.current",
                  "requested_bytes.all.current", "num_alloc_retries", "num_ooms", "num_device_alloc",
                  "num_device_free")


class ScreenRefused(RuntimeError):
    """The screen did not start: the message says why (no record is written)."""


class IntegrityError(RuntimeError):
    """A premise of the screen failed (initialization or inputs differ between arms, the synthetic arm did not
    run synthetic updates, the predictor was fitted): the screen is invalid and reaches no verdict."""


@dataclass
class Hooks:
    """Ways to perturb a screen in tests; all None in a real screen.

    model(arm, model): called after the shared initial state is loaded into the arm's model.
    loader(arm, loader) -> loader: replaces the arm's TRAIN loader.
    micro_batch(arm, update, micro): called before each micro-batch is read; may raise (an injected
        torch.OutOfMemoryError, say).
    clock() -> seconds: the clock of occupied device-seconds (default time.perf_counter)."""

    model: Callable[[str, torch.nn.Module], None] | None = None
    loader: Callable[[str, Any], Any] | None = None
    micro_batch: Callable[[str, int, int], None] | None = None
    clock: Callable[[], float] | None = None


# ---- identity of initialization and inputs -----------------------------------------------------------------

def state_sha256(state: dict[str, torch.Tensor] | torch.nn.Module) -> str:
    """SHA256 over a state dict's names, dtypes, shapes and bytes, in its order."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    h = hashlib.sha256()
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokens_sha256(batch: torch.Tensor) -> str:
    t = batch.detach().cpu().contiguous()
    return hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
                          ).hexdigest()


def compare_sequences(reference: list[str], other: list[str], complete: bool = True) -> dict:
    """Whether two arms read the same micro-batches: equal over the micro-batches both read, and (when both
    arms completed) equally many. Returns what was compared and the first difference."""
    n = min(len(reference), len(other))
    first = next((i for i in range(n) if reference[i] != other[i]), None)
    if first is None and complete and len(reference) != len(other):
        first = n
    return {"match": first is None, "compared": n, "reference": len(reference), "other": len(other),
            "first_difference": first}


class InputRecorder:
    """A TRAIN loader that hashes every micro-batch it hands out, and checks it against what the other arms (its
    peers) read at the same position, as it goes. Arms run interleaved, so either may be the first to read a
    micro-batch: whichever reads it second checks it."""

    def __init__(self, arm: str, loader, grad_accum: int, hook: Callable[[str, int, int], None] | None = None):
        self.arm, self.loader, self.grad_accum, self.hook = arm, loader, grad_accum, hook
        self.hashes: list[str] = []
        self.peers: list["InputRecorder"] = []

    @property
    def position(self) -> tuple[int, int]:
        return divmod(len(self.hashes), self.grad_accum)  # (update, micro) of the next micro-batch

    def next(self) -> torch.Tensor:
        if self.hook is not None:
            self.hook(self.arm, *self.position)
        batch = self.loader.next()
        digest = tokens_sha256(batch)
        i = len(self.hashes)
        self.hashes.append(digest)
        for peer in self.peers:
            if i < len(peer.hashes) and peer.hashes[i] != digest:
                raise IntegrityError(f"identical inputs violated: {self.arm} micro-batch {i} (update "
                                     f"{i // self.grad_accum + 1}, micro {i % self.grad_accum}) hashes to "
                                     f"{digest[:16]}, {peer.arm} read {peer.hashes[i][:16]}")
        return batch


# ---- arm configs -------------------------------------------------------------------------------------------

def synthetic_source_of(cfg: Config) -> str:
    return CANDIDATE if cfg.credit.source == "exact" else cfg.credit.source


def arm_label(arm: str, synthetic_source: str) -> str:
    """The screen's two roles as arms of the one registry (creditlab/experiments/arms.py): native backprop, and the synthetic
    source with no teacher update (its predictor never fitted: all its operations, zero decoders)."""
    return "native" if arm == "native" else f"{synthetic_source}@credit.schedule=never"


def arm_overrides(arm: str, synthetic_source: str) -> list[str]:
    from creditlab.experiments.arms import parse_arm
    from creditlab.credit import registry

    registry.source_class(synthetic_source)  # an unknown source is named as one (a ValueError listing them)
    return list(parse_arm(arm_label(arm, synthetic_source)).overrides)


def arm_config(cfg: Config, arm: str, synthetic_source: str) -> Config:
    """The arm's config: the screen's seed and update count, and the arm's credit source."""
    c = copy.deepcopy(cfg)
    c.train.updates = cfg.screen.updates
    for item in arm_overrides(arm, synthetic_source):
        key, _, value = item.partition("=")
        config_mod._assign(c, key, value)
    config_mod.validate(c)
    return c


def preflight(cfg: Config, synthetic_source: str) -> None:
    """Refuse a screen that cannot produce a verdict, before it occupies a device."""
    from creditlab.credit import make_source

    if cfg.screen.updates < 1:
        raise ScreenRefused("screen.updates must be positive")
    if rt.launched_processes() > 1:
        raise ScreenRefused("the screen runs its two arms in one process on one device; start it without torchrun")
    if synthetic_source == "exact":
        raise ScreenRefused("the synthetic arm needs a source that omits the 16 products, not exact")
    try:
        source = make_source(arm_config(cfg, "synthetic", synthetic_source))
    except ImportError as exc:
        raise ScreenRefused(f"credit.source={synthetic_source} is not available in this package ({exc}); a "
                            "stand-in screen runs with --set credit.source=zero") from None
    except (ValueError, config_mod.ConfigError) as exc:
        raise ScreenRefused(str(exc)) from None
    if not source.omits:
        raise ScreenRefused(f"credit.source={synthetic_source} omits nothing: it cannot be the synthetic arm")


# ---- memory ------------------------------------------------------------------------------------------------

def _mib(n: float | int | None) -> float | None:
    return None if n is None else n / 2**20


def free_memory_mib(runtime) -> dict | None:
    if not runtime.is_cuda:
        return None
    free, total = torch.cuda.mem_get_info(runtime.device)
    return {"free_mib": _mib(free), "total_mib": _mib(total)}


def apply_memory_cap(cap_mib: float, runtime) -> dict:
    """Cap this process's GPU memory at cap_mib (a fraction of the card's total), to emulate a smaller card."""
    if cap_mib <= 0:
        return {"memory_cap_mib": None, "applied": False, "why": "screen.memory_cap_mib is 0"}
    if not runtime.is_cuda:
        return {"memory_cap_mib": cap_mib, "applied": False, "why": "no GPU: the cap applies to CUDA memory"}
    total = torch.cuda.get_device_properties(runtime.device).total_memory / 2**20
    if cap_mib >= total:
        return {"memory_cap_mib": cap_mib, "applied": False, "total_mib": total,
                "why": "the cap is not below the card's total memory"}
    fraction = cap_mib / total
    torch.cuda.set_per_process_memory_fraction(fraction, runtime.device)
    return {"memory_cap_mib": cap_mib, "applied": True, "total_mib": total, "fraction": fraction,
            "how": "torch.cuda.set_per_process_memory_fraction: limits the caching allocator; the CUDA context "
                   "and memory outside PyTorch's allocator are not counted"}


def allocator_figures(runtime) -> dict | None:
    if not runtime.is_cuda:
        return None
    stats = torch.cuda.memory_stats(runtime.device)
    figures = {}
    for key in ALLOCATOR_KEYS:
        value = stats.get(key)
        if key.endswith((".current", ".peak")) and value is not None:
            figures[key.replace("_bytes", "_mib")] = _mib(value)
        else:
            figures[key] = value
    figures.update(free_memory_mib(runtime) or {})
    return figures


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


# ---- the screen --------------------------------------------------------------------------------------------

@dataclass
class ArmRecord:
    name: str
    source: str
    planned: int
    rows: list[dict] = field(default_factory=list)
    init_sha256: str | None = None
    inputs: list[str] = field(default_factory=list)
    oom: dict | None = None
    memory_history: bool = False
    free_before: dict | None = None
    checks: dict = field(default_factory=dict)

    def summary(self) -> ArmSummary:
        return ArmSummary(self.name, self.planned, tuple(r["seconds"] for r in self.rows),
                          tuple(r["peak_allocated_mib"] for r in self.rows),
                          tuple(r["peak_reserved_mib"] for r in self.rows),
                          None if self.oom is None else self.oom["update"])


@dataclass
class ScreenOutcome:
    exit_code: int
    record_dir: Path
    result: dict

    @property
    def verdict(self) -> str | None:
        """The final verdict; None for an exploratory screen (see `measured`) or one that failed."""
        return self.result.get("verdict")

    @property
    def measured(self) -> str | None:
        """What the gates say about what was measured, final or not."""
        return self.result.get("measured")


class _Screen:
    """Both arms built first from one initial state, then run interleaved through the arms runner: one update
    of each per round, the order rotated each round, so a busy host or a drifting GPU slows both alike."""

    def __init__(self, cfg: Config, record: Path, runtime, synthetic_source: str, hooks: Hooks, log: TextIO,
                 clock_start: float, history_entries: int):
        self.cfg, self.record, self.runtime = cfg, record, runtime
        self.synthetic_source, self.hooks, self.log = synthetic_source, hooks, log
        self.clock_start, self.history_entries = clock_start, history_entries
        self.gates = Gates.from_config(cfg)
        self.cap_hit = False
        self.arms: dict[str, ArmRecord] = {}
        self.trainers: dict[str, Any] = {}
        self.recorders: dict[str, InputRecorder] = {}
        self.source_before: dict[str, str | None] = {}
        self.init_sha256: str | None = None
        self.init_state: dict | None = None
        self.memory = OwnMemory((lambda: cuda_allocated(runtime.device)) if runtime.is_cuda else None)
        self.memory_history = runtime.is_cuda and history_entries > 0

    def occupied(self) -> float:
        return (self.hooks.clock or time.perf_counter)() - self.clock_start

    @property
    def out_of_memory(self) -> bool:
        return any(r.oom for r in self.arms.values())

    def shared_initialization(self) -> None:
        from creditlab.train import build_model

        model = build_model(arm_config(self.cfg, "native", self.synthetic_source), self.runtime,
                            seed=self.cfg.train.seed)
        self.init_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        self.init_sha256 = state_sha256(self.init_state)
        del model

    def run(self) -> None:
        """Build both arms, then the rounds; stops at the first out-of-memory error or once over the cap."""
        if self.memory_history:
            # For the whole screen, so that both arms pay its cost alike and an out-of-memory error in either
            # leaves a snapshot. Stack traces of allocations only: recording them for frees too (context="all")
            # made eager backward passes fail inside the autograd engine (SystemError, torch 2.11 on an H200).
            torch.cuda.memory._record_memory_history("all", context="alloc", stacks="all",
                                                     max_entries=self.history_entries)
        try:
            if self.runtime.compile:
                keep_compiled_side_by_side()
            for arm in ARMS:
                if not self.build_arm(arm):
                    return
            run_rounds(ARMS, self.cfg.screen.updates, self.step, stop=self.should_stop)
            for arm in ARMS:
                self._check_source_unchanged(arm)
        finally:
            if self.memory_history:
                torch.cuda.memory._record_memory_history(enabled=None)
            self.trainers.clear()
            gc.collect()
            if self.runtime.is_cuda:
                torch.cuda.empty_cache()

    def should_stop(self) -> bool:
        if not self.cap_hit and self.occupied() > self.gates.cap_s:
            self.cap_hit = True
        return self.cap_hit or self.out_of_memory

    def build_arm(self, arm: str) -> bool:
        """The arm's model from the shared initial state, its loader and trainer; False if it ran out of memory."""
        from creditlab import data
        from creditlab.train import Trainer, build_model

        cfg = arm_config(self.cfg, arm, self.synthetic_source)
        runtime = self.runtime
        rec = ArmRecord(arm, cfg.credit.source, self.cfg.screen.updates, free_before=free_memory_mib(runtime),
                        memory_history=self.memory_history)
        self.arms[arm] = rec

        def make():
            torch.manual_seed(self.cfg.train.seed)
            model = build_model(cfg, runtime, seed=self.cfg.train.seed)
            model.load_state_dict(self.init_state)
            if self.hooks.model is not None:
                self.hooks.model(arm, model)
            rec.init_sha256 = state_sha256(model)
            if rec.init_sha256 != self.init_sha256:
                raise IntegrityError(f"identical initialization violated: the {arm} arm's initial state dict "
                                     f"hashes to {rec.init_sha256[:16]}, the shared one to {self.init_sha256[:16]}")
            loader = data.make_loader(cfg, "train")
            if self.hooks.loader is not None:
                loader = self.hooks.loader(arm, loader)
            recorder = InputRecorder(arm, loader, cfg.train.grad_accum, hook=self.hooks.micro_batch)
            for other in self.recorders.values():  # each arm checks its inputs against the other's
                recorder.peers.append(other)
                other.peers.append(recorder)
            self.recorders[arm] = recorder
            rec.inputs = recorder.hashes
            return Trainer(cfg, runtime, model=model, loader=recorder)

        try:
            trainer = self.memory.build(arm, make)
            self.source_before[arm] = self._source_checks(arm, trainer, rec)
            self.trainers[arm] = trainer
            return True
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory error is caught here
            if not is_out_of_memory(exc):
                raise
            self._out_of_memory(arm, exc, -1, None)
            return False

    def step(self, at: Step) -> bool:
        """One update of one arm, its row appended to the record as soon as it is measured."""
        from creditlab.train import row_dict

        arm, trainer, recorder = at.arm, self.trainers[at.arm], self.recorders[at.arm]
        rec, planned, grad_accum = self.arms[arm], self.cfg.screen.updates, self.cfg.train.grad_accum
        try:
            row = self.memory.update(arm, trainer.train_update)
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory error is caught here
            if not is_out_of_memory(exc):
                raise
            self._out_of_memory(arm, exc, trainer.update_index, recorder.position[1])
            return False
        expected = "native" if arm == "native" else "synthetic"
        if row.kind != expected:
            raise IntegrityError(f"the {arm} arm ran a {row.kind} update (update {row.update + 1}); every update "
                                 f"of this arm must be {expected}")
        first = row.update * grad_accum
        out = {"arm": arm, **row_dict(row), "round": at.round, "position": at.position,
               "occupied_s": self.occupied(), "inputs_sha256": recorder.hashes[first:first + grad_accum],
               "time": _now()}
        append_jsonl(self.record / "rows.jsonl", out)
        rec.rows.append(out)
        print(f"{arm:>9} | {row.line(planned)} | occupied {out['occupied_s']:,.1f} s", file=self.log, flush=True)
        if out["occupied_s"] > self.gates.cap_s:
            self.cap_hit = True
            print(f"{arm:>9} | cap of {self.gates.cap_s:,.0f} occupied device-seconds exceeded: stopping",
                  file=self.log, flush=True)
        return True

    def _out_of_memory(self, arm: str, exc: BaseException, update: int, micro: int | None) -> None:
        self.arms[arm].oom = self._capture_oom(arm, exc, update, micro, traceback.format_exc())
        print(f"{arm:>9} | out of memory at update {update + 1}: {str(exc).splitlines()[0][:200]}",
              file=self.log, flush=True)

    def _check_source_unchanged(self, arm: str) -> None:
        before, trainer = self.source_before.get(arm), self.trainers.get(arm)
        if before is None or trainer is None:
            return
        after = state_sha256(dict(trainer.source.named_parameters()))
        self.arms[arm].checks["predictor_unchanged"] = after == before
        if after != before:
            raise IntegrityError("the synthetic arm changed the credit source's parameters: it must not fit "
                                 "(credit.schedule=never)")

    def _source_checks(self, arm: str, trainer, rec: ArmRecord) -> str | None:
        """For the synthetic arm: its decoders start at zero, and a hash of the source's parameters (to show
        afterwards that nothing was fitted). None for the native arm."""
        if arm == "native":
            if trainer.source.omits:
                raise IntegrityError("the native arm's source omits products")
            return None
        if not trainer.source.omits:
            raise IntegrityError(f"the synthetic arm's source ({trainer.source.name}) omits nothing")
        params = dict(trainer.source.named_parameters())
        decoders = {n: float(p.detach().abs().max()) if p.numel() else 0.0 for n, p in params.items()
                    if "decoder" in n}
        rec.checks.update(source=trainer.source.name, source_parameters=sum(p.numel() for p in params.values()),
                          decoders_max_abs=decoders, decoders_zero=all(v == 0.0 for v in decoders.values()))
        if not rec.checks["decoders_zero"]:
            raise IntegrityError(f"the synthetic arm's decoders are not zero: {decoders}")
        return state_sha256(params)

    def _capture_oom(self, arm: str, exc: BaseException, update: int, micro: int | None, tb: str) -> dict:
        runtime = self.runtime
        snapshot_name = None
        if runtime.is_cuda:
            snapshot_name = f"memory_snapshot_{arm}.pickle"
            snap = torch.cuda.memory._snapshot()
            write_bytes_once(self.record / snapshot_name, pickle.dumps(snap))
        else:
            snapshot_name = f"memory_snapshot_{arm}.json"
            write_once(self.record / snapshot_name,
                       {"available": False, "why": "no CUDA device: the allocator's memory snapshot "
                                                   "(torch.cuda.memory._snapshot) exists only on CUDA"})
        write_once(self.record / "traceback.txt", tb)  # the screen stops at its first out-of-memory error
        return {"arm": arm, "update": update, "micro_batch": micro, "type": type(exc).__name__,
                "message": str(exc), "allocator": allocator_figures(runtime),
                "snapshot": snapshot_name, "memory_history": self.arms[arm].memory_history,
                "traceback": "traceback.txt", "occupied_s": self.occupied()}


def _copy_sources(record: Path, admission: adm_mod.Admission | None, root: Path) -> dict:
    """Copy the frozen files (admitted: the live files the verification just matched, the admission keeping
    their hashes only) or the current package sources (exploratory) into the record."""
    listing = []
    if admission is not None:
        cfg = admission.config()
        for f in admission.files:
            if f.role == "data_shard":  # the admission keeps their hashes only (verified before this)
                listing.append({"path": f.path, "role": f.role, "sha256": f.sha256, "copied": False})
                continue
            sha = copy_once(adm_mod.live_path(admission, f, root, cfg), record / "frozen" / f.path)
            if sha != f.sha256:
                raise adm_mod.AdmissionError(f"{f.path} changed while the screen started (SHA256 {sha[:16]}, "
                                             f"admitted {f.sha256[:16]}); restore it or admit again")
            listing.append({"path": f.path, "role": f.role, "sha256": sha})
        folder = "frozen"
    else:
        for rel in adm_mod.source_paths(root):
            sha = copy_once(root / rel, record / "source" / rel)
            listing.append({"path": rel, "role": "source", "sha256": sha})
        folder = "source"
    return {"folder": folder, "files": listing}


def _arm_result(rec: ArmRecord, window: int) -> dict:
    s = rec.summary()
    return {"source": rec.source, "planned": rec.planned, "updates": s.completed,
            f"median_last{s.window(window)}_s": s.median_last(window),
            "peak_allocated_mib": s.peak_allocated, "peak_reserved_mib": s.peak_reserved,
            "first_update_s": s.seconds[0] if s.seconds else None,
            "last_loss": rec.rows[-1]["loss"] if rec.rows else None,
            "init_sha256": rec.init_sha256,
            "inputs": {"micro_batches": len(rec.inputs), "sha256": list(rec.inputs)},
            "free_before": rec.free_before, "memory_history": rec.memory_history,
            "checks": rec.checks, "oom": rec.oom}


def cannot_decide(runtime) -> str | None:
    """Why a screen on this device cannot reach a final verdict, or None when it can.

    On the CPU no device memory is measured (the peak gate is n/a) and the seconds are a shared host's, not
    the accelerator's the verdict is about: one config measured there read `pass` once and `timing_miss` seven
    times. Such a screen is exploratory: it reports what it measured and records no verdict."""
    if not runtime.is_cuda:
        return ("on the CPU: no device memory is measured and the timings are a host's, so the screen is "
                "exploratory and records no verdict")
    return None


def run_screen(cfg: Config, *, admission: adm_mod.Admission | None = None,
               verification: adm_mod.Verification | None = None, repair: str | None = None,
               synthetic_source: str | None = None, hooks: Hooks | None = None,
               root: str | Path | None = None, log: TextIO = sys.stderr,
               history_entries: int = HISTORY_ENTRIES) -> ScreenOutcome:
    """Run the screen of `cfg` and write its record; returns the exit code, record folder and result.

    Under an admission, `cfg` must be the admitted config and `verification` its passing verification (see
    `admitted_screen`, which does both). Only a screen under an admission on a device that can decide
    (`cannot_decide`) records a verdict; any other is exploratory. Raises ScreenRefused / AdmissionError when
    it does not start."""

    hooks = hooks or Hooks()
    root = Path(root) if root is not None else adm_mod.package_root()
    synthetic_source = synthetic_source or synthetic_source_of(cfg)
    if admission is None and repair is not None:
        raise ScreenRefused("--repair applies to a screen under an admission that already has a verdict")
    if admission is not None and (verification is None or not verification.ok):
        raise ScreenRefused("a screen under an admission needs its passing verification")
    preflight(cfg, synthetic_source)
    permission = adm_mod.may_screen(admission, repair) if admission is not None else None

    clock_start = (hooks.clock or time.perf_counter)()
    runtime = rt.resolve(cfg.train)
    exploratory = "no admission: the screen decides nothing under the protocol" if admission is None \
        else cannot_decide(runtime)
    final = exploratory is None
    retry_of = permission["retry_of"] if permission and final else []
    memory_cap = apply_memory_cap(cfg.screen.memory_cap_mib, runtime)
    prelaunch = free_memory_mib(runtime)
    record = new_record_dir(cfg.train.out_dir, "screen")
    if admission is not None:
        # First, so that a screen killed at any later point is still known to the admission: started, and
        # never finished; the next screen under it is then recorded as a retry of this one.
        adm_mod.record_screen(admission, {"record_dir": str(record), "time": _now(), "repair": repair,
                                          "final": final, "retry_of": [a["record_dir"] for a in retry_of]})
    mode = "admitted" if final else "exploratory"
    stand_in = synthetic_source != CANDIDATE
    meta = {"mode": mode, "admission": admission.id if admission else None, "final": final,
            "exploratory": exploratory, "synthetic_source": synthetic_source, "stand_in": stand_in,
            "repair": repair, "retry_of": retry_of}
    write_once(record / "rows.jsonl", "")  # appended per update as it is measured
    write_once(record / "config.json", cfg.to_dict())
    write_once(record / "arms.json", {arm: {"overrides": arm_overrides(arm, synthetic_source),
                                            "config": arm_config(cfg, arm, synthetic_source).to_dict()}
                                      for arm in ARMS})
    env = rt.environment(runtime)
    write_once(record / "env.json", {**env, **meta, "prelaunch": prelaunch, "memory_cap": memory_cap})
    write_once(record / "admission.json", {**meta, "verification": verification.to_json() if verification else None,
                                           "earlier_verdicts": permission["earlier_verdicts"] if permission else [],
                                           "unfinished_screens": permission["unfinished_screens"]
                                           if permission else []})
    sources = _copy_sources(record, admission, root)
    write_once(record / "sources.json", sources)

    print(f"screen {record.name}: {mode}"
          + (f" under admission {admission.id[:16]} ({verification.summary()})" if admission else "")
          + (f", retry of {', '.join(a['record_dir'] for a in retry_of)}" if retry_of else "")
          + f"; device {runtime.device}; arms native (exact) and synthetic ({synthetic_source}, schedule never)"
          + (" [stand-in source]" if stand_in else "") + f", interleaved; {cfg.screen.updates} updates each"
          + (f" ({exploratory})" if exploratory and admission is not None else ""),
          file=log, flush=True)
    screen = _Screen(cfg, record, runtime, synthetic_source, hooks, log, clock_start, history_entries)
    base = {"record_dir": str(record), "run_id": record.name, **meta, "schedule": "interleaved",
            "device": str(runtime.device), "prelaunch": prelaunch, "memory_cap": memory_cap, "seed": cfg.train.seed,
            "updates": cfg.screen.updates, "shape": {"micro_batch": cfg.train.micro_batch,
                                                     "seq_len": cfg.model.seq_len, "grad_accum": cfg.train.grad_accum},
            "sources": {"folder": sources["folder"], "files": len(sources["files"])},
            "environment": {k: env.get(k) for k in ("gpu", "gpu_memory_mib", "driver", "cuda", "torch", "git_sha",
                                                     "git_dirty")},
            "verification": verification.summary() if verification else None}
    try:
        screen.shared_initialization()
        screen.run()
        occupied = screen.occupied()
        inputs = _input_check(screen)
        if not inputs["match"]:
            raise IntegrityError(f"identical inputs violated: the arms' micro-batch sequences differ at "
                                 f"{inputs['first_difference']} ({inputs['reference']} native, "
                                 f"{inputs['other']} synthetic)")
        summaries = {arm: (screen.arms[arm].summary() if arm in screen.arms else
                           ArmSummary(arm, cfg.screen.updates)) for arm in ARMS}
        decision = decide(summaries["native"], summaries["synthetic"], occupied, screen.gates,
                          device_memory=runtime.is_cuda, cap_hit=screen.cap_hit)
    except BaseException as exc:  # noqa: BLE001 - recorded, then reported as an exit code (or re-raised)
        tb = traceback.format_exc()
        invalid = isinstance(exc, IntegrityError)
        outcome = "invalid" if invalid else "error" if isinstance(exc, Exception) else "interrupted"
        write_once(record / "traceback.txt", tb)
        result = {**base, "verdict": None, "measured": None, "exit_code": EXIT_INVALID if invalid else EXIT_ERROR,
                  "invalid" if invalid else "error": f"{type(exc).__name__}: {exc}",
                  "occupied_s": screen.occupied(), "init_sha256": screen.init_sha256,
                  "arms": {name: _arm_result(rec, screen.gates.window) for name, rec in screen.arms.items()}}
        write_once(record / "result.json", result)
        from creditlab.protocol.screen_report import report_markdown
        write_once(record / "report.md", report_markdown(result, None))
        if admission is not None:
            adm_mod.record_finish(admission, {"record_dir": str(record), "time": _now(), "outcome": outcome})
        if not isinstance(exc, Exception):
            raise
        print(f"screen {'invalid' if invalid else 'failed'}: {type(exc).__name__}: {exc} "
              f"(traceback in {record / 'traceback.txt'})", file=log, flush=True)
        return ScreenOutcome(result["exit_code"], record, result)
    finally:
        if memory_cap.get("applied"):
            torch.cuda.set_per_process_memory_fraction(1.0, runtime.device)

    arms = {name: _arm_result(rec, screen.gates.window) for name, rec in screen.arms.items()}
    decided = decision.to_json()
    measured = decided.pop("verdict")
    # The exit code says what was measured, for both kinds; only a final screen names it a verdict.
    result = {**base, **decided, "measured": measured, "verdict": measured if final else None,
              "exit_code": decision.exit_code, "occupied_s": occupied, "cap_hit": screen.cap_hit,
              "gate_config": {"ratio_gate": screen.gates.ratio, "peak_gate_mib": cfg.screen.peak_gate_mib,
                              "cap_gpu_s": cfg.screen.cap_gpu_s, "window": screen.gates.window,
                              "cycle_gate": cfg.screen.cycle_gate},
              "identical_init": {"sha256": screen.init_sha256,
                                 "match": all(r.init_sha256 == screen.init_sha256 for r in screen.arms.values())},
              "identical_inputs": inputs, "arms": arms, "ratio_per_round": ratio_per_round(summaries)}
    write_once(record / "result.json", result)
    from creditlab.protocol.screen_report import report_markdown
    write_once(record / "report.md", report_markdown(result, decision))
    if admission is not None:
        if final:
            adm_mod.record_verdict(admission, {"verdict": decision.verdict, "ratio": decision.ratio,
                                               "record_dir": str(record), "time": _now(), "repair": repair,
                                               "stand_in": stand_in, "synthetic_source": synthetic_source,
                                               "retry_of": [a["record_dir"] for a in retry_of]})
        adm_mod.record_finish(admission, {"record_dir": str(record), "time": _now(),
                                          "outcome": measured if final else "exploratory", "measured": measured})
    print(decision.sentence if final else f"Exploratory, no verdict ({exploratory}). Measured: {decision.sentence}",
          file=log, flush=True)
    return ScreenOutcome(decision.exit_code, record, result)


def ratio_per_round(summaries: dict[str, ArmSummary]) -> dict | None:
    """Synthetic over native seconds per update in the same round, the median over the rounds from the third with
    its 95% bootstrap interval (arms_runner.round_ratio): beside the verdict, as information. The verdict reads the
    ratio of last-window medians, as the protocol defines it."""
    ratio = round_ratio(summaries["synthetic"].seconds, summaries["native"].seconds)
    if ratio is None:
        return None
    median, low, high, rounds = ratio
    return {"median": median, "low": low, "high": high, "rounds": rounds}


def _input_check(screen: _Screen) -> dict:
    native, synthetic = screen.arms.get("native"), screen.arms.get("synthetic")
    if native is None or synthetic is None:
        return {"match": True, "compared": 0, "reference": len(native.inputs) if native else 0,
                "other": 0, "first_difference": None, "note": "the synthetic arm did not run"}
    complete = native.summary().complete and synthetic.summary().complete
    return compare_sequences(native.inputs, synthetic.inputs, complete)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def admitted_screen(ref: str, out_dir: str | Path, *, repair: str | None = None, root: str | Path | None = None,
                    **kw) -> tuple[ScreenOutcome, adm_mod.Verification]:
    """Find an admission, verify every frozen file, hold it exclusively and screen its config."""
    admission = adm_mod.find(ref, out_dir)
    cfg, verification = adm_mod.verified_config(admission, root)
    with adm_mod.exclusive(admission):
        outcome = run_screen(cfg, admission=admission, verification=verification, repair=repair, root=root, **kw)
    return outcome, verification
