"""Training: one forward+backward step per micro-batch, the update, and the loop.

`Trainer.forward_backward` is the one place a forward and a backward pass happen, for every kind of update
(native, synthetic, teacher); which credit path runs inside it is the credit source's business (credit/), and
which kind each update is, the schedule's (credit/schedules.py). An update is `grad_accum` micro-batches then
one optimizer step; each update yields a row of its time, loss and peak memory. `train_update` times an update
from a synchronized device to a synchronized device; `run` is the loop.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import statistics
from dataclasses import asdict, dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from creditlab import data
from creditlab import runtime as rt
from creditlab.alignment import alignment
from creditlab.config import Config, UserError
from creditlab.credit import make_source
from creditlab.credit.schedules import plan_for
from creditlab.credit.teacher import read_fit
from creditlab.flops import flop_budget
from creditlab.model import EXACT, GPT
from creditlab.optim import Optimizers
from creditlab.protocol.records import atomic_save


class Diverged(FloatingPointError):
    """A non-finite loss or gradient: the run cannot go on. `details` is what failure.json records."""

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


class CheckpointMismatch(UserError):
    pass


@dataclass
class UpdateRow:
    update: int
    kind: str  # native | synthetic | teacher, or the source's own name for an update with more work (refresh)
    loss: float
    seconds: float
    tokens: int
    tokens_per_s: float
    lr_scale: float
    peak_allocated_mib: float | None
    peak_reserved_mib: float | None
    mfu: float | None
    fit: dict | None = None  # on teacher updates: the predictor's fit to the true corrections
    align: dict | None = None  # on alignment updates: {group: {cosine, norm_ratio}} against the exact gradient

    def line(self, total: int) -> str:
        parts = [f"update {self.update + 1:>4}/{total}", self.kind, f"loss {self.loss:.4f}",
                 f"lr x{self.lr_scale:.2f}", f"{self.seconds:.3f} s", f"{self.tokens_per_s:,.0f} tok/s"]
        if self.mfu is not None:
            parts.append(f"MFU {100 * self.mfu:.1f}%")
        if self.peak_allocated_mib is not None:
            parts.append(f"peak {self.peak_allocated_mib:,.0f} MiB")
        if self.fit is not None:
            parts.append(f"fit err {self.fit['fit_error']:.3f} cos {self.fit['fit_cosine']:.3f}")
        return " | ".join(parts)


class DoesNotFit(UserError):
    """A model and micro-batch whose estimated memory exceeds what the device has free."""


def memory_estimate(cfg: Config, runtime: rt.Runtime) -> tuple[int, int]:
    """(parameters, estimated bytes) of a training step, without allocating anything: the parameters (built on
    the meta device) with their gradients and two optimizer buffers each, and one micro-batch's activations. An
    estimate, not a bound: per token and layer the backward keeps about twelve widths (block inputs, norms, Q/K/V,
    attention output, projections) and two MLP hidden widths, and the loss one chunk of logits."""
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg.model).parameters())
    m, t = cfg.model, cfg.train
    param_bytes = runtime.param_dtype.itemsize
    activation_bytes = (runtime.autocast_dtype or runtime.param_dtype).itemsize
    tokens = t.micro_batch * m.seq_len
    activations = tokens * m.layers * (12 * m.width + 2 * m.mlp_hidden) * activation_bytes
    logits = min(t.loss_chunk, tokens) * m.vocab_size * 4
    return params, params * (2 * param_bytes + 8) + activations + logits


def free_memory(runtime: rt.Runtime) -> int | None:
    """Bytes free on the run's device now (CUDA: the driver's count; CPU: MemAvailable), or None if unknown."""
    if runtime.is_cuda:
        return torch.cuda.mem_get_info(runtime.device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def refuse_what_cannot_fit(cfg: Config, runtime: rt.Runtime) -> None:
    params, need = memory_estimate(cfg, runtime)
    free = free_memory(runtime)
    if free is not None and need > free:
        where = "GPU" if runtime.is_cuda else "machine"
        raise DoesNotFit(
            f"this model does not fit: {params:,} parameters with their gradients and optimizer state and one "
            f"micro-batch's activations need about {need / 2**30:,.1f} GiB (an estimate), and the {where} has "
            f"{free / 2**30:,.1f} GiB free; lower model.width, model.layers, model.mlp_hidden or train.micro_batch")


def build_model(cfg: Config, runtime: rt.Runtime, seed: int | None = None) -> GPT:
    refuse_what_cannot_fit(cfg, runtime)
    torch.manual_seed(cfg.train.seed if seed is None else seed)
    return GPT(cfg.model).to(device=runtime.device, dtype=runtime.param_dtype)


class Trainer:
    def __init__(self, cfg: Config, runtime: rt.Runtime | None = None, model: GPT | None = None, loader=None,
                 peak_tflops: float | None = None):
        self.cfg = cfg
        self.runtime = runtime or rt.resolve(cfg.train)
        self.model = model if model is not None else build_model(cfg, self.runtime)
        self.source = make_source(cfg).to(device=self.runtime.device, dtype=self.runtime.param_dtype)
        self.plan = plan_for(cfg.credit.schedule, cfg.credit.teacher_every, self.source.omits, self.source.fits)
        self.optimizers = Optimizers(self.model, cfg.train)
        self.loader = loader if loader is not None else data.make_loader(
            cfg, "train", self.runtime.rank, self.runtime.world_size)
        # A source whose backward leaves some parameters without a gradient (dropbp's dropped branches) has DDP
        # look for them after each backward; otherwise it would wait for their gradients forever.
        self.ddp = DDP(self.model, device_ids=[self.runtime.local_rank] if self.runtime.is_cuda else None,
                       find_unused_parameters=getattr(self.source, "unused_parameters", False)) \
            if self.runtime.world_size > 1 else None
        self._forward = self._compile()
        self.flops_per_token = flop_budget(cfg.model, max(cfg.credit.teacher_every, 2)).total_per_token
        self.peak_tflops = peak_tflops
        self.update_index = 0
        self._ahead: tuple[int, torch.Tensor] | None = None  # (loader position, the batch made ahead for it)
        self.watch = LossWatch(cfg.model.vocab_size, cfg.train.stall_updates) if cfg.train.stall_updates else None

    def _compile(self):
        """The forward a micro-batch runs: the whole model compiled (where the runtime compiles), or, for a source
        that makes a Python choice per update inside the blocks (dropbp's drop pattern), each block compiled on its
        own: a choice then costs a block a few graph variants (the source's `compile_per_block`), where the whole
        model would need a graph per combination of every block's choices."""
        variants = getattr(self.source, "compile_per_block", 0)
        if not (self.runtime.compile and variants):
            return rt.maybe_compile(self.ddp or self.model, self.runtime)
        import torch._dynamo

        # Every block's graphs are cached on the one code object Block.forward, each block's apart (the blocks
        # differ in their index; models of one config share them): the source's variants, and the trainer's own
        # exact context with a gradient (native updates, alignment) and without (evaluation). Past the limit the
        # compiler would run the remaining blocks eagerly.
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), (variants + 2) * len(self.model.blocks)))
        for block in self.model.blocks:  # (kept by the model's blocks: a deep copy of the model calls these)
            block.forward = rt.maybe_compile(block.forward, self.runtime)
        return self.ddp or self.model

    def close(self) -> None:
        """Drop the DDP wrapper (and the compiled forward around it) before the process group is destroyed.
        Were DDP's reducer to release the group's last reference, gloo would join its worker threads with the
        interpreter lock held while they wait for it to free tensors: the process would hang at exit. Dropped
        here, even a trainer an exception's traceback keeps alive holds no reducer."""
        if self.ddp is not None:
            self.ddp = self._forward = None

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        if self.runtime.is_cuda:
            batch = batch.pin_memory().to(self.runtime.device, non_blocking=True)
        return batch

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == self.loader.position:
            batch = ahead[1]
            self.loader.position += 1
        else:
            batch = self._to_device(self.loader.next())
        return batch[:, :-1], batch[:, 1:]

    def _make_ahead(self) -> None:
        """The next micro-batch, made now and taken by the next _batch() if the loader is still at its position.
        The loader does not move: its position (what a checkpoint saves) counts only the batches taken."""
        if hasattr(self.loader, "batch_at"):
            position = self.loader.position
            self._ahead = (position, self._to_device(self.loader.batch_at(position)))

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, credit, scale: float) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients accumulate into .grad. Returns the loss."""
        with self.runtime.autocast():
            loss = self._forward(inputs, targets, credit=credit, loss_chunk=self.cfg.train.loss_chunk)
        (loss * scale).backward()
        return loss.detach()

    def update_kind(self, update: int) -> str:
        return self.plan.kind(update)

    def train_update(self, align: bool = False) -> UpdateRow:
        """One update: grad_accum micro-batches, then the optimizer step and the source's end of update, timed from
        a synchronized device to a synchronized device; then its loss and gradients are checked on the host.

        With `align`, the update's gradient is also compared with the exact gradient of the same micro-batches,
        between the backward passes and the step and outside the timed regions (see `measure_alignment`)."""
        cfg, runtime = self.cfg.train, self.runtime
        update, kind = self.update_index, self.update_kind(self.update_index)
        rt.reset_peak_memory(runtime)
        losses, batches = [], []

        def step():
            # What the host reads of the update, gathered before the step (the gradients are zeroed after it)
            names, norms = self._grad_norms()
            stacked = torch.stack(losses)
            readback = rt.HostCopy(torch.cat([stacked.mean().view(1), stacked, norms.to(stacked.dtype)]))
            lr_scale = self.optimizers.step(update)
            self.optimizers.zero_grad()
            # After the model's step, so that whatever of the fit's report a source reads on the host waits for
            # the fit alone; a teacher's report (a FitReport) is read, and the schedule told, with the update.
            return lr_scale, self.source.end_update(kind), readback, names

        with rt.Timer(runtime) as timed:
            for micro in range(cfg.grad_accum):
                inputs, targets = self._batch()
                if align:
                    batches.append((inputs, targets))
                sync = self.ddp is None or micro == cfg.grad_accum - 1
                with self.ddp.no_sync() if not sync else contextlib.nullcontext():
                    scale = 1.0 / cfg.grad_accum
                    credit = self.source.context(self, inputs, targets, kind, scale)
                    losses.append(self.forward_backward(inputs, targets, credit, scale))
                    self.source.after_backward(self, credit, kind)
            # queued behind the last backward, so the host makes it while the GPU works
            self._make_ahead()
            if not align:  # one timed region: no synchronization between the backward and the step
                lr_scale, fit, readback, names = step()
        seconds, aligned = timed.seconds, None
        if align:  # the alignment pass between the backward and the step, outside the timed regions
            aligned = self.measure_alignment(batches)
            with rt.Timer(runtime) as timed_step:
                lr_scale, fit, readback, names = step()
            seconds += timed_step.seconds
        peak_allocated, peak_reserved = rt.peak_memory_mib(runtime)
        self.update_index += 1
        values = readback.get().tolist()
        loss, micro_losses, norms = values[0], values[1:1 + len(losses)], values[1 + len(losses):]
        self._check_finite(update, loss, micro_losses, names, norms)
        fit = read_fit(fit)
        self.plan.observe(update, kind, fit)
        tokens = cfg.grad_accum * cfg.micro_batch * self.cfg.model.seq_len * runtime.world_size
        tps = tokens / seconds
        mfu = None if self.peak_tflops is None else \
            tps * self.flops_per_token / (self.peak_tflops * 1e12 * runtime.world_size)
        return UpdateRow(update, self.source.recorded_kind(update, kind), loss, seconds, tokens, tps, lr_scale,
                         peak_allocated, peak_reserved, mfu, fit, aligned)

    def _grad_norms(self) -> tuple[list[str], torch.Tensor]:
        """Each gradient's name and norm, the norms queued on the device (one fused kernel per dtype)."""
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        if not named:
            return [], torch.zeros(0, device=self.runtime.device)
        return [n for n, _ in named], torch.stack(torch._foreach_norm([g for _, g in named]))

    def _check_finite(self, update: int, loss: float, losses: list[float], names: list[str],
                      norms: list[float]) -> None:
        """Stop at the first non-finite loss or gradient, naming the update, micro-batch and parameter."""
        bad_grad = next((n for n, v in zip(names, norms) if not math.isfinite(v)), None)
        if math.isfinite(loss) and bad_grad is None:
            return
        micro = next((i for i, x in enumerate(losses) if not math.isfinite(x)), None)
        what = f"loss {loss}" if not math.isfinite(loss) else f"gradient of {bad_grad}"
        where = f"update {update + 1}" + ("" if micro is None else f", micro-batch {micro + 1}")
        raise Diverged(f"diverged: non-finite {what} at {where}; lower the learning rates "
                       f"(--set train.lr_muon=..., train.lr_embed=...) and start a new run",
                       {"reason": "diverged", "update_index": update, "micro_batch": micro,
                        "loss": loss if math.isfinite(loss) else str(loss), "first_nonfinite_grad": bad_grad})

    def measure_alignment(self, batches) -> dict:
        """The accumulated gradient of this update against the exact gradient of the same micro-batches, per
        trunk parameter group. The exact pass runs with every gradient of the update set aside and put back
        after it, so it changes no training state: parameters, gradients, optimizer, source, loader and RNG."""
        if self.ddp is not None:
            raise RuntimeError("gradient alignment runs in one process (compare), not under DDP")
        params = dict(self.model.named_parameters())
        kept = {name: p.grad for name, p in params.items()}
        for p in params.values():
            p.grad = None
        for inputs, targets in batches:
            self.forward_backward(inputs, targets, EXACT, 1.0 / len(batches))
        trunk = [name for name, _ in self.model.trunk_parameters()]
        exact = {name: params[name].grad for name in trunk}
        result = alignment({name: kept[name] for name in trunk}, exact)
        for name, p in params.items():
            p.grad = kept[name]
        return result

    def state_dict(self) -> dict:
        """Everything a resumed run needs: model, optimizers, credit source (predictor and its optimizer),
        schedule, data position and update count."""
        teacher = getattr(self.source, "teacher", None)
        return {"model": self.model.state_dict(), "optimizers": self.optimizers.state_dict(),
                "source": self.source.state_dict(), "teacher": teacher.state_dict() if teacher else None,
                "schedule": self.plan.schedule.state_dict(),
                "loader": self.loader.state_dict(), "update": self.update_index, "config": self.cfg.to_dict()}

    def save_checkpoint(self, path, keep: int | None = None) -> None:
        """Write a checkpoint atomically (a failed write leaves the previous ones intact), then remove all but
        the newest `keep` of its folder (default train.keep_checkpoints; 0 keeps all)."""
        state = self.state_dict()
        atomic_save(path, lambda tmp: torch.save(state, tmp))
        keep = self.cfg.train.keep_checkpoints if keep is None else keep
        if keep:
            for old in checkpoints(os.path.dirname(path) or ".")[:-keep]:
                old.unlink(missing_ok=True)

    def save_model(self, path) -> None:
        """The trained model alone (what `creditlab heldout` evaluates), with the config that built it."""
        state = {"model": self.model.state_dict(), "config": self.cfg.to_dict(), "update": self.update_index}
        atomic_save(path, lambda tmp: torch.save(state, tmp))

    def load_checkpoint(self, path_or_state, config: dict | None = None) -> None:
        """Restore a checkpoint (a path, or what read_checkpoint returned). It must have been written under
        `config` (default: this trainer's): a checkpoint of another configuration is refused, naming the keys."""
        state = read_checkpoint(path_or_state) if isinstance(path_or_state, (str, os.PathLike)) else path_or_state
        differ = config_diff(state["config"], self.cfg.to_dict() if config is None else config)
        if differ:
            raise CheckpointMismatch(f"the checkpoint was written under another config ({'; '.join(differ)}); "
                                     f"resume it with the config it was written under, or start a new run")
        self.load_state(state)

    def load_state(self, state: dict) -> None:
        """Take over a state_dict() (of this trainer's config, or of a run this one continues: a native budget
        forked from a longer one). A state still in use elsewhere must be passed as a deep copy: optimizers keep
        the tensors of a state they load where its device and dtype already match."""
        self.model.load_state_dict(state["model"])
        self.optimizers.load_state_dict(state["optimizers"])
        self.source.load_state_dict(state["source"])
        if state["teacher"] is not None:
            self.source.teacher = self.source.make_teacher()
            self.source.teacher.load_state_dict(state["teacher"])
        self.plan.schedule.load_state_dict(state.get("schedule", {}))
        self.loader.load_state_dict(state["loader"])
        self._ahead = None
        self.update_index = state["update"]

    def evaluate(self, evaluator, on_eval=None, say=print) -> None:
        """Evaluate the model now (evaluate.py); the row goes to `on_eval`, a line to `say`."""
        row = evaluator(self.model, self.update_index)
        if on_eval is not None:
            on_eval(row)
        if self.runtime.is_main:
            bpb = "" if row.bits_per_byte is None else f", {row.bits_per_byte:.4f} bits/byte"
            say(f"eval after {row.update} updates: {row.split} loss {row.loss:.4f}{bpb} "
                f"({row.tokens:,} tokens, {row.seconds:.1f} s)")

    def aligns(self, update: int, align_every: int) -> bool:
        return align_every > 0 and update % align_every == align_every - 1

    def evaluates_after(self, update: int, last: bool = False) -> bool:
        """Whether an evaluation follows `update` (0-based): every train.eval_every updates, and after the last."""
        every = self.cfg.train.eval_every
        return last or bool(every and (update + 1) % every == 0)

    def advance(self, evaluator=None, on_eval=None, align_every: int = 0, last: bool = False, say=print) -> UpdateRow:
        """One update, with gradient alignment on every `align_every`-th and evaluation every train.eval_every
        updates and after the `last` one."""
        row = self.train_update(align=self.aligns(self.update_index, align_every))
        if evaluator is not None and self.evaluates_after(row.update, last):
            self.evaluate(evaluator, on_eval, say)
        return row

    def run(self, updates: int | None = None, progress: bool = True, on_row=None, evaluator=None, on_eval=None,
            align_every: int = 0, on_warning=None) -> list[UpdateRow]:
        """Train `updates` updates (default: the rest of train.updates). With an `evaluator`, the model is also
        evaluated before the first update of a fresh run, every train.eval_every updates and after the last.
        Each row goes to `on_row` as it is made (which writes it, and checkpoints every train.checkpoint_every
        updates); a stalled loss (LossWatch) is said as a warning line and handed to `on_warning` as a dict."""
        from tqdm import tqdm

        count = updates if updates is not None else self.cfg.train.updates - self.update_index
        total = max(self.cfg.train.updates, self.update_index + count)  # for "update i/total" after a resume
        rows = []
        # A bar only on a terminal; logs and pipes get the plain step lines.
        progress = progress and self.runtime.is_main and sys.stderr.isatty()
        bar = tqdm(range(count), desc="train", unit="update", disable=not progress, dynamic_ncols=True)
        say = bar.write if progress else (lambda line: print(line, flush=True))
        if evaluator is not None and self.update_index == 0:
            self.evaluate(evaluator, on_eval, say)
        for i in bar:
            row = self.advance(evaluator, on_eval, align_every, last=i == count - 1, say=say)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            bar.set_postfix(loss=f"{row.loss:.3f}", s=f"{row.seconds:.3f}")
            if self.runtime.is_main and (row.update % self.cfg.train.log_every == 0 or row.update == total - 1):
                say(row.line(total))
            warning = self.watch.observe(row.loss) if self.watch is not None else None
            if warning is not None and self.runtime.is_main:
                say(f"warning: {warning}")
                if on_warning is not None:
                    on_warning({"update": row.update, "warning": warning})
        return rows


def checkpoints(folder) -> list:
    """A record's checkpoints, oldest first (their names sort by update)."""
    from pathlib import Path

    return sorted(Path(folder).glob("checkpoint_*.pt"))


def drop_finished_checkpoints(folder, cfg: Config) -> None:
    """A finished run's checkpoints removed where train.drop_finished_checkpoints asks (after its model.pt and
    result.json are written: a run stopped before them keeps its checkpoints)."""
    if cfg.train.drop_finished_checkpoints:
        for path in checkpoints(folder):
            path.unlink(missing_ok=True)


def read_checkpoint(path) -> dict:
    # To the CPU: load_state_dict copies every tensor to its parameter's device and dtype.
    return torch.load(path, map_location="cpu", weights_only=True)


def newest_readable_checkpoint(paths, raw: dict, say=print) -> dict:
    """The newest of `paths` (oldest first) that can be read, falling back to older ones (a file cut short by a
    run that died while writing it); it must have been written under the config `raw`. Returns its state with
    its file name as `_name`."""
    paths = list(paths)
    for path in reversed(paths):
        try:
            state = read_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file: any reader error means unreadable
            say(f"creditlab: {path.name} cannot be read ({type(exc).__name__}: {str(exc)[:120]}); "
                f"trying the checkpoint before it")
            continue
        differ = config_diff(state.get("config", {}), raw)
        if differ:
            raise CheckpointMismatch(f"{path} was written under another config than {path.parent / 'config.json'} "
                                     f"({'; '.join(differ)}); restore the record's config.json or start a new run")
        return state | {"_name": path.name}
    where = f"{paths[0].parent} has" if paths else "there is"
    raise CheckpointMismatch(f"{where} no readable checkpoint ({', '.join(p.name for p in paths) or 'none'}); "
                             f"start a new run")


def config_diff(a: dict, b: dict) -> list[str]:
    """`section.key: a != b` for every key whose value differs (or that only one side has)."""
    flat = lambda d: {f"{s}.{k}": v for s, values in d.items() for k, v in values.items()}  # noqa: E731
    fa, fb = flat(a), flat(b)
    return [f"{k}: {fa.get(k, '(absent)')!r} != {fb.get(k, '(absent)')!r}" for k in sorted(fa.keys() | fb.keys())
            if fa.get(k, "(absent)") != fb.get(k, "(absent)")]


class LossWatch:
    """Warns once per episode when the loss has sat near chance (ln V) or more than 1 nat above its running
    minimum for `updates` updates in a row: a run that is not learning, before it wastes its budget."""

    def __init__(self, vocab_size: int, updates: int):
        self.chance, self.updates = math.log(vocab_size), updates
        self.best, self.count = math.inf, 0

    def observe(self, loss: float) -> str | None:
        self.best = min(self.best, loss)
        near_chance = abs(loss - self.chance) <= 0.02 * self.chance
        if near_chance or loss > self.best + 1.0:
            self.count += 1
        else:
            self.count = 0
        if self.count != self.updates:  # once, when the episode reaches its length
            return None
        why = (f"near chance ln(V) = {self.chance:.3f}" if near_chance else
               f"more than 1 nat above its minimum {self.best:.4f}")
        return (f"loss {loss:.4f} has stayed {why} for {self.updates} updates; check the learning rates "
                f"(train.lr_*) and the data (train.stall_updates=0 turns this warning off)")


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per update, the last written: a resumed run re-does the updates after its checkpoint."""
    by_update = {r["update"]: r for r in rows}
    return [by_update[u] for u in sorted(by_update)]


def median_last(rows: list[UpdateRow], window: int, field: str = "seconds") -> float:
    values = [getattr(r, field) for r in rows[-window:]]
    return statistics.median(values)


def row_dict(row: UpdateRow) -> dict:
    return asdict(row)
