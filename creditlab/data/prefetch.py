"""`Prefetcher`: a loader's next micro-batches made on a background thread, pinned, ahead of the trainer.

Making a micro-batch is host work (the synthetic stream's generator, a shard loader's gathers) that otherwise
runs between one micro-batch's backward and the next forward; a step short enough on the GPU then waits for
it. On a thread it overlaps the GPU's work instead (torch's CPU ops and pinning release the GIL).

Its state is the wrapped loader's state after the last batch the trainer took, not after the batches read
ahead, so a checkpoint resumes at exactly the batch the trainer would have taken next.
"""

from __future__ import annotations

import queue
import threading

import torch


class Prefetcher:
    def __init__(self, loader, depth: int = 2, pin: bool = True):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.loader, self.depth, self.pin = loader, depth, pin
        self._state = loader.state_dict()
        self._failed: Exception | None = None
        self._start()

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(self.depth)
        self._stop = threading.Event()
        # the thread holds the loader, not self: a dropped Prefetcher is collected, and its __del__ stops it
        self._thread = threading.Thread(target=_fill, args=(self.loader, self.pin, self._queue, self._stop),
                                        daemon=True, name="creditlab-prefetch")
        self._thread.start()

    def next(self) -> torch.Tensor:
        if self._failed is not None:  # the thread has stopped: every later call fails the same way
            raise self._failed
        batch, state, error = self._queue.get()
        if error is not None:
            self.close()
            self._failed = error
            raise error
        self._state = state
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()
        self._start()

    def __del__(self):
        stop = self.__dict__.get("_stop")
        if stop is not None:
            stop.set()

    def __getattr__(self, name):  # the wrapped loader's other attributes (micro_batch, seq_len, ...)
        if name in ("loader", "_stop"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def _fill(loader, pin: bool, out: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            batch = loader.next()
            item = (batch.pin_memory() if pin else batch, loader.state_dict(), None)
        except Exception as error:  # handed to the trainer's thread, which raises it
            item = (None, None, error)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if item[2] is not None:
            return
