#!/usr/bin/env bash
# One GPU-machine call: GPU tests and the benchmarks users rerun. Results land in $OUT/all.tgz (a
# device call returns few files; a second invocation in the same call writes $OUT/all_<time>.tgz). On the GPU machine, from the repository root:
#   LORAZOR_COMMIT=<sha> bash benchmarks/run_device.sh gpu-tests kernels e2e-quick
# Give the sha literally (not $(git rev-parse ...) run there): the machine's copy of the tree may carry a .git whose
# HEAD is older than its files; without LORAZOR_COMMIT the results say "<that HEAD>+dirty".
# Steps:
#   gpu-tests        every test on the GPU (or those under $TEST_PATHS), in $SHARDS parallel shards over the GPUs (default 20, $SHARD_TIMEOUT s each,
#                    files of more than $UNIT_MAX tests split across shards,
#                    default 540; bf16 kernels, graph replay = eager, compile); check every shard's summary. Then the
#                    whole_gpu tests alone (a default-size KV pool), in tests_whole_gpu.log.
#                    SHARD_PART=k/m runs shards i with i % m == k only: the whole suite over m calls
#   kernels          bench_kernels.py: every grid mode per layer against the memory floor (Llama, Mistral shapes)
#   kernels-sweep    the same with a search over launch parameters; writes tuned_kernel_config.json
#   e2e-quick        bench_e2e.py: backbone vs `exact` at 1 and 128 adapters, CUDA graphs and compiled
#   e2e-grids        bench_e2e.py: every grid mode over 1..128 adapters, PEFT and HF static+compile (Llama)
#   e2e-mistral      bench_e2e.py: Mistral-7B shape, `exact` at 1, 32, 128, graphs and compiled, PEFT at 1
#   e2e-ab           bench_e2e.py --ab-patch "$AB_PATCH": the kernel config against patched versions in one run
#   release          bench_release.py: StepTrim decision cost and throughput
#   adapters         bench_adapters.py: registration, loads into slots, decode during loads, slot memory
#   engine-quick     bench_engine.py on 512 requests, 4 and 128 adapters, two open-loop rates (a smoke run)
#   engine-exact     bench_engine.py --part exact: LoRazor, exact without release, backbone, static, open loop
#   engine-compiled  bench_engine.py --part exact --compile on: LoRazor, exact and backbone at 128 adapters, compiled
#   engine-decode-heavy  bench_engine.py --workload decode-heavy (1,536 requests, outputs ~3x longer, >= 73% of decode
#                    LoRA released): LoRazor, exact and backbone at 128 adapters, eager then compiled; the summary
#                    row gives LoRazor vs the backbone and the share of the exact -> backbone gap it closes
#   trace-busy       probes/trace_busy.py: the bench trace step by step, its steps by kind and, over 200 steps
#                    from its middle, GPU busy / wall (is the engine's req/s bound by the GPU or the host?)
#   engine-tokens    bench_engine.py --part exact at 128 adapters, 512 seats, with 1024, 4096 and 8192 tokens per step
#                    (lorazor, exact; eager): the measurement behind the default max_num_batched_tokens
#   engine-seqs      bench_engine.py --part exact at 128 adapters with 256 seqs / 2048 tokens, 512 / 4096 and 1024 / 8192
#                    (lorazor, backbone; eager): the trace is bound by its 256 seats (benchmarks/results/host_trace_cpu/);
#                    the measurement behind the default max_num_seqs
#   engine-runs      bench_engine.py --part exact at 128 adapters, one process per entry of $ENGINE_RUNS
#                    ("mode seqs tokens skip seconds [name [VAR=value ...] [bench_engine args ...]]; ..."): eager or
#                    compiled, at a shape, within a time limit (engine-decode-heavy, -seqs, -tokens, -configs use it)
#   engine-configs   bench_engine.py --part exact at 128 adapters, 2,048 requests, LoRazor and backbone (eager), one
#                    process per kernel config of $KERNEL_CONFIGS (paths under kernels/lorazor_kernels/configs/, or
#                    "default": this GPU's own): e.g. the H200's tuned config on an H100, which has none of its own
#   engine-full      bench_engine.py --part full: full grid with and without release, open loop
#   engine-sweep     bench_engine.py --part exact at 4-64 adapters only (lorazor and exact), rows_exact_sweep.jsonl
#   testbed-v2       python -m lorazor.testbed.train --version 2 on the GPU, then the paper's tables on it
#                    (python -m lorazor.testbed.paper); assets come back as $OUT/testbed_v2.tgz.part-*
#   roofline         probes/step_roofline.py --compile on (decode rows async, prefill, the trace's mixed step, drift;
#                    kernel split): the step numbers of issue #37
#   mixed            probes/step_roofline.py, mixed phase only, eager then compiled: the bench trace's typical step
#                    (200 decode rows + 824 prompt tokens) against its floors
#   defaults         probes/step_roofline.py --defaults: the step at the engine's defaults, compile=auto on cold caches
#                    (warm-up, decode, prefill), its restart on the caches left, then eager (issue #54)
#   fp8              issue #55's benchmark: probes/step_roofline.py --defaults, compiled, decode at batch 1, 64, 256
#                    (backbone and 128 adapters), bf16 then fp8, Llama-3.2-3B then Mistral-7B shapes (one process each);
#                    then bench_engine.py's mixed trace (LoRazor, backbone; compiled, defaults), bf16 then fp8 (req/s)
#   step-configs     probes/step_roofline.py --defaults, decode rows ($CONFIG_ROWS, default batch 1 and 256, backbone and 128
#                    adapters) once per kernel config file of $KERNEL_CONFIGS (one process each; "default": the GPU's own);
#                    $STEP_ARGS are added to each (e.g. "--quantization fp8")
#   config-ab        the same for the GPU's own file, then that file with $CONFIG_CHANGES ("key=value,...", JSON values:
#                    e.g. fp8_pdl=true), one process each
#   engine-defaults  issue #54's bench: bench_engine.py's mixed trace at the defaults, LoRazor and backbone, the old eager
#                    default then the compiled default (one process each; the decode-heavy trace: engine-decode-heavy)
#   cold-adapters    bench_cold_adapters.py: TTFT of requests whose adapter was on disk, in host memory or in a slot,
#                    1,000 adapters, 32 slots, 128 host copies, Zipf(1.1), open loop, against every adapter resident
#   warmup           probes/warmup_profile.py: warm_up() compiled with cold caches, compiled again with the caches
#                    it left (a restart), eager with cold caches, eager again with its Triton cache (a restart)
#   prefix-cache     bench_engine.py --workload shared-prefix (128 adapters with ~1,000-token system prompts, Zipf
#                    popularity; cache on and off, offline and open loop; $SHARED_REQUESTS, default 1024), then, on
#                    the same engine, the mixed trace's LoRazor with the cache on, off, on (--cache-ab, $CACHE_AB_REQUESTS)
#   moe              bench_moe.py (issue #66): the Qwen3-30B-A3B shape, 4 layers, 64 adapters at the defaults (decode at
#                    batch 1 and 256 with profiles, prefill, trace), then the same decode and prefill with
#                    --quantization fp8 (fp8 experts and projections); moe.log, moe_fp8.log, each run's moe.json
#   moe-ab           bench_moe.py's decode rows (batch 1, 256) and prefill, first on the tree in $AB_TREE (src/ and
#                    kernels/ of another commit, e.g. `git archive <rev> src kernels | tar x -C .ab`, carried), then
#                    on this one: one process each, in one call
#   tree-ab          the engine at its defaults on two trees: the tree in $AB_TREE (as for moe-ab), then this one, each
#                    with emptied compile caches: step_roofline.py --defaults --phases floors,warmup,decode,prefill (rows
#                    $AB_ROWS, default batch 1 and 256, backbone and 128 adapters; $STEP_ARGS added), then the same
#                    warm-up again on the caches it left (a restart); one process each, in one call
#   serving          bench_serving.py: HTTP open loop against the in-process engine at the same rates
#                    (needs fastapi, uvicorn, pydantic: carry their wheels as .whl/, see the device README)
# One-off probes (benchmarks/probes/) are run directly; see their docstrings.
# Structured outputs need xgrammar on the GPU image, which has neither it nor its pydantic: carry the wheels in the
# ignored .whl/ (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
# xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection; jsonschema's for the tests)
# and install them first: python3 -m pip install -q --no-deps .whl/*.whl
set -u
export PYTHONPATH=$PWD/src:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=${WORK:-$OUT/work}  # WORK=/tmp/work: only all.tgz (and the testbed parts) come back, at most 8 files
rm -rf "$W"  # a warm machine keeps the last call's work folder: only this invocation's files go in
mkdir -p "$W"
# A second invocation in one call (OUT starts empty each call) writes its own archive, not over the first's.
TGZ="$OUT/all.tgz"
[ -e "$TGZ" ] && TGZ="$OUT/all_$(date +%s%N).tgz"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$W/gpu.txt"
e2e() {  # bench_e2e.py on the Llama-3.2-3B shape with the given extra arguments; $1 names the log
  local name=$1
  shift
  timeout 420 python3 benchmarks/bench_e2e.py --out "$W" "$@" > "$W/$name.log" 2>&1
}
engine_runs() {  # "mode seqs tokens skip seconds [name [VAR=value ...] [bench_engine args ...]]; ...": one bench_engine
  # process per entry, in order (mode eager or compiled; skip: systems or stages besides static,open,skewed; name:
  # the tag and log, default mode_seqs_tokens; VAR=value: its environment), within its seconds; tar after each
  local runs run
  IFS=';' read -rd '' -a runs <<< "$1" || true  # the whole list, newlines included (read stops at EOF)
  for run in "${runs[@]}"; do
    set -- $run
    [ $# -ge 5 ] || continue  # an empty entry (a trailing ";")
    local mode=$1 seqs=$2 tokens=$3 skip=$4 seconds=$5 name=${6:-$1_$2_$3} envs=() args=()
    shift $(( $# < 6 ? $# : 6 ))
    for field in "$@"; do
      case $field in [A-Z]*=*) envs+=("$field") ;; *) args+=("$field") ;; esac
    done
    [ "$mode" = compiled ] && envs+=(TORCH_LOGS=recompiles) && args+=(--compile on)
    [ "$mode" = eager ] && args+=(--compile off)
    env "${envs[@]}" timeout "$seconds" python3 benchmarks/bench_engine.py --part exact --out "$W/engine" \
      --deadline $(( seconds - 10 )) --adapters 128 --skip "$skip,static,open,skewed" --max-num-seqs "$seqs" \
      --max-num-batched-tokens "$tokens" --tag "_$name" "${args[@]}" > "$W/engine_$name.log" 2>&1
    tar czf "$TGZ" -C "$W" .
  done
}
step_with_config() {  # $1: a kernel config file ("default": this GPU's own), $2: decode rows; one step_roofline process
  local cfg=$1 name
  name=$(basename "$cfg" .json)
  env $([ "$cfg" != default ] && echo LORAZOR_KERNEL_CONFIG=$cfg) timeout ${CONFIG_STEP_S:-200} \
    python3 benchmarks/probes/step_roofline.py --defaults --compile auto --modes async --phases floors,decode \
    --decode-rows "$2" ${STEP_ARGS:-} --out "$W" --tag "_cfg_$name" > "$W/step_cfg_$name.log" 2>&1
  tar czf "$TGZ" -C "$W" .
}
for step in "$@"; do
  start=$(date +%s)
  case $step in
    gpu-tests) for path in ${TEST_PATHS:-tests}; do  # a missing path would collect nothing (see below)
                 [ -e "$path" ] || { echo "gpu-tests: no such test path: $path"; exit 2; }
               done
               # Tests marked whole_gpu take most of the GPU's memory: they run alone, after the shards.
               python3 -m pytest ${TEST_PATHS:-tests} -m "not whole_gpu" --collect-only -q -p no:cacheprovider \
                 | grep :: > "$W/all_ids.txt"
               # A shard given no test ids would run pytest with no arguments: the whole suite.
               [ -s "$W/all_ids.txt" ] || { echo "gpu-tests: pytest collected no tests"; exit 2; }
               # 16 shards at 360 s left one cut on an H100 at 9fd8d8b (test_examples.py is slow): 20 by default.
               n=${SHARDS:-20}
               # Whole files per shard, the largest first onto the emptiest shard, so a module's fixtures
               # (a served engine) are built once per shard: pytest collects a module once per test id
               # given. Only a file larger than a shard's share (or $UNIT_MAX ids, a slow file) is split into runs of test ids.
               python3 - "$W" "$n" "${UNIT_MAX:-0}" <<'PY'
import collections, sys
w, n, unit_max = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
by_file = collections.defaultdict(list)
for line in open(f"{w}/all_ids.txt"):
    by_file[line.split("::")[0]].append(line.rstrip("\n"))
share = -(-sum(map(len, by_file.values())) // n)
share = min(share, unit_max) if unit_max > 0 else share
units = []  # (test count, pytest arguments)
for f, ids in by_file.items():
    units += [(len(ids), [f])] if len(ids) <= share else [(len(ids[i:i + share]), ids[i:i + share])
                                                         for i in range(0, len(ids), share)]
shards = [[0, []] for _ in range(n)]
for count, args in sorted(units, key=lambda u: -u[0]):
    shard = min(shards, key=lambda s: s[0])
    shard[0] += count
    shard[1] += args
for i, (_, args) in enumerate(shards):
    open(f"{w}/args_{i}.txt", "w").write("\n".join(args) + "\n")
PY
               gpus=$(nvidia-smi -L | wc -l)
               part=${SHARD_PART:-0/1}  # k/m: run only shards i with i % m == k (the suite over m calls)
               for i in $(seq 0 $((n - 1))); do
                 [ $((i % ${part#*/})) -eq "${part%/*}" ] || continue
                 grep -q . "$W/args_$i.txt" || continue  # more shards than test files
                 # Arguments hold spaces (parametrized ids): pass them to pytest whole, not through the shell.
                 # Shards spread over the machine's GPUs.
                 CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout ${SHARD_TIMEOUT:-540} python3 -c "import sys, pytest; sys.exit(pytest.main(open(sys.argv[1]).read().splitlines() + ['-q', '-p', 'no:cacheprovider']))" \
                   "$W/args_$i.txt" > "$W/tests_shard$i.log" 2>&1 &
               done
               wait
               # WHOLE_GPU=0: leave the whole_gpu tests to a call of their own (`-m whole_gpu`).
               [ "${part%/*}" -eq 0 ] && [ "${WHOLE_GPU:-1}" != 0 ] && timeout ${SHARD_TIMEOUT:-540} python3 -m pytest \
                 ${TEST_PATHS:-tests} -m whole_gpu -q -p no:cacheprovider > "$W/tests_whole_gpu.log" 2>&1 ;;
    kernels) timeout 300 python3 benchmarks/bench_kernels.py --out "$W" > "$W/kernels.log" 2>&1 ;;
    kernels-sweep) timeout 400 python3 benchmarks/bench_kernels.py --out "$W" --sweep --models llama-3.2-3b \
                 > "$W/kernels.log" 2>&1 ;;
    e2e-quick) e2e e2e_exact --model llama-3.2-3b --peft "" --grids exact --adapters 1,128 --compile --tag _exact ;;
    e2e-grids) e2e e2e_llama --model llama-3.2-3b --hf-compile ;;
    e2e-mistral) e2e e2e_mistral --model mistral-7b --peft 1 --adapters 1,32,128 --grids exact --compile ;;
    e2e-ab) e2e e2e_ab --model llama-3.2-3b --peft "" --grids exact --adapters "${AB_ADAPTERS:-1,128}" \
                 --ab-patch "${AB_PATCH:-{\}}" --tag _ab ;;
    release) timeout 300 python3 benchmarks/bench_release.py --out "$W" > "$W/release.log" 2>&1 ;;
    adapters) timeout 330 python3 benchmarks/bench_adapters.py --out "$W" > "$W/adapters.log" 2>&1 ;;
    engine-quick) timeout 400 python3 benchmarks/bench_engine.py --part exact --out "$W/engine" --requests 512 \
                 --adapters 4,128 --rates 50,150 --open-seconds 4 --skip static > "$W/engine_quick.log" 2>&1 ;;
    engine-exact) timeout 560 python3 benchmarks/bench_engine.py --part exact --out "$W/engine" --deadline ${ENGINE_DEADLINE:-520} \
                 > "$W/engine_exact.log" 2>&1 ;;
    engine-sweep) timeout 560 python3 benchmarks/bench_engine.py --part exact --out "$W/engine" --deadline ${ENGINE_DEADLINE:-520} \
                 --adapters 4,8,16,32,64 --skip backbone,static,open,skewed --tag _sweep > "$W/engine_sweep.log" 2>&1 ;;
    engine-compiled) TORCH_LOGS=recompiles timeout 560 python3 benchmarks/bench_engine.py --part exact --compile on --out "$W/engine" \
                 --deadline ${ENGINE_DEADLINE:-520} --adapters 128 --skip static,open,skewed --tag _compiled \
                 > "$W/engine_compiled.log" 2>&1 ;;
    engine-decode-heavy) secs=(${DECODE_HEAVY_SECONDS:-280 280})  # eager, compiled: a cold compile takes minutes
                 dh="--workload decode-heavy --requests 1536"
                 engine_runs "eager 512 4096 none ${secs[0]} decode_heavy_eager $dh; compiled 512 4096 none ${secs[1]} decode_heavy_compiled $dh" ;;
    prefix-cache) timeout ${PREFIX_CACHE_SECONDS:-400} python3 benchmarks/bench_engine.py --part exact \
                 --workload shared-prefix --out "$W/engine" --requests ${SHARED_REQUESTS:-1024} --cache-ab \
                 --cache-ab-requests ${CACHE_AB_REQUESTS:-2048} --tag _shared_prefix > "$W/engine_shared_prefix.log" 2>&1 ;;
    trace-busy) timeout 300 python3 benchmarks/probes/trace_busy.py --out "$W" --tag _eager > "$W/trace_busy.log" 2>&1 ;;
    engine-tokens) engine_runs "eager 512 1024 backbone 180; eager 512 4096 backbone 180; eager 512 8192 backbone 180" ;;
    engine-seqs) engine_runs "eager 256 2048 exact 185; eager 512 4096 exact 185; eager 1024 8192 exact 185" ;;
    engine-runs) engine_runs "${ENGINE_RUNS:?}" ;;
    engine-configs) runs=""
                 for cfg in ${KERNEL_CONFIGS:-default}; do
                   env=$([ "$cfg" != default ] && echo LORAZOR_KERNEL_CONFIG="$cfg")
                   runs+="eager 512 4096 exact 150 config_$(basename "$cfg" .json) $env --requests 2048;"
                 done
                 engine_runs "$runs" ;;
    engine-full) timeout 560 python3 benchmarks/bench_engine.py --part full --out "$W/engine" --deadline ${ENGINE_DEADLINE:-520} \
                 > "$W/engine_full.log" 2>&1 ;;
    testbed-v2) # Assets (about 18 MB compressed) come back as 15 MiB parts: cat testbed_v2.tgz.part-* | tar xz
               TB=/tmp/tb/testbed_v2
               timeout ${V2_TIMEOUT:-400} python3 -m lorazor.testbed.train --version 2 --device cuda --out "$TB" \
                 --pretrain-steps ${V2_PRETRAIN_STEPS:-4000} --adapter-steps ${V2_ADAPTER_STEPS:-600} --batch 64 --seq 512 \
                 > "$W/testbed_v2.log" 2>&1
               tar czf - -C /tmp/tb testbed_v2 | split -b 15m - "$OUT/testbed_v2.tgz.part-"
               cp "$TB/train_log.json" "$W/" 2>/dev/null
               timeout ${V2_PAPER_TIMEOUT:-150} python3 -m lorazor.testbed.paper --assets "$TB" --device cuda \
                 --out "$W/testbed_paper" > "$W/testbed_paper.log" 2>&1 ;;
    roofline) # issue #37's numbers: the decode rows (async), prefill and drift with compile, then warm-up (eager)
             timeout 330 python3 benchmarks/probes/step_roofline.py --compile on --modes async \
               --phases floors,decode,prefill,mixed,drift --out "$W" --tag "_${LORAZOR_COMMIT:-head}" > "$W/roofline.log" 2>&1 ;;
    mixed)   for mode in eager compiled; do
               timeout 280 python3 benchmarks/probes/step_roofline.py --compile $([ $mode = compiled ] && echo on || echo off) \
                 --phases floors,mixed --out "$W" --tag "_mixed_${mode}_${LORAZOR_COMMIT:-head}" > "$W/mixed_$mode.log" 2>&1
               tar czf "$TGZ" -C "$W" .
             done ;;
    defaults) # issue #54: the engine at EngineConfig's defaults (pool from gpu_memory_utilization), Llama-3.2-3B shape,
             # 128 adapters: compile=auto (compiled) on cold caches with warm-up, decode and prefill rows; a restart
             # on the caches it left (warm-up only); then the old eager default's rows. Tar after each.
             export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_defaults TRITON_CACHE_DIR=/tmp/triton_defaults
             rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
             roof="python3 benchmarks/probes/step_roofline.py --defaults --modes async --out $W"
             timeout ${DEFAULTS_COLD_S:-270} $roof --compile auto --phases floors,warmup,decode,prefill \
               --tag _defaults_compiled > "$W/defaults_compiled.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             timeout 80 $roof --compile auto --phases floors,warmup --tag _defaults_compiled_restart \
               > "$W/defaults_compiled_restart.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             timeout 130 $roof --compile off --phases floors,decode,prefill --tag _defaults_eager \
               > "$W/defaults_eager.log" 2>&1
             unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR ;;
    fp8)     rows="1:backbone,1:lora,64:lora,256:backbone,256:lora"
             for model in llama-3.2-3b mistral-7b; do
               for q in bf16 fp8; do
                 timeout ${FP8_STEP_S:-200} python3 benchmarks/probes/step_roofline.py --defaults --compile auto \
                   --modes async --phases floors,decode --decode-rows $rows --model $model \
                   $([ $q = fp8 ] && echo --quantization fp8) --out "$W" --tag "_${model}_$q" > "$W/fp8_${model}_$q.log" 2>&1
                 tar czf "$TGZ" -C "$W" .
               done
             done
             engine_runs "compiled 512 4096 exact ${FP8_ENGINE_S:-240} fp8_trace_bf16 --requests 2048;
                          compiled 512 4096 exact ${FP8_ENGINE_S:-240} fp8_trace_fp8 --requests 2048 --quantization fp8" ;;
    step-configs) # the decode step at the defaults (compiled, Llama-3.2-3B shape, 128 adapters) once per kernel config file
             # of $KERNEL_CONFIGS (paths; "default": this GPU's own file), one process each, in order
             for cfg in ${KERNEL_CONFIGS:-default}; do
               step_with_config "$cfg" "${CONFIG_ROWS:-1:backbone,1:lora,256:backbone,256:lora}"
             done ;;
    config-ab) [ -n "${CONFIG_CHANGES:-}" ] || { echo "config-ab: set CONFIG_CHANGES=key=value,..."; exit 2; }
             own=$(python3 -c "import torch; from lorazor_kernels.kernel_config import kernel_config_path as p
print(p(torch.device('cuda')))")
             python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
d.update({k: json.loads(v) for k, v in (kv.split('=') for kv in sys.argv[3].split(','))})
json.dump(d, open(sys.argv[2], 'w'))" "$own" "$W/changed.json" "$CONFIG_CHANGES"
             for cfg in default "$W/changed.json"; do
               step_with_config "$cfg" "${CONFIG_ROWS:-1:backbone,1:lora,256:backbone,256:lora}"
             done ;;
    engine-defaults) engine_runs "eager 512 4096 exact ${DEFAULTS_ENGINE_S:-240} defaults_eager;
                          compiled 512 4096 exact ${DEFAULTS_ENGINE_S:-240} defaults_compiled" ;;
    cold-adapters) # issue #56: 1,000 adapters on disk, 32 slots, 128 host copies, Zipf(1.1), open loop; then all resident
             timeout 500 python3 benchmarks/bench_cold_adapters.py --out "$W/cold_adapters" > "$W/cold_adapters.log" 2>&1 ;;
    warmup)  # compiled on cold caches, compiled again on the caches it left (a restart), then eager; tar after each
             export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_warmup TRITON_CACHE_DIR=/tmp/triton_warmup
             rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
             timeout 200 python3 benchmarks/probes/warmup_profile.py --compile --out "$W" > "$W/warmup_compiled.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             timeout 150 python3 benchmarks/probes/warmup_profile.py --compile --tag _restart --out "$W" \
               > "$W/warmup_compiled_restart.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
             timeout 170 python3 benchmarks/probes/warmup_profile.py --out "$W" > "$W/warmup.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             timeout 120 python3 benchmarks/probes/warmup_profile.py --tag _restart --out "$W" > "$W/warmup_restart.log" 2>&1 ;;
    moe)     timeout ${MOE_S:-330} python3 benchmarks/bench_moe.py --out "$W/moe" --layers 4 --requests 256 \
               > "$W/moe.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             timeout ${MOE_FP8_S:-200} python3 benchmarks/bench_moe.py --out "$W/moe_fp8" --layers 4 --quantization fp8 \
               --phases decode,prefill --warmup-sizes 1,256 > "$W/moe_fp8.log" 2>&1 ;;
    moe-ab)  [ -d "${AB_TREE:-}/src" ] || { echo "moe-ab: AB_TREE must hold src/ and kernels/ of the other tree"; exit 2; }
             ab="benchmarks/bench_moe.py --layers 4 --phases decode,prefill --warmup-sizes 1,256"
             PYTHONPATH=$AB_TREE/src:$AB_TREE/kernels${PYTHONPATH:+:$PYTHONPATH} timeout ${MOE_AB_S:-200} \
               python3 $ab --out "$W/moe_ab_old" > "$W/moe_ab_old.log" 2>&1
             tar czf "$TGZ" -C "$W" .
             timeout ${MOE_AB_S:-200} python3 $ab --out "$W/moe_ab_new" > "$W/moe_ab_new.log" 2>&1 ;;
    tree-ab) [ -d "${AB_TREE:-}/src" ] || { echo "tree-ab: AB_TREE must hold src/ and kernels/ of the other tree"; exit 2; }
             for side in old new; do
               tree=$([ $side = old ] && echo "$AB_TREE" || echo "$PWD")
               export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_ab_$side TRITON_CACHE_DIR=/tmp/triton_ab_$side
               rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
               R="python3 benchmarks/probes/step_roofline.py --defaults --compile auto --modes async ${STEP_ARGS:-}"
               PYTHONPATH=$tree/src:$tree/kernels${PYTHONPATH:+:$PYTHONPATH} timeout ${AB_STEP_S:-200} $R \
                 --phases floors,warmup,decode,prefill --decode-rows "${AB_ROWS:-1:backbone,1:lora,256:backbone,256:lora}" \
                 --out "$W" --tag "_ab_$side" > "$W/ab_$side.log" 2>&1
               PYTHONPATH=$tree/src:$tree/kernels${PYTHONPATH:+:$PYTHONPATH} timeout ${AB_RESTART_S:-120} $R \
                 --phases floors,warmup --out "$W" --tag "_ab_${side}_restart" > "$W/ab_${side}_restart.log" 2>&1
               tar czf "$TGZ" -C "$W" .
             done ;;
    serving) if [ -d .whl ]; then  # fastapi, uvicorn, pydantic wheels carried in (device README)
               python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                 .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
             fi
             timeout 400 python3 benchmarks/bench_serving.py --out "$W/serving" > "$W/serving.log" 2>&1 ;;
    *) echo "unknown step $step (see the header of benchmarks/run_device.sh)" ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"
  tar czf "$TGZ" -C "$W" .  # after every step: a call cut short still returns what it finished
done
for f in "$W"/tests*.log; do [ -f "$f" ] && grep -E "^FAILED|passed|failed" "$f" | tail -12; done
grep -h '^|' "$W"/kernels.log "$W"/release.log "$W"/adapters.log 2>/dev/null | tail -40
for f in "$W"/defaults_*.log "$W"/moe*.log "$W"/step_cfg_*.log; do [ -f "$f" ] && grep -E '^\{' "$f" | cut -c1-330; done
for f in "$W"/engine_*.log "$W"/serving.log; do [ -f "$f" ] && grep -E '^\{|Error|error|done' "$f" | cut -c1-400 | tail -60; done
for f in "$W"/e2e_*.log; do [ -f "$f" ] && grep -E '^\{|^\||Error|error' "$f" | tail -45; done
