"""FINAL_HELDOUT: the loss of a finished run on the held-out split, read once per admission.

The admission must exist and every file it froze must still match (the code, config and data it names are the
ones the read is made with), and the run must have been trained on the admitted data (the same manifest). The
read goes through the access ledger, which refuses a second FINAL_HELDOUT read under the same admission and
names the first. The result is written into the run's record as `heldout-<admission prefix>.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

from creditlab.protocol import admission as adm_mod
from creditlab.protocol.records import write_once


class HeldoutRefused(RuntimeError):
    """The read does not happen; the message says why."""


def heldout(run: str | Path, admission_ref: str, out_dir: str | Path, tokens: int | None = None) -> dict:
    import torch

    from creditlab import config as config_mod
    from creditlab import data
    from creditlab import runtime as rt
    from creditlab.data.ledger import LedgerError
    from creditlab.data.prepare import manifest_sha256
    from creditlab.evaluate import Evaluator
    from creditlab.model import GPT

    run = Path(run)
    if not (run / "model.pt").exists() or not (run / "config.json").exists():
        raise HeldoutRefused(f"{run} is not a finished run (it needs config.json and model.pt, written when "
                             "`creditlab train` or `compare` finishes)")
    adm = adm_mod.find(admission_ref, out_dir)
    verification = adm_mod.verify(adm)
    if not verification.ok:
        raise HeldoutRefused(verification.summary())
    frozen = {f.role: f.sha256 for f in adm.files}.get("data_manifest")
    cfg = config_mod.Config.from_dict(json.loads((run / "config.json").read_text()))
    if cfg.data.source != "shards" or frozen is None:
        raise HeldoutRefused("FINAL_HELDOUT exists only for prepared data: both the run and the admission must "
                             "use data.source=shards")
    live = manifest_sha256(cfg.data.dir)
    if live != frozen:
        raise HeldoutRefused(f"the run was trained on {cfg.data.dir} (manifest {live[:16]}), not on the admitted "
                             f"data (manifest {frozen[:16]})")
    runtime = rt.resolve(cfg.train)
    model = GPT(cfg.model).to(device=runtime.device, dtype=runtime.param_dtype)
    state = torch.load(run / "model.pt", map_location=runtime.device, weights_only=True)
    model.load_state_dict(state["model"])
    split_tokens = data.load_manifest(cfg.data.dir)["splits"]["final_heldout"]["tokens"]
    try:
        evaluator = Evaluator(cfg, runtime, "final_heldout", tokens or split_tokens,
                              purpose=f"heldout of {run.name} under admission {adm.id[:16]}", admission=adm.id,
                              allow_final_heldout=True)
    except LedgerError as exc:
        raise HeldoutRefused(str(exc)) from None
    row = evaluator(model, state.get("update", 0))
    result = row.to_dict() | {"run": str(run), "admission": adm.id, "manifest_sha256": live}
    write_once(run / f"heldout-{adm.id[:16]}.json", result)
    return result
