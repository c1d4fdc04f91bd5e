"""FLOP accounting: the seed's exact numbers, two other shapes against hand arithmetic, the printed derivation,
and `creditlab flops --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from creditlab import cli, config
from creditlab.flops import flop_budget

JSON_KEYS = {"total_per_token", "omitted_per_token", "omitted_fraction", "teacher_every", "ceiling_fraction",
             "gate_ratio"}


def test_seed_totals_are_the_design_numbers():
    b = flop_budget(config.load("seed").model, teacher_every=4, cycle_gate=0.93)
    assert b.n_trunk == 25_165_824
    assert b.n_head == 6_291_968
    assert b.attention_per_token == 50_331_648
    assert 6 * b.n_trunk == 150_994_944 and 6 * b.n_head == 37_751_808
    assert b.total_per_token == 239_078_400
    assert b.omitted_per_token == 29_360_128
    assert round(100 * b.omitted_fraction, 2) == 12.28
    assert round(100 * b.ceiling_fraction, 2) == 9.21
    assert round(b.gate_ratio, 6) == round(0.9066667, 6) == 0.906667
    assert b.gate_ratio == pytest.approx(0.9066667, abs=1e-7)
    # The gate ratio is what the screen derives from its cycle gate (protocol/gates.py), an independent formula.
    from creditlab.protocol.gates import Gates

    assert Gates.from_config(config.load("seed")).ratio == pytest.approx(b.gate_ratio, rel=1e-12)


def test_omitted_per_layer_is_the_design_product():
    b = flop_budget(config.load("seed").model)
    assert b.omitted_per_token == 8 * 2 * 512 * (3 * 512 + 2048)


# Hand arithmetic, written out (not computed by the formula under test):
#
# A: L=4, d=256, h=1024, T=512, V=5000
#    d^2 = 65,536; 3d^2 = 196,608; 2*d*h = 524,288; per layer 196,608 + 65,536 + 524,288 = 786,432
#    N_trunk = 4 * 786,432 = 3,145,728;  N_head = 256 * 5000 = 1,280,000
#    attention = 6*4*512*256 = 3,145,728
#    total = 6 * (3,145,728 + 1,280,000) + 3,145,728 = 26,554,368 + 3,145,728 = 29,700,096
#    omitted = 4*2*256*(768 + 1024) = 2,048 * 1,792 = 3,670,016
# B: L=12, d=768, h=3072, T=1024, V=50257
#    d^2 = 589,824; 3d^2 = 1,769,472; 2*d*h = 4,718,592; per layer 7,077,888
#    N_trunk = 12 * 7,077,888 = 84,934,656;  N_head = 768 * 50,257 = 38,597,376
#    attention = 6*12*1024*768 = 56,623,104
#    total = 6 * (84,934,656 + 38,597,376) + 56,623,104 = 741,192,192 + 56,623,104 = 797,815,296
#    omitted = 12*2*768*(2304 + 3072) = 18,432 * 5,376 = 99,090,432
# C: L=3, d=128, h=384 (not 4d, so the MLP term is told apart from the attention one), T=256, V=1000
#    d^2 = 16,384; 3d^2 = 49,152; 2*d*h = 98,304; per layer 163,840
#    N_trunk = 3 * 163,840 = 491,520;  N_head = 128 * 1000 = 128,000
#    attention = 6*3*256*128 = 589,824
#    total = 6 * (491,520 + 128,000) + 589,824 = 3,717,120 + 589,824 = 4,306,944
#    omitted = 3*2*128*(384 + 384) = 768 * 768 = 589,824
HAND = {
    "A": (["model.layers=4", "model.width=256", "model.heads=4", "model.mlp_hidden=1024", "model.seq_len=512",
           "model.vocab_size=5000", "model.value_embeds=2"],
          dict(n_trunk=3_145_728, n_head=1_280_000, attention_per_token=3_145_728, total_per_token=29_700_096,
               omitted_per_token=3_670_016)),
    "B": (["model.layers=12", "model.width=768", "model.heads=12", "model.mlp_hidden=3072",
           "model.seq_len=1024", "model.vocab_size=50257"],
          dict(n_trunk=84_934_656, n_head=38_597_376, attention_per_token=56_623_104, total_per_token=797_815_296,
               omitted_per_token=99_090_432)),
    "C": (["model.layers=3", "model.width=128", "model.heads=2", "model.mlp_hidden=384", "model.seq_len=256",
           "model.vocab_size=1000", "model.value_embeds=1"],
          dict(n_trunk=491_520, n_head=128_000, attention_per_token=589_824, total_per_token=4_306_944,
               omitted_per_token=589_824)),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_other_shapes_match_hand_arithmetic(name):
    overrides, want = HAND[name]
    b = flop_budget(config.load("seed", overrides).model, teacher_every=4, cycle_gate=0.93)
    for key, value in want.items():
        assert getattr(b, key) == value, key
    assert b.omitted_fraction == want["omitted_per_token"] / want["total_per_token"]
    assert b.ceiling_fraction == pytest.approx(0.75 * want["omitted_per_token"] / want["total_per_token"],
                                               rel=1e-15)


def test_head_flops_count_the_true_vocabulary_not_the_padded_head():
    m = config.load("seed").model
    assert m.padded_vocab == 12_352
    assert flop_budget(m).total_per_token == 239_078_400


@pytest.mark.parametrize("k, cycle, ratio, ceiling_of_omitted", [
    (2, 0.93, 0.86, 1 / 2), (4, 0.93, 2.72 / 3, 3 / 4), (5, 0.9, 0.875, 4 / 5), (8, 0.93, 6.44 / 7, 7 / 8)])
def test_teacher_cycle_ceiling_and_gate(k, cycle, ratio, ceiling_of_omitted):
    b = flop_budget(config.load("seed").model, teacher_every=k, cycle_gate=cycle)
    assert b.gate_ratio == pytest.approx(ratio, rel=1e-12)
    # The defining relation: one teacher at ratio 1 and K-1 synthetic updates at the gate ratio average to the gate.
    assert (1 + (k - 1) * b.gate_ratio) / k == pytest.approx(cycle, rel=1e-12)
    assert b.ceiling_fraction == pytest.approx(ceiling_of_omitted * b.omitted_fraction, rel=1e-12)


@pytest.mark.parametrize("k", [0, 1])
def test_a_teacher_cycle_needs_at_least_two_updates(k):
    with pytest.raises(ValueError, match="teacher_every"):
        flop_budget(config.load("seed").model, teacher_every=k)


def test_derivation_prints_the_steps_and_totals():
    text = flop_budget(config.load("seed").model).derivation()
    for fragment in ("25,165,824", "6,291,968", "150,994,944", "37,751,808", "50,331,648", "239,078,400",
                     "29,360,128", "12.28%", "9.21%", "0.9066667", "6*L*T*d = 6*8*2048*512", "d*V = 512*12289",
                     "8*(3*512^2 + 512^2 + 2*512*2048)", "8*2*512*(3*512 + 2048)", "one exact teacher in 4"):
        assert fragment in text, fragment
    other = flop_budget(config.load("seed", HAND["B"][0]).model).derivation()
    assert "797,815,296" in other and "99,090,432" in other and "239,078,400" not in other


def test_cli_flops_json_keys_and_values(capsys):
    assert cli.main(["flops", "--preset", "seed", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == JSON_KEYS
    assert out["total_per_token"] == 239_078_400 and out["omitted_per_token"] == 29_360_128
    assert out["teacher_every"] == 4
    assert round(100 * out["omitted_fraction"], 2) == 12.28 and round(100 * out["ceiling_fraction"], 2) == 9.21
    assert round(out["gate_ratio"], 6) == 0.906667


def test_cli_flops_text_and_overrides(capsys):
    assert cli.main(["flops", "--preset", "seed"]) == 0
    text = capsys.readouterr().out
    assert "239,078,400" in text and "12.28%" in text and "9.21%" in text and "0.9066667" in text
    assert cli.main(["flops", "--preset", "seed", "--json"] + [a for o in HAND["A"][0] for a in ("--set", o)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_per_token"] == 29_700_096 and out["omitted_per_token"] == 3_670_016


def test_cli_flops_as_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "creditlab.cli", "flops", "--preset", "seed", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) == JSON_KEYS


def test_cli_flops_with_one_in_one_teacher_is_a_clear_error(capsys):
    assert cli.main(["flops", "--preset", "seed", "--set", "credit.teacher_every=1"]) == 2
    assert "teacher_every" in capsys.readouterr().err
