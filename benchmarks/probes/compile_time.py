"""Probe: how long `compile=True` takes to compile the engine's steps, by model depth (CPU).

    python benchmarks/probes/compile_time.py --out /tmp/probe [--layers 2,8,28] [--tag _regional]

A tiny Llama (hidden 64, GQA, the three test adapters; `lorazor.tiny.tiny_peft_model(num_layers=...)`) at
each depth (28: Llama-3.2-3B's) serves the same staggered requests step by step on the CPU: LoRA
decode steps of 1 to 6 rows, then backbone-only steps as the LoRA requests end. Compilation happens
in the steps that first meet a new step kind, so the sum of the step times is the compile time
(the steps themselves take milliseconds). Each depth runs twice in fresh processes: with an empty
inductor cache ("cold", a first start) and again with the cache the first run left ("warm", a
restart on the same machine). On a GPU, inductor writes Triton instead of C++ kernels and the
engine also compiles its packed steps: read the ratios, not the seconds.
Writes `compile_time<tag>.json`: per run, the seconds of each step, their sum and dynamo's counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from common import environment  # noqa: E402


def child(layers: int) -> dict:
    """One run in this process: the compile seconds of the engine's steps at this depth."""
    import torch
    from torch._dynamo.utils import counters

    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
    from lorazor.tiny import tiny_peft_model

    torch.manual_seed(0)
    model = LoRazorModel.from_peft(tiny_peft_model("llama", num_layers=layers),
                                   LoRazorConfig(cuda_graphs=False, compile=True))
    engine = LoRazorEngine(model, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64)
    names = model.adapter_names
    seconds = []
    for i in range(6):
        engine.add_request([3, 4, 5, 6 + i], adapter=names[i % len(names)] if i < 4 else None, max_new_tokens=4 + i)
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        seconds.append(round(time.perf_counter() - start, 3))
    return dict(layers=layers, step_seconds=seconds, total_s=round(sum(seconds), 2),
                unique_graphs=counters["stats"]["unique_graphs"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--layers", default="2,8,28")
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [dict(phase="environment", **environment())]
    for layers in (int(n) for n in args.layers.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            for state in ("cold", "warm"):
                done = subprocess.run([sys.executable, __file__, "--child", str(layers)], env=env, check=True,
                                      capture_output=True, text=True)
                rows.append(dict(phase="compile", cache=state, **json.loads(done.stdout.strip().splitlines()[-1])))
                print(rows[-1], flush=True)
    path = args.out / f"compile_time{args.tag}.json"
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
