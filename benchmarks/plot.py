"""Figures of the committed GPU results: per-arm time and memory, and the screens' per-update rows.

    python benchmarks/plot.py [--out benchmarks]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from creditlab.experiments.arms_runner import steady_ratio  # noqa: E402
from stored import is_stored, read_stored  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png", dpi=120, bbox_inches="tight")  # long path names: nothing cut at the edges
    plt.close(fig)
    path.write_bytes(_palette_png(drawn.getvalue()))
    return path


def _palette_png(png: bytes) -> bytes:
    """The figure as a 256-colour palette PNG (a third of the bytes, reads the same), unless that is no smaller."""
    from PIL import Image

    small = io.BytesIO()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(small, format="PNG",
                                                                                                 optimize=True)
    return small.getvalue() if small.tell() < len(png) else png


def plot_arms(arms_json: Path, out: Path, name: str, note: str) -> Path:
    data = json.loads(read_stored(arms_json))
    results = [r for r in data["results"] if "oom" not in r]
    names = [r["arm"] for r in results]
    native = results[0]["median_last6_s"]
    ratios = [r.get("cycle_s", r["median_last6_s"]) / native for r in results]  # a cycle arm: one cycle's mean
    peaks = [r["peak_allocated_mib"] for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1.barh(names, ratios, color="#4c72b0")
    ax1.axvline(0.9066667, color="#c44e52", ls="--", label="screen gate 0.9067")
    ax1.axvline(1.0, color="grey", lw=0.8)
    ax1.axvline(1.07, color="#dd8452", ls=":", label="teacher target 1.07")
    if any("cycle_s" in r for r in results):
        ax1.axvline(0.93, color="#937860", ls="-.", label="cycle gate 0.93")
    # Where the rounds pair the arms' updates (interleaved): each arm's ratio per round, with its interval.
    interleaved = data["meta"].get("schedule", "interleaved") == "interleaved"
    per_round = [None if y == 0 or "cycle_s" in r or not interleaved else steady_ratio(r["rows"], results[0]["rows"])
                 for y, r in enumerate(results)]
    marked = False
    for y, ratio in enumerate(per_round):
        if ratio is not None:
            ax1.errorbar(ratio[0], y, xerr=[[ratio[0] - ratio[1]], [ratio[2] - ratio[0]]], fmt="o", ms=3,
                         color="black", capsize=3, label=None if marked else "per round, 95% interval")
            marked = True
    ax1.set_xlabel("s/update relative to native (bars: last-six medians)")
    right = 1.2
    ax1.set_xlim(0.85, right)
    ax1.legend(loc="lower right", fontsize=7)
    for y, (r, ratio) in enumerate(zip(ratios, per_round)):
        label = f"{r:.3f}" if r <= right else f"{r:.2f} (off scale)"
        if ratio is not None:
            label += f" | {ratio[0]:.3f}"
        end = max(r, ratio[2] if ratio is not None else r)
        ax1.text(min(end + 0.004, right - 0.09), y, label, va="center", fontsize=7)
    ax2.barh(names, peaks, color="#55a868")
    ax2.axvline(23_400, color="#c44e52", ls="--", label="peak gate 23,400 MiB")
    ax2.axvline(21_301, color="#8172b2", ls=":", label="seed native 21,301 MiB")
    ax2.set_xlabel("peak allocated MiB")
    ax2.legend(loc="lower right", fontsize=8)
    ax2.set_yticklabels([])
    meta = data["meta"]
    gpu, train = meta["env"].get("gpu"), meta.get("config", {}).get("train")
    # Older result files carry no config; they were all measured at the seed preset's shape.
    micro, accum = (train["micro_batch"], train["grad_accum"]) if train else (64, 4)
    seq = meta["config"]["model"]["seq_len"] if train else 2048
    fig.suptitle(f"{meta.get('preset', 'seed').capitalize()} preset, micro {micro} x T {seq} x GA {accum}, "
                 f"{meta['updates']} updates per arm, {gpu} ({note})", fontsize=10)
    return _save(fig, out / name)


def plot_arm_rows(arms_json: Path, out: Path, name: str) -> Path:
    """Seconds of every update of every arm: the spread the last-six medians summarize."""
    data = json.loads(read_stored(arms_json))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for r in (r for r in data["results"] if "oom" not in r):
        rows = r["rows"][1:]  # the first update compiles
        summary = f"cycle {r['cycle_s']:.4f}" if "cycle_s" in r else f"median {r['median_last6_s']:.4f}"
        ax.plot([x["update"] + 1 for x in rows], [x["seconds"] for x in rows], "o-", ms=3,
                label=f"{r['arm']} ({summary})")
    count = len(data["results"][0]["rows"])
    ax.axvspan(count - 5.5, count + 0.5, color="grey", alpha=0.1, label="last-six window")
    ax.set_xlabel("update")
    ax.set_ylabel("s/update")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / name)


def plot_recompute_tradeoff(arms_json: Path, out: Path, name: str) -> Path:
    """s/update against peak memory for each choice of what the backward recomputes."""
    data = json.loads(read_stored(arms_json))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for r in (r for r in data["results"] if "oom" not in r):
        ax.plot(r["peak_allocated_mib"], r["median_last6_s"], "o", color="#4c72b0")
        ax.annotate(r["arm"], (r["peak_allocated_mib"], r["median_last6_s"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.axvline(21_301, color="#8172b2", ls=":", label="seed native 21,301 MiB")
    ax.axhline(0.30, color="#c44e52", ls="--", label="target 0.30 s")
    ax.set_xlabel("peak allocated MiB")
    ax.set_ylabel("s/update (last-six median)")
    ax.set_ylim(0.29, None)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("What the backward recomputes: time vs peak (one process, side by side)", fontsize=10)
    return _save(fig, out / name)


def plot_clocks(dmon_txt: Path, out: Path, name: str) -> Path:
    """Board power and SM clock sampled every 2 s by `nvidia-smi dmon` during an arms run."""
    header, rows = None, []
    for line in read_stored(dmon_txt).splitlines():
        if line.startswith("# gpu"):
            header = line[1:].split()
        elif header and line.strip() and not line.startswith("#"):
            rows.append(dict(zip(header, line.split())))
    power = [float(r["pwr"]) for r in rows]
    clock = [float(r["pclk"]) for r in rows]
    t = [2 * i for i in range(len(rows))]
    fig, ax1 = plt.subplots(figsize=(8, 3.4))
    ax1.plot(t, power, color="#c44e52", lw=1, label="board power W")
    ax1.axhline(700, color="#c44e52", ls=":", lw=0.8)
    ax1.set_ylabel("W (limit 700)")
    ax1.set_xlabel("seconds into the run (compilation between arms: low power)")
    ax2 = ax1.twinx()
    ax2.plot(t, clock, color="#4c72b0", lw=1, label="SM clock MHz")
    ax2.set_ylabel("SM clock MHz (max 1980)")
    fig.legend(fontsize=8, loc="lower right")
    return _save(fig, out / name)


def plot_kernel_classes(profiles: dict[str, Path], out: Path, name: str, note: str) -> Path:
    """GPU time per update by kind of kernel (benchmarks/kernel_table.py's classes), one stacked bar a profile."""
    import kernel_table

    read = {label: kernel_table.read_profile(path) for label, path in profiles.items()}
    classes = [c for c, _ in kernel_table.CLASSES] + ["other", "not among the listed rows"]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    left = [0.0] * len(read)
    colors = plt.get_cmap("tab20").colors
    for i, c in enumerate(classes):
        values = [r["by_class"].get(c, 0.0) for r in read.values()]
        if not any(v > 0.5 for v in values):
            continue
        ax.barh(list(read), values, left=left, color=colors[i % len(colors)], label=c)
        left = [a + b for a, b in zip(left, values)]
    for y, r in enumerate(read.values()):
        ax.text(r["busy_ms"] + 2, y, f"{r['busy_ms']:.1f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GPU busy ms per update (two profiled updates)")
    ax.set_xlim(0, max(r["busy_ms"] for r in read.values()) * 1.12)
    ax.set_title(f"Where the time goes ({note})", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, out / name)


def plot_host_lead(result_json: Path, out: Path, name: str, skip: int = 2) -> Path:
    """Per arm, each round's host share (led less the sleep, less rested) and clock share (rested less plain) of
    `benchmarks/host_lead.py`, in ms, with their medians."""
    import statistics

    result = json.loads(read_stored(result_json))
    sleep_s = result["sleep_s"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (arm, times) in enumerate(result["arms"].items()):
        plain, led, rested = (times[f"{k}_s"][skip:] for k in ("plain", "led", "rested"))
        shares = {"host: led less the sleep, less rested": [1e3 * (b - sleep_s - r) for b, r in zip(led, rested)],
                  "clock: rested less plain": [1e3 * (r - p) for r, p in zip(rested, plain)]}
        for j, (label, values) in enumerate(shares.items()):
            x = i + (j - 0.5) * 0.35
            color = ("#c44e52", "#8c8c8c")[j]
            ax.scatter([x] * len(values), values, s=12, color=color, alpha=0.6, label=label if i == 0 else None)
            ax.hlines(statistics.median(values), x - 0.12, x + 0.12, color=color, lw=2.5)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(result["arms"])), list(result["arms"]))
    ax.set_ylabel("ms per update (each round; bar: median)")
    ax.set_title(f"The host's share of an update: the GPU led by a {1e3 * sleep_s:.1f} ms sleep", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out / name)


def plot_screens(records: Path, out: Path) -> Path:
    screens = sorted(p for p in records.iterdir() if p.is_dir() and is_stored(p / "rows.jsonl"))  # a record packed too
    columns = min(4, len(screens))
    rows_of_panels = -(-len(screens) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4.2 * columns, 3.6 * rows_of_panels), sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(screens):]:
        ax.set_visible(False)
    for ax, folder in zip(axes.flat, screens):
        rows = [json.loads(line) for line in read_stored(folder / "rows.jsonl").splitlines() if line.strip()]
        config = json.loads(read_stored(folder / "config.json"))
        result = json.loads(read_stored(folder / "result.json"))
        for arm, color in (("native", "#4c72b0"), ("synthetic", "#dd8452")):
            arm_rows = [r for r in rows if r.get("arm") == arm]
            if arm_rows:
                ax.plot([r["update"] + 1 for r in arm_rows], [r["seconds"] for r in arm_rows], "o-", ms=3,
                        color=color, label=f"{arm} (peak {max(r['peak_allocated_mib'] for r in arm_rows):,.0f} MiB)")
        cap = config["screen"]["memory_cap_mib"]
        kind = "materialized" if config["credit"].get("materialized", False) else "streaming"
        env = folder / "env.json"
        gpu = json.loads(read_stored(env)).get("gpu", "") if is_stored(env) else ""
        card = next((name for name in ("H200", "H100") if name in gpu), gpu or "card not recorded")
        ax.set_title(f"{folder.name[:15]}: {'cap ' + format(cap, ',.0f') + ' MiB' if cap else 'no cap'}, {kind}, "
                     f"{card}\nverdict: {result['verdict']}", fontsize=9)
        ax.set_xlabel("update")
        ax.set_ylim(0.27, 0.4)
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes[:, 0]:
        ax.set_ylabel("s/update (first update off scale)")
    return _save(fig, out / "screen_seed.png")


def plot_kernel_bandwidth(bandwidth_json: Path, out: Path, name: str, top: int = 10) -> Path:
    """Per arm, the generated kernels furthest over the streaming rate: their time in the step against the time
    their bytes need at that rate (kernel_bandwidth.py)."""
    data = json.loads(read_stored(bandwidth_json))
    arms = data["arms"]
    rate = data["streaming_gbps"] / 1e3
    fig, axes = plt.subplots(1, len(arms), figsize=(5.2 * len(arms), 4.2))
    for ax, arm in zip(axes, arms):
        sized = [k for k in arm["kernels"] if k["gb_per_call"] is not None][:top][::-1]
        labels = [k["kernel"].removeprefix("triton_")[:34] for k in sized]
        ax.barh(labels, [k["ms"] for k in sized], color="#4c72b0", label="in the step")
        ax.barh(labels, [k["ms_at_streaming_rate"] for k in sized], color="#55a868", height=0.4,
                label=f"its bytes at {rate:.1f} TB/s")
        ax.set_title(f"{arm['arm']}: {arm['ms_per_update']:.1f} ms of generated kernels, "
                     f"{arm['over_streaming_ms']:+.1f} ms over the rate", fontsize=8)
        ax.set_xlabel("ms per update")
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Generated kernels of one update, {data['preset']} preset: the {top} furthest over the "
                 "streaming rate", fontsize=10)
    return _save(fig, out / name)


# (results file, figure, title): the arms' medians; a title of None draws the per-update rows of the file instead.
ARMS_FIGURES = [
    ("arms_credit_seed.json", "arms_seed.png", "before pointwise recomputation; eager teacher"),
    ("arms_kernel_seed.json", "arms_kernel_seed.png", "recompute, Triton head loss, chunk 16,384; compiled teacher"),
    ("arms_chunk_seed.json", "arms_chunk_seed.png", "head-loss chunk 16,384 vs 8,192"),
    ("arms_kernel_seed.json", "arms_kernel_rows_seed.png", None),
    ("arms_default_seed.json", "arms_default_seed.png", "recompute ReLU^2 only, head loss as one operator, chunk 8,192"),
    ("arms_default_seed.json", "arms_default_rows_seed.png", None),
    ("arms_teacher_fit_seed.json", "arms_teacher_fit_seed.png", "teacher fit products in bf16 vs float32"),
    ("arms_teacher_onepass_seed.json", "arms_teacher_onepass_seed.png", "teacher with one pass over its residual"),
    ("arms_interleaved_seed.json", "arms_interleaved_seed.png",
     "arms interleaved; rank-space teacher fit, code tap, report after the step"),
    ("arms_interleaved_seed.json", "arms_interleaved_rows_seed.png", None),
    ("arms_teacher_before_sync_seed.json", "arms_teacher_before_sync_seed.png",
     "interleaved; the fit's report read before the optimizer step"),
    ("arms_teacher_after_sync_seed.json", "arms_teacher_after_sync_seed.png",
     "interleaved; the fit's report read after the optimizer step"),
    ("arms_fused_mlp_seed.json", "arms_fused_mlp_seed.png", "fused MLP (ReLU^2 in the products' epilogues) vs plain"),
    ("arms_fused_mlp_seed.json", "arms_fused_mlp_rows_seed.png", None),
    ("arms_fused_qk_seed.json", "arms_fused_qk_seed.png", "fused QK-norm + rotary vs plain, both on the fused MLP"),
    ("arms_fused_decode_seed.json", "arms_fused_decode_seed.png", "learned: decode inside the norm's backward vs plain"),
    ("arms_fused_defaults_seed.json", "arms_fused_defaults_seed.png",
     "fused MLP and QK-norm (defaults): credit arms, norms keeping their output"),
    ("arms_fused_defaults_seed.json", "arms_fused_defaults_rows_seed.png", None),
    ("arms_host_seed.json", "arms_host_seed.png", "micro-batches made ahead and the collector paused, vs in line"),
    ("arms_final_seed.json", "arms_final_seed.png", "fused MLP, QK-norm and norms keeping their output (defaults)"),
    ("arms_final_seed.json", "arms_final_rows_seed.png", None),
    ("arms_fit_rows_seed.json", "arms_fit_rows_seed.png", "teacher: the fit's token-wise pass in one kernel vs op by op"),
    ("arms_fit_rows_second_seed.json", "arms_fit_rows_second_seed.png", "the same, a second process"),
    ("arms_fit_rows_seed.json", "arms_fit_rows_rows_seed.png", None),
    ("arms_fit_whole_tile_seed.json", "arms_fit_whole_tile_seed.png", "credit arms; the teacher's fit kernel, whole tiles"),
    ("arms_graphs_seed.json", "arms_graphs_seed.png", "compiled graphs replayed as CUDA graphs (not kept)"),
    ("arms_merged_gates_seed.json", "arms_merged_gates_seed.png",
     "gates in the Q/K/V products, dependent launches (neither kept)"),
    ("arms_pdl_seed.json", "arms_pdl_seed.png", "generated kernels as dependent launches (not kept)"),
    ("arms_merged_gates_second_seed.json", "arms_merged_gates_second_seed.png",
     "learned with the gates merged, against learned"),
    ("arms_decode_residual_seed.json", "arms_decode_residual_seed.png",
     "learned: MLP decode and residual add in the norm backward"),
    ("arms_final_tree_seed.json", "arms_final_tree_seed.png", "credit arms on the tree the admitted screen ran"),
    ("arms_grouped_muon_seed.json", "arms_grouped_muon_seed.png", "Muon: same-shaped matrices together vs torch's"),
    ("arms_grouped_muon_second_seed.json", "arms_grouped_muon_second_seed.png", "the same, a second process"),
    ("arms_grouped_muon_second_seed.json", "arms_grouped_muon_rows_seed.png", None),
    ("arms_fp8_head_seed.json", "arms_fp8_head_seed.png", "the head's products on FP8 tensor cores, native and learned"),
    ("arms_fp8_head_first_seed.json", "arms_fp8_head_first_seed.png", "the same, the first version (eager quantization)"),
    ("arms_before_head_seed.json", "arms_before_head_seed.png", "credit arms, before the head loss wrote its products in place"),
    ("arms_head_seed.json", "arms_head_seed.png", "credit arms, the head loss's products written and added in place"),
    ("arms_head_second_seed.json", "arms_head_second_seed.png", "the same tree, a second process"),
    ("arms_pointwise_gate_seed.json", "arms_pointwise_gate_seed.png", "the attention gate written pointwise (taken out)"),
    ("arms_chunk16k_seed.json", "arms_chunk16k_seed.png", "head-loss chunk 16,384 vs 8,192, products in place"),
    ("arms_recheck_seed.json", "arms_recheck_seed.png", "the package of the admitted screen, 24 updates"),
    ("arms_fit_lean_seed.json", "arms_fit_lean_seed.png", "credit arms, the teacher's fit kernel at 4 warps, 24 updates"),
    ("arms_fit_lean_second_seed.json", "arms_fit_lean_second_seed.png", "the same tree, a second process"),
    ("arms_wide_ce_seed.json", "arms_wide_ce_seed.png",
     "credit arms, the head loss's cross-entropy with wide loads, 24 updates"),
    ("arms_prefetch_seed.json", "arms_prefetch_seed.png",
     "train.prefetch on (native) and off"),
    ("arms_fused_embed_seed.json", "arms_fused_embed_seed.png",
     "native with the sorted embedding backward (model.embed=fused, 64 x 128 blocks) and with autograd's, 32 updates"),
    ("arms_gluon_dgrad_flat_seed.json", "arms_gluon_dgrad_flat_seed.png",
     "the MLP's derivative product: Gluon kernel (first form, one flat loop) vs Triton's"),
    ("arms_gluon_dgrad_seed.json", "arms_gluon_dgrad_seed.png",
     "the MLP's derivative product: Gluon kernel (K loop unrolled) vs Triton's"),
    ("arms_gluon_default_seed.json", "arms_gluon_default_seed.png",
     "credit arms, the Gluon derivative product by default (the last screen's tree)"),
    ("arms_final_prefetch_seed.json", "arms_final_prefetch_seed.png",
     "credit arms, micro-batches made ahead (the last screen's tree)"),
    ("arms_fused_products_seed.json", "arms_fused_products_seed.png",
     "learned with the gate and decode as Triton kernels (pointer loads) vs cuBLAS"),
    ("arms_options_seed.json", "arms_options_seed.png",
     "QK-norm and rotary in the Q/K/V product's epilogue (Gluon) and the one-pass attention gate, against native"),
    ("arms_product_default_seed.json", "arms_product_default_seed.png",
     "credit arms, the Q/K/V epilogue and the one-pass gate by default (the screened tree)"),
    ("arms_product_default_second_seed.json", "arms_product_default_second_seed.png",
     "credit arms, the same tree, a second process"),
    ("arms_profiled_default_seed.json", "arms_profiled_default_seed.png",
     "credit arms on the same tree, another machine (profiled after the timed rounds)"),
    ("arms_profiled_default_second_seed.json", "arms_profiled_default_second_seed.png",
     "credit arms on the same tree, a second process on another machine (profiled)"),
    ("arms_overlapped_first_seed.json", "arms_overlapped_first_seed.png",
     "credit arms overlapped, first form (its read waited for the next update)"),
    ("arms_settled_first_seed.json", "arms_settled_first_seed.png",
     "credit arms settled, the same machine, after the overlapped process"),
    ("arms_overlapped_final_seed.json", "arms_overlapped_final_seed.png",
     "credit arms overlapped (the corrected loop), the final tree"),
    ("arms_final_h100_seed.json", "arms_final_h100_seed.png",
     "credit arms on the final tree (tiles of v as the product made them), one H100"),
    ("arms_autotune_gemm_h100_seed.json", "arms_autotune_gemm_h100_seed.png",
     "native with the compiler's products autotuned (train.compile_mode=autotune-gemm), one H100"),
    ("arms_overlapped_epilogues_h100_seed.json", "arms_overlapped_epilogues_h100_seed.png",
     "native with the Q/K/V or the derivative product's epilogue beside the next tile's products, one H100"),
    ("arms_specialized_dgrad_h100_seed.json", "arms_specialized_dgrad_h100_seed.png",
     "native with the derivative product's epilogue on a warpgroup of its own, one H100"),
    ("arms_final_h200_seed.json", "arms_final_h200_seed.png",
     "credit arms on the final tree (the step of 6fae155), one H200"),
    ("arms_kernel_table_h100_seed.json", "arms_kernel_table_h100_seed.png",
     "credit arms on the final tree with SDPA's gradient in the output's layout, one H100 (profiled)"),
    ("arms_kernel_table_h200_seed.json", "arms_kernel_table_h200_seed.png",
     "credit arms on the final tree with SDPA's gradient in the output's layout, one H200 (profiled)"),
    ("arms_gluon_expand_h100_seed.json", "arms_gluon_expand_h100_seed.png",
     "native with the MLP's expansion as the Gluon kernel (model.mlp_expand=gluon), one H100 (profiled)"),
    ("arms_all_options_h100_seed.json", "arms_all_options_h100_seed.png",
     "credit arms on the final tree, with and without the FP8 head and the Gluon expansion, one H100"),
    ("arms_all_options_h100_second_seed.json", "arms_all_options_h100_second_seed.png",
     "credit arms on the final tree, with and without the FP8 head and the Gluon expansion, a second H100"),
]


def plot_head_loss(results: list[Path], out: Path, name: str) -> Path:
    """One micro-batch's head loss, the loop as it is against the loop it replaced, in each process: the
    median ms of each, and each round's difference."""
    data = [json.loads(read_stored(r)) for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    x = range(len(data))
    for offset, loop, color in ((-0.2, "before", "#999999"), (0.2, "as it is", "#4c72b0")):
        values = [d["ms_per_micro_batch"][loop] for d in data]
        bars = ax1.bar([i + offset for i in x], values, width=0.4, color=color,
                       label=f"{loop} ({data[0]['launches_per_micro_batch'][loop]} launches)")
        for bar, v in zip(bars, values):
            ax1.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(x), [f"process {i + 1}" for i in x])
    ax1.set(ylabel="ms per micro-batch (median of 10 rounds)", title="bf16 head loss, 131,072 tokens")
    ax1.legend(fontsize=8, loc="lower right")
    for i, d in enumerate(data):
        diffs = d["as_it_is_minus_before_per_round_ms"]
        ax2.plot([i + 1] * len(diffs), diffs, "o", color="#4c72b0", alpha=0.6)
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xticks([i + 1 for i in x], [f"process {i + 1}" for i in x])
    ax2.set(ylabel="as it is - before, ms", title="each alternated round")
    return _save(fig, out / name)


def plot_products(results: Path, out: Path, name: str) -> Path:
    """Each of the step's plain products, cuBLAS against the persistent Triton kernel: TFLOP/s (medians of
    alternated rounds)."""
    rows = json.loads(read_stored(results))["rows"]
    paths = list(rows[0]["median_ms"])
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(paths)
    for j, (path, color) in enumerate(zip(paths, ("#4c72b0", "#dd8452", "#999999"))):
        ax.bar([i + (j - (len(paths) - 1) / 2) * width for i in range(len(rows))],
               [r["TFLOP_per_s"][path] for r in rows], width=width, color=color, label=path)
    ax.set_xticks(range(len(rows)), [textwrap.fill(r["product"], 16) + f"\n{r['M']}x{r['K']}x{r['N']}"
                                     for r in rows], fontsize=7)
    ax.set(ylabel="TFLOP/s (median of 10 rounds)", title="the seed step's plain products, one H200, bf16")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out / name)


def plot_fit_variants(results: Path, out: Path, name: str, default: str) -> Path:
    """The fit kernel's variants at the seed shape: median ms of alternated rounds, fastest first; the ones that
    leave work out (wrong results) hatched, the reads of c alone and cuBLAS's c D as the floor."""
    data = json.loads(read_stored(results))
    times = sorted(data["times_ms"].items(), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(10, 0.24 * len(times) + 1.2))
    for i, (variant, ms) in enumerate(times):
        color = ("#dd8452" if variant == default else "#4c72b0" if variant == "kernel"
                 else "#999999" if variant not in data["difference_from_kernel"] else "#a1c9f4")
        ax.barh(i, ms, color=color, hatch="//" if variant.endswith("(wrong)") else None, edgecolor="white")
        ax.annotate(f"{ms:.3f}", (ms, i), va="center", fontsize=7, xytext=(2, 0), textcoords="offset points")
    ax.set_yticks(range(len(times)), [v if v != "kernel" else "kernel (then the default)" for v, _ in times],
                  fontsize=7)
    ax.invert_yaxis()
    shape = data["shape"]
    ax.set(xlabel="ms per call (median of 10 alternated rounds)",
           title=f"the teacher's fit kernel, {shape['tokens']:,} x {shape['width']}, code width "
                 f"{shape['code_width']}\norange: the default since; hatched: work left out")
    return _save(fig, out / name)


def _ratio_bar(ax, y: float, r: dict, height: float, color: str, label: str | None) -> None:
    """One variant's per-round ratio as a bar, with the range of its rounds."""
    lo, hi = r["ratio_range"]
    ax.barh(y, r["ratio_per_round"], height=height, color=color, label=label)
    ax.errorbar(r["ratio_per_round"], y, xerr=[[r["ratio_per_round"] - lo], [hi - r["ratio_per_round"]]],
                color="black", lw=0.8, capsize=2)


def plot_softcap_variants(results: Path, out: Path, name: str) -> Path:
    """The head loss's cross-entropy kernel against its variants, one chunk: the per-round ratio over the kernel
    (median and range of alternated rounds), for the bf16 and the FP8 head's e5m2 gradient."""
    data = json.loads(read_stored(results))["variants"]
    names = list(dict.fromkeys(k.rsplit(", ", 1)[0] for k in data))
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(names) + 1.4))
    for j, (grad, color) in enumerate((("bf16", "#4c72b0"), ("e5m2", "#dd8452"))):
        for i, variant in enumerate(names):
            r = data[f"{variant}, {grad} gradient"]
            y = i + (j - 0.5) * 0.38
            _ratio_bar(ax, y, r, 0.36, color, f"{grad} gradient" if i == 0 else None)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0.8, max(r["ratio_range"][1] for r in data.values()) + 0.05)
    ax.set(xlabel="time over the kernel's, per round (median, range of 10 alternated rounds)",
           title="the head loss's soft-capped cross-entropy kernel against its variants\n"
                 "one chunk of 8,192 rows x 12,352 columns, bf16 logits, one H200; under 1: faster")
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, out / name)


MLP_PATHS = ("time over the product's Triton kernel, per round (median, range of 10 alternated rounds)",
             "the fused MLP's products on Hopper (the derivative product (dy W) * 2 sqrt(post) unless named)\n"
             "131,072 x 512 -> 2,048, bf16, one H200")


QKV_PATHS = ("time over the step's model.qk=fused forward, per round (median, range of 10 alternated rounds)",
             "the Q/K/V product with QK-norm and rotary (model.qk=product, Triton and Gluon)\n"
             "131,072 x 512 -> 3 x 512, 4 heads of 128, bf16, one H200")
TWO_PROGRAMS_PATHS = ("time over the first path of the same product, per round (median, range of 10 alternated "
                      "rounds)", "the fused MLP's products with one warpgroup a program, two programs a "
                      "multiprocessor,\nagainst the default tiling; 131,072 x 512 -> 2,048, bf16, one H100")
QKV_TWO_PROGRAMS_PATHS = (QKV_PATHS[0], "the Q/K/V product with QK-norm and rotary, with one warpgroup a program, two "
                          "programs a multiprocessor\n131,072 x 512 -> 3 x 512, 4 heads of 128, bf16, one H100")


def _mlp_h100_labels(what: str) -> tuple[str, str]:
    """plot_path_ratios' labels for a try at the fused MLP's products, measured on an H100."""
    return (TWO_PROGRAMS_PATHS[0], f"the fused MLP's products: {what},\nbeside every tiling; 131,072 x 512 -> 2,048, "
            "bf16, one H100")


def _qkv_h100_labels(what: str) -> tuple[str, str]:
    """plot_path_ratios' labels for a try at the Q/K/V product's epilogue, measured on an H100."""
    return (QKV_PATHS[0], f"the Q/K/V product with QK-norm and rotary: {what}\nbeside every tiling; 131,072 x 512 -> "
            "3 x 512, 4 heads of 128, bf16, one H100")


QKV_EPILOGUE_PATHS = _qkv_h100_labels("the epilogue's forms (tiles of v as made, the rotary tables early)")
POST_APART_PATHS = _mlp_h100_labels("the derivative product's post tile in a buffer of its own")
QKV_OVERLAPPED_PATHS = _qkv_h100_labels("the epilogue in 32-row pieces beside the next tile's products,")
DGRAD_OVERLAPPED_PATHS = _mlp_h100_labels("the derivative product's epilogue in row pieces beside the next tile's "
                                          "products")
DGRAD_SPECIALIZED_PATHS = _mlp_h100_labels("the derivative product's epilogue on a warpgroup of its own")
ATTENTION_PATHS = ("time over cuDNN's same pass, per round (median, range of 10 alternated rounds)",
                   "causal attention in each kernel PyTorch offers, forward and forward + backward\n"
                   "64 x 2,048 tokens, 4 heads of 128, bf16, one H100")
ATTENTION_LAYOUT_PATHS = (ATTENTION_PATHS[0], ATTENTION_PATHS[1].replace(
    "kernel PyTorch offers", "kernel PyTorch offers, the model's layout and heads first"))
GATE_PATHS = ("time over cuBLAS's products of the same direction, per round (median, range of 10 alternated rounds)",
              "the attention gate's thin product (model.attn_gate=fused), forward and backward\n"
              "131,072 tokens x 12 -> 4, bf16, CUDA graphs of 20 calls, one H200")


def plot_path_ratios(results: list[Path], out: Path, name: str, labels: tuple[str, str] = MLP_PATHS) -> Path:
    """A kernel benchmark's paths (`checked_paths`' results: "paths" with "ratio_per_round" and "ratio_range"),
    each path's time over its group's base per round (median and range of alternated rounds), in each process;
    `labels`: the x label and the title."""
    data = [json.loads(read_stored(r))["paths"] for r in results]
    names = list(data[0])
    fig, ax = plt.subplots(figsize=(10, 0.36 * len(names) * len(data) + 1.4))
    colors = ("#4c72b0", "#dd8452", "#55a868")
    height = 0.8 / len(data)
    for j, paths in enumerate(data):
        for i, path in enumerate(names):
            if path not in paths:
                continue
            r = paths[path]
            y = i + (j - (len(data) - 1) / 2) * height
            _ratio_bar(ax, y, r, height * 0.9, colors[j % len(colors)], f"process {j + 1}" if i == 0 else None)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(names)), [textwrap.fill(n, 70) for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel=labels[0], title=labels[1])
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out / name)


def plot_gate_decode(results: Path, out: Path, name: str) -> Path:
    """The predictor's skinny products, one branch and micro-batch: each path's time per call and its rate over the
    bytes it must move (medians of alternated rounds), the state gate and the decode in a panel each."""
    data = json.loads(read_stored(results))
    paths = data["paths"]
    products = list(dict.fromkeys(r["product"] for r in paths.values()))
    fig, axes = plt.subplots(len(products), 1, figsize=(10, 0.3 * len(paths) + 2.2), squeeze=False)
    for ax, product in zip(axes[:, 0], products):
        names = [k for k, r in paths.items() if r["product"] == product]
        us = [paths[k]["median_ms"] * 1e3 for k in names]
        colors = ["#dd8452" if k.startswith("plain") else "#8c8c8c" if k.startswith("cuBLAS") else
                  "#55a868" if "TMA" in k else "#4c72b0" for k in names]
        ax.barh(range(len(names)), us, color=colors)
        for i, k in enumerate(names):
            ax.text(us[i], i, f" {us[i]:.1f} µs, {paths[k]['tb_per_s']:.2f} TB/s", va="center", fontsize=7)
        ax.set_yticks(range(len(names)), [textwrap.fill(k, 75) for k in names], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, max(us) * 1.3)
        ax.set(xlabel="µs per call (median of 10 alternated rounds, CUDA graphs of 20 calls)", title=product)
    fig.suptitle(f"the predictor's skinny products, {data['tokens']:,} tokens x {data['width']} <-> "
                 f"{data['code_width']}, bf16, one H200\norange: the plain path as compiled; grey: its cuBLAS "
                 "product alone; blue: Triton kernel, pointer loads; green: Triton kernel, TMA", fontsize=9)
    return _save(fig, out / name)


def plot_embedding_grad(results: Path, out: Path, name: str) -> Path:
    """The embedding tables' backward, one micro-batch, in ms (medians of alternated rounds): the lookups'
    forward + backward less the forward alone, and the kernel configurations' sort and tables alone, for the
    two ways of drawing the ids."""
    data = json.loads(read_stored(results))["results"]
    kinds = list(data)
    names = [n for n in data[kinds[0]]["variants"] if n != "forward alone"]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(names) + 1.6))
    for j, (kind, color) in enumerate(zip(kinds, ("#4c72b0", "#dd8452"))):
        variants = data[kind]["variants"]
        for i, variant in enumerate(names):
            ms = variants[variant]["ms"] - (variants["forward alone"]["ms"] if "forward + backward" in variant else 0)
            ax.barh(i + (j - 0.5) * 0.38, ms, height=0.36, color=color, label=f"ids {kind}" if i == 0 else None)
    compiled = data[kinds[0]]["variants"]
    ax.axvline(compiled[names[0]]["ms"] - compiled["forward alone"]["ms"], color="black", lw=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="backward ms per micro-batch (line: compiled autograd's, synthetic ids)",
           title="the four embedding tables' backward, one micro-batch of 64 x 2,048 ids, one H200\n"
                 "lookups: forward + backward less the forward; kernels: the sort and four tables alone")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, out / name)


def plot_step_gradients(result_json: Path, out: Path, name: str) -> Path:
    """Each parameter's gradient error against float64 over its level (the plain step's error in the same
    precision): eager (circles) and compiled (crosses), one panel per arm and kind; the flag lines at the level
    and at OVER_LEVEL x it; parameters not judged in grey."""
    data = json.loads(read_stored(result_json))
    bounds = data["bounds"]
    panels = [(arm, kind, errors, {f["parameter"] for f in r["unjudged"] if f["kind"] == kind})
              for arm, r in data["arms"].items() for kind, errors in r["errors"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    for ax, (arm, kind, errors, unjudged) in zip(axes[0], panels):
        for way, marker in (("eager", "o"), ("compiled", "x")):
            for judged, color in ((True, "#4c72b0" if way == "eager" else "#c44e52"), (False, "#aaaaaa")):
                points = [(e["plain"], e[way]) for n, e in errors.items() if (n not in unjudged) == judged]
                if points:
                    ax.scatter(*zip(*points), s=12, marker=marker, color=color, facecolors="none" if marker == "o"
                               else None, label=f"{way}{'' if judged else ', not judged'}")
        low = max(min(min(e["plain"], e["eager"], e["compiled"]) for e in errors.values()), 1e-12)
        high = max(max(e["plain"], e["eager"], e["compiled"]) for e in errors.values())
        line = [low, high]
        ax.plot(line, line, color="grey", lw=0.8, label="the level")
        ax.plot(line, [bounds["over_level"] * v for v in line], color="#dd8452", ls="--",
                label=f"{bounds['over_level']:g} x the level")
        ax.axhline(bounds["floor"], color="#937860", ls=":", lw=0.8, label=f"floor {bounds['floor']:g}")
        ax.set(xscale="log", yscale="log", xlabel="plain step's error (the level)", title=f"{arm}: {kind}")
    axes[0][0].set_ylabel("error against float64")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"the step's gradients, {data['gpu']}, torch {data['torch']}: verdict {data['verdict']}",
                 fontsize=9)
    return _save(fig, out / name)


def step_lines(log: Path) -> list[dict]:
    """Rank 0's step lines of a `creditlab train` log as rows: update, kind, seconds."""
    rows = []
    for line in read_stored(log).splitlines():
        parts = [p.strip() for p in line.split("|")]
        if parts[0].startswith("update ") and len(parts) > 4 and parts[4].endswith(" s"):
            rows.append({"update": int(parts[0].split()[1].split("/")[0]) - 1, "kind": parts[1],
                         "seconds": float(parts[4][:-2])})
    return rows


def plot_ddp(ddp_json: Path, out: Path, name: str, logs: dict[str, Path] | None = None) -> Path:
    """Seconds per update of every data-parallel run (a kind's first update, which compiles, left out), and
    tokens/s against the one-GPU run. `logs` fills a run whose rows the script did not read from its log."""
    data = json.loads(read_stored(ddp_json))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    throughput = {}
    for run in data["runs"]:
        rows, source = run["rows"], ""
        if logs and run["name"] in logs and len(rows) < data["updates"]:
            rows, source = step_lines(logs[run["name"]]), " (from its log)"
        seen = set()
        timed = [r for r in rows if (r["kind"] in seen) or seen.add(r["kind"])]  # each kind's first left out
        ax1.plot([r["update"] + 1 for r in timed], [r["seconds"] for r in timed], "o-", ms=3,
                 label=f"{run['name']}, {run['gpus']} GPU{'s' if run['gpus'] > 1 else ''}{source}")
        for r in timed:
            if r["kind"] == "teacher":
                ax1.annotate("teacher", (r["update"] + 1, r["seconds"]), fontsize=7, xytext=(4, -3),
                             textcoords="offset points")
    for summary in data["summaries"]:
        if "native" in summary:
            throughput[f"{summary['name']}\n{summary['gpus']} GPU"] = summary["native"]["tokens_per_s"] / 1e6
    ax1.set(xlabel="update", ylabel="s / update", title="seed preset, per update (compiling updates left out)")
    ax1.legend(fontsize=8)
    single = next(v for k, v in throughput.items() if k.endswith("\n1 GPU"))
    bars = ax2.bar(list(throughput), list(throughput.values()), color="#4c72b0")
    for bar, value in zip(bars, throughput.values()):
        ax2.annotate(f"{value:.2f} M ({value / single:.2f}x)", (bar.get_x() + bar.get_width() / 2, value),
                     ha="center", va="bottom", fontsize=8)
    ax2.set(ylabel="M tokens / s (median)", title="native throughput")
    return _save(fig, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE), help="output folder")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = HERE / "results"
    for source, figure, title in ARMS_FIGURES:
        print(plot_arm_rows(results / source, out, figure) if title is None else
              plot_arms(results / source, out, figure, title))
    print(plot_recompute_tradeoff(results / "arms_recompute_parts_seed.json", out, "recompute_parts_seed.png"))
    print(plot_clocks(results / "dmon_default_seed.txt", out, "clocks_seed.png"))
    print(plot_ddp(results / "ddp_seed.json", out, "ddp_seed.png",
                   {"ddp_learned": results / "ddp_seed_learned.log"}))
    print(plot_screens(HERE / "screen_records", out))
    print(plot_head_loss([results / f"head_loss{n}_seed.json" for n in ("", "_second", "_third")], out,
                         "head_loss_seed.png"))
    print(plot_products(results / "products_seed.json", out, "products_seed.png"))
    print(plot_fit_variants(results / "fit_rows_variants_seed.json", out, "fit_rows_variants_seed.png",
                            "lean, M per tile, 4 warps, Gram in bf16"))
    print(plot_softcap_variants(results / "softcap_ce_held_seed.json", out, "softcap_ce_held_seed.png"))
    print(plot_softcap_variants(results / "softcap_ce_held_split_seed.json", out, "softcap_ce_held_split_seed.png"))
    print(plot_embedding_grad(results / "embedding_grad_seed.json", out, "embedding_grad_seed.png"))
    print(plot_path_ratios([results / f"relu2_hopper_flat{n}_seed.json" for n in ("_second", "")], out,
                           "relu2_hopper_flat_seed.png"))
    print(plot_path_ratios([results / "relu2_hopper_seed.json"], out, "relu2_hopper_seed.png"))
    print(plot_path_ratios([results / "relu2_hopper_expand_seed.json"], out, "relu2_hopper_expand_seed.png"))
    print(plot_path_ratios([results / "qkv_rotary_seed.json"], out, "qkv_rotary_seed.png", QKV_PATHS))
    print(plot_path_ratios([results / "attention_gate_seed.json"], out, "attention_gate_seed.png", GATE_PATHS))
    print(plot_path_ratios([results / "relu2_hopper_two_programs_h100_seed.json"], out,
                           "relu2_hopper_two_programs_h100_seed.png", TWO_PROGRAMS_PATHS))
    print(plot_path_ratios([results / "qkv_rotary_two_programs_h100_seed.json"], out,
                           "qkv_rotary_two_programs_h100_seed.png", QKV_TWO_PROGRAMS_PATHS))
    print(plot_path_ratios([results / "attention_h100_seed.json"], out, "attention_h100_seed.png", ATTENTION_PATHS))
    print(plot_path_ratios([results / "attention_model_layout_h100_seed.json"], out,
                           "attention_model_layout_h100_seed.png", ATTENTION_LAYOUT_PATHS))
    print(plot_path_ratios([results / "qkv_rotary_epilogue_h100_seed.json"], out, "qkv_rotary_epilogue_h100_seed.png",
                           QKV_EPILOGUE_PATHS))
    print(plot_path_ratios([results / "relu2_hopper_post_apart_h100_seed.json"], out,
                           "relu2_hopper_post_apart_h100_seed.png", POST_APART_PATHS))
    print(plot_path_ratios([results / "qkv_rotary_overlapped_h100_seed.json"], out,
                           "qkv_rotary_overlapped_h100_seed.png", QKV_OVERLAPPED_PATHS))
    print(plot_path_ratios([results / "relu2_hopper_overlapped_h100_seed.json"], out,
                           "relu2_hopper_overlapped_h100_seed.png", DGRAD_OVERLAPPED_PATHS))
    print(plot_path_ratios([results / "relu2_hopper_specialized_h100_seed.json"], out,
                           "relu2_hopper_specialized_h100_seed.png", DGRAD_SPECIALIZED_PATHS))
    print(plot_gate_decode(results / "gate_decode_first_seed.json", out, "gate_decode_first_seed.png"))
    print(plot_gate_decode(results / "gate_decode_seed.json", out, "gate_decode_seed.png"))
    print(plot_kernel_bandwidth(results / "kernel_bandwidth_seed.json", out, "kernel_bandwidth_seed.png"))
    print(plot_host_lead(results / "host_lead_seed.json", out, "host_lead_seed.png"))
    print(plot_step_gradients(results / "step_gradients_seed.json", out, "step_gradients_seed.png"))
    print(plot_kernel_classes({"native, before the fused modules": results / "profile_native_busy_seed.txt",
                               "native now": results / "profile_native_final_busy_seed.txt",
                               "zero now": results / "profile_zero_final_busy_seed.txt",
                               "learned now": results / "profile_learned_final_busy_seed.txt"},
                              out, "kernel_table_seed.png", "seed preset, one H200"))
    print(plot_kernel_classes({"native, before the fused modules": results / "profile_native_busy_seed.txt",
                               "native, fused defaults": results / "profile_native_final_busy_seed.txt",
                               "native now": results / "profile_native_product_default_second_seed.txt",
                               "zero now": results / "profile_zero_product_default_second_seed.txt",
                               "learned now": results / "profile_learned_product_default_second_seed.txt"},
                              out, "kernel_table_default_seed.png",
                              "seed preset, one H200: the Q/K/V epilogue and the one-pass gate by default"))
    print(plot_kernel_classes({arm: results / f"profile_{arm}_final_h100_seed.txt" for arm in ("native", "zero", "learned")},
                              out, "kernel_table_final_h100_seed.png", "seed preset, the final tree, one H100"))
    print(plot_kernel_classes({"native, before the fused modules": results / "profile_native_busy_seed.txt",
                               **{f"{arm}, final": results / f"profile_{arm}_final_h200_seed.txt"
                                  for arm in ("native", "zero", "learned")}},
                              out, "kernel_table_final_h200_seed.png", "seed preset, before and the final tree, one H200"))
    (out / "fit").mkdir(exist_ok=True)
    print(plot_arms(HERE / "fit" / "cost" / "arms.json", out / "fit", "cost.png",
                    "fit study: synthetic and teacher updates per family"))
    (out / "rivals" / "cost").mkdir(parents=True, exist_ok=True)
    for table in ("A", "B"):
        print(plot_arms(HERE / "rivals" / "cost" / table / "arms.json", out / "rivals" / "cost", f"{table}.png",
                        f"rivals at the seed shape, table {table} (ratios against its own native)"))


if __name__ == "__main__":
    main()
