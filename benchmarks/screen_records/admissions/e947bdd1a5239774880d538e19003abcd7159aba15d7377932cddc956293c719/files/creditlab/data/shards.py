"""The token shard format of the modded-nanogpt records: a 256 x int32 header, then uint16 tokens.

Header words: [0] magic 20240520, [1] version 1, [2] number of tokens; the rest are zero. Files are read
through a memory map, so a loader touches only the windows it serves.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
MAX_VOCAB = 1 << 16  # tokens are stored as uint16


class ShardError(ValueError):
    """A shard file that cannot be read as written; the message names the file and the problem."""


def write_shard(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int) -> str:
    """Write `tokens` to `path` (via a temporary file and a rename) and return the file's SHA256.

    `vocab_size` is checked against the uint16 range, and every token against `vocab_size`, so a bad
    tokenizer fails here rather than as silently wrapped ids at training time.
    """
    path = Path(path)
    if vocab_size > MAX_VOCAB:
        raise ShardError(f"{path}: vocab_size {vocab_size} does not fit the uint16 shard format "
                         f"(must be <= {MAX_VOCAB})")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ShardError(f"{path}: tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ShardError(f"{path}: token ids must lie in [0, {vocab_size}), got "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    if tokens.size >= 1 << 31:
        raise ShardError(f"{path}: {tokens.size} tokens overflow the int32 count of the header")
    header = np.zeros(HEADER_WORDS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
    body = tokens.astype("<u2", copy=False)
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for part in (header.tobytes(), body.tobytes()):
            f.write(part)
            digest.update(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader never sees a half-written shard under the final name
    return digest.hexdigest()


def read_header(path: str | os.PathLike) -> int:
    """Validate the header and size of a shard and return its token count; raise ShardError otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShardError(f"{path}: shard file is missing") from None
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: truncated: {size} bytes is shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_WORDS)
    if int(header[0]) != MAGIC:
        raise ShardError(f"{path}: bad magic number {int(header[0])} (expected {MAGIC}); "
                         "not a token shard, or corrupted")
    if int(header[1]) != VERSION:
        raise ShardError(f"{path}: unsupported shard version {int(header[1])} (expected {VERSION})")
    count = int(header[2])
    if count < 0:
        raise ShardError(f"{path}: corrupted header: negative token count {count}")
    expected = HEADER_BYTES + 2 * count
    if size < expected:
        raise ShardError(f"{path}: truncated: header says {count} tokens ({expected} bytes) "
                         f"but the file has {size} bytes")
    if size > expected:
        raise ShardError(f"{path}: size mismatch: header says {count} tokens ({expected} bytes) "
                         f"but the file has {size} bytes (trailing data)")
    return count


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """A read-only uint16 memory map of a validated shard's tokens."""
    count = read_header(path)
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


def check_ids(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int) -> None:
    """Raise ShardError at the first token id >= vocab_size, naming the shard and the token's offset.

    An id beyond the model's embedding would otherwise surface as a bare IndexError deep in a training step.
    """
    if tokens.size == 0 or int(tokens.max()) < vocab_size:
        return
    offset = int(np.argmax(tokens >= vocab_size))
    raise ShardError(f"{path}: token {offset:,} (byte {HEADER_BYTES + 2 * offset:,}) is id {int(tokens[offset])}, "
                     f"outside the model's vocabulary of {vocab_size} ids (largest id in the shard: "
                     f"{int(tokens.max())}); these shards were not made for this vocabulary: prepare the data "
                     "again for it, or use a model whose vocab_size covers them")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
