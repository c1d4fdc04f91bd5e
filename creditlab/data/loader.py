"""ShardLoader: micro-batches of B x (T+1) tokens from a prepared split, a pure function of (seed, position).

The split's shards are one token stream, cut into windows of T+1 tokens with stride T (a window's last token
is the next window's first, so every token is a target once). Each epoch shifts the cut by a seeded offset in
[0, T) and visits the windows in a seeded permutation. Global step `position` takes the next W*B windows of
that order; rank r of world W takes windows [r*B, (r+1)*B) of them, so ranks are disjoint within a step and
a loader created at position p yields exactly what an uninterrupted one yields from p.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from creditlab.data.ledger import read_split
from creditlab.data.prepare import load_manifest, manifest_sha256
from creditlab.data.shards import ShardError, check_ids


class ShardLoader:
    def __init__(self, data_dir: str | Path, split: str, micro_batch: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, position: int = 0, *, purpose: str | None = None,
                 admission: str | None = None, allow_final_heldout: bool = False, vocab_size: int | None = None):
        """`vocab_size`: the model's; every shard's ids are checked against it here, before any batch."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batch < 1 or seq_len < 1:
            raise ValueError("micro_batch and seq_len must be positive")
        self.data_dir, self.split = Path(data_dir), split
        self.micro_batch, self.seq_len, self.seed = micro_batch, seq_len, seed
        self.rank, self.world_size, self.position = rank, world_size, position
        # DEV and FINAL_HELDOUT go through the ledger (one entry per loader); TRAIN does not.
        self._shards = read_split(data_dir, split, purpose, admission, allow_final_heldout, rank, world_size)
        self._manifest_sha256 = manifest_sha256(data_dir)
        if vocab_size is not None:
            names = [f["name"] for f in load_manifest(data_dir)["splits"][split]["files"]]
            for name, tokens in zip(names, self._shards):
                check_ids(self.data_dir / name, tokens, vocab_size)
        self._ends = np.cumsum([s.size for s in self._shards])  # stream offset where each shard ends
        self.tokens = int(self._ends[-1]) if len(self._ends) else 0
        # Windows start at shift + i*T with shift < T, and need T+1 tokens: n*T + T <= tokens.
        self.windows_per_epoch = (self.tokens - seq_len) // seq_len if self.tokens > seq_len else 0
        if self.windows_per_epoch < 1:
            raise ShardError(f"{data_dir}: split {split!r} has {self.tokens:,} tokens, too few for one window of "
                             f"model.seq_len+1 = {seq_len + 1:,} tokens with a shift (needs >= {2 * seq_len:,}); "
                             f"lower model.seq_len to at most {self.tokens // 2:,}, or prepare more text")
        self._epoch_cache: tuple[int, np.ndarray, int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Global steps (all ranks together) until every window of an epoch has been served once."""
        return self.windows_per_epoch // (self.micro_batch * self.world_size)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, int]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed % 2**64, epoch]))
            shift = int(rng.integers(0, self.seq_len))
            self._epoch_cache = (epoch, rng.permutation(self.windows_per_epoch), shift)
        return self._epoch_cache[1], self._epoch_cache[2]

    def _slice(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the split's stream, across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self._ends, start, side="right"))
        while filled < length:
            shard_start = int(self._ends[i - 1]) if i else 0
            lo = start + filled - shard_start
            take = min(length - filled, self._shards[i].size - lo)
            out[filled:filled + take] = self._shards[i][lo:lo + take]
            filled += take
            i += 1
        return out

    def batch_at(self, position: int) -> torch.Tensor:
        B, T = self.micro_batch, self.seq_len
        first = (position * self.world_size + self.rank) * B  # global index of this rank's first window
        rows = []
        for g in range(first, first + B):
            order, shift = self._epoch(g // self.windows_per_epoch)
            rows.append(self._slice(shift + int(order[g % self.windows_per_epoch]) * T, T + 1))
        return torch.from_numpy(np.stack(rows))  # (B, T+1) int64

    def next(self) -> torch.Tensor:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position, "split": self.split, "seed": self.seed, "micro_batch": self.micro_batch,
                "seq_len": self.seq_len, "world_size": self.world_size, "manifest_sha256": self._manifest_sha256}

    def load_state_dict(self, state: dict) -> None:
        # Resuming with another stream definition would silently change the data: refuse it.
        mine = self.state_dict()
        wrong = [f"{k}: saved {state[k]!r}, now {mine[k]!r}" for k in mine
                 if k != "position" and k in state and state[k] != mine[k]]
        if wrong:
            raise ValueError("loader state does not match this loader (" + "; ".join(wrong) + ")")
        self.position = int(state["position"])
