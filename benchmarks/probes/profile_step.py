"""Where one decode step's GPU time goes: backbone-only against LoRA, kernel by kernel.

    python benchmarks/profile_step.py --model llama-3.2-3b --adapters 128 [--compile] [--no-graphs] [--repeat 3]

Runs `generate` as a user does (CUDA graphs on unless --no-graphs), profiles a call of 1 and of
`--new` tokens, and takes the difference: what remains is `--new - 1` decode steps, prefill and
setup cancel out. Per kernel name: launches and GPU microseconds per step, for the backbone-only
call and the LoRA call, then their difference. The last lines compare the step's wall time with
its summed kernel time; the rest is the time between kernels (launch gaps inside the graph).
Per-kernel times under the profiler spread by tens of microseconds between calls: `--repeat N`
profiles N times and reports each kernel's median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # probes, then benchmarks/
from bench_e2e import RANK, TARGETS, assign, build_base, fill_random_adapters  # noqa: E402
from common import environment, timed  # noqa: E402


def kernel_times(fn, trace: list | None = None) -> tuple[Counter, Counter]:
    """(microseconds, launches) per GPU kernel name over one call of `fn`; `trace` gets every
    kernel's (start us, name, us) in launch order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    us, count = Counter(), Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us[event.name] += event.time_range.elapsed_us()
            count[event.name] += 1
            if trace is not None:
                trace.append((event.time_range.start, event.name, event.time_range.elapsed_us()))
    if trace is not None:
        trace.sort()
    return us, count


def per_step(gen, new: int, trace: list | None = None, repeat: int = 1) -> tuple[Counter, Counter, float]:
    """Per decode step: (us per kernel name, launches per kernel name, wall ms); with `repeat` > 1
    each kernel's median over that many profiled pairs of calls."""
    gen(1), gen(2), gen(new)  # capture and compile outside the measurement
    steps = new - 1
    samples = []
    for i in range(repeat):
        us_1, n_1 = kernel_times(lambda: gen(1))
        us_n, n_n = kernel_times(lambda: gen(new), trace if i == repeat - 1 else None)
        samples.append(Counter({k: (us_n[k] - us_1[k]) / steps for k in us_n}))
    us = Counter({k: statistics.median(s[k] for s in samples) for k in samples[-1]})
    count = Counter({k: (n_n[k] - n_1[k]) / steps for k in n_n})
    wall = (timed(lambda: gen(new)) - timed(lambda: gen(1))) / steps * 1e3
    return us, count, wall


def short(name: str, width: int = 150) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-3b")
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--rows", type=int, default=30, help="kernel names shown, largest difference first")
    ap.add_argument("--repeat", type=int, default=1, help="profiled calls per setup; per-kernel medians")
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model

    from lorazor import LoRazorConfig, LoRazorModel

    base = build_base(args.model)
    pm = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False),
                        adapter_name="a0").eval()
    model = LoRazorModel.from_peft(pm, LoRazorConfig(
        max_loras=args.adapters, max_batch_size=args.batch, max_cache_len=args.prompt + args.new,
        cuda_graphs=not args.no_graphs, compile=args.compile))
    names = ["a0"] + fill_random_adapters(model, 1, args.adapters - 1)
    B = args.batch
    ids = torch.randint(3, base.config.vocab_size, (B, args.prompt), device="cuda")
    mask = torch.ones_like(ids)

    def gen(adapter_ids):
        return lambda n: model.generate(ids, attention_mask=mask, adapter_ids=adapter_ids, max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=0)

    print(environment(), f"compile={args.compile} graphs={not args.no_graphs}", flush=True)
    base_us, base_n, base_wall = per_step(gen([None] * B), args.new, repeat=args.repeat)
    trace = []
    lora_us, lora_n, lora_wall = per_step(gen(assign(B, args.adapters, names)), args.new, trace, args.repeat)
    layers = model.model.config.num_hidden_layers
    print(f"\nper decode step, batch {B}, {args.adapters} adapters, {layers} layers "
          f"(us{', median of %d profiles' % args.repeat if args.repeat > 1 else ''}; launches in brackets)\n")
    print("| kernel | backbone | LoRA | LoRA - backbone |\n|---|---|---|---|")
    names_all = set(base_us) | set(lora_us)
    for name in sorted(names_all, key=lambda k: -abs(lora_us[k] - base_us[k]))[: args.rows]:
        print(f"| {short(name)} | {base_us[name]:.1f} [{base_n[name]:.0f}] | {lora_us[name]:.1f} [{lora_n[name]:.0f}] "
              f"| {lora_us[name] - base_us[name]:+.1f} |")
    for label, us, count, wall in (("backbone", base_us, base_n, base_wall), ("LoRA", lora_us, lora_n, lora_wall)):
        busy = sum(us.values()) / 1e3
        print(f"{label}: wall {wall:.3f} ms/step, kernels {busy:.3f} ms over {sum(count.values()):.0f} launches, "
              f"between kernels {wall - busy:.3f} ms")
    # One layer in the middle of the last decode step, in launch order: each LoRA launch in place.
    lora_at = [i for i, (_, name, _) in enumerate(trace) if name.startswith("_lora_")]
    if len(lora_at) >= 8 * layers:
        middle = lora_at[-8 * (layers // 2)]
        print("\none layer, in launch order (us; LoRA launches marked *):")
        for _, name, us in trace[middle - 3: middle + 20]:
            print(f"  {'*' if name.startswith('_lora_') else ' '} {us:7.1f}  {short(name, 90)}")
    # The last decode step outside its layers: what runs before its first LoRA launch (the previous
    # step's tail, then this step's head: release decision, metadata, embedding) and after its last
    # (LM head), each with the idle gap before it.
    if len(lora_at) >= 8 * layers:
        first, last = lora_at[-8 * layers], lora_at[-1]
        print("\nlast step outside its layers (us: gap before, kernel; LoRA launches marked *):")
        for i in [*range(max(first - 24, 1), first + 1), *range(last, min(last + 8, len(trace)))]:
            start, name, us = trace[i]
            gap = start - (trace[i - 1][0] + trace[i - 1][2])
            print(f"  {'*' if name.startswith('_lora_') else ' '} {gap:7.1f} {us:7.1f}  {short(name, 90)}")
    extra = lora_wall - base_wall
    print(f"LoRA adds {extra:.3f} ms/step = {extra * 1e3 / layers:.1f} us/layer "
          f"(kernels {(sum(lora_us.values()) - sum(base_us.values())) / layers:.1f} us/layer, "
          f"{(sum(lora_n.values()) - sum(base_n.values())) / layers:.1f} launches/layer)")


if __name__ == "__main__":
    main()
