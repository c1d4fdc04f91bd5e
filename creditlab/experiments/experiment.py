"""Experiment files: a comparison as a TOML file (stdlib tomllib), and back.

```toml
preset = "seed"
arms = ["native", "zero", "learned@credit.fit=lstsq"]
seeds = [1, 2, 3]
repeat = 1                      # runs of each seed (the same seed again measures run-to-run noise)
out = "runs/verdict_small"      # the comparison's folder (`--out` replaces it)

[train]                         # any config section: each key is a --set section.key=value
micro_batch = 16
[compare]
native_budgets = "0.7,0.85,1.0,1.15"
```

`creditlab compare EXPERIMENT.toml` runs it; flags given beside the file (`--set`, `--seeds`, `--out`, ...)
replace or extend its values. Every comparison's folder holds its experiment as `experiment.toml`, which is
what `compare --resume` reads: a comparison started from flags is written as a file too.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from creditlab import config as config_mod

TOP_KEYS = ("preset", "arms", "seeds", "repeat", "out", "wandb")
DEFAULT_SEEDS = (1, 2, 3)


@dataclass
class Experiment:
    preset: str = "tiny"
    arms: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))
    repeat: int = 1
    overrides: list[str] = field(default_factory=list)  # section.key=value, in order
    out: str | None = None
    wandb: str | None = None  # a W&B project to log every arm's rows and evaluations to (optional dependency)

    def check(self) -> None:
        """Refuse what cannot run, in one line each."""
        if not self.arms:
            raise config_mod.ConfigError("the experiment names no arms: give arms = [...] in the file or --arms, "
                                         "e.g. --arms native,zero,learned")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise config_mod.ConfigError(f"seeds {self.seeds}: give distinct integers, e.g. --seeds 1,2,3")
        if self.repeat < 1:
            raise config_mod.ConfigError(f"repeat {self.repeat}: give a positive count of runs per seed")

    def to_toml(self) -> str:
        lines = [f"preset = {_literal(self.preset)}", f"arms = {_literal(self.arms)}",
                 f"seeds = {_literal(self.seeds)}", f"repeat = {self.repeat}"]
        if self.out is not None:
            lines.append(f"out = {_literal(self.out)}")
        if self.wandb is not None:
            lines.append(f"wandb = {_literal(self.wandb)}")
        sections: dict[str, dict[str, object]] = {}
        for item in self.overrides:
            key, _, value = item.partition("=")
            section, _, name = key.strip().partition(".")
            sections.setdefault(section, {})[name] = _typed(section, name, value.strip())
        for section, values in sections.items():
            lines += ["", f"[{section}]"] + [f"{name} = {_literal(value)}" for name, value in values.items()]
        return "\n".join(lines) + "\n"


def _typed(section: str, name: str, raw: str):
    """An override's value as the type its config field has (for the TOML file); unknown keys stay strings
    (the config refuses them when the experiment is loaded)."""
    cfg = config_mod.Config()
    sub = getattr(cfg, section, None)
    if sub is None or not dataclasses.is_dataclass(sub) or name not in {f.name for f in dataclasses.fields(sub)}:
        return raw
    try:
        return config_mod._parse(raw, typing.get_type_hints(type(sub))[name], f"{section}.{name}")
    except config_mod.ConfigError:
        return raw


def _literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    raise TypeError(f"no TOML literal for {value!r}")


def _override(section: str, name: str, value) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"{section}.{name}={value}"


def load(path: str | Path) -> Experiment:
    """An experiment file; a file that does not parse, or a key that does not belong, is one line naming it."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise config_mod.ConfigError(f"no experiment file {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise config_mod.ConfigError(f"{path} is not a TOML experiment file ({exc})") from None
    sections = {f.name for f in dataclasses.fields(config_mod.Config)}
    exp = Experiment()
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in sections:
                raise config_mod.ConfigError(f"{path}: unknown section [{key}]; config sections: "
                                             f"{', '.join(sorted(sections))}")
            exp.overrides += [_override(key, name, v) for name, v in value.items()]
        elif key in TOP_KEYS:
            setattr(exp, key, _top(path, key, value))
        else:
            raise config_mod.ConfigError(f"{path}: unknown key {key!r}; top-level keys: {', '.join(TOP_KEYS)}, "
                                         f"and config sections as [section] tables")
    return exp


def _top(path: Path, key: str, value):
    wanted = {"preset": str, "out": str, "wandb": str, "repeat": int}
    if key in wanted and not (isinstance(value, wanted[key]) and not isinstance(value, bool)):
        raise config_mod.ConfigError(f"{path}: {key} must be a {wanted[key].__name__}, got {value!r}")
    if key == "arms":
        if isinstance(value, str):
            from creditlab.experiments.arms import parse_arms
            return [s.label for s in parse_arms(value)]
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise config_mod.ConfigError(f"{path}: arms must be a list of arm labels, got {value!r}")
        return list(value)
    if key == "seeds":
        if not (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise config_mod.ConfigError(f"{path}: seeds must be a list of integers, got {value!r}")
        return list(value)
    return value


__all__ = ["Experiment", "load", "DEFAULT_SEEDS"]
