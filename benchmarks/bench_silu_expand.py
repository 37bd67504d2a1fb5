"""A gated MLP's gate/up LoRA + activation, unfused against `silu_mul_expand`, kernel by kernel.

    python benchmarks/bench_silu_expand.py --out benchmarks/results [--model llama-3.2-3b]

Batch 256, rank 8, a 128-slot bank, bf16, CUDA graphs. At L = 1 and 128 distinct adapters:
  unfused  base GEMM, shrink, segmented expand (read-modify-write of y), then silu(gate) * up by
           inductor (torch.compile of the same expression the HF MLP runs)
  fused    base GEMM, shrink, `lora_expand_silu_mul` (y read once, h written), at several
           (column block, warps)
and the pieces alone (expand, activation, fused kernel given y and u), so a difference can be
placed. Each fused variant is checked against the unfused h first.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, environment, time_graph, write_results  # noqa: E402
from lorazor_kernels import (  # noqa: E402
    build_batch_meta, get_kernel_config, lora_expand, lora_expand_silu_mul, lora_shrink, slot_bound_class,
)

BATCH, RANK, SLOTS = 256, 8, 128
VARIANTS = [(0, 0), (128, 8), (128, 4), (64, 4), (64, 8), (32, 4)]  # (silu_block_n, silu_num_warps); 0: expand's


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-3b")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    shape = SHAPES[args.model]
    K, I = shape["hidden"], shape["inter"]
    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(BATCH, K, generator=g, **bf16)
    w = torch.randn(2 * I, K, generator=g, **bf16) / K**0.5
    a = torch.randn(SLOTS, 2 * RANK, K, generator=g, **bf16) / K**0.5
    b = (torch.randn(SLOTS, RANK, 2 * I, generator=g, **bf16) * 0.1).transpose(1, 2)  # the bank: N-contiguous
    scaling = torch.full((2, SLOTS), 2.0, device="cuda")
    rank = torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda")
    silu_mul = torch.compile(lambda y: torch.nn.functional.silu(y[:, :I]) * y[:, I:])
    base_cfg = get_kernel_config(torch.device("cuda"))
    rows = []
    for L in (1, 128):
        slots = (torch.arange(BATCH, device="cuda") % L).int()
        meta = build_batch_meta(slots, SLOTS, "exact", max_active_slots=slot_bound_class(L, SLOTS))
        y0 = x @ w.T
        u0 = lora_shrink(x, a, rank, meta, base_cfg, mask_rank=False)

        def unfused():
            y = x @ w.T
            u = lora_shrink(x, a, rank, meta, base_cfg, mask_rank=False)
            lora_expand(u, b, scaling, rank, y, meta, base_cfg, mask_rank=False, segments=(I,))
            return silu_mul(y)

        expected = unfused()
        y_work = y0.clone()
        row = dict(model=args.model, L=L, unfused_us=1e3 * time_graph(unfused),
                   expand_alone_us=1e3 * time_graph(lambda: lora_expand(
                       u0, b, scaling, rank, y_work, meta, base_cfg, mask_rank=False, segments=(I,))),
                   silu_alone_us=1e3 * time_graph(lambda: silu_mul(y0)),
                   gemm_shrink_us=1e3 * time_graph(lambda: (x @ w.T, lora_shrink(x, a, rank, meta, base_cfg,
                                                                                    mask_rank=False))))
        for block_n, warps in VARIANTS:
            cfg = dataclasses.replace(base_cfg, silu_block_n=block_n, silu_num_warps=warps)
            name = f"{block_n or cfg.expand_block_n}x{warps or cfg.expand_num_warps}"

            def fused(cfg=cfg):
                y = x @ w.T
                u = lora_shrink(x, a, rank, meta, base_cfg, mask_rank=False)
                return lora_expand_silu_mul(u, b, scaling, y, meta, cfg)

            err = ((fused().float() - expected.float()).abs().max() / expected.float().abs().max()).item()
            row[f"fused_{name}_us"] = 1e3 * time_graph(fused)
            row[f"fused_{name}_alone_us"] = 1e3 * time_graph(lambda cfg=cfg: lora_expand_silu_mul(u0, b, scaling, y0,
                                                                                                 meta, cfg))
            row[f"fused_{name}_err"] = err
        rows.append(row)
        print(row, flush=True)
    keys = [k for k in rows[0] if k.endswith("_us")]
    head = "| L | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1) + "\n"
    body = "".join(f"| {r['L']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |\n" for r in rows)
    meta = dict(environment(), command=" ".join(sys.argv), batch=BATCH, rank=RANK, bank_slots=SLOTS,
                kernel_config=dataclasses.asdict(base_cfg))
    table = (f"# Gate/up LoRA + activation, unfused vs fused ({args.model}, M={BATCH}, bf16, CUDA graphs)\n\n"
             f"{meta}\n\n{head}{body}")
    write_results(args.out, f"silu_expand_{args.model}", rows, meta, table)
    print(table)


if __name__ == "__main__":
    main()
