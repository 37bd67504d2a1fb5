"""Adapters from folders on the GPU: registration, loads into slots, decode while loading, slot memory.

    python benchmarks/bench_adapters.py --out benchmarks/results/adapters [--registrations 1000]

Llama-3.2-3B shape with random bf16 weights (as bench_e2e.py), rank-8 adapters on all 7
projections saved as PEFT folders (`adapter_config.json` + `adapter_model.safetensors`). Eight
distinct weight files are written; the other folders hard-link them (registration reads only the
config and the safetensors header, and a load copies whatever the file holds, so timings do not
depend on the values). Everything is measured in this one run:
- registration: `register_adapter` per folder (median, P90);
- the copy floor: a pinned host -> GPU copy of 1 GiB;
- a batch of `--batch` rows over 128 adapters of which 64 are not in a slot: the time to make them
  resident, from host copies (max_cpu_loras) and from disk, against the bytes over the floor;
- the decode step of that batch (CUDA graphs), with and without one adapter load per step running
  on the side stream into slots the batch does not use;
- GPU memory the slots hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import build_base, decode_rate  # noqa: E402
from common import environment, write_results  # noqa: E402

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DISTINCT_FILES = 8


def write_folders(base, root: Path, count: int, targets=TARGETS, distinct: int = DISTINCT_FILES) -> list[Path]:
    """`count` PEFT adapter folders over `distinct` weight files (hard links beyond those)."""
    from safetensors.torch import save_file

    linears = {n: m for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in targets}
    g = torch.Generator().manual_seed(0)
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": list(targets),
              "task_type": "CAUSAL_LM"}
    folders = []
    for i in range(count):
        folder = root / f"a{i:04d}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(config))
        if i < distinct:
            tensors = {}
            for name, lin in linears.items():
                a = torch.randn(RANK, lin.in_features, generator=g) / lin.in_features**0.5
                b = torch.randn(lin.out_features, RANK, generator=g) * 0.01
                tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(torch.bfloat16)
            save_file(tensors, str(folder / "adapter_model.safetensors"))
        else:
            os.link(folders[i % distinct] / "adapter_model.safetensors", folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders


def copy_floor_gbs(nbytes: int = 1 << 30) -> float:
    """Pinned host -> GPU copy bandwidth (GB/s), median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:]) / 1e9


def timed_resident(model, names) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.registry.make_resident(names)
    torch.cuda.synchronize()
    return time.perf_counter() - start


class LoadEachStep:
    """Benchmark hook (a logits processor): start one adapter load per decode step on the side stream,
    into slots the batch does not use. It reaches the registry directly, which LoRazor's own API
    refuses inside a running generate."""

    def __init__(self, registry, pool: list[str], batch: list[str]):
        self.registry, self.pool, self.batch, self.next = registry, pool, batch, 0

    def __call__(self, input_ids, scores):
        name = self.pool[self.next % len(self.pool)]
        self.next += 1
        self.registry.prefetch([name], protected=self.batch)
        return scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/adapters"))
    ap.add_argument("--model", default="llama-3.2-3b")
    ap.add_argument("--registrations", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    from lorazor import LoRazorConfig, LoRazorModel

    meta = {**environment(), "command": " ".join(sys.argv), "rank": RANK, "targets": TARGETS}
    rows = []
    base = build_base(args.model)
    root = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    folders = write_folders(base, root, args.registrations)
    print(f"wrote {len(folders)} folders in {time.perf_counter() - start:.1f} s", flush=True)

    # 128 adapters in the batch + 64 slots that loads can churn.
    slots = 192
    before = torch.cuda.memory_allocated()
    config = LoRazorConfig(max_loras=slots, max_lora_rank=RANK, max_cache_len=args.prompt + args.new)
    model = LoRazorModel.from_pretrained(base, adapters={}, config=config)
    slot_bytes = torch.cuda.memory_allocated() - before
    rows.append({"what": "slot memory", "max_loras": slots, "GB": slot_bytes / 1e9,
                 "per_slot_MB": slot_bytes / slots / 1e6})

    times = []
    for i, folder in enumerate(folders):
        t0 = time.perf_counter()
        model.register_adapter(folder.name, folder)
        times.append(time.perf_counter() - t0)
    times.sort()
    rows.append({"what": "registration", "count": len(times), "median_ms": statistics.median(times) * 1e3,
                 "p90_ms": times[int(0.9 * len(times))] * 1e3, "max_ms": times[-1] * 1e3})
    print(rows[-1], flush=True)

    names = [f.name for f in folders]
    floor = copy_floor_gbs()
    # Slots 0-191 hold names[0:192]; the batch uses names[0:64] (resident) + names[192:256] (not).
    timed_resident(model, names[:slots])
    image_bytes = model.registry.entries[names[0]].image.nbytes
    for name in names[192:256]:
        model.registry._image(name)  # host copies (max_cpu_loras=None keeps them all)
    batch_names = names[:64] + names[192:256]
    took = timed_resident(model, batch_names)
    floor_s = 64 * image_bytes / (floor * 1e9)
    rows.append({"what": "64 loads from host copies", "s": took, "floor_s": floor_s, "vs_floor": took / floor_s,
                 "image_MB": image_bytes / 1e6, "copy_floor_GBs": floor})
    print(rows[-1], flush=True)
    took = timed_resident(model, names[:64] + names[256:320])
    rows.append({"what": "64 loads from disk (read + pack + copy)", "s": took, "floor_s": floor_s,
                 "vs_floor": took / floor_s})
    print(rows[-1], flush=True)

    # Decode: 256 rows over 128 resident adapters; loads into the other 64 slots, one per step.
    batch_names = names[:128]
    timed_resident(model, batch_names)
    pool = names[320:320 + 64]
    for name in pool:
        model.registry._image(name)
    B, T = args.batch, args.prompt
    ids = torch.randint(3, 1000, (B, T), device="cuda")
    mask = torch.ones_like(ids)
    adapter_ids = [batch_names[i % len(batch_names)] for i in range(B)]

    def gen(hook):
        return lambda n: model.generate(ids, attention_mask=mask, adapter_ids=adapter_ids, max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=0,
                                        logits_processor=[hook] if hook else None)

    for label, hook in (("decode, no loads", None), ("decode, one load per step", "load"),
                        ("decode, no loads (again)", None)):
        loader = LoadEachStep(model.registry, pool, batch_names) if hook else None
        rate = decode_rate(gen(loader), B, args.new)
        rows.append({"what": label, "step_ms": rate["step_ms"], "decode_tok_s": rate["decode_tok_s"],
                     "loads": loader.next if loader else 0})
        print(rows[-1], flush=True)
    base_ms = statistics.mean(r["step_ms"] for r in rows if r["what"].startswith("decode, no loads"))
    for r in rows:
        if r["what"] == "decode, one load per step":
            r["vs_no_loads"] = r["step_ms"] / base_ms

    table = "| what | numbers |\n|---|---|\n" + "\n".join(
        f"| {r['what']} | " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in r.items() if k != "what") + " |" for r in rows)
    table = f"# Adapters on the GPU ({meta.get('gpu', '?')}, {meta['commit']})\n\n`{meta['command']}`\n\n{table}\n"
    write_results(args.out, f"adapters_{args.model}", rows, meta, table)
    print(table)


if __name__ == "__main__":
    main()
