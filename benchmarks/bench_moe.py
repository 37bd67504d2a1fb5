"""A mixture-of-experts backbone under many adapters (issue #66): decode against its bytes floor,
LoRazor against its own backbone, prefill against its FLOPs floor, and a request trace.

    python benchmarks/bench_moe.py --out $OUT [--layers 8] [--adapters 64] [--rank 16] [--tiny]
        [--phases decode,prefill,trace] [--batches 1,256]

The Qwen3-30B-A3B shape (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top-8,
vocabulary 151,936) with random bf16 weights and `--layers` of its 48 decoder layers (the whole
model and 64 adapters on its experts do not fit one 80 GB card: every floor below counts the layers
that run). Adapters: rank `--rank` on q/k/v/o and on every expert's gate/up/down, random weights,
`max_loras` = the adapter count, the engine at its defaults otherwise (compiled on a GPU, its KV
pool sized by `gpu_memory_utilization`).

- floors: read bandwidth (a graph-timed reduction over 4 GiB) and bf16 matmul TFLOPS, this run;
- decode at batch 1 and 256, backbone rows and adapter rows (row i uses adapter i % adapters, never
  released): the median engine step against the bytes the step reads: attention and router weights,
  the experts its tokens chose (counted from the router's picks of a forward of the same batch
  size), the LM head, the KV cache, and per (adapter, expert) pair in use that expert's adapter
  slice plus each adapter's attention LoRA;
- prefill: one engine step of 8 prompts of 512 tokens against 2 x (active parameters per token) x
  tokens plus the causal attention's FLOPs at the measured TFLOPS;
- trace: 512 requests (128-token prompts, 64 tokens out, EOS ignored) all queued at once, for the
  backbone, LoRA kept (`exact`), and StepTrim (every request releases after 8 decode steps), each
  system after an unmeasured pass of every system (one-time costs out of the timings).
On a GPU each decode and prefill row carries a torch.profiler breakdown of its steps (kernels per
step, GPU ms by category, the ten heaviest kernels). Writes `moe.json` (rows with the environment)
and `moe.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "probes")]
from common import environment  # noqa: E402
from step_roofline import matmul_tflops, profile_steps, read_bandwidth  # noqa: E402

QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151936)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
            intermediate_size=96, num_experts=8, num_experts_per_tok=2, vocab_size=512)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# Kernels each profile lists by time (a 4-layer step launches ~40 distinct ones: all of them, so a
# profile says where every launch of a launch-bound step comes from).
KERNELS_LISTED = 60


def build(args):
    """(LoRazorModel with `args.adapters` adapters registered, the HF config)."""
    from lorazor import LoRazorConfig, LoRazorModel
    from lorazor.lora.types import AdapterWeights
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = TINY if args.tiny else QWEN3_30B_A3B
    config = Qwen3MoeConfig(**shape, num_hidden_layers=args.layers, max_position_embeddings=4096, norm_topk_prob=True,
                            eos_token_id=None, pad_token_id=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model = LoRazorModel.from_pretrained(hf_model, config=LoRazorConfig(max_loras=args.adapters,
                                                                        max_lora_rank=args.rank,
                                                                        quantization=args.quantization))
    g = torch.Generator().manual_seed(1)
    # One random A and B per module shared by every adapter (their values do not change the speed).
    modules = {name: (torch.randn(args.rank, k, generator=g, dtype=dtype) * 0.01,
                      torch.randn(n, args.rank, generator=g, dtype=dtype) * 0.01, 2.0)
               for name, (k, n) in model.bank.module_sizes.items()
               if name.endswith(ATTENTION) or ".experts." in name}
    for i in range(args.adapters):
        model.registry.add_loaded(f"a{i}", AdapterWeights(modules))
    return model, config


def active_experts(model, config, batch: int, adapters: int) -> tuple[list[int], list[int]]:
    """Per layer: distinct experts its router picks for `batch` random hidden states, and distinct
    (adapter, expert) pairs when row i uses adapter i % adapters."""
    experts, pairs = [], []
    g = torch.Generator(device=model.device).manual_seed(batch)
    with torch.inference_mode():
        for layer in model.model.get_decoder().layers:
            hidden = torch.randn(batch, config.hidden_size, generator=g, device=model.device, dtype=model.runner.dtype)
            index = layer.mlp.gate(hidden)[2]  # [batch, k]
            experts.append(int(index.unique().numel()))
            rows = torch.arange(batch, device=index.device)[:, None].expand_as(index) % adapters
            pairs.append(int((rows * config.num_experts + index).unique().numel()))
    return experts, pairs


def weight_bytes(config, experts_per_layer: list[int], element: int = 2, decoder_element: int | None = None) -> int:
    """The bytes of the weights a step reads: `decoder_element` bytes per decoder projection and expert
    weight (1 with fp8 weights; default `element`), `element` for the router and the LM head."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    decoder_element = element if decoder_element is None else decoder_element
    projections = h * q + 2 * h * kv + q * h  # q, k, v, o
    expert = 3 * h * config.moe_intermediate_size
    return (decoder_element * sum(projections + e * expert for e in experts_per_layer)
            + element * (len(experts_per_layer) * config.num_experts * h + config.vocab_size * h))


def adapter_bytes(config, rank: int, pairs_per_layer: list[int], adapters: int, element: int = 2) -> int:
    h, q, kv, i = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim, config.moe_intermediate_size
    attention = rank * ((h + q) * 2 + (h + kv) * 2)  # q, o and k, v: A [r, K] + B [N, r]
    expert = rank * (3 * (h + i))  # gate and up: h -> i; down: i -> h
    return element * sum(adapters * attention + p * expert for p in pairs_per_layer)


def decode_ms(engine, batch: int, adapter_of, steps: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(torch.randint(3, vocab, (64,), generator=g).tolist(), adapter=adapter_of(i),
                           max_new_tokens=steps + 40, release="never" if adapter_of(i) else None)
    while any(len(r.output) == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    # Where the step's time goes: kernels by category and the ten heaviest (GPU only).
    profile = profile_steps(engine, 5, cpu=False, top=KERNELS_LISTED) if torch.cuda.is_available() else {}
    engine.abort_all()
    return statistics.median(times), profile


def prefill_ms(engine, vocab: int, prompts: int = 8, length: int = 512) -> float:
    g = torch.Generator().manual_seed(7)
    times = []
    for _ in range(3):
        for _ in range(prompts):
            engine.add_request(torch.randint(3, vocab, (length,), generator=g).tolist(), max_new_tokens=1)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
        while engine.has_unfinished():
            engine.step()
    profile = {}
    if torch.cuda.is_available():  # one more prefill step, profiled
        for _ in range(prompts):
            engine.add_request(torch.randint(3, vocab, (length,), generator=g).tolist(), max_new_tokens=1)
        profile = profile_steps(engine, 1, cpu=False, top=KERNELS_LISTED)
        while engine.has_unfinished():
            engine.step()
    return min(times[1:]), profile


def trace(engine, vocab: int, adapters: int, system: str, requests: int) -> dict:
    g = torch.Generator().manual_seed(11)
    for i in range(requests):
        adapter = None if system == "backbone" else f"a{i % adapters}"
        engine.add_request(torch.randint(3, vocab, (128,), generator=g).tolist(), adapter=adapter, max_new_tokens=64,
                           release=None if adapter is None else (8 if system == "steptrim" else "never"))
    start = time.perf_counter()
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    wall = time.perf_counter() - start
    return dict(req_s=round(requests / wall, 2), tok_s=round(sum(len(o.token_ids) for o in outs) / wall, 1))


def significant(ms: float) -> float:
    """A floor to 4 significant digits: a tiny model's (tests, `--tiny`) is microseconds on a GPU,
    which three decimals of a millisecond would round to zero."""
    return float(f"{ms:.4g}")


def decode_rows(engine, model, config, args, bandwidth: float, record) -> None:
    """Decode at each batch of `--batches`, backbone rows and adapter rows, against their bytes floors."""
    per_token_kv = model.runner.kv_bytes_per_token()
    for batch in (int(b) for b in args.batches.split(",")):
        experts, pairs = active_experts(model, config, batch, args.adapters)
        kv = batch * (64 + 30) * per_token_kv
        weights = weight_bytes(config, experts, decoder_element=1 if args.quantization else 2)
        base_floor = (weights + kv) / bandwidth * 1e3
        lora_floor = base_floor + adapter_bytes(config, args.rank, pairs, min(batch, args.adapters)) / bandwidth * 1e3
        backbone, backbone_profile = decode_ms(engine, batch, lambda i: None, 30, config.vocab_size)
        lora, lora_profile = decode_ms(engine, batch, lambda i: f"a{i % args.adapters}", 30, config.vocab_size)
        record(phase="decode", batch=batch, experts_per_layer=round(sum(experts) / len(experts), 1),
               adapter_expert_pairs_per_layer=round(sum(pairs) / len(pairs), 1), backbone_ms=round(backbone, 3),
               backbone_floor_ms=significant(base_floor), backbone_vs_floor=round(backbone / base_floor, 2),
               lora_ms=round(lora, 3), lora_floor_ms=significant(lora_floor), lora_vs_floor=round(lora / lora_floor, 2),
               lora_vs_backbone=round(lora / backbone, 2), backbone_profile=backbone_profile,
               lora_profile=lora_profile)


def prefill_row(engine, config, tflops: float, record) -> None:
    """One 8 x 512-token prefill step against 2 x active parameters x tokens + causal attention FLOPs."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    active = config.num_hidden_layers * (h * q * 2 + 2 * h * kv + config.num_experts * h
                                         + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size)
    tokens, length = 8 * 512, 512
    attention = config.num_hidden_layers * 8 * 2 * length * length * q  # causal QK^T and PV: 4 T^2 d / 2 each
    flops = 2 * active * tokens + attention + 2 * 8 * h * config.vocab_size
    measured, prefill_profile = prefill_ms(engine, config.vocab_size)
    floor = flops / (tflops * 1e12) * 1e3
    record(phase="prefill", tokens=tokens, ms=round(measured, 2), flops_floor_ms=round(floor, 2),
           vs_floor=round(measured / floor, 2), profile=prefill_profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (a CPU check of the script)")
    parser.add_argument("--phases", default="decode,prefill,trace", help="which measurements to run")
    parser.add_argument("--batches", default="1,256", help="decode batch sizes")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="fp8 base weights (attention projections and experts; the floors count 1 byte each)")
    parser.add_argument("--warmup-sizes", default=None,
                        help="decode batch sizes warm_up captures, e.g. 1,256 (default: all, as the engine does)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor import LoRazorEngine

    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    cuda = torch.cuda.is_available()
    bandwidth, tflops = (read_bandwidth(), matmul_tflops()) if cuda else (1e11, 1.0)
    record(phase="floors", read_gb_s=round(bandwidth / 1e9, 1), matmul_tflops=round(tflops, 1))
    start = time.perf_counter()
    model, config = build(args)
    engine = LoRazorEngine(model)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    sizes = None if args.warmup_sizes is None else [int(b) for b in args.warmup_sizes.split(",")]
    graphs = engine.warm_up(sizes)
    record(phase="setup", build_s=round(build_s, 1), warmup_s=round(time.perf_counter() - start, 1), graphs=graphs,
           compile=model.config.compile, layers=args.layers, adapters=args.adapters, rank=args.rank,
           bank_gb=round(model.bank.storage.nbytes / 1e9, 2), kv_blocks=engine.pool.num_blocks)
    phases = set(args.phases.split(","))
    if "decode" in phases:
        decode_rows(engine, model, config, args, bandwidth, record)
    if "prefill" in phases:
        prefill_row(engine, config, tflops, record)
    if "trace" in phases:
        requests = args.requests if cuda else 16
        # One unmeasured pass of each system first: the first trace of a process pays one-time costs
        # (the lazy captures of batch sizes warm_up left out, new compiled shapes) that made a backbone
        # measured first look slower than StepTrim measured after it (H100, e4b023d: 555 vs 902 req/s).
        for system in ("backbone", "exact", "steptrim"):
            trace(engine, config.vocab_size, args.adapters, system, min(requests, 64))
        for system in ("backbone", "exact", "steptrim"):
            record(phase="trace", system=system, requests=requests, **trace(engine, config.vocab_size, args.adapters,
                                                                              system, requests))
    meta = dict(environment(), command="python benchmarks/bench_moe.py " + " ".join(sys.argv[1:]))
    (args.out / "moe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# MoE under adapters ({meta.get('gpu', 'cpu')}, {meta['commit']})", "", f"`{meta['command']}`", "",
             "| phase | row |", "|---|---|"]
    lines += [f"| {r['phase']} | {', '.join(f'{k}={v}' for k, v in r.items() if k != 'phase' and 'profile' not in k)} |"
              for r in rows]
    lines += ["", "Profiles (GPU ms per step by kernel category, the heaviest kernels): `moe.json`."]
    (args.out / "moe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
