"""Admission: freeze what a run depends on before it runs, and check it again when it starts.

An admission lists every file a run depends on, each with its SHA256:

* every package source file, `creditlab/**/*.py` (role `source`);
* the resolved config, written as canonical JSON into the admission itself (role `config`, `config.json`);
* the prepared data's `manifest.json` (role `data_manifest`), which itself lists every shard's SHA256; with
  `data.source=synthetic` there is no file to freeze and the admission says so;
* every shard that manifest lists (role `data_shard`, path `data/<shard name>`). A shard that does not match
  its manifest is refused at admission.

Only the config is kept in the admission (a run under it reads its config from there); every other file is
frozen by its SHA256 alone, with the git commit the package sources were admitted at (and whether they then
differed from it) beside the list: the commit is where the frozen sources can be seen again.

The admission id is the SHA256 of that list (path, role, sha256; canonical JSON), so the same inputs always
give the same id, and admitting them again finds the admission (and its verdict) already there. Inputs that
differ only in cosmetic config keys (COSMETIC_KEYS: where records go, how often a line is printed) are the
same experiment: admitting them finds the earlier admission of that experiment in the same admissions folder,
with its verdict, instead of opening a second one. Layout:

    <train.out_dir>/admissions/<id>/
        admission.json   the list, the git commit and what it was made from; written last
        config.json      the admitted config
        verdicts.jsonl   one line per verdict reached under this admission (append-only)
        screens.jsonl    a `started` line per screen started under it, with its record folder, written before
                         it measures anything, and a `finished` line when it ends (append-only): a screen
                         killed before its verdict is one started and never finished

Admissions of format /1 also hold `files/`, a copy of every frozen file but the shards; their config is read
from `files/config.json`, and the other copies are not read: the live files are checked against the list.

A run under an admission verifies every frozen file (the live file against the listed SHA256; the digests of
shards may come from the data folder's hash cache, see creditlab/data/integrity.py; package sources added since
admission count as mismatches) and refuses to start on any mismatch, naming the files and, for sources, the
commit to check out to see them as they were frozen. One verdict per admission: a second screen is refused,
except one `repair` (for a correctness mismatch), which the records mark. A screen after attempts that reached
no verdict (killed, interrupted, failed) is a retry, and its record and verdict name those attempts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from creditlab.config import COSMETIC_KEYS, Config
from creditlab.data.integrity import DigestCache, shard_problems
from creditlab.protocol.records import append_jsonl, canonical_json, read_json, read_jsonl, sha256_file, \
    write_bytes_once, write_once

FORMAT = "creditlab-admission/2"  # /1: with files/, a copy of every frozen file but the shards
ADMISSIONS = "admissions"
ADMISSION_FILE = "admission.json"
LEGACY_FILES = "files"  # the copies admissions of format /1 hold; only their config.json is read
VERDICTS = "verdicts.jsonl"
SCREENS = "screens.jsonl"
CONFIG_PATH = "config.json"
MANIFEST_PATH = "data/manifest.json"
DATA_PREFIX = "data/"  # shards are listed as data/<shard name>
ROLES = ("source", "config", "data_manifest", "data_shard")
PACKAGE = "creditlab"



class AdmissionError(RuntimeError):
    """A refusal: the run does not start. The message says why and what to do."""


class AdmissionMismatch(AdmissionError):
    def __init__(self, verification: "Verification"):
        self.verification = verification
        super().__init__(verification.summary())


class AdmissionConsumed(AdmissionError):
    pass


@dataclass(frozen=True)
class FrozenFile:
    path: str  # as listed: creditlab/..., config.json, data/manifest.json, data/<shard name>
    role: str  # source | config | data_manifest | data_shard
    sha256: str


@dataclass
class Admission:
    id: str
    dir: Path
    files: list[FrozenFile]
    meta: dict = field(default_factory=dict)
    # Set by `admit` when it returns an earlier admission of the same experiment: key -> [admitted, requested]
    # for each cosmetic key whose value differs. Not stored.
    cosmetic_differences: dict = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        """The admitted config: config.json, or files/config.json in an admission of format /1."""
        path = self.dir / CONFIG_PATH
        legacy = self.dir / LEGACY_FILES / CONFIG_PATH
        return legacy if not path.exists() and legacy.exists() else path

    @property
    def config_text(self) -> str:
        return self.config_path.read_text()

    def config(self) -> Config:
        return Config.from_dict(json.loads(self.config_text))

    @property
    def commit(self) -> str | None:
        """The git commit the package sources were admitted at (None outside a git checkout)."""
        return self.meta.get("git_sha")


# ---- what is frozen ----------------------------------------------------------------------------------------

def package_root() -> Path:
    """The folder that holds the `creditlab` package (the repository root in a source checkout)."""
    return Path(__file__).resolve().parents[2]


def source_paths(root: str | os.PathLike) -> list[str]:
    """Every `creditlab/**/*.py` under root, as sorted POSIX paths relative to root (hidden files skipped)."""
    root = Path(root)
    found = []
    for path in (root / PACKAGE).rglob("*.py"):
        rel = path.relative_to(root)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if path.is_file():
            found.append(rel.as_posix())
    return sorted(found)


def config_text(cfg: Config) -> str:
    return cfg.to_json() + "\n"


def manifest_file(cfg: Config) -> Path | None:
    """The data manifest a run of cfg reads, or None when no manifest applies (synthetic data)."""
    return None if cfg.data.source == "synthetic" else Path(cfg.data.dir) / "manifest.json"


def admission_id(files: list[FrozenFile]) -> str:
    listing = [{"path": f.path, "role": f.role, "sha256": f.sha256} for f in sorted(files, key=lambda f: f.path)]
    return hashlib.sha256(canonical_json(listing).encode()).hexdigest()


def _git(root: Path, *args: str) -> str | None:
    """git's output in root (unstripped: a status line may begin with a space), or None where git fails."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(root: str | os.PathLike) -> dict:
    """The git commit of the checkout holding root, whether its tracked files differ from it (`git_dirty`), and
    which package sources differ from it or are not in it (`git_sources_changed`: the frozen sources are that
    commit's byte for byte when it is empty). All None outside a git checkout."""
    root = Path(root)
    sha = (_git(root, "rev-parse", "HEAD") or "").strip()
    if not sha:
        return {"git_sha": None, "git_dirty": None, "git_sources_changed": None}
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    package = _git(root, "status", "--porcelain", "--untracked-files=all", "--", PACKAGE)
    changed = None if package is None else sorted(
        line[3:].split(" -> ")[-1] for line in package.splitlines() if line[3:].endswith(".py"))
    return {"git_sha": sha, "git_dirty": None if dirty is None else bool(dirty.strip()),
            "git_sources_changed": changed}


def _payloads(cfg: Config, root: Path) -> dict[str, tuple[str, bytes]]:
    """path -> (role, bytes): every frozen file but the shards, each read once."""
    out = {rel: ("source", (root / rel).read_bytes()) for rel in source_paths(root)}
    if not out:
        raise AdmissionError(f"no package sources under {root / PACKAGE}; is {root} the repository root?")
    out[CONFIG_PATH] = ("config", config_text(cfg).encode())
    manifest = manifest_file(cfg)
    if manifest is not None:
        if not manifest.exists():
            from creditlab.data.prepare import DEFAULT_SOURCE, prepare_command
            raise AdmissionError(f"data.source={cfg.data.source} but {manifest} does not exist; prepare the data "
                                 f"first (`{prepare_command(DEFAULT_SOURCE, cfg.data.dir)}`) or admit with "
                                 "--set data.source=synthetic")
        out[MANIFEST_PATH] = ("data_manifest", manifest.read_bytes())
    return out


def _shards(cfg: Config, manifest_bytes: bytes) -> list[FrozenFile]:
    """The manifest's shards as frozen entries, after checking that the live shards are what it lists."""
    data_dir = Path(cfg.data.dir)
    try:
        listed = [f for split in json.loads(manifest_bytes)["splits"].values() for f in split["files"]]
        entries = [FrozenFile(DATA_PREFIX + f["name"], "data_shard", f["sha256"]) for f in listed]
    except (ValueError, KeyError, TypeError, AttributeError):
        from creditlab.data.prepare import prepare_again
        raise AdmissionError(f"{manifest_file(cfg)} is not a data manifest (no splits with files); "
                             f"{prepare_again(cfg.data.dir)}") from None
    problems = shard_problems(data_dir, listed)
    if problems:
        from creditlab.data.prepare import prepare_again
        raise AdmissionError(f"the shards in {data_dir} do not match its manifest ({'; '.join(problems)}); "
                             f"restore them, or {prepare_again(cfg.data.dir)}, before admitting")
    return entries


def admit(cfg: Config, out_dir: str | os.PathLike | None = None, root: str | os.PathLike | None = None,
          preset: str | None = None, overrides: list[str] | tuple = ()) -> tuple[Admission, bool]:
    """Freeze sources, config, data manifest and shard hashes; returns (admission, created). Admitting the same inputs
    again returns the existing admission (created=False) with whatever verdicts it already holds."""
    root = Path(root) if root is not None else package_root()
    payloads = _payloads(cfg, root)
    files = [FrozenFile(path, role, hashlib.sha256(data).hexdigest())
             for path, (role, data) in sorted(payloads.items())]
    if MANIFEST_PATH in payloads:
        files = sorted(files + _shards(cfg, payloads[MANIFEST_PATH][1]), key=lambda f: f.path)
    ident = admission_id(files)
    base = Path(out_dir if out_dir is not None else cfg.train.out_dir) / ADMISSIONS
    final = base / ident
    if (final / ADMISSION_FILE).exists():
        return load(final), False
    experiment = experiment_key(files, cfg.to_dict())
    same = same_experiment(base, experiment)
    if same is not None:
        same.cosmetic_differences = cosmetic_differences(json.loads(same.config_text), cfg.to_dict())
        return same, False
    base.mkdir(parents=True, exist_ok=True)
    manifest = manifest_file(cfg)
    counts = {role: sum(f.role == role for f in files) for role in ROLES}
    meta = {
        "format": FORMAT, "admission": ident, "files": [asdict(f) for f in files], "counts": counts,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "preset": preset, "overrides": list(overrides), "root": str(root.resolve()),
        "data": ({"source": cfg.data.source, "manifest": str(manifest.resolve()), "applies": True}
                 if manifest is not None else
                 {"source": cfg.data.source, "manifest": None, "applies": False,
                  "why": "data.source=synthetic: a deterministic token stream with no files, so no manifest "
                         "applies; the config (frozen) fixes the stream"}),
        **git_state(root),
        "id_rule": "sha256 of canonical JSON of [{path, role, sha256}] sorted by path",
        "experiment": experiment, "cosmetic_keys": list(COSMETIC_KEYS),
    }
    staging = base / f".staging-{ident[:16]}-{secrets.token_hex(3)}"
    staging.mkdir()
    write_bytes_once(staging / CONFIG_PATH, payloads[CONFIG_PATH][1])  # the one file kept: the rest by hash
    write_once(staging / ADMISSION_FILE, meta)  # last: a folder without admission.json is not an admission
    try:
        os.rename(staging, final)
    except OSError:
        if (final / ADMISSION_FILE).exists():  # admitted concurrently with the same inputs
            return load(final), False
        raise AdmissionError(f"{final} exists but holds no {ADMISSION_FILE} (an interrupted admission); "
                             f"move it aside and admit again; the new admission is left in {staging}") from None
    return load(final), True


# ---- one experiment, one admission ------------------------------------------------------------------------

def _without_cosmetic(config: dict) -> dict:
    out = {section: dict(values) for section, values in config.items()}
    for key in COSMETIC_KEYS:
        section, _, name = key.partition(".")
        out.get(section, {}).pop(name, None)
    return out


def experiment_key(files: list[FrozenFile], config: dict) -> str:
    """What the arms depend on: every frozen file but the config (sources, data manifest, shards), and the
    config without its cosmetic keys. Equal keys: the same experiment, however its records are labelled."""
    listing = [{"path": f.path, "role": f.role, "sha256": f.sha256}
               for f in sorted(files, key=lambda f: f.path) if f.role != "config"]
    return hashlib.sha256(canonical_json({"files": listing, "config": _without_cosmetic(config)}).encode()
                          ).hexdigest()


def experiment_of(adm: Admission) -> str:
    """The experiment key of an admission, from its listing and stored config (admissions made before the key
    was recorded have it computed the same way)."""
    return experiment_key(adm.files, json.loads(adm.config_text))


def cosmetic_differences(admitted: dict, requested: dict) -> dict:
    out = {}
    for key in COSMETIC_KEYS:
        section, _, name = key.partition(".")
        a, b = admitted.get(section, {}).get(name), requested.get(section, {}).get(name)
        if a != b:
            out[key] = [a, b]
    return out


def same_experiment(base: Path, experiment: str) -> Admission | None:
    """The earliest admission under base of the same experiment, or None."""
    found = []
    for meta_path in sorted(base.glob(f"*/{ADMISSION_FILE}")) if base.is_dir() else []:
        try:
            adm = load(meta_path.parent)
            if experiment_of(adm) == experiment:
                found.append(adm)
        except (AdmissionError, OSError, ValueError, KeyError):
            continue  # an unreadable or altered admission is no precedent; verifying it refuses it by name
    return min(found, key=lambda a: (a.meta.get("created", ""), a.id)) if found else None


# ---- finding an admission ----------------------------------------------------------------------------------

def load(path: str | os.PathLike) -> Admission:
    path = Path(path)
    meta_path = path / ADMISSION_FILE
    if not meta_path.exists():
        raise AdmissionError(f"{path} is not an admission ({ADMISSION_FILE} is missing)")
    meta = read_json(meta_path, AdmissionError, "the admission record was damaged; admit again into a new folder")
    files = [FrozenFile(f["path"], f["role"], f["sha256"]) for f in meta["files"]]
    ident = admission_id(files)
    if ident != meta["admission"] or ident != path.name:
        raise AdmissionError(f"{meta_path}: the listed files hash to {ident}, but the record says "
                             f"{meta['admission']} (folder {path.name}); the admission record was altered")
    return Admission(ident, path, files, meta)


def find(ref: str, out_dir: str | os.PathLike) -> Admission:
    """An admission by folder path, full id, or unique id prefix (at least 8 hex digits) under out_dir."""
    as_path = Path(ref)
    if (as_path / ADMISSION_FILE).exists():
        return load(as_path)
    base = Path(out_dir) / ADMISSIONS
    if len(ref) < 8 or any(c not in "0123456789abcdef" for c in ref.lower()):
        raise AdmissionError(f"no admission {ref!r}: give its folder or at least 8 hex digits of its id")
    matches = sorted(p for p in base.glob(f"{ref.lower()}*") if (p / ADMISSION_FILE).exists()) \
        if base.is_dir() else []
    if not matches:
        raise AdmissionError(f"no admission {ref!r} under {base}; admissions are made by `creditlab admit` "
                             "(pass --out-dir if it was made elsewhere)")
    if len(matches) > 1:
        raise AdmissionError(f"{ref!r} matches {len(matches)} admissions under {base}: "
                             + ", ".join(p.name[:16] for p in matches))
    return load(matches[0])


# ---- verification ------------------------------------------------------------------------------------------

@dataclass
class FileCheck:
    path: str
    role: str
    status: str  # match | changed | missing | added
    expected: str | None = None
    live: str | None = None  # SHA256 of the file the run would use
    where: str | None = None  # the live file checked

    DESCRIBE = {"changed": "changed since admission", "missing": "missing", "added": "added since admission"}

    def describe(self) -> str:
        return f"{self.path} ({self.DESCRIBE.get(self.status, self.status)})"


@dataclass
class Verification:
    admission: str
    checks: list[FileCheck]
    commit: str | None = None  # the git commit the sources were admitted at
    sources_changed: list[str] | None = None  # sources that differed from that commit at admission
    dirty: bool | None = None  # whether the checkout differed from that commit at admission

    @property
    def frozen(self) -> int:
        return sum(c.status != "added" for c in self.checks)

    @property
    def matched(self) -> int:
        return sum(c.status == "match" for c in self.checks)

    @property
    def problems(self) -> list[FileCheck]:
        return [c for c in self.checks if c.status != "match"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def where_frozen(self) -> str | None:
        """Where the frozen sources can be seen, when a source does not match; None when every source does."""
        if not any(c.role == "source" for c in self.problems):
            return None
        if self.commit is None:
            return "the admission recorded no git commit (its sources were not a git checkout): admit again"
        sha = self.commit[:12]
        where = f"the admission froze them at commit {sha}: `git checkout {sha}` to see them, or admit again"
        if self.sources_changed:
            where += (f" (at admission {len(self.sources_changed)} source file(s) differed from that commit: "
                      + ", ".join(self.sources_changed[:5]) + (", ..." if len(self.sources_changed) > 5 else "")
                      + "; the listed SHA256 is what was frozen)")
        elif self.sources_changed is None and self.dirty:
            where += " (the checkout had uncommitted changes at admission; the listed SHA256 is what was frozen)"
        return where

    def summary(self) -> str:
        head = f"{self.matched}/{self.frozen} frozen files match admission {self.admission[:16]}"
        if self.ok:
            return head
        where = self.where_frozen()
        return (head + "; refusing to run: " + ", ".join(c.describe() for c in self.problems)
                + (f"; {where}" if where else ""))

    def to_json(self) -> dict:
        return {"admission": self.admission, "frozen": self.frozen, "matched": self.matched, "ok": self.ok,
                "commit": self.commit, "summary": self.summary(), "checks": [asdict(c) for c in self.checks]}


def _sha_or_none(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def live_path(adm: Admission, entry: FrozenFile, root: str | os.PathLike | None = None,
              cfg: Config | None = None) -> Path | None:
    """The file a run under the admission uses for a frozen entry: a source at root/path; the config in the
    admission itself (an admitted run reads its config from there); the data manifest and shards where the
    admitted config's data.dir points from here (None when the config cannot be read)."""
    root = Path(root) if root is not None else package_root()
    if entry.role == "source":
        return root / entry.path
    if entry.role == "config":
        return adm.config_path
    cfg = cfg if cfg is not None else _config_or_none(adm)
    if cfg is None:
        return None
    if entry.role == "data_shard":
        return Path(cfg.data.dir) / entry.path.removeprefix(DATA_PREFIX)
    return manifest_file(cfg)


def verify(adm: Admission, root: str | os.PathLike | None = None) -> Verification:
    """Check every frozen file the run will use against its listed SHA256 (see live_path). A copy in an
    admission of format /1 is not read (but its config)."""
    root = Path(root) if root is not None else package_root()
    cfg = _config_or_none(adm) if any(f.role.startswith("data_") for f in adm.files) else None
    shard_cache = DigestCache(cfg.data.dir) if cfg is not None else None
    checks = []
    for f in adm.files:
        where = live_path(adm, f, root, cfg)
        if f.role == "data_shard":
            live = _cached_sha_or_none(shard_cache, where.name) if where is not None else None
        else:
            live = _sha_or_none(where) if where is not None else None
        status = "missing" if live is None else "changed" if live != f.sha256 else "match"
        checks.append(FileCheck(f.path, f.role, status, f.sha256, live, str(where) if where else None))
    if shard_cache is not None:
        shard_cache.save()
    listed = {f.path for f in adm.files if f.role == "source"}
    for rel in source_paths(root):
        if rel not in listed:
            checks.append(FileCheck(rel, "source", "added", None, sha256_file(root / rel), str(root / rel)))
    return Verification(adm.id, checks, adm.commit, adm.meta.get("git_sources_changed"), adm.meta.get("git_dirty"))


def _cached_sha_or_none(cache: DigestCache | None, name: str) -> str | None:
    try:
        return cache.sha256(name) if cache is not None else None
    except (FileNotFoundError, IsADirectoryError):
        return None


def _config_or_none(adm: Admission) -> Config | None:
    try:
        return adm.config()
    except (OSError, ValueError):
        return None


def verified_config(adm: Admission, root: str | os.PathLike | None = None) -> tuple[Config, Verification]:
    """The admitted config, after every frozen file matched; raises AdmissionMismatch otherwise."""
    verification = verify(adm, root)
    if not verification.ok:
        raise AdmissionMismatch(verification)
    cfg = adm.config()
    if config_text(cfg) != adm.config_text:
        raise AdmissionError(f"the admitted config does not round-trip through this package's Config "
                             f"({adm.config_path}); admit again")
    return cfg, verification


# ---- one verdict per admission -----------------------------------------------------------------------------

def verdicts(adm: Admission) -> list[dict]:
    path = adm.dir / VERDICTS
    return read_jsonl(path) if path.exists() else []


def screens(adm: Admission) -> list[dict]:
    path = adm.dir / SCREENS
    return read_jsonl(path) if path.exists() else []


# How a screen started under an admission ended, when it reached no verdict: `unfinished` (started and never
# finished: killed, or its machine died), `interrupted`, `error`, `invalid`. Each makes the next screen a retry.
NO_VERDICT = ("unfinished", "interrupted", "error", "invalid")


def attempts(adm: Admission) -> list[dict]:
    """Every screen started under the admission, in order: {record_dir, time, repair, final, status}, the status
    its verdict, `exploratory` (it ran where no verdict can be final), or one of NO_VERDICT."""
    verdict_of = {v["record_dir"]: v["verdict"] for v in verdicts(adm)}
    started, ended = [], {}
    for entry in screens(adm):
        if entry.get("event", "started") == "started":  # lines written before events were named are starts
            started.append(entry)
        else:
            ended[entry["record_dir"]] = entry.get("outcome")
    out = []
    for entry in started:
        where = entry["record_dir"]
        status = verdict_of.get(where) or ended.get(where) or "unfinished"
        out.append({"record_dir": where, "time": entry.get("time"), "repair": entry.get("repair"),
                    "final": entry.get("final", True), "status": status})
    return out


def may_screen(adm: Admission, repair: str | None = None) -> dict:
    """Whether a screen may run under this admission now; raises AdmissionConsumed if not.

    Returns what the new record should say: {"repair": reason or None, "earlier_verdicts": [...],
    "unfinished_screens": [...] (screens started here that reached no verdict), "retry_of": [...] (the
    attempts since the last verdict that could have reached one and did not: the new screen retries them)}."""
    done = verdicts(adm)
    if repair is not None and not repair.strip():
        raise AdmissionError("--repair needs a reason: the correctness mismatch that the repair addresses")
    if not done and repair is not None:
        raise AdmissionError(f"admission {adm.id[:16]} has no verdict yet, so there is nothing to repair; "
                             "run the screen without --repair")
    if done:
        first = done[0]
        earlier = f"{first['verdict']} recorded in {first['record_dir']} at {first['time']}"
        repairs = [v for v in done if v.get("repair")]
        if repairs:
            raise AdmissionConsumed(
                f"admission {adm.id[:16]} already has a verdict ({earlier}) and its one repair was used "
                f"({repairs[0]['verdict']} in {repairs[0]['record_dir']}, reason: {repairs[0]['repair']!r}); "
                "a further screen needs a new admission")
        if repair is None:
            raise AdmissionConsumed(
                f"admission {adm.id[:16]} already has a verdict: {earlier}. One verdict per admission; a "
                "correctness mismatch may be repaired once with --repair \"reason\"")
    verdict_dirs = {v["record_dir"] for v in done}
    unfinished = [s["record_dir"] for s in screens(adm)
                  if s.get("event", "started") == "started" and s["record_dir"] not in verdict_dirs]
    retry_of = []
    for attempt in attempts(adm):
        if attempt["record_dir"] in verdict_dirs:
            retry_of = []  # a verdict settles the attempts before it
        elif attempt["final"] and attempt["status"] in NO_VERDICT:
            retry_of.append(attempt)
    return {"repair": repair, "earlier_verdicts": done, "unfinished_screens": unfinished, "retry_of": retry_of}


@contextlib.contextmanager
def exclusive(adm: Admission):
    """Hold the admission for one screen at a time (released by the OS if the process dies)."""
    with open(adm.dir / ".lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AdmissionError(f"another screen is running under admission {adm.id[:16]}") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_screen(adm: Admission, entry: dict) -> None:
    """A screen started (written before it measures anything)."""
    append_jsonl(adm.dir / SCREENS, {"event": "started", **entry})


def record_finish(adm: Admission, entry: dict) -> None:
    """A screen ended: entry["outcome"] is its verdict, `exploratory`, or how it failed."""
    append_jsonl(adm.dir / SCREENS, {"event": "finished", **entry})


def record_verdict(adm: Admission, entry: dict) -> None:
    append_jsonl(adm.dir / VERDICTS, entry)
