"""pack:docs on tiny fake .debs built here: formats, prose filters, dedup, chunks, caches (CPU, no network)."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from creditlab.data import debian, docs_pack
from creditlab.data.artifacts import ArtifactError
from creditlab.data.chunks import chunk_text
from creditlab.data.debian import Deb, deb_files, fetch_deb
from creditlab.data.dedup import dedup
from creditlab.data.docs_pins import DocSource
from creditlab.data.prose import Block, judge

PROSE = ("The quick configuration of the server is described in this section, and it explains how the "
         "options work together when the daemon starts for the first time on a new machine.")

HTML = f"""<html><head><title>Guide</title><style>p {{ color: red }}</style><script>var x = 1;</script></head>
<body><div class="related"><a href="a.html">previous</a> | <a href="b.html">next</a></div>
<div class="body" role="main"><h1>Getting started<a class="headerlink" href="#s">\u00b6</a></h1>
<p>{PROSE}</p>
<div class="highlight"><pre>for (int i = 0; i &lt; n; i++) {{ total += values[i]; }}</pre></div>
<pre>SECRET_CODE_LINE = compute(42)</pre>
<table><tr><td>TABLE_CELL alpha</td><td>beta gamma delta</td></tr></table>
<ul><li>Each option can be set in the file or on the command line, whichever is more convenient.</li></ul>
<p>if (x == 1) {{ y[0] = z->next; return &amp;w; }}</p>
<p>You can use the <code class="docutils literal">open()</code> function to read the file that holds the data.</p>
</div><div class="footer">&copy; Copyright 2023, Example. Created using Sphinx 5.3.</div></body></html>"""

GERMAN = ("<html><body><h1>Anleitung</h1><p>Die Konfiguration des Servers wird in diesem Abschnitt beschrieben, "
          "und sie erklärt, wie die Optionen beim ersten Start des Dienstes auf einem neuen Rechner "
          "zusammenwirken und welche Dateien dafür gelesen werden müssen.</p>" * 3 + "</body></html>")

MAN = r""".\" a comment
.TH FAKE 1
.de Vx
MACRO_BODY_LINE \\$1
..
.SH NAME
fake \- a program that does nothing useful
.SH DESCRIPTION
.B fake
reads the configuration of the server and explains how the options work together when the daemon starts
for the first time on a new machine, and it prints \fIa short report\fP to the standard output.
.PP
.nf
EXAMPLE_BLOCK_LINE --flag=1
.fi
.SH EXIT STATUS
The program returns zero when it succeeds and a value other than zero when an error is found in the file.
"""

INFO = ("This is fake.info, produced by makeinfo.\n\n\x1f\nFile: fake.info,  Node: Top,  Next: Intro,  Up: (dir)\n\n"
        "Fake manual\n***********\n\n"
        "This manual describes how the fake tool reads its configuration and what each of the options does when "
        "the tool starts for the first time.\n\n"
        "     INFO_EXAMPLE = 1\n     more code here\n\n"
        "* Menu:\n\n* Intro::     The introduction.\n\n"
        "\x1f\nFile: fake.info,  Node: Intro,  Prev: Top,  Up: Top\n\n"
        "1 Intro\n*******\n\nThe introduction explains that the tool is only an example and that it has no "
        "real purpose other than to be read by a test of the extraction code, which is a fine purpose.\n"
        "\x1f\nTag Table:\nNode: Top\x7f90\n\x1f\nEnd Tag Table\n")

POD = """=head1 NAME

fakepod - a manual written in plain old documentation for the tests

=head1 DESCRIPTION

This B<manual> explains how the C<fake> module reads the configuration and what each of the options
does when the module is loaded for the first time by a program, see L<perlfunc/open> for more.

    my $POD_VERBATIM = 1;

=begin html

<p>POD_HTML_BLOCK</p>

=end html

=head2 Options

Every option has a default value that is good enough for most of the people who will use the module.

=cut
"""


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ar(members: list[tuple[str, bytes]]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        out += [header, data, b"\n" if len(data) % 2 else b""]
    return b"".join(out)


def make_deb(path: Path, files: dict[str, bytes], data_member: str = "data.tar.xz") -> Path:
    path.write_bytes(_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", _tar_xz({"control": b"Package: x\n"})),
                          (data_member, _tar_xz(files))]))
    return path


def fake_files(extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    files = {
        "usr/share/doc/fakedoc/html/guide.html": HTML.encode(),
        "usr/share/doc/fakedoc/html/de/guide.html": GERMAN.encode(),  # a translation, by its path
        "usr/share/doc/fakedoc/html/anleitung.html": GERMAN.encode(),  # German under an English path
        "usr/share/doc/fakedoc/html/_sources/guide.rst.txt": b"Getting started\n===============\n\n" + PROSE.encode(),
        "usr/share/man/man1/fake.1.gz": gzip.compress(MAN.encode(), mtime=0),
        "usr/share/info/fake.info.gz": gzip.compress(INFO.encode(), mtime=0),
        "usr/share/perl/5/pod/fakepod.pod": POD.encode(),
        "usr/share/doc/fakedoc/copyright": b"License: MIT\n",
    }
    files.update(extra or {})
    return files


def fake_source(deb_path: Path, package: str = "fakedoc") -> DocSource:
    data = deb_path.read_bytes()
    deb = Deb(package, "1.0", deb_path.name, hashlib.sha256(data).hexdigest(), len(data), "MIT")
    return DocSource(deb, "Fake docs", r"^usr/share/(?:doc/fakedoc/html/|man/|info/|perl/)", None,
                     ("usr/share/doc/fakedoc/html/", "usr/share/"))


@pytest.fixture
def deb(tmp_path: Path) -> Path:
    return make_deb(tmp_path / "fakedoc_1.0_all.deb", fake_files())


def test_deb_reader_lists_files_and_refuses_other_compressions(tmp_path: Path, deb: Path) -> None:
    names = [name for name, _ in deb_files(deb)]
    assert "usr/share/man/man1/fake.1.gz" in names and len(names) == 8
    gz = make_deb(tmp_path / "old_1.0_all.deb", {"usr/share/doc/x": b"x"}, data_member="data.tar.zst")
    with pytest.raises(ArtifactError, match="data.tar.zst is not supported"):
        list(deb_files(gz))


def test_extraction_keeps_prose_and_drops_code_tables_furniture_and_translations(deb: Path) -> None:
    docs, meta = docs_pack.extract(fake_source(deb), deb)
    by_id = {d.id: d.text for d in docs}
    assert sorted(by_id) == ["fakedoc/guide.html", "fakedoc/info/fake.info", "fakedoc/man/man1/fake.1",
                             "fakedoc/perl/5/pod/fakepod.pod"]
    html = by_id["fakedoc/guide.html"]
    assert html.split("\n\n") == [
        "Getting started", PROSE,
        "Each option can be set in the file or on the command line, whichever is more convenient.",
        "You can use the open() function to read the file that holds the data."]
    man = by_id["fakedoc/man/man1/fake.1"]
    assert man.startswith("NAME\n\nfake - a program that does nothing useful\n\nDESCRIPTION\n\nfake reads")
    assert "a short report to the standard output" in man and "EXAMPLE_BLOCK_LINE" not in man and "MACRO_BODY" not in man
    info = by_id["fakedoc/info/fake.info"]
    assert info.startswith("Fake manual\n\nThis manual describes") and "INFO_EXAMPLE" not in info
    assert "Menu" not in info and "Tag Table" not in info and "1 Intro\n\nThe introduction" in info
    pod = by_id["fakedoc/perl/5/pod/fakepod.pod"]
    assert "This manual explains how the fake module" in pod and "see open in perlfunc for more" in pod
    assert "POD_VERBATIM" not in pod and "POD_HTML_BLOCK" not in pod
    dropped = meta["dropped"]
    # The German page under an English path: its paragraphs fail the stopword check, so nothing is left.
    assert dropped["pages"] == {"too_short": 1, "translation": 1} and dropped["blocks"]["not_english"] == 3
    assert dropped["blocks"]["code"] == 1  # the <p> of C; <pre>, tables and the footer never become blocks
    assert meta["files_read"] == 5 and meta["pages"] == 4  # _sources/ is never read: it repeats the page


def test_judge_rules() -> None:
    assert judge(Block("para", PROSE)) is None
    assert judge(Block("para", "x = foo(bar[1], {baz: 2}); y->z = &q;")) == "code"
    assert judge(Block("para", "0x00 0x1f 0x20 127 255 1024 4096 65535")) == "data"
    assert judge(Block("para", "os.path.join os.path.split sys.getrecursionlimit sys.setrecursionlimit")) == "code"
    german = "Die Konfiguration des Servers wird in diesem Abschnitt beschrieben und erklärt die Optionen genau"
    assert judge(Block("para", german)) == "not_english"
    assert judge(Block("para", "Created using Sphinx 5.3.0.")) == "boilerplate"
    assert judge(Block("para", "See below")) == "fragment"
    assert judge(Block("heading", "Options")) is None


def test_exact_and_near_duplicates_drop_the_later_copy() -> None:
    words = (PROSE + " " + " ".join(f"term{i}" for i in range(150))).split()  # ~180 distinct shingles
    a = " ".join(words)
    near = " ".join(words[:100] + ["machine"] + words[101:])  # one word changed: Jaccard ~0.95
    assert near != a
    unrelated = ("Rivers carry sediment from the mountains to the sea, building deltas where the current slows "
                 "and the water spreads across the plain in many small channels over the years.")
    result = dedup([a, near, unrelated, a.upper().replace(" ", "  "), a[: len(a) // 3]])
    assert result.keep == [True, False, True, False, True]
    assert (result.exact, result.near) == (1, 1) and result.near_of == {1: 0}
    assert result.exact_bytes == len(a.upper().replace(" ", "  ").encode()) and result.near_bytes == len(near.encode())


def test_chunks_are_bounded_and_cut_at_paragraphs() -> None:
    paras = [f"Paragraph {i} " + "word " * (40 + i % 60) for i in range(300)]
    paras = [p.strip() for p in paras]
    text = "\n\n".join(paras)
    chunks = chunk_text(text, 4096)
    assert len(chunks) > 10 and all(len(c.encode()) <= 4096 for c in chunks)
    assert "\n\n".join(chunks) == text  # nothing lost, cut only between paragraphs
    long = "This is one sentence of the long paragraph. " * 400
    pieces = chunk_text(long.strip(), 1000)
    assert all(len(p.encode()) <= 1000 for p in pieces) and " ".join(pieces) == long.strip()


def _pack_from(monkeypatch, cache: Path, sources: list[DocSource]):
    monkeypatch.setattr(docs_pack, "SOURCES", tuple(sources))
    monkeypatch.setattr(docs_pack, "PROSE_PARTS", [])
    return docs_pack.build(cache, log=lambda _: None, workers=1, max_chunk_bytes=300)


def test_pack_ids_chunks_licences_and_text_cache_reuse(monkeypatch, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    copy = HTML.encode()  # the same page under a second name, later in id order
    deb = make_deb(cache / "fakedoc_1.0_all.deb", fake_files({"usr/share/doc/fakedoc/html/zcopy.html": copy}))
    source = fake_source(deb)
    pack = _pack_from(monkeypatch, cache, [source])
    ids = [d.id for d in pack.documents]
    assert len(ids) == len(set(ids)) and all(i.startswith("fakedoc/") for i in ids)
    assert [i for i in ids if i.startswith("fakedoc/guide.html")] == ["fakedoc/guide.html#0", "fakedoc/guide.html#1"]
    assert not any(i.startswith("fakedoc/zcopy.html") for i in ids)  # an exact duplicate of guide.html
    assert all(len(d.text.encode()) <= 300 for d in pack.documents)
    (record,) = pack.artifacts
    assert record["kept"]["exact_duplicate"] == 1 and record["sha256"] == source.deb.sha256
    assert len(record["text_sha256"]) == 64 and record["text_file"].endswith(".jsonl.xz")
    assert pack.licences == [{"name": "Fake docs", "licence": "MIT", "artifact": "fakedoc=1.0",
                              "documents": len(ids), "id_prefixes": ["fakedoc"]}]

    # A second build reads only the text cache: no .deb, no download.
    deb.unlink()
    monkeypatch.setattr(docs_pack, "fetch_deb", lambda *a, **k: pytest.fail("the text cache was not used"))
    again = _pack_from(monkeypatch, cache, [source])
    assert again.documents == pack.documents and again.artifacts == pack.artifacts


def test_extraction_is_deterministic(deb: Path, tmp_path: Path) -> None:
    source = fake_source(deb)
    first, meta1 = docs_pack.extract(source, deb)
    second, meta2 = docs_pack.extract(source, deb)
    assert first == second and meta1 == meta2
    from creditlab.data import textcache

    sha1 = textcache.write(tmp_path / "a.jsonl.xz", first, meta1)
    sha2 = textcache.write(tmp_path / "b.jsonl.xz", second, meta2)
    docs, meta, sha3 = textcache.read(tmp_path / "a.jsonl.xz")
    assert sha1 == sha2 == sha3 and docs == first and meta == meta1


def test_sha256_mismatch_is_refused(monkeypatch, tmp_path: Path, deb: Path) -> None:
    pinned = Deb("fakedoc", "1.0", "fakedoc_1.0_all.deb", "0" * 64, 10, "MIT")
    monkeypatch.setattr(debian, "_apt_knows", lambda d: True)
    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/" + name)

    def fake_download(cmd, cwd=None, **kw):  # "downloads" the fake .deb, whose hash is not the pinned one
        (Path(cwd) / pinned.filename).write_bytes(deb.read_bytes())
        return debian.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(debian.subprocess, "run", fake_download)
    cache = tmp_path / "cache"
    with pytest.raises(ArtifactError, match="differs from the pinned"):
        fetch_deb(pinned, cache, log=lambda _: None)
    assert not (cache / pinned.filename).exists() and list(cache.iterdir()) == []


def test_missing_apt_lists_say_what_to_run(monkeypatch, tmp_path: Path) -> None:
    pinned = Deb("fakedoc", "1.0", "fakedoc_1.0_all.deb", "0" * 64, 10, "MIT")
    monkeypatch.setattr(debian, "_apt_knows", lambda d: False)
    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(ArtifactError, match=r"run `apt-get update`"):
        fetch_deb(pinned, tmp_path, log=lambda _: None)


def test_every_artifact_of_the_pack_has_a_pinned_size() -> None:
    """The manifest records each artifact's size from its pin, never from the file: a machine holding only the
    extracted-text cache (the artifact absent) must write the same manifest as the one that downloaded it."""
    parts = docs_pack._parts()
    assert len(parts) > 90 and all(isinstance(p["size"], int) and p["size"] > 0 for p in parts)
