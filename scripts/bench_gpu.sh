#!/usr/bin/env bash
# The single-GPU figures of the README (issue: one GPU at full speed), in one pass:
#   1. llava_1b bf16 training step at sequence 2048 (+ a Perfetto trace of one step)
#   2. this device's hardware profile (scripts/profile_hardware.py)
#   3. llava_1b at sequence 4096
#   4. a Llama-3-8B-wide LLM alone (6 layers) at sequence 4096
# Results go to $OUT (default bench_results/gpu); each part writes its JSON when it ends, so a
# time limit keeps what finished.   usage: OUT=dir bash scripts/bench_gpu.sh
set -uo pipefail
OUT=${OUT:-bench_results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
step() {  # name, then bench_step arguments
  local name=$1; shift
  python3 scripts/bench_step.py --dtype bfloat16 --json "$OUT/$name.json" "$@" \
    2>&1 | tee -a "$OUT/log.txt" | grep -v "^step " | tail -22
}
step llava_2048 --preset llava_1b --seq_len 2048 --global_batch 16 --trace /tmp/trace_2048
f=$(python3 -c "import json;print(json.load(open('$OUT/llava_2048.json'))['trace'] or '')" 2>/dev/null)
[ -n "$f" ] && cp "$f" "$OUT/trace_2048.json.gz"
[ -n "${SKIP_PROFILE:-}" ] || python3 scripts/profile_hardware.py --out "$OUT/hardware_profile.json" 2>&1 | tee -a "$OUT/log.txt" | tail -3
step llava_4096 --preset llava_1b --seq_len 4096 --global_batch 16
step llama8b_4096 --preset llama3_8b_cut --override llm.num_layers=6 --seq_len 4096 --global_batch 16
