"""The unit every source yields: one document with a stable id."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """A document: `id` is stable across runs and unique within a source; `text` is the raw text.

    `group` names documents whose texts overlap (an edition and its excerpt); documents of one group always
    fall in the same split. It defaults to the id.
    """

    id: str
    text: str
    group: str | None = None

    @property
    def split_key(self) -> str:
        return self.group if self.group is not None else self.id
