"""Document-level splits: TRAIN / DEV / FINAL_HELDOUT, decided by a hash of each document's key.

The key is the document id (or a group id shared by documents whose texts overlap, so that an edition and
its excerpt never straddle two splits). A hash rather than a shuffle makes a document's split a property of
the document alone: adding or removing other documents never moves it.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

SPLITS: tuple[str, ...] = ("train", "dev", "final_heldout")
DEFAULT_FRACTIONS: tuple[float, float, float] = (0.90, 0.05, 0.05)


def check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    if len(fractions) != len(SPLITS):
        raise ValueError(f"split fractions need {len(SPLITS)} numbers ({'/'.join(SPLITS)}), got {list(fractions)}")
    if any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9 or fractions[0] <= 0:
        raise ValueError(f"split fractions must be >= 0, with train > 0, and sum to 1; got {list(fractions)}")
    return (float(fractions[0]), float(fractions[1]), float(fractions[2]))


def parse_fractions(text: str) -> tuple[float, float, float]:
    """'90/5/5' (percentages, summing to 100) or '0.9,0.05,0.05' (fractions, summing to 1) -> (0.9, 0.05, 0.05).
    Anything else is refused rather than renormalized: 50/50/50 is a mistake, not a third each."""
    parts = [p for p in text.replace(",", "/").split("/") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"cannot parse split fractions {text!r}; write e.g. 90/5/5") from None
    total = sum(values)
    for scale in (1.0, 100.0):
        if abs(total - scale) <= 1e-9 * scale:
            return check_fractions([v / scale for v in values])
    raise ValueError(f"--splits {text!r} sums to {total:g}: give percentages summing to 100 (e.g. 90/5/5) or "
                     f"fractions summing to 1 (e.g. 0.9,0.05,0.05)")


def split_of(key: str, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> str:
    """The split of the document with this key: sha256(key) read as a number in [0, 1), cut by the fractions."""
    u = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64
    edge = 0.0
    for name, frac in zip(SPLITS, fractions):
        edge += frac
        if u < edge:
            return name
    # Only reachable through float rounding at the top edge: the last split that takes any documents.
    return [name for name, frac in zip(SPLITS, fractions) if frac > 0][-1]
