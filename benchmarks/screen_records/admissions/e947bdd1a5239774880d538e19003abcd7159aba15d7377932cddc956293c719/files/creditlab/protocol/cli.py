"""`creditlab admit` and `creditlab screen`.

    creditlab admit --preset seed [--set k=v ...] [--json]
    creditlab screen --admission ID [--repair "reason"] [--out-dir DIR] [--json]
    creditlab screen --preset tiny [--set k=v ...] [--json]          (exploratory: no admission)

Exit codes of `screen`: 0 pass, 3 capacity miss, 4 timing miss, 5 cap miss; 2 refused (a frozen file does not
match, the admission already has its verdict, the config cannot be screened); 6 invalid (initialization or
inputs differed between the arms); 1 failed otherwise. Every started screen leaves a record folder. Only a
screen under an admission on a GPU records a verdict; any other (no admission, or on the CPU) is exploratory:
it exits with the code of what it measured and prints it marked so.
"""

from __future__ import annotations

import json
import sys

from creditlab import config as config_mod
from creditlab.protocol.gates import EXIT_REFUSED


def add_commands(sub, config_args) -> None:
    p = sub.add_parser("admit", help="freeze package sources, config and data manifest; print the admission id")
    config_args(p)
    p.add_argument("--out-dir", default=None,
                   help="folder to hold admissions/ (default: train.out_dir of the config); admissions of one "
                        "experiment are matched within one such folder")
    p.add_argument("--json", action="store_true",
                   help='print {"admission": id, "files": n, "created": bool, "verdict": first verdict or null, '
                        '"cosmetic_differences": {key: [admitted, requested]}}')
    p.set_defaults(func=cmd_admit)

    p = sub.add_parser("screen", help="resource screen: native vs synthetic arm, gated verdict",
                       description="Without --admission the screen is exploratory (labelled so in its record).")
    config_args(p)
    p.set_defaults(preset=None)  # so that --preset given with --admission can be refused
    p.add_argument("--admission", metavar="ID", help="admission id (or unique prefix, or its folder)")
    p.add_argument("--repair", metavar="REASON",
                   help="the admission's one repair screen after a verdict (for a correctness mismatch)")
    p.add_argument("--out-dir", default=None,
                   help="folder holding admissions/ when --admission is an id (default: train.out_dir of the "
                        "default config, 'runs')")
    p.add_argument("--json", action="store_true", help="print the verdict and numbers as JSON")
    p.set_defaults(func=cmd_screen)


def _refuse(message: str, as_json: bool) -> int:
    print(f"creditlab: refused: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"verdict": None, "refused": message}))
    return EXIT_REFUSED


def cmd_admit(args) -> int:
    from creditlab.protocol import admission as adm_mod

    cfg = config_mod.load(args.preset, args.overrides)
    try:
        adm, created = adm_mod.admit(cfg, out_dir=args.out_dir, preset=args.preset, overrides=args.overrides)
    except adm_mod.AdmissionError as exc:
        return _refuse(str(exc), args.json)
    done = adm_mod.verdicts(adm)
    if args.json:
        print(json.dumps({"admission": adm.id, "files": len(adm.files), "created": created,
                          "verdict": done[0]["verdict"] if done else None,
                          "cosmetic_differences": adm.cosmetic_differences}))
        return 0
    counts = adm.meta["counts"]
    data = adm.meta["data"]
    print(f"admission {adm.id}")
    print(f"  {len(adm.files)} files frozen: {counts['source']} package sources, the resolved config, "
          + (f"the data manifest and its {counts.get('data_shard', 0)} shards (by hash)" if data["applies"]
             else "no data manifest (synthetic data: none applies)"))
    print(f"  {'stored in' if created else 'already admitted, in'} {adm.dir}")
    if adm.cosmetic_differences:
        print("  the same experiment as this earlier admission: it differs only in cosmetic keys ("
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in adm.cosmetic_differences.items())
              + "), which change nothing the arms compute; its config, as admitted, is what a screen runs")
    if done:
        print(f"  it already has a verdict: {done[0]['verdict']} ({done[0]['record_dir']})")
    else:
        unfinished = [a for a in adm_mod.attempts(adm) if a["status"] in adm_mod.NO_VERDICT]
        if unfinished:
            print("  no verdict yet; screens started without one: "
                  + ", ".join(f"{a['record_dir']} ({a['status']})" for a in unfinished))
    print(f"  screen it with: creditlab screen --admission {adm.id[:16]}"
          + (f" --out-dir {adm.dir.parent.parent}" if str(adm.dir.parent.parent) != "runs" else ""))
    return 0


def cmd_screen(args) -> int:
    from creditlab.protocol import admission as adm_mod
    from creditlab.protocol import screen as screen_mod

    try:
        if args.admission:
            if args.preset is not None or args.overrides:
                return _refuse("a screen under an admission runs the admitted config: drop --preset/--set "
                               "(or admit the config you want to screen)", args.json)
            out_dir = args.out_dir or config_mod.Config().train.out_dir
            outcome, _ = screen_mod.admitted_screen(args.admission, out_dir, repair=args.repair)
        else:
            cfg = config_mod.load(args.preset or "tiny", args.overrides)
            outcome = screen_mod.run_screen(cfg, repair=args.repair)
    except (adm_mod.AdmissionError, screen_mod.ScreenRefused) as exc:
        return _refuse(str(exc), args.json)
    result = outcome.result
    arms = {}
    for name, arm in result.get("arms", {}).items():
        key = next(k for k in arm if k.startswith("median_last"))
        arms[name] = {key: arm[key], "peak_mib": arm["peak_allocated_mib"], "updates": arm["updates"]}
    if args.json:
        out = {"verdict": result.get("verdict"), "measured": result.get("measured"),
               "exploratory": result.get("exploratory"), "retry_of": [a["record_dir"] for a in
                                                                       result.get("retry_of") or []],
               "ratio": result.get("ratio"), "arms": arms,
               "gates": result.get("gates"), "record_dir": str(outcome.record_dir), "admission": result["admission"],
               "exit_code": outcome.exit_code}
        for key in ("invalid", "error"):
            if key in result:
                out[key] = result[key]
        print(json.dumps(out))
        return outcome.exit_code
    if result.get("verdict"):
        label = result["verdict"]
    elif result.get("measured"):
        label = f"exploratory, measured {result['measured']}, no verdict"
    else:
        label = "invalid" if "invalid" in result else "error"
    print(f"screen {result['run_id']} ({result['mode']}"
          + (f", admission {result['admission'][:16]}" if result["admission"] else "")
          + (f", stand-in source {result['synthetic_source']}" if result["stand_in"] else "") + f"): {label}")
    for name in ("native", "synthetic"):
        if name not in arms:
            print(f"  {name:<9} not run")
            continue
        arm = arms[name]
        key = next(k for k in arm if k.startswith("median_last"))
        median = "–" if arm[key] is None else f"{arm[key]:.4f} s"
        peak = "n/a" if arm["peak_mib"] is None else f"{arm['peak_mib']:,.1f} MiB"
        print(f"  {name:<9} {arm['updates']:>3} updates, {key.replace('_s', '').replace('_', ' ')} {median}, "
              f"peak {peak}")
    if result.get("retry_of"):
        print("  a retry of: " + ", ".join(f"{a['record_dir']} ({a['status']})" for a in result["retry_of"]))
    if result.get("sentence"):
        print(f"  {result['sentence']}" if result.get("verdict") else
              f"  exploratory ({result['exploratory']}); measured: {result['sentence']}")
    else:
        print(f"  {result.get('invalid') or result.get('error')}")
    print(f"  record: {outcome.record_dir}  (exit code {outcome.exit_code})")
    return outcome.exit_code
