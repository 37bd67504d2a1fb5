"""Probe: the engine's steps against their physical floors, measured in one process (issue #37).

    python benchmarks/probes/step_roofline.py --out /tmp/probe [--compile] [--phases all]

Llama-3.2-3B shape (`--model mistral-7b`: Mistral-7B's), bf16 (`--quantization fp8`: fp8 base
weights), 128 random rank-8 adapters on every projection (`--rank`: another rank), `max_num_seqs=256`,
`max_num_batched_tokens=2048` (`--defaults`: the engine's own defaults), through the public API. Phases:

- `floors`: read bandwidth (a graph-timed reduction over 4 GiB), copy bandwidth, bf16 matmul TFLOPS.
- `warmup`: `engine.warm_up()` wall time and graph count.
- `decode`: decode-only steps at batch 1 and 256 (backbone, 128 adapters, every row released after
  prefill, half released; `structured`: 128 adapters with every other row under a JSON schema, its
  grammar's bitmask filled on the host and applied on the device each step, `mask_host_ms` the
  host's part), with async scheduling and then step by step over the same requests:
  wall per `engine.step()` (median of 30), and from torch.profiler over
  5 steps the CUDA kernels per step, GPU busy time and its split by kernel kind; the bytes floor
  (weights + KV read + active adapters) at the measured read bandwidth, the GEMMs' FLOPs at the
  measured matmul rate, and the roofline: the GEMMs at the larger of their bytes and FLOPs, plus the
  KV and adapters' bytes (`vs_roofline`).
- `prefill`: a step of 8 prompts of 256 tokens (2,048 tokens) against its FLOPs floor.
- `mixed`: the bench trace's typical step (`probes/host_trace.py`: 858 of its 1,112 steps carry
  prefill chunks, on average 202 decode rows and 825 prompt tokens): 200 decode rows and 4 prompts of
  206 tokens in one step, against the larger of its bytes and FLOPs floors, and its roofline.
- `drift`: the batch-256 decode probe, then three traces of 1,024 requests (`engine_workload`),
  then the probe again; GPU clock, temperature and Python heap recorded with each.

Writes `step_roofline{tag}.json` and prints each row as it is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
import engine_workload as wl  # noqa: E402
from bench_e2e import TARGETS, build_base, fill_random_adapters  # noqa: E402
from common import copy_bandwidth, environment, mask_timer, time_graph  # noqa: E402

PROMPT = 64
ADAPTERS = 128
# The decode kind "structured": every other row decodes under this JSON schema (a string of at least
# 2,000 characters, so no row's grammar ends while the steps are timed).
LONG_JSON = {"json": {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
                      "required": ["text"]}}


def read_bandwidth() -> float:
    """Bytes/s of a reduction over 4 GiB (reads only)."""
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda").uniform_()
    ms = time_graph(lambda: x.sum(dtype=torch.float32), iters=20)
    return x.numel() * x.element_size() / (ms * 1e-3)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = time_graph(lambda: a @ b, iters=20)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def gpu_state() -> dict:
    state = {"python_objects": len(gc.get_objects()), "gc_collections": [s["collections"] for s in gc.get_stats()]}
    for name in ("clock_rate", "temperature", "power_draw"):
        try:
            state[name] = getattr(torch.cuda, name)()
        except Exception as err:  # pynvml missing: say so
            state[name] = f"n/a ({type(err).__name__})"
    return state


def profile_steps(engine, steps: int = 5, cpu: bool = True, top: int = 10) -> dict:
    """Kernels per step and GPU busy ms per step over `steps` decode steps (torch.profiler; `cpu=False`
    records the CUDA kernels only, which slows the host less), with the `top` heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA][0 if cpu else 1:]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for s, e in intervals:  # union of kernel intervals (us)
        if e > end:
            busy += e - max(s, end)
            end = e
    return dict(kernels_per_step=round(len(kernels) / steps), gpu_busy_ms=round(busy / 1e3 / steps, 3),
                profiled_wall_ms=round(wall, 3), **kernel_breakdown(kernels, steps, top))


# Kernel name fragments -> category, first match wins (cuBLAS names its Hopper GEMMs nvjet/sm90_xmma).
# Inductor's kernels first: it names a fused kernel after the ops it fuses (`triton_poi_fused_linear_lora_mul_silu_
# ...`, `..._paged_attention_...`), which are not LoRA or attention kernels.
CATEGORIES = (("fused (inductor)", ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")),
              ("attention", ("paged_attention", "decode_attention", "flash", "fmha")),
              ("lora", ("lora", "_zero_rows", "_batch_meta")),
              ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce")),
              ("fused (inductor)", ("triton_",)),
              ("copy/memset", ("memcpy", "memset", "copy")))


def kernel_breakdown(kernels, steps: int, top: int = 10) -> dict:
    """GPU ms per step by category, and the `top` kernels with the most time per step (name, ms, count)."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    categories: dict[str, float] = {}
    for name, times in by_name.items():
        low = name.lower()
        category = next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")
        categories[category] = categories.get(category, 0.0) + sum(times)
    heaviest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return dict(category_ms={c: round(us / 1e3 / steps, 3) for c, us in sorted(categories.items())},
                top_kernels=[(name[:90], round(sum(t) / 1e3 / steps, 3), round(len(t) / steps, 1))
                             for name, t in heaviest])


class Probe:
    def __init__(self, args):
        from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

        self.base = build_base(args.model)
        self.base.generation_config.eos_token_id = None
        self.base.config.eos_token_id = None
        self.model = LoRazorModel.from_pretrained(self.base, None, LoRazorConfig(
            max_loras=ADAPTERS, max_lora_rank=args.rank, lora_target_modules=TARGETS, compile=args.compile,
            quantization=args.quantization))
        self.names = fill_random_adapters(self.model, 0, ADAPTERS, rank=args.rank)
        # --defaults: the engine as users get it (EngineConfig's defaults: the KV pool from
        # gpu_memory_utilization, 512 seats, 4,096 tokens per step); else the probe's old shape.
        self.engine = LoRazorEngine(self.model) if args.defaults else LoRazorEngine(
            self.model, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=12000, max_model_len=1024)
        self.vocab = self.base.config.vocab_size
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.base.parameters())
        bank = self.model.bank
        # One adapter's A and B over every targeted module of every layer.
        self.adapter_bytes = sum(args.rank * (k + n) * bank.dtype.itemsize for k, n in bank.module_sizes.values())
        self.rows: list[dict] = []
        self.bandwidth = self.tflops = None

    def record(self, **row):
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def floors(self):
        self.bandwidth, copy = read_bandwidth(), copy_bandwidth()
        self.tflops = matmul_tflops()
        self.record(phase="floors", read_tb_s=round(self.bandwidth / 1e12, 3), copy_tb_s=round(copy / 1e12, 3),
                    matmul_tflops=round(self.tflops, 1), weight_gb=round(self.weight_bytes / 1e9, 3),
                    adapter_mb=round(self.adapter_bytes / 1e6, 2))

    def warm_up(self):
        start = time.perf_counter()
        captured = self.engine.warm_up()
        graphs = self.engine.graphs
        self.record(phase="warmup", seconds=round(time.perf_counter() - start, 1), graphs=captured,
                    compile=self.model.config.compile, decode_capture_s=round(graphs.capture_seconds, 1),
                    packed_capture_s=round(graphs.packed.capture_seconds, 1))

    def _fill(self, batch: int, adapters, release, prompt: int = PROMPT, new: int = 200, seed: int = 0,
              structured=lambda i: False):
        g = torch.Generator().manual_seed(seed)
        for i in range(batch):
            ids = torch.randint(3, self.vocab, (prompt,), generator=g).tolist()
            extra = dict(structured_output=LONG_JSON, tokenizer=self.synthetic_tokenizer()) if structured(i) else {}
            self.engine.add_request(ids, adapter=adapters(i), max_new_tokens=new, release=release(i), pad_token_id=0,
                                    **extra)

    def synthetic_tokenizer(self):
        """xgrammar's view of a vocabulary as large as the model's, built from the testbed tokenizer's
        pieces (`grammar_cost.synthetic_info`: no tokenizer can be downloaded on the GPU machine)."""
        if getattr(self, "_tokenizer", None) is None:
            from grammar_cost import synthetic_info

            self._tokenizer = synthetic_info(self.vocab)
        return self._tokenizer

    def decode(self, batch: int, kind: str, steps: int = 30, label: str = "decode", modes=("async",)) -> dict:
        """The decode rows, one per scheduling mode ("async", "sync") over the same requests; returns the first."""
        names = self.names
        adapters = (lambda i: None) if kind == "backbone" else (lambda i: names[i % len(names)])
        release = {"backbone": lambda i: "never", "lora": lambda i: "never", "released": lambda i: 0,
                   "half": lambda i: 0 if i % 2 else "never", "structured": lambda i: "never"}[kind]
        self._fill(batch, adapters, release, structured=(lambda i: i % 2 == 0) if kind == "structured" else
                   (lambda i: False))
        engine = self.engine
        while any(len(r.output) == 0 for r in engine.requests.values()):
            engine.step()
        rows = []
        for mode in modes:
            engine.async_scheduling = mode == "async"
            for _ in range(3):
                engine.step()
            times = []
            with mask_timer() as mask_ms:
                for _ in range(steps):
                    t = time.perf_counter()
                    engine.step()
                    times.append((time.perf_counter() - t) * 1e3)
            prof = profile_steps(engine)
            context = PROMPT + 3 + len(rows) * (steps + 8) + steps + 5
            kv = batch * context * self.model.runner.kv_bytes_per_token()
            # Adapters whose rows keep them ("half": rows i and i + 128 share adapter i % 128 and
            # their parity, so the odd adapters are released whole and 64 remain).
            active = len({adapters(i) for i in range(batch) if release(i) == "never"} - {None})
            other_ms = (kv + active * self.adapter_bytes) / self.bandwidth * 1e3
            floor_ms = self.weight_bytes / self.bandwidth * 1e3 + other_ms
            # At batch 256 the GEMMs are past the H200's ridge (~190 FLOP/byte): their floor is their
            # FLOPs, not their weights' bytes. The roofline counts the GEMMs at the larger of the two,
            # and the attention and adapters at their bytes.
            flops_ms = batch * self.decode_flops(context) / (self.tflops * 1e12) * 1e3
            roofline_ms = max(self.weight_bytes / self.bandwidth * 1e3, flops_ms) + other_ms
            median = statistics.median(times)
            row = dict(phase=label, batch=batch, kind=kind, scheduling=mode, step_ms=round(median, 3),
                       floor_ms=round(floor_ms, 3), vs_floor=round(median / floor_ms, 2),
                       gemm_flops_ms=round(flops_ms, 3), roofline_ms=round(roofline_ms, 3),
                       vs_roofline=round(median / roofline_ms, 2), **prof,
                       host_gap=round(1 - prof["gpu_busy_ms"] / prof["profiled_wall_ms"], 3), **gpu_state(),
                       **({"mask_host_ms": round(sum(mask_ms) / steps, 3)} if mask_ms else {}))
            self.record(**row)
            rows.append(row)
        engine.async_scheduling = True
        engine.abort_all()
        return rows[0]

    def decode_flops(self, context: int) -> float:
        """GEMM FLOPs of one decode token: every linear layer and the LM head (`context` is unused:
        the attention's FLOPs are far below its KV bytes' time)."""
        cfg = self.base.config
        linear = sum(p.numel() for p in self.base.model.layers.parameters() if p.dim() == 2)
        return 2 * (linear + cfg.vocab_size * cfg.hidden_size)

    def prefill(self, kind: str, reps: int = 5):
        names = self.names
        adapters = (lambda i: None) if kind == "backbone" else (lambda i: names[(i * 16) % len(names)])
        cfg = self.base.config
        tokens, prompt = 2048, 256
        linear = sum(p.numel() for n, p in self.base.model.layers.named_parameters() if p.dim() == 2)
        # Causal attention: QK^T and PV over (prompt + 1) / 2 keys per query on average.
        attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * (prompt + 1) / 2
        flops = 2 * linear * tokens + attn
        times = []
        for rep in range(reps + 2):
            self._fill(tokens // prompt, adapters, lambda i: "never", prompt=prompt, new=2, seed=rep)
            torch.cuda.synchronize()
            t = time.perf_counter()
            self.engine.step()  # the whole 2,048-token prefill in one step
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
            self.engine.abort_all()
        median = statistics.median(times[2:])
        floor = flops / (self.tflops * 1e12) * 1e3
        self._fill(tokens // prompt, adapters, lambda i: "never", prompt=prompt, new=2, seed=reps + 2)
        prof = profile_steps(self.engine, steps=1)  # the same step under torch.profiler: where its GPU time goes
        self.engine.abort_all()
        self.record(phase="prefill", kind=kind, tokens=tokens, step_ms=round(median, 3), floor_ms=round(floor, 3),
                    vs_floor=round(median / floor, 2), **prof)

    def mixed(self, kind: str, decode: int = 200, prompts: int = 4, prompt: int = 206, reps: int = 5):
        """One step of `decode` decode rows and `prompts` new prompts of `prompt` tokens, timed from
        `step()` to the GPU's end (sync scheduling), against its floors."""
        names = self.names
        adapters = (lambda i: None) if kind == "backbone" else (lambda i: names[i % len(names)])
        engine = self.engine
        engine.async_scheduling = False
        self._fill(decode, adapters, lambda i: "never")
        while any(len(r.output) == 0 for r in engine.requests.values()):
            engine.step()
        decoding = set(engine.requests)
        times = []
        for rep in range(reps + 3):
            self._fill(prompts, lambda i: adapters(decode + i), lambda i: "never", prompt=prompt, new=2, seed=100 + rep)
            torch.cuda.synchronize()
            t = time.perf_counter()
            if rep == reps + 2:  # the last one under the profiler: where its GPU time goes
                prof = profile_steps(engine, steps=1)
            else:
                engine.step()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            for rid in set(engine.requests) - decoding:
                engine.abort(rid)
        median = statistics.median(times[2:])
        cfg, tokens = self.base.config, decode + prompts * prompt
        context = PROMPT + reps + 6
        kv = decode * context * self.model.runner.kv_bytes_per_token()
        active = len({adapters(i) for i in range(decode + prompts)} - {None})
        other_ms = (kv + active * self.adapter_bytes) / self.bandwidth * 1e3
        linear = sum(p.numel() for p in self.base.model.layers.parameters() if p.dim() == 2)
        gemm_flops = 2 * linear * tokens + 2 * cfg.vocab_size * cfg.hidden_size * (decode + prompts)
        heads = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        attn_flops = 4 * heads * prompts * prompt * (prompt + 1) / 2  # causal: (prompt + 1) / 2 keys per query
        to_ms = lambda flops: flops / (self.tflops * 1e12) * 1e3  # noqa: E731
        weights_ms = self.weight_bytes / self.bandwidth * 1e3
        floor_ms = max(weights_ms + other_ms, to_ms(gemm_flops + attn_flops))
        roofline_ms = max(weights_ms, to_ms(gemm_flops)) + other_ms + to_ms(attn_flops)
        engine.async_scheduling = True
        engine.abort_all()
        self.record(phase="mixed", kind=kind, decode_rows=decode, prompt_tokens=prompts * prompt, tokens=tokens,
                    step_ms=round(median, 3), floor_ms=round(floor_ms, 3), vs_floor=round(median / floor_ms, 2),
                    roofline_ms=round(roofline_ms, 3), vs_roofline=round(median / roofline_ms, 2), **prof)

    def drift(self, traces: int = 3, requests: int = 1024):
        before = self.decode(256, "lora", label="drift_before")
        rates = []
        for t in range(traces):
            workload = wl.build(requests, self.vocab, seed=t)
            ids = wl.assign(workload, ADAPTERS)
            reqs = [dict(prompt_ids=r.prompt, max_new_tokens=r.max_new_tokens, pad_token_id=0, adapter=self.names[i],
                         release="never") for r, i in zip(workload, ids)]
            self.engine.pool.reset_cache()  # each trace from a cold prefix cache
            start = time.perf_counter()
            self.engine.generate(reqs)
            rates.append(round(requests / (time.perf_counter() - start), 1))
        after = self.decode(256, "lora", label="drift_after")
        self.record(phase="drift", trace_req_s=rates, before_ms=before["step_ms"], after_ms=after["step_ms"],
                    change=round(after["step_ms"] / before["step_ms"] - 1, 3),
                    free_blocks=self.engine.pool.num_free)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="off",
                    help="LoRazorConfig.compile (default off: the probe's old eager rows; auto: the product's default)")
    ap.add_argument("--quantization", choices=("fp8",), default=None)
    ap.add_argument("--rank", type=int, default=8, help="the random adapters' rank (every one the same)")
    ap.add_argument("--model", choices=("llama-3.2-3b", "mistral-7b"), default="llama-3.2-3b", help="the shape")
    ap.add_argument("--defaults", action="store_true", help="the engine at EngineConfig's defaults (the KV pool "
                    "sized by gpu_memory_utilization, 512 seats, 4,096 tokens a step)")
    ap.add_argument("--phases", default="floors,warmup,decode,prefill,mixed,drift")
    ap.add_argument("--modes", default="async,sync", help="decode scheduling modes to measure, in order")
    ap.add_argument("--decode-rows", default="1:backbone,1:lora,256:backbone,256:lora,256:released,256:half",
                    help="the decode rows to measure: batch:kind (kind: backbone, lora, released, half, structured: "
                         "128 adapters, every other row under a JSON schema)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    probe = Probe(args)
    probe.record(phase="environment", **environment(), compile=probe.model.config.compile, rank=args.rank,
                 quantization=args.quantization, model=args.model, defaults=args.defaults,
                 kv_blocks=probe.engine.pool.num_blocks)
    try:
        probe.floors()
        if "warmup" in phases:
            probe.warm_up()
        if "decode" in phases:
            for spec in args.decode_rows.split(","):
                batch, kind = spec.split(":")
                probe.decode(int(batch), kind, modes=tuple(args.modes.split(",")))
        if "prefill" in phases:
            probe.prefill("backbone")
            probe.prefill("lora")
        if "mixed" in phases:
            probe.mixed("backbone")
            probe.mixed("lora")
        if "drift" in phases:
            probe.drift()
    finally:
        (args.out / f"step_roofline{args.tag}.json").write_text(json.dumps(probe.rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
