"""Probe: one adapter load into a GPU slot against its copy floor (issue #56).

    python benchmarks/probes/adapter_load.py --out /tmp/probe

The Llama-3.2-3B shape's bank (rank 8 on all 7 projections of 28 layers, q/k/v and gate/up laid out
merged as the model lays them out; 24.3 MB a slot), 64 adapters packed in pinned host memory: the
wall time of 64 `bank.write` calls (the loads from host copies) to the GPU's end, against the pinned
host-to-device copy floor (the same bytes in one copy, timed the same way). Writes `adapter_load.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from common import environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--loads", type=int, default=64)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor.adapters import AdapterWeights
    from lorazor.lora.bank import AdapterBank

    H, inter, kv, layers, r = 3072, 8192, 1024, 28, 8
    sizes = {}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        sizes.update({p + "self_attn.q_proj": (H, H), p + "self_attn.k_proj": (H, kv), p + "self_attn.v_proj": (H, kv),
                      p + "self_attn.o_proj": (H, H), p + "mlp.gate_proj": (H, inter), p + "mlp.up_proj": (H, inter),
                      p + "mlp.down_proj": (inter, H)})
    stub = {n: types.SimpleNamespace(in_features=k, out_features=m,
                                     weight=torch.empty(0, dtype=torch.bfloat16, device="cuda"))
            for n, (k, m) in sizes.items()}
    bank = AdapterBank.empty(stub, args.loads, r)
    groups = [[f"model.layers.{i}.self_attn.{m}_proj" for m in "qkv"] for i in range(layers)]
    groups += [[f"model.layers.{i}.mlp.{m}_proj" for m in ("gate", "up")] for i in range(layers)]
    bank.lay_out(groups)
    g = torch.Generator().manual_seed(0)
    images = [bank.pack(AdapterWeights({n: (torch.randn(r, k, generator=g).bfloat16(),
                                            torch.randn(m, r, generator=g).bfloat16(), 2.0)
                                        for n, (k, m) in sizes.items()})) for _ in range(2)]
    bank.write(0, "warm", images[0])  # the first write allocates what later ones reuse
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.loads):
        bank.write(i, f"a{i}", images[i % 2])
    torch.cuda.synchronize()
    loads_s = time.perf_counter() - start
    dst = torch.empty_like(images[0].weights, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(args.loads):
        dst.copy_(images[i % 2].weights, non_blocking=True)
    torch.cuda.synchronize()
    floor_s = time.perf_counter() - start
    ok = torch.equal(bank.storage[3].cpu(), images[1].weights)
    row = dict(environment(), probe="adapter_load", loads=args.loads, slot_mb=round(images[0].nbytes / 1e6, 2),
               loads_s=round(loads_s, 4), per_load_ms=round(loads_s / args.loads * 1e3, 3),
               copy_floor_s=round(floor_s, 4),
               pinned_copy_gb_s=round(images[0].weights.nbytes * args.loads / floor_s / 1e9, 1),
               vs_floor=round(loads_s / floor_s, 2), slot_equals_image=ok)
    print(json.dumps(row), flush=True)
    (args.out / "adapter_load.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
