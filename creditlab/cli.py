"""The one entry point: `creditlab <command>`.

Commands: data, flops, check, admit, screen, train, compare, heldout, ceiling, report, demo. Every command that
builds a model takes `--preset NAME` and repeatable `--set section.key=value`.

A user error (`user_error`: a config, a path, data, a full or read-only disk) ends in one line on stderr and
exit 2; `creditlab --debug ...` shows its traceback. An internal error keeps its traceback (exit 1), and a run
that diverges says so in one line and exits 1, its record holding failure.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from creditlab import config as config_mod
from creditlab.credit.registry import SOURCES  # the sources by name, for the arms in --help (imports nothing heavy)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help=f"one of: {', '.join(config_mod.PRESETS)} (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config field; repeatable")


def load_config(args) -> config_mod.Config:
    return config_mod.load(args.preset or "tiny", args.overrides)


def print_config(cfg: config_mod.Config, stream=None) -> None:
    stream = stream or sys.stderr  # looked up at call time, so redirections see it
    print("resolved config:", file=stream)
    for section, values in cfg.to_dict().items():
        print(f"  [{section}] " + ", ".join(f"{k}={v}" for k, v in values.items()), file=stream)


# ---- flops -------------------------------------------------------------------------------------------------

def cmd_flops(args) -> int:
    from creditlab.flops import SKETCH_FORMS, dropbp_rate, flop_budget, sketch_cost

    cfg = load_config(args)
    if cfg.credit.teacher_every == 1:
        raise config_mod.ConfigError("credit.teacher_every=1 has no synthetic updates to save FLOPs on; "
                                     "use >= 2 (or 0 for the default cycle of 4)")
    budget = flop_budget(cfg.model, cfg.credit.teacher_every or 4, cfg.screen.cycle_gate)
    sketch, variants = None, {}
    if args.sketch or cfg.credit.source == "sketch":  # every form of credit.sketch; `sketch` the configured one
        c, t = cfg.credit, cfg.train
        tokens = t.micro_batch * cfg.model.seq_len
        try:
            variants = {form: sketch_cost(cfg.model, c.sketch_rank, form, c.sketch_every, tokens, tokens * t.grad_accum)
                        for form in SKETCH_FORMS}
        except ValueError as exc:
            raise config_mod.ConfigError(f"credit.sketch_rank: {exc}") from None
        sketch = variants[c.sketch]
    dropbp = dropbp_rate(cfg.model)  # the dropbp control's rate, the same FLOPs skipped as the omitted products
    if args.json:
        print(json.dumps(budget.to_json() | ({"sketch": sketch.to_json(), "sketch_forms": {
                             form: cost.to_json() for form, cost in variants.items()}} if sketch else {})
                         | ({"dropbp": dropbp.to_json()} if cfg.credit.source == "dropbp" else {})))
    else:
        print(f"nominal matrix/attention FLOPs per target ({args.preset}"
              f"{' + overrides' if args.overrides else ''}; Kaplan et al. 2020 convention)")
        print(budget.derivation())
        for cost in variants.values():
            print(cost.derivation())
        print(dropbp.derivation())
    return 0


# ---- check -------------------------------------------------------------------------------------------------

def cmd_check(args) -> int:
    import torch

    from creditlab import checks
    from creditlab.checks import fp8 as checks_fp8

    cfg = load_config(args)
    seeds = parse_seeds(args.seeds) if args.seed is None else [args.seed]
    configs = {args.preset: cfg.model, "seed-structure": checks.seed_structure()}
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = checks.run_all(configs, seeds)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"} | {"runs": result["runs"]}))
        return 0 if result["passed"] else 1
    o = result["oracle"]
    print(f"oracle: true corrections injected, float64, configs {', '.join(configs)}, seeds {seeds}")
    print(f"  {'trunk parameter group':<56} {'rel err':>10}")
    for g in o["groups"]:
        print(f"  {g['name']:<56} {g['rel_err']:>10.2e}")
    print(f"  {len(o['groups'])} groups ({', '.join(f'{k}: {v} per model' for k, v in o['groups_per_model'].items())}); "
          f"max rel err {o['max_rel_err']:.2e} (<= {checks.TOLERANCE:g}): {'PASS' if o['passed'] else 'FAIL'}")
    for run in result["runs"]:
        m = run["mutation"]
        print(f"  {run['config']} seed {run['seed']}: zero max rel err {run['zero_max_rel_err']:.3f}; "
              f"dropping {m['dropped_branch']} breaks {len(m['broken'])} groups, all upstream "
              f"({len(m['upstream'])}): {m['caught']}; streaming {run['streaming']['streaming_max_rel_err']:.1e}, "
              f"materialized {run['streaming']['materialized_max_rel_err']:.1e} vs explicit decode")
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    om = result["omission"]
    counted = sorted({(run["config"], run["omission"]["omitted"], run["omission"]["expected"]) for run in result["runs"]})
    print("omission: " + ", ".join(f"{o} of the {e} intended products left out ({label})" for label, o, e in counted)
          + f" (Q/K/V and MLP expansion of every block): {verdict(om['passed'])}")
    for run in result["runs"]:
        o = run["omission"]
        if not o["passed"]:
            print(f"  {run['config']} seed {run['seed']}: omitted but not intended {o['omitted_but_not_intended']}; "
                  f"intended but computed {o['intended_but_computed']}")
    print(f"zero differs from native:          {verdict(result['zero_differs'])}")
    print(f"mutation caught:                   {verdict(result['mutation_caught'])}")
    print(f"streaming == explicit decode:      {verdict(result['streaming']['passed'])}")
    print(f"linearity (max rel err {result['linearity']['max_rel_err']:.1e}):  {verdict(result['linearity']['passed'])}")
    print(f"reverse-causal support:            {verdict(result['reverse_causal']['passed'])}")
    fd = result["finite_differences"]
    print(f"native vs finite differences:      {verdict(fd['passed'])} ({len(fd['groups'])} trunk parameters of "
          f"{fd['config']}, seed {fd['seed']}: each directional derivative against the forward pass's central "
          f"difference, largest error {fd['largest_error_over_tolerance']:.2f} of its tolerance)")
    f8 = result["fp8"]
    print(f"fp8 corrections within FP8's bound: {verdict(f8['passed'])} ({f8['products']} products of {f8['config']}: "
          f"relative error {f8['rel_err_min']:.3f}-{f8['rel_err_max']:.3f} against the float64 product, largest "
          f"entry {f8['error_over_bound_max']:.2f} of its rounding bound; a scale off by {checks_fp8.WRONG_SCALE:g}x: "
          f"{f8['mutant_error_over_bound_max']:.2f} of it, caught: {f8['mutant_caught']}; trunk gradient "
          f"{f8['trunk_rel_err_max']:.3f} from native's at most)")
    dbp = result["dropbp"]
    print(f"dropbp == constant branches:       {verdict(dbp['passed'])} (dropped branches' parameters with a "
          f"gradient: {dbp['dropped_with_gradient']}; none dropped vs native {dbp['none_dropped_max_rel_err']:.1e}, "
          f"a pattern vs its outputs as constants {dbp['reference_max_rel_err']:.1e})")
    print(f"all checks: {verdict(result['passed'])}")
    return 0 if result["passed"] else 1


# ---- train -------------------------------------------------------------------------------------------------

def cmd_train(args) -> int:
    state = raw = trainer = None
    if args.resume:
        record, cfg, raw = _resumable(args)
    else:
        record, cfg = None, load_config(args)  # before importing what training needs: a mistake is said at once
    from creditlab import runtime as rt
    from creditlab.protocol.records import RecordLock, new_record_dir, write_once

    runtime = rt.resolve(cfg.train)
    writes = runtime.is_main and not args.no_record  # one process writes the record
    lock = RecordLock(record) if record is not None and writes else None
    if lock is not None:
        _acquire(lock)  # before reading what another living process may still be writing
    try:
        if record is not None:
            _repair(record, writes)
            from creditlab.train import checkpoints, newest_readable_checkpoint

            state = newest_readable_checkpoint(checkpoints(record), raw, say=lambda line: print(line, file=sys.stderr))
        if runtime.is_main:
            print_config(cfg)
        peak = rt.measure_matmul_tflops(runtime)
        from creditlab.train import Trainer

        trainer = Trainer(cfg, runtime, peak_tflops=peak)
        if state is not None:
            trainer.load_checkpoint(state, config=raw)
            print(f"resumed {record} from {state['_name']} at update {trainer.update_index}", file=sys.stderr)
        if writes and record is None:
            record = new_record_dir(cfg.train.out_dir, "train")
            lock = RecordLock(record)
            _acquire(lock)
            write_once(record / "config.json", cfg.to_dict())
            write_once(record / "env.json", {**rt.environment(runtime), "matmul_tflops": peak,
                                             "cwd": os.getcwd()})  # where relative paths (data.dir) point
        if record is not None:
            print(f"record: {record}", file=sys.stderr)
        return _train(args, cfg, runtime, trainer, record if writes else None)
    finally:
        if lock is not None:
            lock.release()
        if trainer is not None:
            trainer.close()  # before the process group: see Trainer.close
        rt.leave_process_group()


def _train(args, cfg, runtime, trainer, record) -> int:
    """The loop of `train`, and the end of its record: result and report, or failure.json saying why not."""
    from creditlab.protocol.records import append_jsonl, read_jsonl, write_once
    from creditlab.train import Diverged, UpdateRow, drop_finished_checkpoints, latest_rows, median_last, row_dict

    def on_row(row):
        if record is None:
            return
        append_jsonl(record / "rows.jsonl", row_dict(row))
        every = cfg.train.checkpoint_every
        if every and (row.update + 1) % every == 0:
            trainer.save_checkpoint(record / f"checkpoint_{row.update + 1:06d}.pt")

    def on_eval(row):
        if record is not None:
            append_jsonl(record / "eval.jsonl", row.to_dict())

    def on_warning(entry):
        if record is not None:
            append_jsonl(record / "warnings.jsonl", entry)

    try:
        evaluator = None
        if runtime.is_main and cfg.train.eval_tokens > 0:
            from creditlab.evaluate import Evaluator
            every = f"every {cfg.train.eval_every} updates and " if cfg.train.eval_every else ""
            evaluator = Evaluator(cfg, runtime, purpose=f"train {record.name if record else 'unrecorded run'}: dev "
                                                        f"loss {every}at the start and end")
        rows = trainer.run(progress=not args.no_progress, on_row=on_row, evaluator=evaluator, on_eval=on_eval,
                           on_warning=on_warning)
        if record is not None:  # a resumed run's result covers every update of its record
            rows = [UpdateRow(**r) for r in latest_rows(read_jsonl(record / "rows.jsonl"))]
        window = min(6, len(rows))
        result = {"updates": len(rows), "final_loss": rows[-1].loss, "first_loss": rows[0].loss,
                  f"median_last{window}_s": median_last(rows, window),
                  "peak_allocated_mib": max((r.peak_allocated_mib or 0.0) for r in rows) or None}
        if record is not None and (record / "eval.jsonl").exists():
            last = read_jsonl(record / "eval.jsonl")[-1]
            result.update(dev_loss=last["loss"], dev_bits_per_byte=last["bits_per_byte"])
        if record is not None:
            trainer.save_model(record / "model.pt")
            write_once(record / "result.json", result)
            drop_finished_checkpoints(record, cfg)
            from creditlab.experiments.report import report
            report([record])
    except Diverged as exc:  # the run's own failure, not the program's: one line, the record says the rest
        _record_failure(record, trainer, {**exc.details, "error": str(exc)})
        print(f"creditlab: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (main): the user's stop, said in one line
        _record_failure(record, trainer, {"reason": "interrupted", "error": "stopped by the user"})
        if runtime.is_main:
            print(f"creditlab: train stopped: {_train_kept(record, trainer)}", file=sys.stderr)
        return 130
    except BaseException as exc:
        import traceback

        _record_failure(record, trainer, {"reason": type(exc).__name__, "error": str(exc),
                                          "traceback": traceback.format_exc()})
        raise
    if runtime.is_main:
        print(json.dumps(result) if args.json else
              f"done: loss {result['first_loss']:.4f} -> {result['final_loss']:.4f} over {len(rows)} updates")
    return 0


def _train_kept(record, trainer) -> str:
    """What a stopped `train` keeps and how to go on, in one clause."""
    if record is None:
        return f"nothing was recorded (--no-record), {trainer.update_index} updates done"
    from creditlab.train import checkpoints

    found = checkpoints(record)
    if not found:
        return (f"kept the rows of {trainer.update_index} updates in {record} but no checkpoint "
                f"(train.checkpoint_every=0), so it cannot be resumed; start it again with train.checkpoint_every=N")
    update = int(found[-1].stem.rpartition("_")[2])
    return (f"kept {record} with its checkpoint at update {update}; go on with: creditlab train --resume "
            f"{_quote(record)}")


def _record_failure(record, trainer, details: dict) -> None:
    """failure.json (failure-2.json, ... after a resumed run fails again): why the run stopped and where. Best
    effort: on a full disk it cannot be written, and the error that says so matters more than this file."""
    if record is None:
        return
    from creditlab.protocol.records import write_once

    n = 1 + len(list(record.glob("failure*.json")))
    path = record / ("failure.json" if n == 1 else f"failure-{n}.json")
    stage = "start" if not (record / "rows.jsonl").exists() else "training"  # start: before its first update
    try:
        write_once(path, {"status": "failed", "stage": stage, "updates_done": trainer.update_index, **details})
    except OSError:
        pass


def _acquire(lock) -> None:
    from creditlab.protocol.records import Locked

    try:
        lock.acquire()
    except Locked as exc:
        raise config_mod.UserError(str(exc)) from None


def _repair(record, writes: bool) -> None:
    """Cut a half-written last line off the record's JSON lines (a run killed mid-write), saying so; then read
    every line, so that a damaged one stops the resume before its first update, not at its end."""
    from creditlab.protocol.records import append_jsonl, read_jsonl, repair_jsonl

    for name in ("rows.jsonl", "eval.jsonl", "warnings.jsonl"):
        removed = repair_jsonl(record / name) if writes else 0
        if removed:
            message = f"repaired {name}: removed a half-written last line ({removed} bytes)"
            print(f"creditlab: {message}", file=sys.stderr)
            append_jsonl(record / "warnings.jsonl", {"update": None, "warning": message})
    for name in ("rows.jsonl", "eval.jsonl", "warnings.jsonl"):
        if (record / name).exists():
            read_jsonl(record / name, partial_last=not writes)


def _resumable(args):
    """The record, its config (paths resolved) and the config as stored; refuse what cannot be resumed."""
    from pathlib import Path

    from creditlab.protocol.records import read_json
    from creditlab.train import checkpoints

    record = Path(args.resume)
    given = [flag for flag, value in (("--preset", args.preset), ("--set", args.overrides)) if value]
    if given:
        raise config_mod.ConfigError(f"--resume continues a run exactly as configured; drop {', '.join(given)}")
    if args.no_record:
        raise config_mod.ConfigError("--resume continues a record, which --no-record would leave as it is; drop "
                                     "--no-record")
    if not (record / "config.json").exists():
        raise config_mod.ConfigError(f"{record} is not a training record (no config.json)")
    if (record / "result.json").exists():
        raise config_mod.ConfigError(f"{record} finished (result.json exists); start a new run instead")
    if not checkpoints(record):
        raise config_mod.ConfigError(f"{record} has no checkpoint to resume from (it ran with "
                                     f"train.checkpoint_every=0)")
    # Rows written after the newest checkpoint stay (append-only); the resumed run re-does those updates and
    # appends their new rows, and readers keep the last row of each update (train.latest_rows).
    raw = read_json(record / "config.json")
    cfg = config_mod.Config.from_dict(raw)
    config_mod.validate(cfg)
    cfg.data.dir = _data_dir(record, cfg)
    return record, cfg, raw


def _data_dir(record, cfg) -> str:
    """data.dir as the run saw it: a relative one points from the folder the run started in, which is where
    train.out_dir leads back from the record (or env.json's cwd), not from wherever the resume is started."""
    from pathlib import Path

    data_dir, out_dir = Path(cfg.data.dir), Path(cfg.train.out_dir)
    if data_dir.is_absolute() or cfg.data.source != "shards":
        return cfg.data.dir
    origins = []
    if not out_dir.is_absolute() and ".." not in out_dir.parts:
        origins.append(record.resolve().parents[len(out_dir.parts)])
    from creditlab.protocol.records import read_json

    env = read_json(record / "env.json") if (record / "env.json").exists() else {}
    if env.get("cwd"):
        origins.append(Path(env["cwd"]))
    for origin in origins:
        if (origin / data_dir).is_dir():
            return str(origin / data_dir)
    return cfg.data.dir


# ---- compare and heldout -----------------------------------------------------------------------------------

def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise config_mod.ConfigError(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise config_mod.ConfigError(f"--seeds {text!r}: give distinct integers, e.g. --seeds 1,2")
    return seeds


def cmd_compare(args) -> int:
    from pathlib import Path

    from creditlab.experiments.compare import CompareRun, Interrupted, kept, merge, partial_result, verdicts
    from creditlab.experiments.compare_report import table, write_report

    given = [flag for flag, value in (("EXPERIMENT", args.experiment), ("--arms", args.arms), ("--seeds", args.seeds),
                                      ("--set", args.overrides), ("--preset", args.preset), ("--repeat", args.repeat),
                                      ("--wandb", args.wandb)) if value]
    for flag, value, what in (("--resume", args.resume, "continues a comparison as it was started"),
                              ("--report", args.report, "reports a comparison as it ran"),
                              ("--merge", args.merge, "reports compare folders as they ran")):
        if value and (given or (args.out and flag != "--merge")):
            drop = given + (["--out"] if args.out and flag != "--merge" else [])
            raise config_mod.ConfigError(f"{flag} {what}; drop {', '.join(drop)}")
    if args.report:
        out = Path(args.report)
        if not (out / "experiment.toml").exists():
            raise config_mod.UserError(f"{out} holds no comparison (no experiment.toml); give the folder of a "
                                       f"creditlab compare run")
        folder = _numbered(out / "report")
        folder.mkdir()
        result = partial_result(out)
        write_once_json(folder / "compare.json", result)
        report = write_report(folder, result, records_from=out)
        print("\n".join(table(result) + [""] + verdicts(result)))
        print(f"report: {report}" + (f" (from the {len(result['unfinished'])} arm runs not finished: none of "
                                     f"their numbers)" if result.get("unfinished") else ""))
        return 0
    if args.resume:
        out = Path(args.resume)
        run = CompareRun.resume(out, progress=not args.no_progress)
    elif args.merge:
        if not args.out:
            raise config_mod.ConfigError("--merge needs --out: a new folder for the merged comparison")
        out = Path(args.out)
        _new_compare_folder(out)
        folders = [Path(f) for f in args.merge]
        missing = [str(f) for f in folders if not (f / "compare.json").exists()]
        if missing:
            raise config_mod.ConfigError(f"--merge: no compare.json in {', '.join(missing)}")
        run = None
        result = merge(folders, out)
    else:
        run = CompareRun(_experiment(args), Path(args.out or "."), progress=not args.no_progress)
        out = run.out = Path(_experiment_out(args, run.experiment))
        _new_compare_folder(out)
        run.check()
        print_config(run.base)
        run.start()
        if args.experiment:  # the file as given, beside the experiment it resolved to (which --resume reads)
            from creditlab.protocol.records import copy_once
            copy_once(args.experiment, out / "experiment-file.toml")
    if run is not None:
        try:
            result = run.run()
        except Interrupted as exc:
            print(f"creditlab: compare stopped ({exc}): kept {kept(out)}; go on with: creditlab compare --resume "
                  f"{_quote(out)}", file=sys.stderr)
            return 130
        except KeyboardInterrupt:
            print(f"creditlab: compare stopped at once: kept {kept(out)} (the states saved at the last evaluation); "
                  f"go on with: creditlab compare --resume {_quote(out)}", file=sys.stderr)
            return 130
    report = write_report(out, result)
    if args.json:
        print(json.dumps(result["summary"]))
    else:
        print("\n".join(table(result) + [""] + verdicts(result)))
        print(f"report: {report}")
    return 0


def _quote(path) -> str:
    import shlex
    return shlex.quote(str(path))


def _numbered(base):
    """base-1, base-2, ...: the first that does not exist (a report is derived, so a new one goes beside)."""
    from pathlib import Path
    k = 1
    while Path(f"{base}-{k}").exists():
        k += 1
    return Path(f"{base}-{k}")


def write_once_json(path, content) -> None:
    from creditlab.protocol.records import write_once
    write_once(path, content)


def _experiment(args):
    """The experiment of `compare`: its file (if given), then the flags beside it."""
    from creditlab.experiments import experiment as experiment_mod

    exp = experiment_mod.load(args.experiment) if args.experiment else experiment_mod.Experiment()
    if args.preset:
        exp.preset = args.preset
    if args.arms:
        from creditlab.experiments.arms import parse_arms
        exp.arms = [s.label for s in parse_arms(args.arms)]
    if args.seeds is not None:
        exp.seeds = parse_seeds(args.seeds)
    if args.repeat is not None:
        exp.repeat = args.repeat
    if args.wandb:
        exp.wandb = args.wandb
    exp.overrides = [*exp.overrides, *args.overrides]
    if not exp.arms:
        raise config_mod.ConfigError("compare needs arms: an experiment file, or --arms (e.g. --arms "
                                     "native,zero,learned); or --resume DIR, --report DIR, --merge DIR ...")
    exp.check()
    return exp


def _experiment_out(args, exp) -> str:
    out = args.out or exp.out
    if not out:
        raise config_mod.ConfigError("compare needs --out (or out = \"...\" in the experiment file): a new folder "
                                     "for the comparison's records and report")
    exp.out = out
    return out


def _new_compare_folder(out) -> None:
    """Refuse a folder that holds anything, saying why; an empty one is taken."""
    if out.exists() and not out.is_dir():
        raise config_mod.UserError(f"cannot use {out}: a file is in the way; choose a new --out")
    if out.exists() and (out / "experiment.toml").exists():
        raise config_mod.UserError(f"{out} holds a comparison already: go on with creditlab compare --resume "
                                   f"{_quote(out)}, or choose a new --out")
    if out.exists() and any(out.iterdir()):
        raise config_mod.UserError(f"{out} exists and is not empty; records are append-only: choose a new --out")
    if out.exists():
        out.rmdir()


def cmd_heldout(args) -> int:
    from creditlab.protocol.admission import AdmissionError
    from creditlab.protocol.heldout import HeldoutRefused, heldout

    if args.tokens is not None and args.tokens < 1:
        raise config_mod.ConfigError(f"--tokens {args.tokens}: give a positive count, or leave --tokens out for the "
                                     f"whole split")
    try:
        result = heldout(args.run, args.admission, args.out_dir, args.tokens)
    except (HeldoutRefused, AdmissionError) as exc:
        print(f"creditlab: refused: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"FINAL_HELDOUT under admission {result['admission'][:16]} (the ledger allows no second read under it):")
        for name, row in result["models"].items():
            bpb = "" if row["bits_per_byte"] is None else f", {row['bits_per_byte']:.4f} bits/byte"
            print(f"  {name}: loss {row['loss']:.4f} nats/token{bpb} over {row['tokens']:,} tokens")
    return 0


# ---- parser ------------------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, like every other error of the command (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; given the `command` a command line names, the commands that live beside their
    subsystems (data, demo, report, admit, screen, ceiling) are registered only where that one is among them, so
    that a command does not import what only the others need (a config error is said before torch is imported)."""
    parser = Parser(prog="creditlab", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error too")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("flops", help="print the nominal FLOP derivation per target")
    _config_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--sketch", action="store_true", help="also the `sketch` source's cost at credit.sketch_rank, "
                                                         "each form of credit.sketch with its refresh "
                                                         "(implied by credit.source=sketch)")
    p.set_defaults(func=cmd_flops)

    p = sub.add_parser("check", help="float64 interface checks of the credit path (oracle, linearity, ...)")
    _config_args(p)
    p.add_argument("--seed", type=int, default=None, help="one seed (overrides --seeds)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated random seeds (default 0,1,2)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("train", help="train with the configured credit source")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="plain step lines instead of a progress bar")
    p.add_argument("--no-record", action="store_true", help="do not write runs/<id>/")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue an unfinished run from its newest checkpoint (train.checkpoint_every > 0)")
    p.set_defaults(func=cmd_train, preset=None)  # None: not given (tiny), so that --resume can refuse it

    p = sub.add_parser("compare", help="competence test and verdict: arms from one start on one data order, DEV "
                                       "loss, fair floors, native's budgets, speedup with a 95%% interval")
    p.add_argument("experiment", nargs="?", default=None, metavar="EXPERIMENT.toml",
                   help="an experiment file (experiments/*.toml); flags given beside it replace or extend its values")
    p.add_argument("--preset", default=None, help=f"one of: {', '.join(config_mod.PRESETS)} (default tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config field; repeatable")
    p.add_argument("--arms", default=None,
                   help=f"comma-separated arms: native, {', '.join(s for s in SOURCES if s != 'exact')}, "
                        "intermittent; an arm's own overrides as name@section.key=value")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 1,2,3)")
    p.add_argument("--repeat", type=int, default=None, metavar="K",
                   help="run each seed K times (the same init and data order) to measure run-to-run noise")
    p.add_argument("--out", default=None, help="a new folder for the comparison's records and report")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue an interrupted comparison from its arms' saved states")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="a report (into DIR/report-N/) of whatever arm runs of DIR have finished")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="instead of training: one report from compare folders of one experiment at other seeds")
    p.add_argument("--wandb", metavar="PROJECT", default=None,
                   help="also log every arm's rows and evaluations to W&B (offline unless WANDB_MODE says otherwise)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("heldout", help="FINAL_HELDOUT loss of a finished run or comparison, once per admission")
    p.add_argument("run", help="a finished run's record folder (with model.pt), or a compare folder (all its "
                               "models in one read)")
    p.add_argument("--admission", required=True, help="admission id (or unique prefix, or its folder)")
    p.add_argument("--out-dir", default="runs", help="folder holding admissions/ (default runs)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to evaluate (default: the whole split)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_heldout)

    own = {a.dest for a in sub._choices_actions}  # noqa: SLF001 - the commands defined above
    for names, register in _extensions():
        if command is None or command in names or (command not in own and command not in EXTENSION_COMMANDS):
            register(sub, _config_args)
    return parser


# The commands that live beside the subsystem they drive, and where each registers its parser.
EXTENSIONS = ((("data",), "creditlab.data.cli"), (("demo",), "creditlab.demo"),
              (("report",), "creditlab.experiments.report"), (("admit", "screen"), "creditlab.protocol.cli"),
              (("ceiling",), "creditlab.experiments.ceiling"))
EXTENSION_COMMANDS = {name for names, _ in EXTENSIONS for name in names}


def _extensions():
    import importlib

    for names, module in EXTENSIONS:
        def register(sub, config_args, module=module):
            add = importlib.import_module(module).add_commands
            return add(sub) if module == "creditlab.data.cli" else add(sub, config_args)
        yield names, register


def main(argv: list[str] | None = None) -> int:
    words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(argv)
    # A command that runs other commands (`demo`) does so through these, not by importing this module.
    args.run_command = main
    # every command there is (a command that runs others, `demo`, reaches those not registered for this line)
    args.commands = set(parser._subparsers._group_actions[0].choices) | EXTENSION_COMMANDS  # noqa: SLF001
    previous = signal.signal(signal.SIGTERM, _terminate) if _main_thread() else None
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM: a command without a stop of its own says what is left
        if args.debug:
            raise
        print(f"creditlab: {stopped(args)}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader has gone (`creditlab flops | head`): Python's own note on SIGPIPE, stdout pointed at
        # devnull so that the exit's flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        message = user_error(exc)
        if message is None or args.debug:
            raise  # an internal error keeps its traceback (exit 1)
        print(f"creditlab: error: {message}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    """SIGTERM as Ctrl-C: every command stops the same way, saying what it kept."""
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def stopped(args) -> str:
    """What a stopped command leaves, in one line."""
    if args.command == "data" and getattr(args, "data_command", None) == "prepare":
        out = getattr(args, "out", None)
        return (f"data prepare stopped: {out} is as it was (the partial work in {out}/.staging goes with the next "
                f"prepare); what was fetched and extracted stays in the cache; run the same command again")
    return f"{args.command} stopped; nothing it had not finished was kept"


def user_error(exc: BaseException) -> str | None:
    """The one line that says what the user must fix, or None for an internal error. User errors are the
    UserError family (configuration, records), the data errors (creditlab.data.DATA_ERRORS), and storage
    errors; for `train`, the folder is train.out_dir."""
    if isinstance(exc, config_mod.UserError):  # before importing what the other kinds need
        return str(exc)
    from creditlab.data import DATA_ERRORS
    from creditlab.protocol.records import STORAGE_ERRNOS, RecordError

    if isinstance(exc, (RecordError, *DATA_ERRORS)):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        where = exc.filename or "a file"
        return f"cannot use {where}: {STORAGE_ERRNOS[exc.errno]} (train.out_dir, --out)"
    return None


if __name__ == "__main__":
    sys.exit(main())
