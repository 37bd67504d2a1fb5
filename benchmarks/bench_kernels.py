"""Per-layer LoRA kernel time (7 projections) for every grid mode, against the memory floor.

    python benchmarks/bench_kernels.py --out benchmarks/results [--sweep]

M = 256 decode rows spread uniformly over L adapters (L in 1..128), rank 8, bf16, plus a mixed
case (192 prefill rows of one adapter + 64 decode rows over the others). Every grid mode runs
shrink + expand per projection; `full` and `exact` also run the model's default layout (q/k/v and
gate/up merged), `exact` also in a 128-slot bank with and without the distinct-adapter bound, and
with the per-slot rank load (mixed-rank banks). Each layer's LoRA ops
are captured in one CUDA graph over a pool of distinct layers (so weights come from HBM, not L2)
and replayed; the step metadata is built once outside, as in a model step.
Floor = (active adapters' A and B bytes + x read once + y read and written) / measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, copy_bandwidth, environment, projections, time_graph, write_results  # noqa: E402
from lorazor_kernels import (  # noqa: E402
    GRID_MODES,
    KernelConfig,
    add_batched_lora_,
    build_batch_meta,
    get_kernel_config,
    slot_bound_class,
)

# Projections that share an input and can run as one merged shrink + one segmented expand.
MERGED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))

RANK = 8
M = 256
L2_BYTES = 60e6


def slot_map(case: str, L: int, gen: torch.Generator) -> torch.Tensor:
    if case == "decode":
        slots = torch.arange(M) % L
    else:  # mixed: 192 prefill rows of slot 0, 64 decode rows over the other slots
        slots = torch.cat([torch.zeros(192, dtype=torch.long), 1 + torch.arange(64) % (L - 1)])
    return slots[torch.randperm(M, generator=gen)].cuda()


def layer_pool(shape: dict, L: int):
    """Enough distinct layers that the pool is ~3x the L2, each with 7 projections' weights."""
    per_layer = sum(L * RANK * (k + n) * 2 for k, n in projections(shape).values())
    n_layers = max(2, min(16, math.ceil(3 * L2_BYTES / per_layer)))
    layers = []
    for _ in range(n_layers):
        projs = {}
        for name, (k, n) in projections(shape).items():
            projs[name] = dict(
                a=torch.randn(L, RANK, k, device="cuda", dtype=torch.bfloat16) / k**0.5,
                # The bank's layout: stored [L, r, N], used as a [L, N, r] view.
                b=(torch.randn(L, RANK, n, device="cuda", dtype=torch.bfloat16) / RANK**0.5).transpose(1, 2),
                s=torch.ones(L, device="cuda"), r=torch.full((L,), RANK, dtype=torch.int32, device="cuda"),
                x=torch.randn(M, k, device="cuda", dtype=torch.bfloat16),
                y=torch.randn(M, n, device="cuda", dtype=torch.bfloat16),
            )
        layers.append(projs)
    return layers


def floor_us(shape: dict, active: int, bandwidth: float) -> float:
    total = 0
    for k, n in projections(shape).values():
        total += active * RANK * (k + n) * 2 + M * k * 2 + 2 * M * n * 2
    return total / bandwidth * 1e6


def time_mode(layers, meta, cfg, mask_rank: bool = False) -> float:
    """us per layer. mask_rank=False as the model runs a bank of uniform-rank adapters."""
    def run():
        for projs in layers:
            for p in projs.values():
                add_batched_lora_(p["y"], p["x"], p["a"], p["b"], p["s"], p["r"], meta, cfg=cfg, mask_rank=mask_rank)
    return time_graph(run) * 1e3 / len(layers)


def merged_pool(layers):
    """The same weights as merged projections: per group, A stacked [L, G*r, K], B [L, r, sum N] (as a
    [L, sum N, r] view), scaling [G, L], one output y [M, sum N]."""
    pool = []
    for projs in layers:
        groups = []
        for names in MERGED_GROUPS:
            ps = [projs[n] for n in names]
            widths = [p["b"].shape[1] for p in ps]
            groups.append(dict(
                x=ps[0]["x"], a=torch.cat([p["a"] for p in ps], dim=1),
                b=torch.cat([p["b"].transpose(1, 2) for p in ps], dim=2).transpose(1, 2),
                s=torch.stack([p["s"] for p in ps]), r=ps[0]["r"],
                y=torch.cat([p["y"] for p in ps], dim=1),
                edges=tuple(torch.tensor(widths[:-1]).cumsum(0).tolist()) or None,
            ))
        pool.append(groups)
    return pool


def merged_scaling(g) -> torch.Tensor:
    """A merged group's scaling as the kernels take it: `[G, L]` for merged members, `[L]` for one."""
    return g["s"] if g["edges"] else g["s"][0]


def _merged_lora(g, y, meta, cfg):
    """One merged group's LoRA into y: q/k/v or gate/up as one shrink + one segmented expand."""
    add_batched_lora_(y, g["x"], g["a"], g["b"], merged_scaling(g), g["r"], meta, cfg=cfg, mask_rank=False,
                      segments=g["edges"])


def time_merged(pool, meta, cfg) -> float:
    """us per layer with q/k/v and gate/up merged: 8 launches per layer instead of 14."""
    return time_graph(lambda: [_merged_lora(g, g["y"], meta, cfg) for groups in pool for g in groups]) \
        * 1e3 / len(pool)


def base_weights(pool, n_layers: int = 2):
    """Base weights [sum N, K] per merged group for the first layers of a merged pool (2 layers of
    Llama's are ~400 MB, far past the L2)."""
    return [[torch.randn(g["y"].shape[1], g["x"].shape[1], device="cuda", dtype=torch.bfloat16) / g["x"].shape[1] ** 0.5
             for g in groups] for groups in pool[:n_layers]]


def time_with_gemms(pool, weights, meta, cfg) -> float:
    """us per layer of the base GEMMs + merged LoRA (each group's GEMM, then its LoRA), as the model runs."""
    return time_graph(lambda: [_merged_lora(g, g["x"] @ w.T, meta, cfg) for groups, ws in zip(pool, weights)
                               for g, w in zip(groups, ws)]) * 1e3 / len(weights)


def time_gemms(pool, weights) -> float:
    """us per layer of the merged base GEMMs alone (the baseline of `time_with_gemms`)."""
    return time_graph(lambda: [g["x"] @ w.T for groups, ws in zip(pool, weights) for g, w in zip(groups, ws)]) \
        * 1e3 / len(weights)


def time_backbone(shape: dict) -> float:
    ws = [
        (torch.randn(n, k, device="cuda", dtype=torch.bfloat16), torch.randn(M, k, device="cuda", dtype=torch.bfloat16))
        for k, n in projections(shape).values()
    ]
    return time_graph(lambda: [x @ w.T for w, x in ws]) * 1e3


def sweep(shape: dict, gen, base: KernelConfig) -> KernelConfig:
    """Coordinate search over shrink + expand launch parameters on the model's path (merged
    projections, exact grid, each group's base GEMM ahead of its LoRA as in the model, so that
    programmatic dependent launch acts as it does there), scored at L = 8 and L = 128: shrink
    parameters first, then expand's."""
    pools = {}
    for L in (8, 128):
        pool = merged_pool(layer_pool(shape, L)[:2])
        pools[L] = (pool, base_weights(pool), build_batch_meta(slot_map("decode", L, gen), L, "exact"))

    def score(cfg):
        t = sum(time_with_gemms(pool, weights, meta, cfg) for pool, weights, meta in pools.values())
        print(f"sweep {cfg} -> {t:.1f} us (GEMMs + LoRA, L=8 + L=128)", flush=True)
        return t

    best = dataclasses.replace(base, fused=False)
    best_t = score(best)
    # Decode LoRA is latency-bound per program (a few small loads per loop step). The ranges are
    # centred on the last best (d51fc64: shrink BK 128 at 8 programs/SM on 2 warps; expand BN 256 at
    # 4 programs/SM, both at the edge of that search) and reach one step past it.
    spaces = (
        [dict(shrink_block_k=bk, target_programs_per_sm=pps, shrink_num_warps=w)
         for bk in (64, 128) for pps in (4, 8, 16) for w in (2, 4)],
        [dict(shrink_num_stages=st) for st in (2, 3, 4)],
        [dict(shrink_max_steps=steps) for steps in (0, 1, 2, 4)],
        [dict(expand_block_n=bn, expand_programs_per_sm=pps, expand_num_warps=w)
         for bn in (128, 256, 512) for pps in (2, 4, 8, 16) for w in (4, 8)],
        [dict(expand_num_stages=st) for st in (2, 3, 4)],
        [dict(expand_max_steps=steps) for steps in (0, 2, 4, 8)],
    )
    for space in spaces:
        start = best
        for params in space:
            cfg = dataclasses.replace(start, **params)
            t = score(cfg)
            if t < best_t:
                best, best_t = cfg, t
    print(f"sweep best {best} -> {best_t:.1f} us", flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--sweep", action="store_true", help="tune launch parameters first and use the best")
    ap.add_argument("--models", default="llama-3.2-3b,mistral-7b")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    cfg = get_kernel_config(torch.device("cuda"))
    if args.sweep:
        cfg = sweep(SHAPES["llama-3.2-3b"], gen, cfg)
        (args.out / "tuned_kernel_config.json").parent.mkdir(parents=True, exist_ok=True)
        (args.out / "tuned_kernel_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    # Every column without programmatic dependent launch, except the PDL columns (whatever the file says).
    cfg = dataclasses.replace(cfg, pdl=False)
    rows = []
    for model in args.models.split(","):
        shape = SHAPES[model]
        gemm = time_backbone(shape)
        # The model's setting: a bank of 128 slots (max_loras) of which the batch uses L. The exact
        # grid and its split sizes follow the bank's bound, not L.
        bank = merged_pool(layer_pool(shape, 128))
        for case, Ls in (("decode", (1, 4, 8, 16, 32, 64, 128)), ("mixed", (128,))):
            for L in Ls:
                layers = layer_pool(shape, L)
                merged = merged_pool(layers)
                slots = slot_map(case, L, gen)
                row = dict(model=model, case=case, L=L, floor_us=floor_us(shape, L, bw), backbone_gemm_us=gemm)
                for grid in GRID_MODES:
                    meta = build_batch_meta(slots, L, grid)
                    row[f"{grid}_us"] = time_mode(layers, meta, cfg)
                    if grid in ("exact", "full"):
                        row[f"{grid}_merged_us"] = time_merged(merged, meta, cfg)
                    if grid == "exact":
                        row["exact_masked_us"] = time_mode(layers, meta, cfg, mask_rank=True)
                        # The model's bank holds 128 slots; the batch's distinct adapters bound the grid.
                        bounded = build_batch_meta(slots, 128, "exact", max_active_slots=slot_bound_class(L, 128))
                        row["exact_merged_bank128_us"] = time_merged(bank, bounded, cfg)
                        row["exact_merged_bank128_unbounded_us"] = time_merged(
                            bank, build_batch_meta(slots, 128, "exact"), cfg
                        )
                        weights = base_weights(merged)
                        row["merged_gemm_us"] = time_gemms(merged, weights)
                        row["gemm_lora_us"] = time_with_gemms(merged, weights, meta, cfg)
                        # Programmatic dependent launch: LoRA kernels scheduled while the kernel ahead drains.
                        pdl = dataclasses.replace(cfg, pdl=True)
                        row["exact_merged_pdl_us"] = time_merged(merged, meta, pdl)
                        row["gemm_lora_pdl_us"] = time_with_gemms(merged, weights, meta, pdl)
                        # ... and o/down (the unmerged projections) as one fused kernel each.
                        pdl_fused = dataclasses.replace(pdl, fused=True)
                        row["exact_merged_pdl_fused_us"] = time_merged(merged, meta, pdl_fused)
                        row["gemm_lora_pdl_fused_us"] = time_with_gemms(merged, weights, meta, pdl_fused)
                        del weights
                row["exact_over_full"] = row["exact_us"] / row["full_us"]
                row["exact_over_floor"] = row["exact_us"] / row["floor_us"]
                row["merged_over_full"] = row["exact_merged_us"] / row["full_merged_us"]
                row["merged_over_floor"] = row["exact_merged_us"] / row["floor_us"]
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                del layers, merged
                torch.cuda.empty_cache()
        del bank
    meta = dict(environment(), command=" ".join(sys.argv), copy_bandwidth_TBps=bw / 1e12, rank=RANK, rows_M=M,
                kernel_config=dataclasses.asdict(cfg), date=time.strftime("%Y-%m-%d"))
    head = (
        "| model | case | L | full us | active_rows us | two_class us | exact us | full merged us | exact merged us | "
        "floor us | exact/full | exact/floor | merged exact/full | merged exact/floor | "
        "merged exact, 128-slot bank us | same, unbounded grid us | exact rank-masked us | backbone GEMMs us | "
        "merged GEMMs us | GEMMs + merged exact us | exact merged, PDL us | GEMMs + merged exact, PDL us | "
        "exact merged, PDL, fused o/down us | GEMMs + same us |\n"
    )
    head += "|---" * 24 + "|\n"
    body = "".join(
        f"| {r['model']} | {r['case']} | {r['L']} | {r['full_us']:.1f} | {r['active_rows_us']:.1f} | "
        f"{r['two_class_us']:.1f} | {r['exact_us']:.1f} | {r['full_merged_us']:.1f} | {r['exact_merged_us']:.1f} | "
        f"{r['floor_us']:.1f} | {r['exact_over_full']:.2f} | {r['exact_over_floor']:.2f} | "
        f"{r['merged_over_full']:.2f} | {r['merged_over_floor']:.2f} | {r['exact_merged_bank128_us']:.1f} | "
        f"{r['exact_merged_bank128_unbounded_us']:.1f} | {r['exact_masked_us']:.1f} | {r['backbone_gemm_us']:.1f} | "
        f"{r['merged_gemm_us']:.1f} | {r['gemm_lora_us']:.1f} | {r['exact_merged_pdl_us']:.1f} | "
        f"{r['gemm_lora_pdl_us']:.1f} | {r['exact_merged_pdl_fused_us']:.1f} | {r['gemm_lora_pdl_fused_us']:.1f} |\n"
        for r in rows
    )
    table = (f"# LoRA kernel time per layer (7 projections, rank {RANK}, M={M}, bf16)\n\n"
             f"```\n{json.dumps(meta, indent=2)}\n```\n\n{head}{body}")
    table += ("\nPer-projection columns (full, active_rows, two_class, exact) run shrink + expand for each of the 7 "
              "projections (14 launches per layer) without the per-slot rank load, as the model does for a bank "
              "of uniform-rank adapters. Merged columns run q/k/v and gate/up as one shrink + one segmented expand "
              "each (8 launches per layer), the model's default. The 128-slot bank columns run the same rows in a "
              "bank of 128 slots (a model with max_loras=128): bounded by the batch's distinct adapters (the model's "
              "path: tile table of M/16 + max(16, 2^ceil(log2 L)) tiles) and unbounded (M/16 + 128 tiles). "
              "Rank-masked: exact reading each slot's rank (mixed-rank banks). Floor: active adapters' A and B + x "
              "read once + y read and written, over the measured copy bandwidth. Backbone GEMMs: the 7 projections' "
              "GEMMs; merged GEMMs: the model's 4 (q/k/v and gate/up merged). The GEMMs + LoRA columns run each "
              "merged group's base GEMM, then its LoRA: minus merged GEMMs, that is LoRA's cost in place. Columns run "
              "without programmatic dependent launch, whatever the GPU's file says; PDL columns: the same with "
              "programmatic dependent launch (`KernelConfig(pdl=True)`); fused o/down: also `fused=True`, which runs "
              "each unmerged projection (o_proj, down_proj) as one fused shrink + expand kernel.\n")
    write_results(args.out, "kernels", rows, meta, table)
    print(table)


if __name__ == "__main__":
    main()
