#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmark, end-to-end benchmarks. Everything lands in
# $OUT/all.tgz (the device returns at most 8 files). Usage on the device:
#   LORAZOR_COMMIT=<sha> bash benchmarks/run_device.sh tests kernels e2e-llama [e2e-mistral] [release] [profile]
set -u
export PYTHONPATH=$PWD/src:$PWD/kernels PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=$OUT/work
rm -rf "$W"  # only this call's files come back (so run every step of a call in one invocation)
mkdir -p "$W"
# $W/patched_config.json: the H200 kernel config with $PATCH (JSON) applied, for LORAZOR_KERNEL_CONFIG.
patched_config() {
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c.update(json.loads(sys.argv[3])); json.dump(c, open(sys.argv[2], 'w'))" \
    kernels/lorazor_kernels/configs/NVIDIA_H200.json "$W/patched_config.json" "${PATCH:-{\}}"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$W/gpu.txt"
for step in "$@"; do
  start=$(date +%s)
  case $step in
    tests) timeout 280 python3 -m pytest tests -q -p no:cacheprovider > "$W/tests.log" 2>&1 ;;
    gpu-tests) timeout 300 python3 -m pytest tests/test_kernels.py tests/test_gpu.py tests/test_merged.py tests/test_release.py tests/test_add_adapter.py tests/test_compile.py tests/test_decode_attention.py -q --durations=15 -p no:cacheprovider > "$W/tests.log" 2>&1 ;;
    # The same suite in two calls' worth of steps (it took 288 s at c012cc0).
    # The kernel half alone ran past 200 s at 3321966 (about 240 of 283 tests done).
    gpu-tests-kernels) timeout 300 python3 -m pytest tests/test_kernels.py tests/test_meta.py tests/test_decode_attention.py -q --durations=10 -p no:cacheprovider > "$W/tests_kernels.log" 2>&1 ;;
    gpu-tests-model) timeout 250 python3 -m pytest tests/test_gpu.py tests/test_merged.py tests/test_release.py tests/test_add_adapter.py tests/test_compile.py -q --durations=10 -p no:cacheprovider > "$W/tests_model.log" 2>&1 ;;
    # The kernel tests past the first 240 (a 200 s run stops near there).
    gpu-tests-tail) python3 -m pytest tests/test_kernels.py tests/test_decode_attention.py --collect-only -q -p no:cacheprovider | grep :: | tail -n +240 > "$W/tail_ids.txt"
               timeout 150 python3 -m pytest $(cat "$W/tail_ids.txt") -q -p no:cacheprovider > "$W/tests_tail.log" 2>&1 ;;
    kernels) timeout 170 python3 benchmarks/bench_kernels.py --out "$W" > "$W/kernels.log" 2>&1 ;;
    kernels-sweep) timeout 300 python3 benchmarks/bench_kernels.py --out "$W" --sweep --models llama-3.2-3b > "$W/kernels.log" 2>&1 ;;
    # Later steps of this call use the swept config (the file comes back in all.tgz to be committed).
    apply-tuned) cp "$W/tuned_kernel_config.json" kernels/lorazor_kernels/configs/NVIDIA_H200.json ;;
    gpu-tests-changed) timeout 110 python3 -m pytest tests/test_gpu.py tests/test_merged.py tests/test_compile.py tests/test_kernels.py -k "bound or slot or merged or graph or tile or bad or compile or logits or recapture" -q --durations=10 -p no:cacheprovider > "$W/tests.log" 2>&1 ;;
    e2e-llama) timeout 360 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --hf-compile --compile > "$W/e2e_llama.log" 2>&1 ;;
    # The full table without the compiled sweep (it does not fit one call beside it): every grid, PEFT, HF.
    e2e-grids) timeout 330 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --hf-compile > "$W/e2e_llama.log" 2>&1 ;;
    # Mistral's full table: every grid mode at every L, PEFT at 1 and 8, HF static + compile (CUDA graphs only).
    e2e-mistral-grids) timeout 420 python3 benchmarks/bench_e2e.py --model mistral-7b --out "$W" --peft 1,8 --hf-compile \
                 --tag _grids > "$W/e2e_mistral_grids.log" 2>&1 ;;
    e2e-mistral-graphs) timeout 200 python3 benchmarks/bench_e2e.py --model mistral-7b --out "$W" --peft 1 --adapters 1,32,128 > "$W/e2e_mistral.log" 2>&1 ;;
    e2e-exact) timeout 400 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --peft "" --grids exact --adapters 1,32,128 --compile --tag _exact > "$W/e2e_exact.log" 2>&1 ;;
    e2e-quick) timeout 220 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --peft "" --grids exact --adapters 1,128 --compile --tag _exact > "$W/e2e_exact.log" 2>&1 ;;
    e2e-per-projection) timeout 190 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --peft "" --grids exact --adapters 1,128 --compile --per-projection --tag _per_projection > "$W/e2e_per_projection.log" 2>&1 ;;
    e2e-mistral) timeout 430 python3 benchmarks/bench_e2e.py --model mistral-7b --out "$W" --peft 1 --adapters 1,32,128 --grids exact --compile > "$W/e2e_mistral.log" 2>&1 ;;
    release) timeout 300 python3 benchmarks/bench_release.py --out "$W" > "$W/release.log" 2>&1 ;;
    # StepTrim's throughput against the backbone: CUDA graphs, then graphs + compile.
    release-throughput) timeout 150 python3 benchmarks/bench_release.py --out "$W" --throughput-only > "$W/release_graphs.log" 2>&1
             timeout 300 python3 benchmarks/bench_release.py --out "$W" --throughput-only --compile > "$W/release_compiled.log" 2>&1 ;;
    # Backbone against LoRA kernel by kernel in the decode step users run (graphs; then graphs + compile).
    profile) timeout 120 python3 benchmarks/profile_step.py > "$W/profile_graphs.log" 2>&1
             timeout 240 python3 benchmarks/profile_step.py --compile > "$W/profile_compile.log" 2>&1 ;;
    # PROFILE_REPEAT=3: each kernel's median over 3 profiles (per-kernel profiler times spread by tens of us).
    profile-compile) timeout 300 python3 benchmarks/profile_step.py --compile --repeat ${PROFILE_REPEAT:-1} \
                 > "$W/profile_compile.log" 2>&1 ;;
    # The same with the H200 config patched by $PATCH (JSON), e.g. '{"pdl": false}'.
    profile-compile-patched) patched_config
               LORAZOR_KERNEL_CONFIG="$W/patched_config.json" timeout 240 python3 benchmarks/profile_step.py --compile \
                 > "$W/profile_compile_patched.log" 2>&1 ;;
    # A layer's LoRA beside its GEMMs several ways: exact kernels (shrink after or before the GEMM, or in it),
    # dense cuBLAS over the bank, grouped GEMM.
    lora-forms) timeout 300 python3 benchmarks/bench_lora_forms.py --out "$W" > "$W/lora_forms.log" 2>&1 ;;
    kernels-llama) timeout 150 python3 benchmarks/bench_kernels.py --out "$W" --models llama-3.2-3b > "$W/kernels.log" 2>&1 ;;
    # The model's GPU tests with the tuned config patched by $PATCH (as e2e-quick-patched), then the PDL kernel tests.
    gpu-tests-patched) patched_config
               LORAZOR_KERNEL_CONFIG="$W/patched_config.json" timeout 150 python3 -m pytest tests/test_gpu.py tests/test_merged.py \
                 tests/test_compile.py tests/test_release.py tests/test_meta.py -q -p no:cacheprovider > "$W/tests_patched.log" 2>&1
               timeout 60 python3 -m pytest tests/test_kernels.py -k programmatic -q -p no:cacheprovider >> "$W/tests_patched.log" 2>&1 ;;
    # Every test in 5 parallel shards at the package config, beside the model's GPU tests at the config
    # patched by $PATCH: the whole suite in about a third of the serial time (16 CPU cores compile).
    gpu-tests-parallel) patched_config
               python3 -m pytest tests --collect-only -q -p no:cacheprovider | grep :: > "$W/all_ids.txt"
               for i in 0 1 2 3 4; do
                 awk -v i=$i 'NR % 5 == i' "$W/all_ids.txt" > "$W/ids_$i.txt"
                 # Test ids hold spaces (parametrized messages): pass them to pytest whole, not through the shell.
                 timeout 400 python3 -c "import sys, pytest; sys.exit(pytest.main(open(sys.argv[1]).read().splitlines() + ['-q', '-p', 'no:cacheprovider']))" \
                   "$W/ids_$i.txt" > "$W/tests_shard$i.log" 2>&1 &
               done
               LORAZOR_KERNEL_CONFIG="$W/patched_config.json" timeout 400 python3 -m pytest tests/test_gpu.py tests/test_merged.py \
                 tests/test_compile.py tests/test_release.py tests/test_add_adapter.py -q -p no:cacheprovider > "$W/tests_patched.log" 2>&1 &
               wait ;;
    # Compiled exact at L = 1, 128 with the GPU's kernel config, then with each patch of $AB_PATCH (else
    # $PATCH) applied (one run, one backbone). $AB_PATCH lets the tests of the same call use $PATCH.
    e2e-ab) timeout 420 python3 benchmarks/bench_e2e.py --model llama-3.2-3b --out "$W" --peft "" --grids exact \
                 --adapters ${AB_ADAPTERS:-1,128} --ab-patch "${AB_PATCH:-${PATCH:-{\}}}" --tag _ab${TAG:-} \
                 > "$W/e2e_ab${TAG:-}.log" 2>&1 ;;
    # e2e-ab with inductor's own kernels launched with programmatic dependent launch too (backbone and LoRA alike),
    # then the compiled-model GPU tests that way.
    e2e-ab-inductor-pdl) TORCHINDUCTOR_ENABLE_PDL=1 timeout 420 python3 benchmarks/bench_e2e.py --model llama-3.2-3b \
                 --out "$W" --peft "" --grids exact --adapters ${AB_ADAPTERS:-1,128} --ab-patch "${AB_PATCH:-${PATCH:-{\}}}" \
                 --tag _ab_inductor_pdl > "$W/e2e_ab_inductor_pdl.log" 2>&1 ;;
    gpu-tests-inductor-pdl) TORCHINDUCTOR_ENABLE_PDL=1 timeout 200 python3 -m pytest tests/test_compile.py tests/test_merged.py \
                 -q -k "compile" -p no:cacheprovider > "$W/tests_inductor_pdl.log" 2>&1 ;;
    # Nsight Compute over one layer's GEMMs + merged exact LoRA at L = 128 and 1 (hardware counters: DRAM
    # throughput, occupancy, warp stalls); details as text, then a one-line-per-kernel summary.
    ncu-layer) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
               for L in 128 1; do
                 timeout 200 "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight \
                   --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
                   --section SchedulerStats python3 benchmarks/ncu_layer.py --adapters $L > "$W/ncu_L$L.txt" 2>&1
                 timeout 200 "$NCU" --clock-control none --profile-from-start off --csv --metrics \
                   gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread \
                   python3 benchmarks/ncu_layer.py --adapters $L > "$W/ncu_L${L}_summary.csv" 2>&1
               done ;;
    # Per-instruction warp-stall samples (SASS) of the gate/up expand and the q/k/v shrink at L = 128.
    ncu-source) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
               for k in "_lora_expand_kernel 2" "_lora_shrink_kernel 0"; do
                 set -- $k
                 timeout 150 "$NCU" --clock-control none --profile-from-start off -k $1 --launch-skip $2 --launch-count 1 \
                   --section SourceCounters --section WarpStateStats -o "$W/$1" python3 benchmarks/ncu_layer.py --adapters 128 \
                   > "$W/$1_run.txt" 2>&1
                 "$NCU" --import "$W/$1.ncu-rep" --page source --print-source sass --csv > "$W/$1_sass.csv" 2>&1
                 "$NCU" --import "$W/$1.ncu-rep" --page details > "$W/$1_details.txt" 2>&1
                 rm -f "$W/$1.ncu-rep"
               done ;;
    # The gate/up expand at L = 128 with stages left out (benchmarks/expand_probe.py).
    expand-probe) timeout 200 python3 benchmarks/expand_probe.py --out "$W" > "$W/expand_probe.log" 2>&1 ;;
    # The same for the q/k/v and down shrinks (benchmarks/shrink_probe.py).
    shrink-probe) timeout 200 python3 benchmarks/shrink_probe.py --out "$W" > "$W/shrink_probe.log" 2>&1 ;;
    # e2e-quick with the tuned config patched by $PATCH (JSON, e.g. '{"pdl": true}'), results tagged $TAG.
    e2e-quick-patched) patched_config
               LORAZOR_KERNEL_CONFIG="$W/patched_config.json" timeout 220 python3 benchmarks/bench_e2e.py --model llama-3.2-3b \
                 --out "$W" --peft "" --grids exact --adapters 1,128 --compile --tag "_exact${TAG:-_patched}" > "$W/e2e_exact${TAG:-_patched}.log" 2>&1 ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"
  tar czf "$OUT/all.tgz" -C "$W" .  # after every step: a call cut short still returns what it finished
done
tar czf "$OUT/all.tgz" -C "$W" .
for f in "$W"/tests*.log; do [ -f "$f" ] && grep -E "^FAILED|passed|failed" "$f" | tail -12; done
grep '^|' "$W"/kernels.log 2>/dev/null | tail -16
for f in "$W"/profile_*.log; do [ -f "$f" ] && grep -E "^\||wall|adds|Error|^  [ *] " "$f" | cut -c1-220 | head -70; done
grep -h '^|' "$W"/release*.log 2>/dev/null
grep -E '^\||Error|error' "$W"/lora_forms.log 2>/dev/null | tail -12
for f in "$W"/e2e_*.log; do [ -f "$f" ] && grep -E '^\{|^\||Error|error' "$f" | tail -45; done
