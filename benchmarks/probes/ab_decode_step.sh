#!/usr/bin/env bash
# Decode step before/after a change, in one device call: bench_e2e (exact grid, CUDA graphs,
# batch 256, prompt 128, 128 new tokens, default greedy settings) at L = 128 adapters for the tree
# in $OLD (e.g. `git archive <sha> src kernels benchmarks | tar -x -C .devout/old`) and this tree,
# interleaved twice. Logs and JSON under $OUT/ab/.
set -u
OLD=${OLD:-.devout/old}
W=${OUT:-/tmp/out}/ab
mkdir -p "$W"
export PYTHONUNBUFFERED=1
run() {  # $1 = tree, $2 = tag
  (cd "$1" && PYTHONPATH=$PWD/src:$PWD/kernels timeout 200 python3 benchmarks/bench_e2e.py --model llama-3.2-3b \
     --out "$W" --peft "" --grids exact --adapters 128 --tag "_$2") > "$W/$2.log" 2>&1
  grep -h decode_tok_s "$W/$2.log" | head -3
}
for round in 1 2; do
  run "$OLD" "old$round"
  run "$PWD" "new$round"
done
