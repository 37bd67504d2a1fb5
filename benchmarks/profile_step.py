"""Where one decode step's GPU time goes: torch.profiler over a few eager decode steps.

    python benchmarks/profile_step.py --model llama-3.2-3b --adapters 128 [--compile]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_e2e import RANK, TARGETS, assign, build_base, fill_random_adapters  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-3b")
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile

    from lorazor import LoRazorConfig, LoRazorModel

    base = build_base(args.model)
    pm = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False),
                        adapter_name="a0").eval()
    model = LoRazorModel.from_peft(pm, LoRazorConfig(max_loras=args.adapters, cuda_graphs=False, compile=args.compile))
    names = ["a0"] + fill_random_adapters(model, 1, args.adapters - 1)
    B, T = args.batch, 128
    ids = torch.randint(3, base.config.vocab_size, (B, T), device="cuda")
    mask = torch.ones_like(ids)
    row_slot = model.bank.slots_for(assign(B, args.adapters, names), device="cuda")
    model.context.enabled = True
    cache = model.new_cache(B, 256, torch.device("cuda"))
    model.prefill(ids, mask, cache, row_slot)
    tok = ids[:, -1]
    pos = mask.sum(-1)
    for i in range(3):
        model.decode_step(tok, pos, torch.full((B,), T + i, device="cuda"), cache, row_slot)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            model.decode_step(tok, pos, torch.full((B,), T + 3 + i, device="cuda"), cache, row_slot)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    print(table)
    events = [e for e in prof.key_averages()]
    total = sum(e.device_time_total for e in events) / 3 / 1e3
    count = sum(e.count for e in events if e.device_time_total > 0) / 3
    print(f"GPU time per step {total:.2f} ms over {count:.0f} kernels (compile={args.compile})")


if __name__ == "__main__":
    main()
