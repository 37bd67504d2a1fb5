#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmark, end-to-end benchmark. Logs and results go to $OUT.
# Usage (on the device): bash benchmarks/run_device.sh [tests] [kernels] [e2e-llama] [e2e-mistral]
set -u
export PYTHONPATH=$PWD/src:$PWD/kernels PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
for step in "$@"; do
  case $step in
    tests) timeout 240 python3 -m pytest tests -q -x -p no:cacheprovider 2>&1 | tail -30 > "$OUT/tests.log" ;;
    kernels) timeout 300 python3 benchmarks/bench_kernels.py --out "$OUT" --sweep > "$OUT/kernels.log" 2>&1 ;;
    e2e-llama) timeout 420 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$OUT" --hf-compile > "$OUT/e2e_llama.log" 2>&1 ;;
    e2e-mistral) timeout 360 python3 benchmarks/bench_e2e.py --model mistral-7b --out "$OUT" --peft 1,8 > "$OUT/e2e_mistral.log" 2>&1 ;;
  esac
  echo "== $step rc=$?"
done
tail -3 "$OUT"/tests.log 2>/dev/null
grep -v '^sweep' "$OUT"/kernels.log 2>/dev/null | grep '^|' | tail -16
tail -25 "$OUT"/e2e_*.log 2>/dev/null
