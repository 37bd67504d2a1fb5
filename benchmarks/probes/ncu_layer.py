"""One decoder layer's base GEMMs and merged `exact` LoRA kernels, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python benchmarks/ncu_layer.py --adapters 128

Llama-3.2-3B shape, M = 256 decode rows spread uniformly over L adapters of a 128-slot bank (the
model's setting, the grid bounded by the batch's slot class), the H200 config without PDL (ncu
serializes kernels anyway). Warm-up runs first; only the last layer's launches run between
`cudaProfilerStart` and `cudaProfilerStop`, so `--profile-from-start off` profiles exactly one
layer: per merged group its GEMM, shrink and expand. The hardware counters say what the timing
benchmarks cannot: each kernel's DRAM throughput against the peak, occupancy and warp stalls.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # probes, then benchmarks/
from bench_kernels import _merged_lora, base_weights, layer_pool, merged_pool, slot_map  # noqa: E402
from common import SHAPES  # noqa: E402
from lorazor_kernels import build_batch_meta, get_kernel_config, slot_bound_class  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=128, help="distinct adapters L in the batch")
    ap.add_argument("--model", default="llama-3.2-3b", choices=sorted(SHAPES))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bank = merged_pool(layer_pool(SHAPES[args.model], 128))
    weights = base_weights(bank)
    meta = build_batch_meta(slot_map("decode", args.adapters, gen), 128, "exact",
                            max_active_slots=slot_bound_class(args.adapters, 128))
    cfg = dataclasses.replace(get_kernel_config(torch.device("cuda")), pdl=False)

    def layer(i: int) -> None:
        for g, w in zip(bank[i], weights[i]):
            _merged_lora(g, g["x"] @ w.T, meta, cfg)

    for _ in range(3):
        for i in range(len(weights)):
            layer(i)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    layer(len(weights) - 1)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
