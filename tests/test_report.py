"""Run reports: written from a record folder alone, never over an existing one (a second goes beside it)."""

import pytest

from creditlab import cli
from creditlab.experiments.report import load_run, report


def _train(tmp_path, *extra):
    code = cli.main(["train", "--preset", "tiny", "--set", "model.vocab_size=97", "--set", "train.updates=5", "--set", "train.warmup=0",
                     "--set", "credit.teacher_every=2", "--set", f"train.out_dir={tmp_path}", *extra])
    assert code == 0
    return [p for p in tmp_path.iterdir() if "-train-" in p.name]


def test_train_writes_a_report_and_a_second_beside_it(tmp_path):
    (run,) = _train(tmp_path, "--set", "credit.source=learned")
    text = (run / "report.md").read_text()
    assert "teacher updates | 3" in text and "loss first -> last" in text and "Status: **finished**" in text
    assert (run / "report.png").stat().st_size > 10_000
    before = (run / "report.md").read_bytes()
    # The report is derived and the record append-only: a second report goes beside the first.
    assert [p.name for p in report([run])] == ["report-2.png", "report-2.md"]
    assert (run / "report.md").read_bytes() == before and "(report-2.png)" in (run / "report-2.md").read_text()
    rows = load_run(run)["rows"]
    assert [r["kind"] for r in rows] == ["teacher", "synthetic", "teacher", "synthetic", "teacher"]
    first_fit = rows[0]["fit"]
    # Zero-initialized projections make every true correction exactly zero at the first update: no fit signal,
    # 0/0, which strict JSON records as null.
    assert first_fit["fit_error"] is None and "NaN" not in (run / "rows.jsonl").read_text()


def test_several_runs_compare_in_one_figure(tmp_path):
    runs = _train(tmp_path / "a") + _train(tmp_path / "b", "--set", "credit.source=zero")
    paths = report(runs, tmp_path / "cmp")
    assert [p.name for p in paths] == ["report.png", "report.md"]
    assert (tmp_path / "cmp" / "report.md").read_text().count("# Run ") == 2


def test_a_folder_without_rows_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_run(tmp_path)
