"""Tokenizers: a byte-level BPE trained on TRAIN documents, or GPT-2's r50k_base read from a registry file.

Both reserve the LAST id for the document separator (12,288 BPE tokens + separator 12,288 = 12,289 ids;
r50k_base's <|endoftext|> = 50,256). The separator is never produced by encoding text, even text that spells
it out, so a document can never fake a document boundary.
"""

from __future__ import annotations

import base64
import hashlib
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

from creditlab.data.artifacts import Artifact, fetch

SEPARATOR_TEXT = "<|endoftext|>"  # how decode() renders the separator
KINDS = ("bpe", "gpt2")
DEFAULT_VOCAB = {"bpe": 12_289, "gpt2": 50_257}

# r50k_base (GPT-2) merges, shipped inside the openai-whisper sdist; the hash is the one tiktoken pins.
WHISPER = Artifact("openai-whisper==20250625", "openai_whisper-20250625.tar.gz",
                   "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96")
GPT2_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_ORIGIN = f"r50k_base merges: whisper/assets/gpt2.tiktoken of {WHISPER.requirement} (MIT licence)"
# GPT-2's pre-tokenization regex (as in tiktoken's r50k_base).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """Text <-> ids with a separator id; `kind`, `vocab_size` (separator included) and the file that defines it."""

    def __init__(self, kind: str, vocab_size: int, encode_batch: Callable[[list[str]], list[list[int]]],
                 decode: Callable[[list[int]], str], file_bytes: bytes, filename: str):
        self.kind, self.vocab_size = kind, vocab_size
        self.separator = vocab_size - 1
        self._encode_batch, self._decode = encode_batch, decode
        self._file_bytes, self.filename = file_bytes, filename
        self.sha256 = hashlib.sha256(file_bytes).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; each separator renders as SEPARATOR_TEXT."""
        ids = [int(i) for i in ids]
        pieces, start = [], 0
        for i, t in enumerate(ids + [self.separator]):
            if t == self.separator:
                pieces.append(self._decode(ids[start:i]))
                start = i + 1
        return SEPARATOR_TEXT.join(pieces)

    def save(self, directory: str | Path) -> dict:
        """Write the defining file beside the shards; return the manifest record (with its SHA256)."""
        (Path(directory) / self.filename).write_bytes(self._file_bytes)
        return self.record()

    def record(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "separator": self.separator,
                "file": self.filename, "sha256": self.sha256}


# --- byte-level BPE (HF tokenizers) ---------------------------------------------------------------------

def _from_hf(hf, file_bytes: bytes) -> Tokenizer:
    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)] if texts else []

    def decode(ids: list[int]) -> str:
        return hf.decode(ids, skip_special_tokens=False)

    return Tokenizer("bpe", hf.get_vocab_size() + 1, encode_batch, decode, file_bytes, "tokenizer.json")


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB["bpe"], progress: bool = True,
              length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size - 1` tokens (the last id is the separator).

    No normalizer, all 256 bytes in the alphabet and a byte-level decoder: every string round-trips exactly.
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size - 1 < 256 + 1:
        raise TokenizerError(f"a byte-level BPE needs vocab_size >= 258 (256 bytes, a merge, the separator); "
                             f"got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=2, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    hf.train_from_iterator(texts, trainer=trainer, length=length)
    return _from_hf(hf, hf.to_str().encode("utf-8"))


def _load_bpe(file_bytes: bytes) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    return _from_hf(HFTokenizer.from_str(file_bytes.decode("utf-8")), file_bytes)


# --- GPT-2 r50k_base (tiktoken) -------------------------------------------------------------------------

def _load_gpt2(file_bytes: bytes) -> Tokenizer:
    import tiktoken

    ranks = {}
    for line in file_bytes.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    enc = tiktoken.Encoding(name="r50k_base", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={SEPARATOR_TEXT: len(ranks)}, explicit_n_vocab=len(ranks) + 1)

    def decode(ids: list[int]) -> str:
        return enc.decode(ids, errors="replace")

    # encode_ordinary: text that spells <|endoftext|> is encoded as ordinary text, never as the separator.
    return Tokenizer("gpt2", enc.n_vocab, enc.encode_ordinary_batch, decode, file_bytes, "gpt2.tiktoken")


def gpt2(cache: Path | None = None, log: Callable[[str], None] = print) -> Tokenizer:
    """GPT-2's tokenizer with its BPE file taken from the openai-whisper sdist (fetched once, SHA256-checked)."""
    with tarfile.open(fetch(WHISPER, cache, log), "r:gz") as tar:
        file_bytes = tar.extractfile(GPT2_MEMBER).read()
    digest = hashlib.sha256(file_bytes).hexdigest()
    if digest != GPT2_SHA256:
        raise TokenizerError(f"{WHISPER.filename}:{GPT2_MEMBER}: SHA256 {digest} is not r50k_base's {GPT2_SHA256}")
    return _load_gpt2(file_bytes)


# --- loading a saved tokenizer --------------------------------------------------------------------------

def load(directory: str | Path, record: dict) -> Tokenizer:
    """The tokenizer saved in `directory` as described by its manifest record, after checking its SHA256."""
    path = Path(directory) / record["file"]
    if not path.exists():
        raise TokenizerError(f"{path}: tokenizer file is missing")
    file_bytes = path.read_bytes()
    digest = hashlib.sha256(file_bytes).hexdigest()
    if digest != record["sha256"]:
        raise TokenizerError(f"{path}: SHA256 {digest} differs from the manifest's {record['sha256']}")
    kind = record["kind"]
    if kind == "bpe":
        tok = _load_bpe(file_bytes)
    elif kind == "gpt2":
        tok = _load_gpt2(file_bytes)
    else:
        raise TokenizerError(f"{path}: unknown tokenizer kind {kind!r}; known: {', '.join(KINDS)}")
    if tok.vocab_size != record["vocab_size"]:
        raise TokenizerError(f"{path}: vocab_size {tok.vocab_size} differs from the manifest's {record['vocab_size']}")
    return tok
