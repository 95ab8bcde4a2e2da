#!/usr/bin/env bash
# The single-GPU figures of the README (issue: one GPU at full speed), in one pass:
#   1. llava_1b bf16 training step at sequence 4096 (+ a Perfetto trace of one step and its
#      attention / matmuls / norms / other / idle breakdown)
#   2. llava_1b at sequence 2048
#   3. the Pallas kernel's tile sweep against cuDNN (scripts/bench_pallas_tiles.py)
# Both steps: LLM and generator remat "dots", the vision tower "full", the fused chunked LM
# loss (2048 tokens), packed rows, the measured H100 profile for the planner's prediction.
# Results go to $OUT (default bench_results/gpu); each part writes its JSON when it ends, so
# a time limit keeps what finished.   usage: OUT=dir bash scripts/bench_gpu.sh
set -uo pipefail
OUT=${OUT:-bench_results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
step() {  # name, then bench_step arguments
  local name=$1; shift
  python3 scripts/bench_step.py --preset llava_1b --dtype bfloat16 --remat dots \
    --override encoders.vision.encoder.remat=full --loss_chunk 2048 \
    --profile configs/hardware/h100.json --warmup 2 --steps 4 --json "$OUT/$name.json" "$@" \
    2>&1 | tee -a "$OUT/log.txt" | grep -v "^step " | tail -24
}
step llava_4096 --seq_len 4096 --global_batch 16 --trace /tmp/trace_4096
f=$(python3 -c "import json;print(json.load(open('$OUT/llava_4096.json'))['trace'] or '')" 2>/dev/null)
[ -n "$f" ] && cp "$f" "$OUT/trace_4096.json.gz" && \
  python3 scripts/trace_breakdown.py "$OUT/trace_4096.json.gz" --json "$OUT/breakdown_4096.json"
step llava_2048 --seq_len 2048 --global_batch 16
timeout ${PALLAS_S:-150} python3 scripts/bench_pallas_tiles.py --json "$OUT/pallas_tiles.json" \
  2>&1 | tee -a "$OUT/log.txt" | tail -14
