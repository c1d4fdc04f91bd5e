"""`creditlab data prepare|info`: the data subcommands, registered on the main CLI by `add_commands`.

Also runnable alone: `python -m creditlab.data.cli data prepare --source pack:prose --out data/prose`.
"""

from __future__ import annotations

import argparse
import json
import sys

from creditlab.data.artifacts import ArtifactError
from creditlab.data.prepare import (DEFAULT_OUT, DEFAULT_SHARD_TOKENS, DEFAULT_TOKENIZER_SAMPLE_MB, NotPreparedError,
                                    PrepareError, info, prepare, size_problems, verify)
from creditlab.data.shards import ShardError
from creditlab.data.sources import DEFAULT_DIR_GLOB, DEFAULT_SOURCE, SourceError
from creditlab.data.splits import parse_fractions
from creditlab.data.tokenizer import KINDS, TokenizerError

# Errors that are the user's to fix: printed as one clear line, no traceback.
_USER_ERRORS = (PrepareError, NotPreparedError, SourceError, ArtifactError, TokenizerError, ShardError)

_SOURCE_HELP = (f"pack:prose (default: Shakespeare, Milton, the KJV Bible, Wikipedia leads; ~15 MB), "
                f"pack:docs (Debian documentation prose plus pack:prose; about 200 MB, needs apt-get or its text cache), "
                f"dir:PATH[::GLOBS] (default glob {DEFAULT_DIR_GLOB}), jsonl:PATH, parquet:PATH, hf:NAME[::SPLIT]")


def add_commands(subparsers) -> None:
    """Register `data` with its subcommands `prepare` and `info` on an argparse subparsers object."""
    data = subparsers.add_parser("data", help="prepare and inspect token data (shards, splits, ledger)",
                                 description="Prepare token shards from a text source, or describe prepared ones.")
    sub = data.add_subparsers(dest="data_command", metavar="{prepare,info}", required=True)

    p = sub.add_parser("prepare", help="source -> tokenizer -> TRAIN/DEV/FINAL_HELDOUT shards + manifest",
                       description="Prepare token shards. Idempotent: an existing folder prepared from the "
                                   "same request is reported, not redone.")
    p.add_argument("--source", default=DEFAULT_SOURCE, help=_SOURCE_HELP)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="ids including the document separator (default: bpe 12289, gpt2 50257)")
    p.add_argument("--tokenizer", choices=KINDS, default="bpe",
                   help="bpe: byte-level BPE trained on TRAIN; gpt2: r50k_base (default bpe)")
    p.add_argument("--tokenizer-sample-mb", type=float, default=DEFAULT_TOKENIZER_SAMPLE_MB,
                   help="train the BPE on this many MB of TRAIN text, taking documents in sha256(id) order "
                        f"(default {DEFAULT_TOKENIZER_SAMPLE_MB}; 0: all of TRAIN); every document is still encoded")
    p.add_argument("--text-field", default="text", help="field holding the text (jsonl/parquet/hf; default text)")
    p.add_argument("--splits", default="90/5/5", help="train/dev/final_heldout fractions (default 90/5/5)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--force", action="store_true", help="replace an existing, different preparation")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prepare)

    i = sub.add_parser("info", help="splits, token counts, tokenizer and licences of a prepared folder")
    i.add_argument("dir", nargs="?", default=DEFAULT_OUT, help=f"prepared folder (default {DEFAULT_OUT})")
    i.add_argument("--json", action="store_true", help="print the info as JSON")
    i.add_argument("--verify", action="store_true",
                   help="re-hash every file against the manifest (without it, only shard sizes are checked)")
    i.set_defaults(func=cmd_info)


def cmd_prepare(args: argparse.Namespace) -> int:
    if not args.out.strip():
        print("creditlab: error: --out is empty; name the folder for the prepared data (e.g. --out data/prose)",
              file=sys.stderr)
        return 2
    try:
        fractions = parse_fractions(args.splits)
        summary = prepare(args.source, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                          text_field=args.text_field, fractions=fractions, shard_tokens=args.shard_tokens,
                          force=args.force, progress=not args.no_progress,
                          tokenizer_sample_mb=args.tokenizer_sample_mb)
    except _USER_ERRORS + (ValueError,) as e:
        print(f"creditlab: error: {e}", file=sys.stderr)
        return 2
    print(format_info(args.out, summary))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    try:
        summary = info(args.dir)
        # Sizes are cheap and catch truncated or swapped shards; hashes are --verify's (seconds per GB).
        problems = verify(args.dir) if args.verify else size_problems(args.dir)
    except _USER_ERRORS as e:
        print(f"creditlab: error: {e}", file=sys.stderr)
        return 2
    check = "verify" if args.verify else "size_check"
    if args.json:
        summary[check] = {"ok": not problems, "problems": problems}
        print(json.dumps(summary, indent=2))
    else:
        print(format_info(args.dir, summary))
        if args.verify:
            print("\nverify: all files match the manifest" if not problems else
                  "\nverify: FAILED\n" + "\n".join(f"  {p}" for p in problems))
        else:
            print("\nsizes: every shard's size matches the manifest (--verify re-hashes every file)" if not problems
                  else "\nsizes: FAILED\n" + "\n".join(f"  {p}" for p in problems))
    return 1 if problems else 0


def format_info(directory: str, summary: dict) -> str:
    tok = summary["tokenizer"]
    lines = [f"{directory}: source {summary['source']}, manifest sha256 {summary['manifest_sha256']}",
             f"tokenizer: {tok['kind']}, vocab_size {tok['vocab_size']:,} (separator {tok['vocab_size'] - 1:,}), "
             f"sha256 {tok['sha256']}",
             "",
             f"{'split':<14}{'tokens':>14}{'documents':>12}{'files':>7}"]
    for name, s in summary["splits"].items():
        lines.append(f"{name:<14}{s['tokens']:>14,}{s['documents']:>12,}{len(s['files']):>7}")
    splits = summary["splits"].values()
    lines.append(f"{'total':<14}{sum(s['tokens'] for s in splits):>14,}{sum(s['documents'] for s in splits):>12,}"
                 f"{sum(len(s['files']) for s in splits):>7}")
    lines += format_composition(summary.get("composition") or {})
    lines += ["", "licences:"]
    for lic in summary["licences"]:
        count = f" ({lic['documents']:,} documents)" if "documents" in lic else ""
        lines.append(f"  {lic['name']}{count}: {lic['licence']}")
    return "\n".join(lines)


def format_composition(composition: dict[str, dict[str, dict]], shown: int = 12) -> list[str]:
    """Per split, the largest `shown` origins (the rest summed in one row), with their share of its tokens."""
    if not composition:
        return []
    lines = ["", "composition by origin (first /-separated part of document ids; share of the split's tokens):",
             f"{'split / origin':<30}{'tokens':>14}{'share':>8}{'documents':>12}"]
    for split, origins in composition.items():
        lines.append(split)
        rows = list(origins.items())
        if len(rows) > shown:
            rest = rows[shown - 1:]
            rows = rows[:shown - 1] + [(f"({len(rest):,} more origins)",
                                        {k: sum(r[k] for _, r in rest) for k in ("tokens", "documents", "share")})]
        for name, r in rows:
            label = name if len(name) <= 27 else name[:26] + "…"
            lines.append(f"  {label:<28}{r['tokens']:>14,}{r['share']:>8.1%}{r['documents']:>12,}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="creditlab")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
