"""report.md of a resource screen: what ran, the per-arm table, the gates, one verdict sentence."""

from __future__ import annotations

from creditlab.protocol.gates import Decision

WORDS = {"pass": "pass", "timing_miss": "timing miss", "capacity_miss": "capacity miss", "cap_miss": "cap miss"}
GATE_LABELS = {"oom": "out-of-memory error", "peak": "synthetic peak allocated (MiB)",
               "cap": "occupied device-seconds", "ratio": "synthetic/native seconds per update"}


def _num(x, fmt: str = "{:,.4f}") -> str:
    return "–" if x is None else fmt.format(x) if isinstance(x, (int, float)) else str(x)


def _arm_row(name: str, arm: dict) -> str:
    median_key = next((k for k in arm if k.startswith("median_last")), None)
    status = f"{arm['updates']}/{arm['planned']}"
    if arm.get("oom"):
        status += " (out of memory)"
    return (f"| {name} | {arm['source']} | {status} | {_num(arm.get(median_key))} | {_num(arm['first_update_s'])} | "
            f"{_num(arm['peak_allocated_mib'], '{:,.3f}')} | {_num(arm['peak_reserved_mib'], '{:,.3f}')} | "
            f"{_num(arm['last_loss'])} |")


def _gate_row(gate: dict) -> str:
    measured = gate["measured"]
    if gate["name"] == "oom":
        measured = f"{measured} arm" if measured else "none"
    fmt = {"peak": "{:,.3f}", "cap": "{:,.1f}", "ratio": "{:.4f}"}.get(gate["name"], "{}")
    limit = "–" if gate["limit"] is None else f"<= {gate['limit']:,.7g}"
    return (f"| {GATE_LABELS[gate['name']]} | {_num(measured, fmt)} | {limit} | {gate['outcome']} | "
            f"{gate['note']} |")


def _allocator(fig: dict | None) -> str:
    if not fig:
        return "n/a (no GPU)"
    mib = lambda key: _num(fig.get(key), "{:,.1f} MiB")  # noqa: E731
    return (f"allocated {mib('allocated_mib.all.current')} (peak {mib('allocated_mib.all.peak')}), reserved "
            f"{mib('reserved_mib.all.current')} (peak {mib('reserved_mib.all.peak')}), inactive split "
            f"{mib('inactive_split_mib.all.current')}, device free {mib('free_mib')} of {mib('total_mib')}, "
            f"{fig.get('num_alloc_retries')} allocation retries, {fig.get('num_ooms')} out-of-memory events "
            "(all figures in result.json)")


def report_markdown(result: dict, decision: Decision | None) -> str:
    env = result.get("environment") or {}
    measured = result.get("measured")
    final = result.get("verdict") is not None
    if final:
        title = WORDS[result["verdict"]]
    elif measured is not None:  # exploratory: what was measured, never called a verdict
        title = f"exploratory, {WORDS[measured]} measured, no verdict"
    else:
        title = "no verdict"
    lines = [f"# Resource screen {result['run_id']}: {title}", ""]
    if result["mode"] == "admitted":
        lines.append(f"Admitted screen, admission `{result['admission']}`: {result.get('verification')}. "
                     f"The frozen files are copied to `{result['sources']['folder']}/`.")
    elif result.get("admission"):
        lines.append(f"Exploratory screen under admission `{result['admission']}` "
                     f"({result.get('verification')}): {result.get('exploratory')}. The frozen files are copied "
                     f"to `{result['sources']['folder']}/`.")
    else:
        lines.append(f"Exploratory screen: no admission, so it decides nothing under the protocol. The "
                     f"package sources as they were ({result['sources']['files']} files) are copied to "
                     f"`{result['sources']['folder']}/`.")
    if result.get("repair"):
        lines.append(f"This is the admission's one repair screen; reason: {result['repair']!r}.")
    for attempt in result.get("retry_of") or []:
        lines.append(f"This screen is a retry of `{attempt['record_dir']}` (started {attempt.get('time')}, "
                     f"{'started, not finished' if attempt['status'] == 'unfinished' else attempt['status']}).")
    if result.get("stand_in"):
        lines.append(f"Stand-in synthetic source `{result['synthetic_source']}`: this screen does not measure "
                     "the learned predictor.")
    device = result["device"]
    if env.get("gpu"):
        device = (f"{env['gpu']} ({env['gpu_memory_mib']:,.0f} MiB), driver {env.get('driver')}, "
                  f"CUDA {env.get('cuda')}")
    pre = result.get("prelaunch")
    cap = result.get("memory_cap") or {}
    lines += ["", f"Device: {device}; torch {env.get('torch')}; git {str(env.get('git_sha'))[:12]}"
                  f"{' (dirty)' if env.get('git_dirty') else ''}. Prelaunch free memory: "
                  f"{_num(pre['free_mib'], '{:,.0f} MiB') if pre else 'n/a (no GPU)'}. Memory cap: "
                  + (f"{cap['memory_cap_mib']:,.0f} MiB (fraction {cap['fraction']:.4f} of the card)"
                     if cap.get("applied") else f"none ({cap.get('why', '')})") + "."]
    shape = result["shape"]
    arms = result.get("arms", {})
    init = result.get("identical_init") or {}
    inputs = result.get("identical_inputs") or {}
    lines.append(f"Arms: native (credit.source=exact) and synthetic (credit.source={result['synthetic_source']}, "
                 f"schedule never, no fitting), interleaved: both resident, one update of each per round, "
                 f"the order rotated each round; seed {result['seed']}; micro {shape['micro_batch']} x T "
                 f"{shape['seq_len']} x GA {shape['grad_accum']}; {result['updates']} updates each."
                 + (" On CUDA allocator history (allocation stack traces) is recorded for the whole screen, so "
                    "that an out-of-memory error in either arm leaves a memory snapshot; each arm's peak counts "
                    "its own bytes, reserved memory is one pool and not an arm's figure."
                    if any(a.get("memory_history") for a in arms.values()) else "")
                 + (f" Identical initialization: state-dict SHA256 `{str(init.get('sha256'))[:16]}` in every arm "
                    f"({'equal' if init.get('match') else 'NOT equal'})." if init else "")
                 + (f" Identical TRAIN inputs: {inputs.get('compared')} micro-batches compared by SHA256 "
                    f"({'equal' if inputs.get('match') else 'NOT equal'})." if inputs else ""))
    if arms:
        window = result.get("window") or next((k for k in next(iter(arms.values())) if k.startswith("median_last")),
                                              "median_last?_s")
        label = f"median last {window} s/update" if isinstance(window, int) else "median s/update"
        lines += ["", f"| arm | source | updates | {label} | first update s | peak allocated MiB | "
                      "peak reserved MiB | last loss |", "|---|---|---|---|---|---|---|---|"]
        lines += [_arm_row(name, arm) for name, arm in arms.items()]
    if decision is not None:
        lines += ["", "| gate | measured | limit | outcome | note |", "|---|---|---|---|---|"]
        lines += [_gate_row(g) for g in result["gates"].values()]
    per_round = result.get("ratio_per_round")
    if per_round:
        lines += ["", f"Synthetic/native per round (the two arms' updates of one round, rounds 3 to "
                      f"{per_round['rounds'] + 2}): median {per_round['median']:.4f}, 95% interval "
                      f"{per_round['low']:.4f} .. {per_round['high']:.4f}. Information beside the verdict, which "
                      f"reads the ratio of last-window medians."]
    for name, arm in arms.items():
        oom = arm.get("oom")
        if oom:
            lines += ["", f"Out of memory in the {name} arm at update {oom['update'] + 1} (micro-batch "
                          f"{oom['micro_batch']}), {oom['occupied_s']:,.1f} s into the screen; {oom['type']}:",
                      "", "```", oom["message"].strip(), "```", "",
                      f"Allocator: {_allocator(oom['allocator'])}. Memory snapshot: "
                      f"`{oom['snapshot']}` (history {'recorded' if oom['memory_history'] else 'not recorded'}). "
                      f"Traceback: `{oom['traceback']}`."]
    lines.append("")
    if decision is not None:
        detail = decision.sentence.split(": ", 1)[-1]
        detail = detail[0].upper() + detail[1:]
        if final:
            lines.append(f"**Verdict: {title}.** {detail}")
        else:
            lines.append(f"**Exploratory, no verdict.** Measured: {WORDS[measured]}. {detail} Nothing is recorded "
                         f"as a verdict: {result.get('exploratory')}.")
    else:
        why = result.get("invalid") or result.get("error")
        kind = "invalid screen" if result.get("invalid") else "the screen failed"
        lines.append(f"**No verdict: {kind}.** {why}. Rows measured before it are in `rows.jsonl`; the "
                     "traceback is in `traceback.txt`.")
    return "\n".join(lines) + "\n"
