"""The credit contract (creditlab/credit/README.md): a new source is one class and one registry line, for every
command. The README's own example is the source these tests register."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from creditlab import cli
from creditlab.credit import registry

README = Path(__file__).resolve().parents[1] / "creditlab" / "credit" / "README.md"
CPU = ["train.device=cpu", "train.warmup=0", "train.compile=off", "model.vocab_size=97", "model.seq_len=16", "model.layers=2",
       "model.value_embeds=1", "train.micro_batch=2", "train.grad_accum=1", "train.eval_tokens=128"]


@pytest.fixture
def shrink(tmp_path, monkeypatch):
    """The README's example source, from a temporary module, registered by one line."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    (tmp_path / "shrink_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.SOURCES, "shrink", "shrink_example:ShrinkSource")
    yield
    sys.modules.pop("shrink_example", None)


def test_a_source_from_a_temporary_module_trains_and_compares_with_its_floor(shrink, tmp_path, capsys):
    sets = [a for o in CPU for a in ("--set", o)]
    assert cli.main(["train", "--preset", "tiny", "--set", "credit.source=shrink", "--set", "train.updates=2",
                     "--no-record", "--no-progress", *sets]) == 0
    assert cli.main(["compare", "--preset", "tiny", "--arms", "native,shrink", "--seeds", "1",
                     "--set", "train.updates=3", "--set", "compare.native_budgets=", "--no-progress",
                     "--out", str(tmp_path / "c"), *sets]) == 0
    result = json.loads((tmp_path / "c" / "compare.json").read_text())
    arms = {a["label"]: a for a in result["arms"]}
    assert arms["shrink"]["about"].startswith("the omitted products replaced")
    assert arms["shrink"]["role"]["floor"] == "zero" and arms["zero"]["role"]["added"] == "floor"
    shrunk, zero = result["runs"]["shrink"]["1"]["dev_loss"], result["runs"]["zero"]["1"]["dev_loss"]
    assert shrunk != zero  # the correction reached the trunk: not the floor under another name
    capsys.readouterr()
    assert cli.main(["compare", "--preset", "tiny", "--arms", "native,shrunk", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "unknown arm 'shrunk'" in err and ", shrink" in err  # the registered source is listed among the arms


def test_the_arms_benchmark_and_the_screen_take_a_registered_source(shrink):
    from benchmark_scripts import load
    from creditlab import config
    from creditlab.protocol import screen

    assert load("arms").overrides_of("shrink") == ["credit.source=shrink"]
    cfg = config.load("tiny", ["credit.source=shrink"])
    synthetic = screen.arm_config(cfg, "synthetic", screen.synthetic_source_of(cfg))
    assert synthetic.credit.source == "shrink" and synthetic.credit.schedule == "never"
