"""FINAL_HELDOUT: the loss of a finished run (or of every model of a comparison) on the held-out split, read
once per admission.

The admission must exist (checked before the run or the data are read) and every file it froze must still match
(the code, config and data it names are the ones the read is made with), and the run must have been trained on
the admitted data (the same manifest). The read goes through the access ledger, which refuses a second FINAL_HELDOUT read under the same admission and
names the first; a comparison's models are all evaluated in that one read. The result is written into the
run's (or comparison's) folder as `heldout-<admission prefix>.json`.
"""

from __future__ import annotations

from pathlib import Path

from creditlab.protocol import admission as adm_mod
from creditlab.protocol.records import read_json, write_once


class HeldoutRefused(RuntimeError):
    """The read does not happen; the message says why."""


def _models(path: Path) -> list[Path]:
    """The finished runs a heldout read covers: one run, or every arm-seed record of a comparison."""
    if (path / "compare.json").exists():
        from creditlab.experiments.compare import record_dirs
        runs = record_dirs(path, read_json(path / "compare.json"))
    else:
        runs = [path]
    unfinished = [str(r) for r in runs if not (r / "model.pt").exists() or not (r / "config.json").exists()]
    if not runs or unfinished:
        raise HeldoutRefused(f"{', '.join(unfinished) or path} is not a finished run (it needs config.json and "
                             "model.pt, written when `creditlab train` or `compare` finishes)")
    return runs


def require_admission(admission_ref: str | None, out_dir: str | Path) -> adm_mod.Admission:
    """The admission a FINAL_HELDOUT read is made under: it must exist (its record intact) and every file it froze
    must still match. Checked before anything else is read, so a read without one never reaches the split."""
    if admission_ref is None or not str(admission_ref).strip():
        raise HeldoutRefused("FINAL_HELDOUT is read only under an existing admission (`creditlab admit`, then "
                             "--admission ID)")
    try:
        adm = adm_mod.find(str(admission_ref).strip(), out_dir)
    except adm_mod.AdmissionError as exc:
        raise HeldoutRefused(f"FINAL_HELDOUT is read only under an existing admission: {exc}") from None
    verification = adm_mod.verify(adm)
    if not verification.ok:
        raise HeldoutRefused(verification.summary())
    return adm


def heldout(path: str | Path, admission_ref: str, out_dir: str | Path, tokens: int | None = None) -> dict:
    """FINAL_HELDOUT loss of a finished run, or of every model of a comparison in one read."""
    import torch

    from creditlab import config as config_mod
    from creditlab import data
    from creditlab import runtime as rt
    from creditlab.data.ledger import LedgerError
    from creditlab.data.prepare import manifest_sha256
    from creditlab.evaluate import Evaluator
    from creditlab.model import GPT

    if rt.launched_processes() > 1:  # every rank would read the split and append to its ledger
        raise HeldoutRefused("FINAL_HELDOUT is read in one process; start it without torchrun")
    adm = require_admission(admission_ref, out_dir)
    path = Path(path)
    runs = _models(path)
    frozen = {f.role: f.sha256 for f in adm.files}.get("data_manifest")
    configs = [config_mod.Config.from_dict(read_json(r / "config.json")) for r in runs]
    for run, cfg in zip(runs, configs):
        if cfg.data.source != "shards" or frozen is None:
            raise HeldoutRefused("FINAL_HELDOUT exists only for prepared data: both the run and the admission "
                                 "must use data.source=shards")
        live = manifest_sha256(cfg.data.dir)
        if live != frozen:
            raise HeldoutRefused(f"{run} was trained on {cfg.data.dir} (manifest {live[:16]}), not on the "
                                 f"admitted data (manifest {frozen[:16]})")
    cfg = configs[0]
    runtime = rt.resolve(cfg.train)
    split_tokens = data.load_manifest(cfg.data.dir)["splits"]["final_heldout"]["tokens"]
    try:  # one read of the split for every model: one ledger entry
        evaluator = Evaluator(cfg, runtime, "final_heldout", tokens or split_tokens,
                              purpose=f"heldout of {path.name} ({len(runs)} model(s)) under admission "
                                      f"{adm.id[:16]}", admission=adm.id, allow_final_heldout=True)
    except LedgerError as exc:
        raise HeldoutRefused(str(exc)) from None
    rows = {}
    for run, run_cfg in zip(runs, configs):
        model = GPT(run_cfg.model).to(device=runtime.device, dtype=runtime.param_dtype)
        state = torch.load(run / "model.pt", map_location=runtime.device, weights_only=True)
        model.load_state_dict(state["model"])
        rows[run.name] = evaluator(model, state.get("update", 0)).to_dict()
    first = next(iter(rows.values()))
    result = first | {"path": str(path), "admission": adm.id, "manifest_sha256": frozen, "models": rows}
    write_once(path / f"heldout-{adm.id[:16]}.json", result)
    return result
