#!/usr/bin/env bash
# The single-GPU figures of the README (issue: one GPU at full speed), in one pass:
#   1. llava_1b bf16 training step at sequence 4096 and 2048 (16 samples): LLM and generator
#      remat "dots", the vision tower "full", the fused chunked LM loss (2048 tokens)
#   2. a Llama-3-8B-wide LLM alone (6 layers, 12 samples) at 4096 and 2048, the same settings
#   3. with COLO=1 first: llava_1b at 4096 through the co-located runner, every unit at
#      ZeRO-3 (the layer gathers and reduce-scatters on), its step time and memory
#   4. with TRACE=1: a Perfetto trace of one llava_1b step at 4096 and its attention /
#      matmuls / norms / other / idle breakdown; with TILES=1 the Pallas tile sweep
#      (scripts/bench_pallas_tiles.py)
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
  python3 scripts/bench_step.py --dtype bfloat16 --remat dots --loss_chunk 2048 \
    --profile configs/hardware/h100.json --warmup 2 --steps 4 --json "$OUT/$name.json" "$@" \
    2>&1 | tee -a "$OUT/log.txt" | grep -v "^step " | tail -24
}
llava="--preset llava_1b --global_batch 16 --override encoders.vision.encoder.remat=full"
llama="--preset llama3_8b_cut --override llm.num_layers=6 --global_batch 12"
[ -n "${COLO:-}" ] && step llava_4096_colocated_zero3 $llava --seq_len 4096 --colocated_zero 3
if [ -n "${TRACE:-}" ]; then
  step llava_4096 $llava --seq_len 4096 --trace /tmp/trace_4096
  f=$(python3 -c "import json;print(json.load(open('$OUT/llava_4096.json'))['trace'] or '')")
  [ -n "$f" ] && cp "$f" "$OUT/trace_4096.json.gz" && python3 scripts/trace_breakdown.py \
    "$OUT/trace_4096.json.gz" --json "$OUT/breakdown_4096.json"
else
  step llava_4096 $llava --seq_len 4096
fi
step llama_4096 $llama --seq_len 4096
step llava_2048 $llava --seq_len 2048
step llama_2048 $llama --seq_len 2048
[ -n "${TILES:-}" ] && python3 scripts/bench_pallas_tiles.py --json "$OUT/pallas_tiles.json" \
  2>&1 | tee -a "$OUT/log.txt" | tail -14
exit 0
