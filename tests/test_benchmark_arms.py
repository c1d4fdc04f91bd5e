"""The benchmark's arm names resolve to valid configs on the CPU, before any GPU time is spent on them."""

import json
from pathlib import Path

import pytest
import torch

from benchmark_scripts import load
from creditlab import config


def test_every_arm_a_benchmark_script_names_is_a_valid_seed_config():
    import re

    arms = load("arms")
    scripts = Path(__file__).resolve().parents[1] / "benchmarks"
    named = [m for f in sorted(scripts.glob("*.sh"))
             for m in re.findall(r"--arms\s+(?:\\\n\s*)?\"?([^\s\"]+)", f.read_text()) if "$" not in m]
    assert len(named) >= 4, named
    labels = [label for text in named for label in arms.arm_names(text)]
    for label in labels:
        assert config.load("seed", arms.overrides_of(label)).model.layers == 8, label
    assert config.load("seed", arms.overrides_of("learned@credit.teacher_every=1")).credit.teacher_every == 1
    assert config.load("seed", arms.overrides_of("native@model.head=fp8")).model.head == "fp8"


def test_a_misspelt_arm_is_refused_with_the_valid_names():
    arms = load("arms")
    with pytest.raises(SystemExit, match="unknown arm 'nativ'; arms: native, oracle, zero"):
        arms.arm_names("zero,nativ")
    with pytest.raises(SystemExit, match="not of the form section.key=value"):
        arms.overrides_of("native@fp8_head")


def test_interleaved_rounds_put_every_arm_in_every_position_equally():
    arms = load("arms")
    names = ["native", "zero", "learned", "teacher"]
    rounds = [arms.rotation(names, u) for u in range(2 * len(names))]
    assert all(sorted(r) == sorted(names) for r in rounds)
    for position in range(len(names)):
        assert sorted(r[position] for r in rounds) == sorted(names * 2)


def test_cycle_estimate_uses_medians_after_the_first_cycle():
    arms = load("arms")
    kinds = ["teacher", "synthetic", "synthetic", "synthetic"] * 4
    seconds = [30.0, 1.0, 1.0, 1.0] + [2.0, 1.0, 1.0, 1.0] * 3
    seconds[9] = 5.0  # one slow synthetic update
    rows = [{"kind": k, "seconds": s} for k, s in zip(kinds, seconds)]
    est = arms.cycle_estimate(rows)
    assert est["cycle_every"] == 4 and est["cycle_teacher_s"] == 2.0 and est["cycle_synthetic_s"] == 1.0
    assert est["cycle_s"] == (2.0 + 3 * 1.0) / 4
    assert arms.cycle_estimate([{"kind": "synthetic", "seconds": 1.0}] * 8) == {}


def test_a_sketch_counts_its_refresh_at_its_share_of_the_updates_as_compare_does():
    from creditlab.experiments.compare import arm_summary
    from creditlab.train import Trainer

    arms = load("arms")
    cfg = config.load("tiny", ["credit.source=sketch", "credit.sketch_rank=4", "credit.sketch_every=10",
                               "train.device=cpu", "train.compile=off"])
    trainer = Trainer(cfg)
    trainer.train_update()  # takes the first basis
    est = arms.refresh_estimate(trainer)
    assert est["refresh_every"] == 10 and est["refresh_s"] > 0
    assert est["refresh_share_s"] == pytest.approx(est["refresh_s"] / 10)
    assert arms.refresh_estimate(Trainer(config.load("tiny", ["train.device=cpu", "train.compile=off"]))) == {}
    # the table's s/update and per-round columns: the update plus the refresh's share, the rule compare applies
    # to an arm whose rows record each refresh as its own kind
    rows = [{"seconds": 1.0, "tokens": 100, "kind": "native"} for _ in range(8)]
    native = {"arm": "native", "rows": rows, "median_last6_s": 1.0, "median_last6_tokens_per_s": 100.0,
              "median_last6_mfu": None, "peak_allocated_mib": 1.0, "peak_reserved_mib": None, "first_update_s": 1.0,
              "loss_last": 1.0}
    sketch = native | {"arm": "sketch16", "rows": [r | {"kind": "synthetic"} for r in rows], "refresh_s": 5.0,
                       "refresh_every": 50, "refresh_share_s": 0.1}
    table = arms.markdown([native, sketch], {"env": {"torch": "x", "cuda": "y"}, "matmul_tflops": None, "updates": 8,
                                             "schedule": "interleaved"})
    assert "| sketch16 | 1.1000 | 1.1000 |" in table and "refresh 5.0000 s" in table
    assert "1.1000 (1.1000 .. 1.1000)" in table  # per round, the share added to every update
    long_run = [{"kind": "refresh", "seconds": 6.0, "loss": 1.0}] + \
        [{"kind": "synthetic", "seconds": 1.0, "loss": 1.0}] * 49
    long_run = long_run * 3  # 150 updates, three refreshes: the compiling first of each kind left out
    assert arm_summary(long_run, [])["gpu_seconds"] == pytest.approx(3 * 6.0 + 147 * 1.0)


def test_gpu_busy_is_the_union_of_device_intervals():
    arms = load("arms")
    events = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 10}, {"ph": "X", "cat": "kernel", "ts": 5, "dur": 10},
              {"ph": "X", "cat": "gpu_memset", "ts": 30, "dur": 5}, {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 99},
              {"ph": "X", "cat": "kernel", "ts": 32, "dur": 1}]
    busy, kernels, gaps = arms.gpu_busy_ms({"traceEvents": events}, gaps=1)
    assert busy == (15 + 5) / 1e3 and kernels == 3
    assert gaps == [(15 / 1e3, "?", "?")]


def test_idle_stretches_are_charged_to_what_the_host_did_before_the_launch():
    arms = load("arms")

    def kernel(ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": f"k{corr}", "args": {"correlation": corr}}

    def host(cat, name, ts, dur, corr=None, tid=1):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "tid": tid,
                **({"args": {"correlation": corr}} if corr is not None else {})}

    events = [kernel(0, 100, 1), host("cuda_runtime", "cudaLaunchKernel", 0, 2, 1),
              # the host waits 900 us in a synchronization, then launches k2: 1 ms idle, charged to the wait
              host("cpu_op", "aten::item", 50, 1000), host("cuda_runtime", "cudaStreamSynchronize", 60, 900),
              host("cpu_op", "step", 1040, 20), host("cuda_runtime", "cudaLaunchKernel", 1050, 5, 2),
              kernel(1100, 100, 2),
              # k3 was launched early but starts 300 us after k2: it waited on something other than the host
              host("cuda_runtime", "cudaLaunchKernel", 1060, 5, 3), kernel(1500, 100, 3),
              # k4 is launched 200 us late with nothing long on the host in between
              host("cpu_op", "forward", 1700, 300), host("cuda_runtime", "cudaLaunchKernel", 1790, 5, 4),
              # a garbage collection holds the host 400 us before k5's launch
              host("user_annotation", "python garbage collection", 1815, 400),
              host("cuda_runtime", "cudaLaunchKernel", 2220, 5, 5), kernel(2230, 10, 5),
              # another thread's long call during that stretch is not what held the launch back
              host("cpu_op", "elsewhere", 1600, 400, tid=2),
              host("cuda_runtime", "cudaEventSynchronize", 1610, 180, tid=2),
              kernel(1800, 10, 4)]
    text = arms.idle_causes({"traceEvents": events}, updates=1)
    table = dict(line.strip("|").rsplit("|", 1) for line in text.splitlines() if line.startswith("| ") and
                 "cause" not in line)
    table = {k.strip(): float(v) for k, v in table.items()}
    assert table == {"host in cudaStreamSynchronize; launched in step": 1.0,
                     "queued before the stretch: waited on another stream or a copy": 0.3,
                     "host between launches (Python, dispatch); launched in forward": 0.2,
                     "host in python garbage collection; launched in ?": 0.42}
    assert "4.0 per update, 1.92 ms per update" in text


def test_launches_are_grouped_by_the_ops_around_them_on_the_launching_thread():
    arms = load("arms")

    def host(cat, name, ts, dur, corr=None, tid=1):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "tid": tid,
                **({"args": {"correlation": corr}} if corr is not None else {})}

    def device(cat, ts, dur, corr):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": f"k{corr}", "args": {"correlation": corr}}

    events = [host("user_annotation", "AccumulateGrad", 0, 100, tid=2), host("cpu_op", "aten::add_", 10, 20, tid=2),
              host("cuda_runtime", "cudaLaunchKernel", 12, 2, 1, tid=2), device("kernel", 20, 500, 1),
              host("cpu_op", "aten::add_", 40, 20, tid=2), host("cuda_runtime", "cudaLaunchKernel", 42, 2, 2, tid=2),
              device("kernel", 520, 1500, 2),
              # the main thread's compiled region is open meanwhile, but it did not launch these
              host("cpu_op", "Compiled Region", 0, 300), host("cuda_runtime", "cudaLaunchKernel", 200, 2, 3),
              device("gpu_memset", 2100, 1000, 3),
              host("cuda_runtime", "cudaMemcpyAsync", 400, 2, 4), device("gpu_memcpy", 3200, 1000, 4),
              host("cpu_op", "not a device event", 0, 1), {"ph": "X", "cat": "kernel", "ts": 5000, "dur": 500}]
    text = arms.launch_origins({"traceEvents": events}, updates=2)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[4:]]
    # the copy's launch lies outside every op of its thread; the last kernel has no launch in the trace
    assert rows == [["AccumulateGrad", "aten::add_", "1.0", "1.000"], ["?", "?", "1.0", "0.750"],
                    ["Compiled Region", "Compiled Region", "0.5", "0.500"]]
    assert text.startswith("GPU work launched per update: 2.5 kernels, memsets and copies, in 3 groups")


def test_products_are_grouped_by_op_and_shapes_with_their_rate():
    arms = load("arms")

    def op(name, ts, dur, dims):
        return {"ph": "X", "cat": "cpu_op", "ts": ts, "dur": dur, "name": name, "tid": 1,
                "args": {"Input Dims": dims}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "ts": ts, "dur": 1, "name": "cudaLaunchKernel", "tid": 1,
                "args": {"correlation": corr}}

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"correlation": corr}}

    m, k, n = 1024, 512, 2048
    flop = 2 * m * k * n
    events = [
        # two calls of one product, the second with a split-K reduction after its main kernel
        op("aten::mm", 0, 10, [[m, k], [k, n]]), launch(2, 1), kernel("gemm", 100, 2, 1),
        op("aten::mm", 20, 10, [[m, k], [k, n]]), launch(22, 2), kernel("gemm", 200, 2, 2), launch(25, 3),
        kernel("reduce", 210, 1, 3),
        # an addmm: its accumulator's shape comes first; a product inside an autograd node of the same thread
        {"ph": "X", "cat": "cpu_op", "ts": 40, "dur": 30, "name": "MmBackward0", "tid": 1},
        op("aten::addmm", 45, 10, [[n], [m, k], [k, n]]), launch(47, 4), kernel("gemm_bias", 300, 4, 4),
        # not a product
        op("aten::add_", 80, 5, [[m, n], [m, n], []]), launch(82, 5), kernel("add", 400, 9, 5),
    ]
    text = arms.product_shapes({"traceEvents": events}, updates=1)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[4:]]
    assert [r[:6] for r in rows] == [
        ["aten::mm", f"({m}, {k}) x ({k}, {n})", "2.0", "0.005", "2.5", f"{2 * flop / 5e-6 / 1e12:.0f}"],
        ["aten::addmm", f"({n},) x ({m}, {k}) x ({k}, {n})", "1.0", "0.004", "4.0", f"{flop / 4e-6 / 1e12:.0f}"]]
    assert rows[0][6] == "gemm 0.00; reduce 0.00"
    assert text.startswith("Products: 0.0 GPU ms per update in 2 (op, shapes) groups")
    assert arms._product_flop("creditlab::relu2_dgrad", [[m, k], [k, n], [m, n]]) == flop
    assert arms._product_flop("creditlab::relu2_linear", [[m, k], [n, k]]) == flop
    assert arms._product_flop("creditlab::relu2_dgrad_gluon", [[m, k], [k, n], [m, n]]) == flop
    assert arms._product_flop("creditlab::relu2_linear_gluon", [[m, k], [n, k]]) == flop
    assert arms._product_flop("aten::add_", [[m, n]]) is None


def test_kernel_table_classifies_a_profile_and_accounts_for_its_busy_time():
    kernel_table = load("kernel_table")
    profile = Path(__file__).resolve().parents[1] / "benchmarks/results/profile_native_fused_mlp_seed.txt"
    read = kernel_table.read_profile(profile)
    assert read["busy_ms"] == 313.8 and read["kernels"] == 3108
    assert sum(read["by_class"].values()) == pytest.approx(read["busy_ms"])  # the listed rows plus the rest
    assert read["by_class"]["fused MLP products (Triton, Gluon)"] > 30 and "ReLU^2 (plain MLP)" not in read["by_class"]
    assert kernel_table.classify("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "products (cuBLAS)"
    assert kernel_table.classify("triton_red_fused__to_copy_add_cat_div_expand_mul_neg_pow") == "QK-norm + rotary"
    # our kernels by their first names: the Gluon MLP and Q/K/V products, the attention gate's, the credit path's
    assert kernel_table.classify("_mlp_kernel") == "fused MLP products (Triton, Gluon)"
    assert kernel_table.classify("_qkv_kernel") == "Q/K/V product with QK-norm + rotary"
    assert kernel_table.classify("_qk_backward") == "QK-norm + rotary"
    assert kernel_table.classify("_thin_backward") == "attention gate (Triton)"
    assert kernel_table.classify("_gated_decode") == "state gate and decode (Triton)"


def test_kernel_table_leaves_out_the_ranges_drawn_over_a_compiled_graphs_kernels():
    """A profile whose key averages list each compiled graph's call as a GPU range over its kernels: the ranges
    are not counted again (they would add the graphs' whole time to "other")."""
    kernel_table = load("kernel_table")
    profile = Path(__file__).resolve().parents[1] / "benchmarks/results/profile_teacher_fit_lean_seed.txt"
    assert "## Call CompiledFxGraph" in profile.read_text()
    read = kernel_table.read_profile(profile)
    assert sum(read["by_class"].values()) == pytest.approx(read["busy_ms"])
    assert read["by_class"]["other"] < 10 and read["by_class"]["not among the listed rows"] > 0
    assert read["by_class"]["the teacher's fit (Triton)"] == pytest.approx(15.343 / 2)  # 128 calls, 2 updates


def test_paired_differences_are_taken_round_by_round():
    arms = load("arms")
    base = [{"seconds": s} for s in (9, 9, 0.30, 0.40, 0.30, 0.40, 0.30, 0.40)]
    arm = [{"seconds": s} for s in (9, 9, 0.29, 0.39, 0.29, 0.39, 0.29, 0.41)]  # 10 ms faster but in the last round
    median, lo, hi = arms.paired_ms(arm, base)
    assert median == pytest.approx(-10.0) and lo == pytest.approx(-10.0) and hi == pytest.approx(10.0)
    assert arms.paired_ms(arm[:-1], base) is None  # not the same rounds


@pytest.mark.parametrize("script", ["arms", "softcap_ce", "softcap_ce_held", "qk_norm", "relu2_mlp", "fit_rows",
                                    "fit_rows_variants", "fp8_head", "head_loss", "products", "batch_host",
                                    "relu2_hopper", "qkv_rotary", "host_lead", "attention_gate", "attention",
                                    "attention_grad_layouts", "step_gradients"])
def test_gpu_benchmarks_refuse_a_machine_without_cuda(script, tmp_path, monkeypatch, capsys):
    """Exit 2 with one line, and no output folder made, where no CUDA GPU is visible."""
    import sys

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--out", str(tmp_path / "out")])
    assert load(script).main() == 2
    assert capsys.readouterr().err.strip() == "this benchmark needs a CUDA GPU"
    assert not (tmp_path / "out").exists()


def test_kernel_bandwidth_joins_trace_times_with_the_compilers_byte_counts(tmp_path):
    """Bytes come from the generated sources; a name the compiler gave kernels of two sizes gets no bandwidth,
    and a kernel's excess is its time less its bytes at the streaming rate."""
    kb = load("kernel_bandwidth")

    def source(name, gb):
        body = "'''" + f"\n@triton_heuristics.pointwise(inductor_meta={{'kernel_num_gb': {gb}}})\ndef {name}(): pass\n" + "'''"
        return f"{name} = async_compile.triton('{name}', {body}, device_str='cuda')\n"

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "fwd.py").write_text(source("triton_poi_fused_add_0", 0.43) + source("triton_red_sum_1", 0.1))
    (tmp_path / "bwd.py").write_text(source("triton_red_sum_1", 0.2))
    sizes = kb.kernel_bytes(tmp_path)
    assert sizes == {"triton_poi_fused_add_0": {0.43}, "triton_red_sum_1": {0.1, 0.2}}
    measured = {"arm": "native", "times": {"triton_poi_fused_add_0": {"calls": 4, "ms": 0.8},
                                           "triton_red_sum_1": {"calls": 2, "ms": 5.0}}}
    result, lines = kb.table(measured, sizes, top=10)
    add, ambiguous = result["kernels"]
    assert add["kernel"] == "triton_poi_fused_add_0" and ambiguous["gb_per_call"] is None
    assert add["ms_at_streaming_rate"] == pytest.approx(4 * 0.43 / kb.STREAMING_GBPS * 1e3)  # 0.4 ms
    assert result["over_streaming_ms"] == pytest.approx(0.8 - 0.4)
    assert "| 2.15 | +0.40 |" in lines[4]  # 1.72 GB in 0.8 ms
    assert lines[5].endswith("| - | - | - |")


def test_the_tables_ratio_per_round_is_the_runners_of_the_rows_seconds():
    arms = load("arms")
    from creditlab.experiments.arms_runner import round_ratio

    base = [{"seconds": s} for s in [9.0, 9.0] + [0.30, 0.34] * 4]
    arm = [{"seconds": b["seconds"] * (0.90 if i % 2 else 0.96)} for i, b in enumerate(base)]
    assert arms.steady_ratio(arm, base) == round_ratio([r["seconds"] for r in arm], [r["seconds"] for r in base])

def test_the_benchmarks_error_is_relative_to_the_references_largest_entry():
    import torch

    from creditlab.runtime import largest_relative_error

    want = torch.tensor([4.0, -2.0, 1.0], dtype=torch.float64)
    assert largest_relative_error(torch.tensor([4.0, -2.5, 1.0], dtype=torch.bfloat16), want) == 0.125
    assert largest_relative_error(want, want) == 0.0
    assert largest_relative_error(torch.tensor([float("nan"), -2.0, 1.0]), want) != 0.0  # NaN never passes a bound


def test_the_fp8_benchmarks_references_agree_with_the_head_they_judge():
    """fp8_head.py's float64 references, on the CPU: its quantized-operand reference is what the FP8 head computes,
    its exact one what the plain head computes, and the two references differ (each comparison can fail)."""
    import torch

    from creditlab.ops.loss import fused_head_loss

    bench = load("fp8_head")
    g = torch.Generator().manual_seed(0)
    h = torch.nn.functional.rms_norm(torch.randn(96, 32, generator=g), (32,))
    w, t = torch.randn(112, 32, generator=g) * 0.3, torch.randint(0, 100, (96,), generator=g)
    exact, quantized = bench.reference(h, w, t, 100, 32), bench.reference(h, w, t, 100, 32, quantized=True)
    assert max(bench.errors(fused_head_loss(h, w, t, 100, bench.CAP, 32, True), quantized).values()) < 1e-4
    assert max(bench.errors(fused_head_loss(h, w, t, 100, bench.CAP, 32, False), exact).values()) < 1e-5
    assert bench.errors(fused_head_loss(h, w, t, 100, bench.CAP, 32, False), quantized)["grad_h"] > 1e-2


def _arm(name: str, seconds: list[float], peak: float = 15_000.0) -> dict:
    window = sorted(seconds[-6:])
    return {"arm": name, "rows": [{"seconds": x} for x in seconds], "median_last6_s": (window[2] + window[3]) / 2,
            "median_last6_mfu": 0.5, "peak_allocated_mib": peak}


def test_targets_are_read_both_ways_and_each_can_be_missed():
    targets = load("targets")
    drift = [9.0, 9.0] + [0.28, 0.295] * 6  # the card's drift falls on every arm of a round alike
    native = _arm("native", drift)
    fast = {"learned": [0.92 * x for x in drift], "zero": [0.915 * x for x in drift],
            "teacher": [1.05 * x for x in drift]}
    rows = {r["target"].name: r for r in targets.evaluate(
        [native] + [_arm(name, seconds) for name, seconds in fast.items()])}
    assert rows["native s/update"]["verdict_last_six"] == "met"  # 0.2875 s
    learned = rows["learned (streaming, zero decoders) / native"]
    assert learned["per_round"] == pytest.approx(0.92) and learned["verdict_per_round"] == "met"
    assert rows["teacher / native"]["verdict_last_six"] == "met"
    gap = rows["learned - zero, ms per update"]
    assert gap["per_round"] == pytest.approx(1e3 * 0.005 * 0.29, abs=0.2) and gap["verdict_per_round"] == "met"

    native = [x + 0.02 for x in drift]
    slow = [_arm("native", native, peak=24_000.0), _arm("learned", [0.95 * x for x in native]),
            _arm("zero", [0.90 * x for x in native]), {"arm": "teacher", "oom": "CUDA out of memory"}]
    rows = {r["target"].name: r for r in targets.evaluate(slow)}
    assert rows["native s/update"]["verdict_last_six"] == rows["native s/update"]["verdict_per_round"] == "missed"
    learned = rows["learned (streaming, zero decoders) / native"]
    assert learned["verdict_last_six"] == learned["verdict_per_round"] == "missed"
    assert rows["learned - zero, ms per update"]["verdict_per_round"] == "missed"  # about 15 ms
    assert rows["teacher / native"]["verdict_last_six"] == "not measured"
    peak = rows["every arm's peak allocated MiB"]
    assert peak["verdict_last_six"] == "missed" and "out of memory: teacher" in peak["last_six_text"]
    with pytest.raises(SystemExit, match="no native arm"):
        targets.evaluate(slow[1:])


def test_garbage_collections_are_marked_in_a_profiler_trace(tmp_path):
    import gc
    import json

    from torch.profiler import ProfilerActivity, profile

    arms = load("arms")
    callbacks = list(gc.callbacks)
    with profile(activities=[ProfilerActivity.CPU]) as prof, arms.CollectionsInTrace():
        gc.collect()
    assert gc.callbacks == callbacks  # its callback goes with the block
    with profile(activities=[ProfilerActivity.CPU]) as unmarked:
        gc.collect()
    names = []
    for p, name in ((prof, "marked"), (unmarked, "unmarked")):
        p.export_chrome_trace(str(tmp_path / f"{name}.json"))
        names.append({e.get("name") for e in json.loads((tmp_path / f"{name}.json").read_text())["traceEvents"]})
    assert arms.GC_LABEL in names[0] and arms.GC_LABEL not in names[1]


def test_checked_paths_check_every_output_against_float64_and_report_a_path_that_fails(monkeypatch):
    """The GPU benchmarks' helper (benchmarks/fp8_head.py), run on the CPU: a path's error against its float64
    result, each output's where it gives several, a failing path reported and not timed, each group's base its
    first path that ran."""
    import torch

    bench = load("fp8_head")
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "cuda_ms", lambda fn, repeats, warmup: fn() is not None and 1.0)
    a = torch.ones(3)
    groups = {"first": [("broken", lambda: 1 / 0, None), ("one", lambda: a * 1.5, a.double() * 1.5),
                        ("untimed reference", lambda: a, None)],
              "second": [("two", lambda: (a, 2 * a), (a.double(), 2 * a.double())),
                         ("wrong second output", lambda: (a, a), (a.double(), 2 * a.double()))]}
    times, errors, failures, group_of, base = bench.checked_paths(groups)
    assert errors == {"one": 0.0, "untimed reference": None, "two": [0.0, 0.0], "wrong second output": [0.0, 0.5]}
    assert "ZeroDivisionError" in failures["broken"] and "broken" not in times and len(times["one"]) == 10
    assert base == {"first": "one", "second": "two"} and group_of["wrong second output"] == "second"
    assert [bench.error_text(errors[k]) for k in ("one", "untimed reference", "wrong second output")] == \
        ["0.0e+00", "-", "0.0e+00, 5.0e-01"]
    # the table cells the benchmarks print: a ratio with its range, a failed path's row as wide as the table
    assert bench.ratio_text(bench.round_summary(times["one"], times["one"])) == "1.000 (1.000 .. 1.000)"
    row, = bench.failure_rows(failures, 5)
    assert row.startswith("| broken | failed: ZeroDivisionError") and row.count("|") == 6, row


def test_a_kernel_benchmarks_paths_are_drawn_as_ratio_bars(tmp_path):
    """plot.py's figure of checked_paths' results (one process or several), from the JSON a benchmark writes."""
    import json

    plot = load("plot")
    paths = {"the step's path": {"ratio_per_round": 1.0, "ratio_range": [1.0, 1.0]},
             "a kernel": {"ratio_per_round": 0.9, "ratio_range": [0.85, 0.97], "errors": [1e-3, 2e-3]}}
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"paths": paths}))
    figure = plot.plot_path_ratios([results, results], tmp_path, "bench.png", ("over the step's path", "a title"))
    assert figure == tmp_path / "bench.png" and figure.stat().st_size > 1000


def test_host_lead_queues_one_sleep_before_the_updates_first_micro_batch_and_restores_the_trainer(monkeypatch):
    import types

    import torch

    host_lead = load("host_lead")
    events = []

    class Trainer:
        def _batch(self):
            events.append("batch")
            return None

        def train_update(self):
            for _ in range(3):  # three micro-batches
                self._batch()
            return types.SimpleNamespace(seconds=1.5)

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: events.append(f"sleep {cycles}"))
    trainer = Trainer()
    assert host_lead.led_update(trainer, 123) == 1.5
    assert events == ["sleep 123", "batch", "batch", "batch"]
    assert "_batch" not in vars(trainer)  # the class's method again: the next update is plain
    events.clear()
    trainer.train_update()
    assert events == ["batch"] * 3


def test_the_attention_benchmark_checks_each_kernel_against_float64_and_can_fail():
    attention = load("attention")
    small = attention.inputs(2, 16, 2, 8, "cpu", torch.float32)
    assert small[0].shape == (2, 2, 16, 8) and not small[0].is_contiguous()  # the model's transposed layout
    errors = attention.check(attention.attention_fn("math", 16, "cpu"), *small)
    assert len(errors) == 4 and max(errors) < 1e-5
    # attention that sees the future is caught in the output and every gradient
    leaky = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=attention.SCALE)  # noqa: E731
    assert min(attention.check(leaky, *small)) > 1e-2
    work = attention.flops(64, 2048, 4, 128)
    assert work["forward"] == 2 * 64 * 4 * 2048 ** 2 * 128 and work["forward + backward"] == 3.5 * work["forward"]


def test_the_attention_benchmark_lays_the_same_values_out_as_the_model_and_heads_first():
    attention = load("attention")
    laid = {layout: attention.inputs(2, 16, 2, 8, "cpu", torch.float32, layout=layout)
            for layout in attention.LAYOUTS}
    for layout, tensors in laid.items():
        for got, want in zip(tensors, laid["model"], strict=True):
            assert torch.equal(got, want), layout
    # which of q, k, v and the output's gradient are contiguous in SDPA's order, layout by layout
    contiguous = {layout: [t.is_contiguous() for t in tensors] for layout, tensors in laid.items()}
    assert contiguous == {"model": [False] * 4, "heads_first": [True] * 4}
    # the model's gradient is laid out as SDPA lays out its output (as q is)
    q, _, _, dout = laid["model"]
    assert dout.stride() == q.stride() == torch.nn.functional.scaled_dot_product_attention(q, q, q).stride()
    assert attention.kernel_and_layout("cudnn@heads_first") == ("cudnn", "heads_first")
    assert attention.kernel_and_layout("flex") == ("flex", "model")
    with pytest.raises(ValueError, match="unknown layout 'rows'"):
        attention.inputs(2, 16, 2, 8, "cpu", layout="rows")


def test_the_attention_benchmarks_cache_check_reads_four_calls_against_float64():
    # on the CPU the math kernel caches nothing, so all four calls are right; on a GPU with cuDNN the direct
    # call with the second layout is the one the check flags (benchmarks/native_seed.md)
    cache = load("attention").graph_cache_check("cpu", seq=16, heads=2, head_dim=8, kernel="math")
    assert list(cache) == ["sdpa, gradient contiguous", "sdpa, gradient as the output",
                           "causal_attention, gradient contiguous", "causal_attention, gradient as the output"]
    assert max(cache.values()) < 1e-2  # bf16 inputs against float64


def test_the_gradient_layout_experiment_lays_the_same_values_out_each_way():
    layouts = load("attention_grad_layouts")
    x = torch.randn(2, 3, 5, 4)  # (batch, heads, sequence, head dim)
    laid = {how: layouts.laid_out(x, how) for how in ("heads_first", "transposed", "packed", "contiguous", "as_output")}
    for how, t in laid.items():
        assert torch.equal(t, x), how
    assert laid["heads_first"].is_contiguous() and laid["contiguous"].is_contiguous()
    assert laid["transposed"].stride() == laid["as_output"].stride() == (60, 4, 12, 1)  # (B, T, H, D) underneath
    assert laid["packed"].stride() == (180, 4, 36, 1)  # one of three in (B, T, 3, H, D)
    # the error it reports is the largest of the three gradients', the output's left out
    want = [torch.ones(3)] * 4
    got = [torch.full((3,), 9.0), torch.ones(3), torch.full((3,), 1.5), torch.ones(3)]
    assert layouts.gradient_error(got, want) == pytest.approx(0.5)


def test_each_timed_update_records_the_graphs_it_compiled():
    """run_update's rows say how many graphs the compiler built during each update (on the GPU, a block variant
    dropbp meets for the first time), and the per-round ratio leaves those rounds out."""
    from types import SimpleNamespace

    from creditlab.experiments.arms_runner import OwnMemory
    from creditlab.train import UpdateRow

    arms = load("arms")
    step = torch.compile(lambda x, drop: x.detach() + 1 if drop else x + 1, backend="eager")
    drops = [False, False, True, False, True, False]

    def train_update():
        update = len(arm["rows"])
        step(torch.ones(2), drops[update])
        return UpdateRow(update, "synthetic", 1.0, 3.0 if update in (0, 2) else 0.9, 10, 10.0, 1.0, 100.0, None, None)

    trainer = SimpleNamespace(train_update=train_update, source=SimpleNamespace())
    arm = {"name": "dropbp", "overrides": [], "init_sha256": "", "trainer": trainer, "rows": [],
           "saved_by_forward_mib": 0.0, "wall_s": 0.0}
    for _ in drops:
        arms.run_update(arm, OwnMemory(None), arms.CollectorTime())
    got = arms.summarize_arm(arm)
    assert [r["graphs_compiled"] for r in got["rows"]] == [1, 0, 1, 0, 0, 0]
    base = [{"seconds": 1.0, "graphs_compiled": 0} for _ in drops]
    got["rows"][2]["graphs_compiled"] = 1  # the round read from the third on: round 3 compiled, rounds 4-6 did not
    ratio = arms.steady_ratio(got["rows"], base)
    assert ratio[0] == pytest.approx(0.9) and ratio[3] == 3


def test_a_run_stopped_mid_round_keeps_the_rounds_every_arm_finished():
    """A signal during round 3 of 5: the runner stops before the next update, and each arm keeps its first two
    updates (rows, collector times and compile counts alike), so the arms' rounds still pair; the table says the
    run was stopped and after how many rounds."""
    import os
    import signal

    from creditlab.experiments.arms_runner import StopRequest, run_rounds
    from creditlab.train import UpdateRow

    arms = load("arms")
    fleet = {name: {"name": name, "overrides": [], "init_sha256": "", "trainer": None, "rows": [], "gc_s": [],
                    "graphs_compiled": [], "saved_by_forward_mib": 0.0, "wall_s": 0.0} for name in ("native", "zero")}
    said, full = [], [0]

    def step(at):
        arm = fleet[at.arm]
        if at.round == 2 and at.position == 0:
            os.kill(os.getpid(), signal.SIGINT)  # handled: no KeyboardInterrupt, the update finishes
        arm["rows"].append(UpdateRow(len(arm["rows"]), "native", 1.0, 1.0, 10, 10.0, 1.0, 100.0, None, None))
        arm["gc_s"].append(0.0)
        arm["graphs_compiled"].append(0)

    with StopRequest(said.append) as stop:
        taken = run_rounds(list(fleet), 5, step, stop=lambda: stop.signal is not None,
                           after_round=lambda r: full.__setitem__(0, r + 1))
    assert stop.signal == "SIGINT" and said == ["SIGINT"]
    assert full == [2] and len(taken) == 5  # one arm stepped in the third round
    assert sorted(len(a["rows"]) for a in fleet.values()) == [2, 3]
    for arm in fleet.values():
        arms.keep_full_rounds(arm, full[0])
        assert len(arm["rows"]) == len(arm["gc_s"]) == len(arm["graphs_compiled"]) == 2
    meta = {"updates": 5, "stopped": {"signal": "SIGINT", "full_rounds": 2}}
    assert arms.updates_said(meta) == "2 updates (stopped by SIGINT after 2 of 5 rounds)"
    assert arms.updates_said({"updates": 5}) == "5 updates"
