"""Optional logging of a comparison's arms to Weights & Biases (`compare --wandb PROJECT`).

One W&B run per arm and seed, grouped by the comparison's folder name: every update's row (loss, seconds,
kind, fit) and every DEV evaluation. Offline unless the user has configured otherwise (WANDB_MODE), so nothing
leaves the machine by default; `wandb sync` uploads later. The records on disk stay the source of truth: W&B
is a view of them, and a comparison without the package installed is refused before it starts.
"""

from __future__ import annotations

import importlib
import os

from creditlab.config import ConfigError


def require_wandb():
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ConfigError("--wandb needs the wandb package: pip install wandb (or drop --wandb)") from None


class NoTracker:
    def row(self, row: dict) -> None:
        pass

    def eval(self, row: dict) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker:
    def __init__(self, project: str, group: str, name: str, config: dict, folder: str):
        wandb = require_wandb()
        self.run = wandb.init(project=project, group=group, name=name, config=config, dir=folder,
                              mode=os.environ.get("WANDB_MODE", "offline"), reinit=True)

    def row(self, row: dict) -> None:
        values = {"train/loss": row["loss"], "train/seconds": row["seconds"], "train/lr_scale": row["lr_scale"],
                  "train/teacher": float(row["kind"] == "teacher")}
        if row.get("fit"):
            values.update({f"fit/{k}": v for k, v in row["fit"].items() if isinstance(v, (int, float))})
        self.run.log(values, step=row["update"] + 1)

    def eval(self, row: dict) -> None:
        values = {"dev/loss": row["loss"]}
        if row.get("bits_per_byte") is not None:
            values["dev/bits_per_byte"] = row["bits_per_byte"]
        self.run.log(values, step=row["update"])

    def finish(self) -> None:
        self.run.finish()


def tracker(project: str | None, group: str, name: str, config: dict, folder: str):
    return NoTracker() if project is None else WandbTracker(project, group, name, config, folder)
