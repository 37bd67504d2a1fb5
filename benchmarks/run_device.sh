#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmark, end-to-end benchmarks. Everything lands in
# $OUT/all.tgz (the device returns at most 8 files). Usage on the device:
#   bash benchmarks/run_device.sh tests kernels e2e-llama e2e-mistral
set -u
export PYTHONPATH=$PWD/src:$PWD/kernels PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=$OUT/work
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$W/gpu.txt"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests) timeout 150 python3 -m pytest tests -q -p no:cacheprovider > "$W/tests.log" 2>&1 ;;
    kernels) timeout 200 python3 benchmarks/bench_kernels.py --out "$W" --sweep > "$W/kernels.log" 2>&1 ;;
    e2e-llama) timeout 330 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --hf-compile > "$W/e2e_llama.log" 2>&1 ;;
    explore) timeout 150 python3 benchmarks/profile_step.py > "$W/profile_eager.log" 2>&1
             timeout 200 python3 benchmarks/profile_step.py --compile > "$W/profile_compile.log" 2>&1
             timeout 250 python3 benchmarks/bench_e2e.py --out "$W" --peft '' --adapters 1,128 --grids exact --compile --tag _compile > "$W/e2e_explore.log" 2>&1 ;;
    e2e-mistral) timeout 330 python3 benchmarks/bench_e2e.py --model mistral-7b --out "$W" --peft 1,8 > "$W/e2e_mistral.log" 2>&1 ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"
done
tar czf "$OUT/all.tgz" -C "$W" .
tail -4 "$W"/tests.log 2>/dev/null
grep '^|' "$W"/kernels.log 2>/dev/null | tail -16
for f in "$W"/profile_*.log; do [ -f "$f" ] && head -32 "$f" | cut -c1-150 && tail -1 "$f"; done
for f in "$W"/e2e_*.log; do [ -f "$f" ] && grep -E '^\{|^\||Error|error' "$f" | tail -40; done
