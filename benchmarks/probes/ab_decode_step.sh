#!/usr/bin/env bash
# Decode step before/after a change, in one device call, interleaved $ROUNDS times (default 2):
# - generate(): bench_e2e (exact grid, CUDA graphs, batch 256, prompt 128, 128 new tokens, default
#   greedy settings) at L = 128 adapters;
# - the engine: probes/engine_decode_step.py (256 requests, 128 adapters, decode-only steps).
# E2E=0 skips the generate() half (the engine probe alone).
# $OLD holds the older tree (e.g. `git archive <sha> src kernels benchmarks | tar -x -C .devout/old`);
# the engine probe of this tree runs against its `src`. Logs and JSON under $OUT/ab/.
set -u
OLD=${OLD:-.devout/old}
NEW=$PWD
W=${OUT:-/tmp/out}/ab
mkdir -p "$W"
export PYTHONUNBUFFERED=1
run() {  # $1 = tree, $2 = tag
  if [ "${E2E:-1}" != 0 ]; then
    (cd "$1" && PYTHONPATH=$PWD/src:$PWD/kernels timeout 200 python3 benchmarks/bench_e2e.py --model llama-3.2-3b \
       --out "$W" --peft "" --grids exact --adapters 128 --tag "_$2") > "$W/$2.log" 2>&1
    grep -h decode_tok_s "$W/$2.log" | head -3
  fi
  PYTHONPATH=$1/src:$1/kernels timeout 150 python3 "$NEW/benchmarks/probes/engine_decode_step.py" --out "$W" \
     --tag "_$2" > "$W/engine_$2.log" 2>&1
  tail -1 "$W/engine_$2.log"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  run "$OLD" "old$round"
  run "$NEW" "new$round"
done
