"""Token data: the synthetic stream, prepared shards, splits, the access ledger and the loader.

`make_loader(cfg, split)` is what training code calls; `prepare`/`info` (and `creditlab data ...`) make and
describe a prepared folder; `read_split` is the one door to DEV and FINAL_HELDOUT tokens.
"""

from __future__ import annotations

import shlex

from creditlab.data.ledger import LedgerError, read_split
from creditlab.data.loader import ShardLoader
from creditlab.data.prepare import (NotPreparedError, PrepareError, fresh_folder, info, load_manifest, prepare,
                                    prepare_again, prepare_command, verify)
from creditlab.data.shards import ShardError, read_shard, write_shard
from creditlab.data.splits import SPLITS
from creditlab.data.synthetic import SyntheticLoader

__all__ = ["SyntheticLoader", "ShardLoader", "make_loader", "prepare", "info", "verify", "load_manifest",
           "read_split", "read_shard", "write_shard", "SPLITS", "LedgerError", "ShardError", "PrepareError",
           "NotPreparedError", "VocabMismatchError", "DATA_ERRORS", "DATA_SOURCES"]

DATA_SOURCES = ("synthetic", "shards")
# The synthetic stream has no files to split: DEV/FINAL_HELDOUT batches come from positions far beyond any
# training run, so they are never batches the model trained on (the stream's structure is shared by design).
SYNTHETIC_SPLIT_OFFSET = {"train": 0, "dev": 1 << 40, "final_heldout": 2 << 40}


class VocabMismatchError(ValueError):
    pass


# What make_loader raises for data a run cannot use: each message names the problem and the fix.
DATA_ERRORS = (NotPreparedError, VocabMismatchError, ShardError, LedgerError)


def make_loader(cfg, split: str = "train", rank: int = 0, world_size: int = 1, *, position: int = 0,
                purpose: str | None = None, admission: str | None = None, allow_final_heldout: bool = False,
                seed: int | None = None):
    """The loader a run of `cfg` reads `split` from: SyntheticLoader or ShardLoader, with one interface.

    For shards, the prepared tokenizer's vocab_size must equal cfg.model.vocab_size, every shard must have the
    manifest's SHA256 and no id may reach the vocab_size. DEV/FINAL_HELDOUT reads of shards need a `purpose`
    and are written to the access ledger with it and `admission`. `seed` replaces cfg.train.seed as the
    order's seed (evaluation reads one fixed subset whatever the run's seed).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    m, t = cfg.model, cfg.train
    seed = t.seed if seed is None else seed
    if cfg.data.source == "synthetic":
        return SyntheticLoader(m.vocab_size, t.micro_batch, m.seq_len, seed, rank, world_size,
                               SYNTHETIC_SPLIT_OFFSET[split] + position)
    if cfg.data.source != "shards":
        raise ValueError(f"unknown data.source {cfg.data.source!r}; valid: {', '.join(DATA_SOURCES)} "
                         "(shards are read from data.dir)")
    manifest = load_manifest(cfg.data.dir)
    tok = manifest["tokenizer"]
    if tok["vocab_size"] != m.vocab_size:
        raise VocabMismatchError(_vocab_mismatch(cfg, manifest))
    return ShardLoader(cfg.data.dir, split, t.micro_batch, m.seq_len, seed, rank, world_size, position,
                       purpose=purpose, admission=admission, allow_final_heldout=allow_final_heldout,
                       vocab_size=m.vocab_size)


def _vocab_mismatch(cfg, manifest: dict) -> str:
    """The mismatch, and the two ways to fix it: change the model, or prepare data for the model."""
    tok, want, data_dir = manifest["tokenizer"], cfg.model.vocab_size, cfg.data.dir
    message = (f"model.vocab_size is {want} but the data in {data_dir} was prepared with a {tok['kind']} tokenizer "
               f"of {tok['vocab_size']} ids ({tok['vocab_size'] - 1} tokens + separator). Either run with "
               f"`--set model.vocab_size={tok['vocab_size']}`")
    flags = ("--tokenizer", "gpt2") if want == 50_257 else ("--vocab-size", str(want)) if want >= 258 else None
    if flags is None:
        return message + f" (a byte-level BPE needs at least 258 ids, so no data can be prepared for {want})"
    other = fresh_folder(data_dir, f"v{want}")
    return (message + f", or prepare data for this vocabulary: `{prepare_command(manifest['source'], other, *flags)}` "
            f"and run with `--set data.dir={shlex.quote(other)}`")
