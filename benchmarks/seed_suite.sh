#!/usr/bin/env bash
# Every seed-preset measurement of the benchmark pages in one go (about 13 minutes on one H200 without the step
# check, most of it compilation): the step's gradients against float64; the head-loss kernel's configurations;
# the arms interleaved (the native step, the synthetic step, the teacher, one teacher
# in four) with a kernel profile and a breakdown of the native memory peak; board power and clocks sampled every 2 s; what one compiled forward keeps; each generated
# kernel of native, zero and learned against the card's streaming rate; the head loss with its products in FP8
# against bf16, and its chunk loop against the loop it replaced; causal attention in each kernel PyTorch offers,
# and cuDNN attention's gradients against float64 for each layout of the output's gradient.
#   bash benchmarks/seed_suite.sh OUT_DIR
set -uo pipefail
out=${1:?output folder}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi dmon -s pc -d 2 > "$out/dmon.txt" 2>&1 &
  dmon=$!
  trap 'kill $dmon 2>/dev/null' EXIT
fi
python3 "$here/step_gradients.py" --out "$out/step_gradients" 2>&1 | tail -10
python3 "$here/softcap_ce.py" --out "$out/softcap_ce" 2>&1 | tail -15
python3 "$here/softcap_ce_held.py" --out "$out/softcap_ce_held" 2>&1 | tail -30
python3 "$here/relu2_hopper.py" --out "$out/relu2_hopper" 2>&1 | tail -14
python3 "$here/qkv_rotary.py" --out "$out/qkv_rotary" 2>&1 | tail -12
python3 "$here/attention_gate.py" --out "$out/attention_gate" 2>&1 | tail -14
python3 "$here/attention.py" --out "$out/attention" 2>&1 | tail -12
python3 "$here/attention_grad_layouts.py" --out "$out/attention_grad_layouts" 2>&1 | tail -8
python3 "$here/batch_host.py" --out "$out/batch_host" 2>&1 | tail -5
python3 "$here/host_lead.py" --out "$out/host_lead" 2>&1 | grep "^|"
python3 "$here/fp8_head.py" --out "$out/fp8_head" 2>&1 | head -8
python3 "$here/head_loss.py" --out "$out/head_loss" 2>&1 | head -6
python3 "$here/products.py" --out "$out/products" 2>&1 | tail -9
python3 "$here/arms.py" --out "$out/arms" --profile native --memory native --updates 16 --arms \
  native,zero,learned@credit.schedule=never,learned@credit.teacher_every=1,learned \
  2>&1 | grep -v "^update" | tail -20
python3 "$here/targets.py" "$out/arms/arms.json" --out "$out/arms/targets.md"
python3 "$here/kept.py" --out "$out/kept" 2>&1 | head -16
python3 "$here/kernel_bandwidth.py" --out "$out/kernel_bandwidth" --arms native,zero,learned 2>&1 | grep "^## "
