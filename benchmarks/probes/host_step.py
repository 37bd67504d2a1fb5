"""Probe: the engine's host time per decode step, as the outputs grow (CPU; no GPU needed).

    python benchmarks/probes/host_step.py --out /tmp/probe [--batch 256] [--lengths 100,500,1000,2000] [--stop-strings]

The model's forward is replaced by a stub that returns fixed logits at once, so what is timed is
everything else a step does on the host: scheduling, block tables, input preparation, sampling of
the stub's logits, the read-back, stop checks and one `RequestOutput` per request. `batch` requests
decode together (a tiny Llama, no adapter, step by step: on a GPU, async scheduling overlaps this
time with the GPU's step; it must stay below it). With `--stop-strings`, the testbed's backbone and
tokenizer, and every request has a stop string that never matches (OpenAI's `stop`). Writes
`host_step[_stop_strings].json`: the median of 30 steps after the outputs reach each length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from common import environment  # noqa: E402


def stub_paged_steps(config) -> None:
    """Replace the runner's paged step with one that returns fixed logits at once (token 5 for
    every row): what remains of an engine step is the host's work."""
    from lorazor.runner.runner import ModelRunner

    def stub_step(self, cache, inputs, block_tables, graphs=None, pending=None):
        n = len(inputs.chunks)
        logits = torch.zeros(n, config.vocab_size)
        logits[:, 5] = 1
        return logits, torch.zeros(n, config.hidden_size)

    ModelRunner.run_paged_step = stub_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lengths", default="100,500,1000,2000")
    ap.add_argument("--stop-strings", action="store_true",
                    help="the testbed's backbone and tokenizer, every request with a stop string (OpenAI's `stop`)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorazor import LoRazorEngine, LoRazorModel

    extra = {}
    if args.stop_strings:  # a real tokenizer for the strings: the testbed's
        from lorazor.testbed import ASSETS, load_tokenizer

        base = LlamaForCausalLM.from_pretrained(ASSETS / "backbone").eval()
        base.config.max_position_embeddings = 4096
        config = base.config
        extra = dict(stop_strings=["<never seen>"], tokenizer=load_tokenizer())
    else:
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
        base = LlamaForCausalLM(config).eval()
    model = LoRazorModel.from_pretrained(base)

    stub_paged_steps(config)
    longest = max(lengths) + 40
    eng = LoRazorEngine(model, max_num_seqs=args.batch, max_num_batched_tokens=64 * args.batch,
                        num_kv_blocks=args.batch * (-(-(longest + 64) // 16) + 1), max_model_len=longest + 64,
                        async_scheduling=False)
    for _ in range(args.batch):
        eng.add_request(list(range(3, 67)), max_new_tokens=longest, pad_token_id=0, eos_token_id=None, **extra)
    first = next(iter(eng.requests.values()))
    rows = []
    for length in lengths:
        while len(first.output) < length:
            eng.step()
        times = []
        for _ in range(30):
            start = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - start) * 1e3)
        rows.append(dict(batch=args.batch, output_tokens=length, stop_strings=args.stop_strings,
                         host_ms=round(statistics.median(times), 3)))
        print(json.dumps(rows[-1]), flush=True)
    result = dict(environment=environment(), rows=rows)
    name = f"host_step{'_stop_strings' if args.stop_strings else ''}.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
