"""Arms run interleaved: every arm resident, one update of each per round, the order rotated each round.

Arms timed one after another are timed on different machines: a GPU drifting under its power limit, a host
whose other load comes and goes. Interleaved, that drift falls on every arm alike, so the arms' ratio measures
the arms and not the moment each one ran. The resource screen (protocol/screen.py) and benchmarks/arms.py run
their arms through `run_rounds`; `OwnMemory` keeps each arm's memory peak its own while all are resident.
"""

from __future__ import annotations

import contextlib
import random
import signal
import statistics
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

MIB = 2**20


def rotation(names: Sequence, round_index: int) -> list:
    """The order of the arms in one round: rotated each round, so that no arm always runs first (or always
    follows the same arm), and over len(names) rounds every arm holds every position once."""
    names = list(names)
    if not names:
        return []
    k = round_index % len(names)
    return names[k:] + names[:k]


@dataclass(frozen=True)
class Step:
    round: int  # 0-based
    position: int  # 0-based place of the arm in its round
    arm: str


def run_rounds(arms: Sequence[str], rounds: int, step: Callable[[Step], bool | None], *,
               stop: Callable[[], bool] | None = None,
               after_round: Callable[[int], None] | None = None) -> list[Step]:
    """Run `rounds` rounds of one update per arm: in round r the arms step in `rotation(arms, r)` order.

    `step(at)` runs one update of `at.arm`; returning False retires that arm (it ran out of memory, say) and the
    others go on. `stop()` is asked before every step; once it says True the whole run ends there (a screen
    stops at its cap or its first out-of-memory error). `after_round(r)` is called after each full round.
    Returns the steps taken, in order."""
    retired: set[str] = set()
    taken: list[Step] = []
    for r in range(rounds):
        position = 0
        for name in rotation(arms, r):
            if name in retired:
                continue
            if stop is not None and stop():
                return taken
            at = Step(r, position, name)
            position += 1
            taken.append(at)
            if step(at) is False:
                retired.add(name)
        if after_round is not None:
            after_round(r)
        if len(retired) == len(arms):
            break
    return taken


@contextlib.contextmanager
def signals_handled(handler: Callable, signals=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """`handler` for Ctrl-C and SIGTERM while inside, the handlers before restored after: a long run asked to stop
    ends the update it is in and keeps what it measured (main thread only, as Python's signals are)."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


class StopRequest:
    """Ctrl-C or SIGTERM while inside asks a long run to stop where it keeps what it has: the first is noted
    (`signal` names it) and `announce(name)` says what happens next; the second stops at once (KeyboardInterrupt)."""

    def __init__(self, announce: Callable[[str], None]):
        self.signal: str | None = None
        self._announce = announce
        self._handled = signals_handled(self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        self._announce(self.signal)

    def __enter__(self) -> "StopRequest":
        self._handled.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._handled.__exit__(*exc)


def keep_compiled_side_by_side() -> None:
    """Every resident arm keeps its compiled graphs; without a higher per-function limit the compiler stops
    recompiling after a few arms and the later arms silently run eagerly."""
    import torch._dynamo

    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))


def cuda_allocated(device=None) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


class OwnMemory:
    """Each arm's own allocated bytes, so that its peak is counted as if it ran alone.

    While arms are resident together, the allocator's peak during one arm's update includes the bytes every
    other arm keeps (parameters, optimizer state). What an arm leaves allocated when it is built, and what its
    updates leave alive, are its own; the rest of what was allocated before its update is taken off its peak.
    Reserved memory is one pool for all arms, so with `shared` an arm's reserved peak is not reported.

    `allocated()` reads the device's allocated bytes (synchronized); None where the device reports no memory
    (the CPU), and then rows pass through unchanged."""

    def __init__(self, allocated: Callable[[], int] | None, shared: bool = True):
        self.allocated, self.shared = allocated, shared
        self.resident: dict[str, int] = {}

    def build(self, name: str, make: Callable[[], object]):
        """make() builds the arm; what it leaves allocated is the arm's own."""
        before = self.allocated() if self.allocated is not None else 0
        built = make()
        self.resident[name] = (self.allocated() - before) if self.allocated is not None else 0
        return built

    def update(self, name: str, run: Callable[[], object]):
        """run() performs one update and returns its row (with peak_allocated_mib and peak_reserved_mib); the
        row comes back with the arm's own peak."""
        if self.allocated is None:
            return run()
        before = self.allocated()
        row = run()
        others = before - self.resident.get(name, 0)
        if row.peak_allocated_mib is not None:
            row.peak_allocated_mib -= others / MIB
        if self.shared:
            row.peak_reserved_mib = None
        self.resident[name] = self.resident.get(name, 0) + self.allocated() - before  # e.g. optimizer state
        return row


def graphs_compiled() -> int:
    """How many graphs the compiler has built in this process so far: taken before and after an update, the
    difference says whether that update compiled (a first update, or a source whose Python choices meet a variant
    not yet compiled, as dropbp's drop patterns do for many updates)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def warm_variants(trainer) -> int:
    """Compile, untimed, the graph variants a source's Python choices can take, as the source lists them
    (`warming_contexts`: dropbp's), one micro-batch's forward and backward each, gradients zeroed after; the
    loader moves on (a caller that wants its data rewinds it). Returns how many contexts it ran."""
    contexts = getattr(trainer.source, "warming_contexts", None)
    if contexts is None:
        return 0
    warmed = contexts()
    for credit in warmed:
        inputs, targets = trainer._batch()
        trainer.forward_backward(inputs, targets, credit, 1.0)
    trainer.optimizers.zero_grad()
    return len(warmed)


def steady_rounds(rows: Sequence[dict], base_rows: Sequence[dict], skip: int = 2,
                  where: Callable[[dict], bool] = lambda row: True) -> tuple[list[float], list[float]]:
    """The seconds of two arms' rounds after the first `skip` in which neither compiled a graph (a row's
    `graphs_compiled`, where recorded: a compiling update times the compiler, not the step) and the first arm's
    row is `where` (e.g. of one kind of update)."""
    pairs = [(a["seconds"], b["seconds"]) for a, b in zip(rows[skip:], base_rows[skip:])
             if where(a) and not a.get("graphs_compiled") and not b.get("graphs_compiled")]
    return [a for a, _ in pairs], [b for _, b in pairs]


def steady_ratio(rows: Sequence[dict], base_rows: Sequence[dict],
                 where: Callable[[dict], bool] = lambda row: True) -> tuple[float, float, float, int] | None:
    """round_ratio of two arms' rows over their steady rounds (steady_rounds: from the third, neither compiling,
    the first arm's row `where`). None if the arms ran different rounds or fewer than three steady rounds remain."""
    if len(rows) != len(base_rows):
        return None
    return round_ratio(*steady_rounds(rows, base_rows, where=where), skip=0)


def round_ratio(seconds: Sequence[float], base_seconds: Sequence[float], skip: int = 2, resamples: int = 2000,
                seed: int = 0) -> tuple[float, float, float, int] | None:
    """(median, low, high, rounds): the median over rounds after the first `skip` of an arm's per-round ratio
    seconds / base_seconds (update r of each arm ran in round r), with a 95% bootstrap interval of that median
    (rounds resampled with replacement, a fixed seed). A steadier reading of a ratio than the ratio of two
    last-window medians, with its uncertainty beside it. None if the arms ran different rounds or fewer than
    three rounds remain."""
    return _per_round(seconds, base_seconds, lambda a, b: a / b, skip, resamples, seed)


def round_difference_ms(seconds: Sequence[float], base_seconds: Sequence[float], skip: int = 2,
                        resamples: int = 2000, seed: int = 0) -> tuple[float, float, float, int] | None:
    """As round_ratio, for the per-round difference seconds - base_seconds, in milliseconds."""
    return _per_round(seconds, base_seconds, lambda a, b: 1e3 * (a - b), skip, resamples, seed)


def _per_round(seconds, base_seconds, combine, skip: int, resamples: int, seed: int):
    if len(seconds) != len(base_seconds) or len(seconds) - skip < 3:
        return None
    values = [combine(a, b) for a, b in zip(seconds[skip:], base_seconds[skip:])]
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return (statistics.median(values), medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1],
            len(values))
