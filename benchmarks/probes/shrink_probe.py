"""Where the shrink kernel's time goes at 128 adapters: q/k/v's and down's shrink with stages left out.

    python benchmarks/shrink_probe.py --out benchmarks/results/shrink_probe

The companion of `expand_probe.py`. A probe kernel repeats the shipped shrink's loop (exact tile
table, one K split per program on grid axis 1, one rank block on axis 2, x and A tiles into a dot,
one fp32 partial stored per split) with constexpr switches that leave the x load, the A load or
the store out; the shipped `lora_shrink` runs beside it as the check that the probe is the same
kernel. Llama-3.2-3B's merged q/k/v (K = 3072, 3 x rank 8 = 24 rows of A, two rank blocks of 16)
and down_proj (K = 8192, rank 8): M = 256 rows over 128 adapters (2 rows per tile), a pool of
distinct A banks (~4x the L2) so A comes from HBM, CUDA-graph replay.
Variants that skip a stage compute a wrong u: this is a timing probe, never a kernel to ship.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # probes, then benchmarks/
from common import time_graph  # noqa: E402
from expand_probe import M, SLOTS, probe_setup, write_probe  # noqa: E402
from lorazor_kernels import lora_shrink  # noqa: E402
from lorazor_kernels.lora_launch import _k_ranges, _split_k  # noqa: E402

BLOCK_M, BLOCK_R = 16, 16
# (name, K, rows of A per slot): the merged q/k/v group and down_proj.
GROUPS = (("q/k/v", 3072, 24), ("down", 8192, 8))


@triton.jit
def _probe_kernel(x_ptr, a_ptr, u_ptr, tile_slot_ptr, tile_rows_ptr, sink_ptr, K, R, k_per_split,
                  stride_xm, stride_al, stride_ar, stride_us, stride_um,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  LOAD_X: tl.constexpr, LOAD_A: tl.constexpr, STORE: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_r = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + pid)
    rows = tl.load(tile_rows_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    mask_m = rows >= 0
    rows = tl.maximum(rows, 0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if LOAD_X:
            x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        else:
            x = tl.full((BLOCK_M, BLOCK_K), 1.0, x_ptr.dtype.element_ty)
        if LOAD_A:
            a = tl.load(a_rows + k[None, :], mask=mask_r[:, None] & (k < K)[None, :], other=0.0)
        else:
            a = tl.full((BLOCK_R, BLOCK_K), 1.0, a_ptr.dtype.element_ty)
        acc += tl.dot(x, tl.trans(a))
    if STORE:
        tl.store(u_ptr + pid_k * stride_us + rows[:, None] * stride_um + offs_r[None, :], acc,
                 mask=mask_m[:, None] & mask_r[None, :])
    else:
        tl.store(sink_ptr + (pid * tl.num_programs(1) + pid_k) * tl.num_programs(2) + pid_r, tl.sum(acc))


VARIANTS = {
    "probe, every stage": {},
    "no x load": dict(LOAD_X=False),
    "no A load": dict(LOAD_A=False),
    "no store": dict(STORE=False),
    "A load only (no x, no store)": dict(LOAD_X=False, STORE=False),
}


def main() -> None:
    args, cfg, meta = probe_setup("shrink_probe", 12, "distinct A banks (6-16 MB each)")
    rank = torch.full((SLOTS,), 8, dtype=torch.int32, device="cuda")  # unread: mask_rank=False
    sink = torch.empty(1 << 20, device="cuda")
    rows = []
    for group, K, R in GROUPS:
        banks = [(torch.randn(SLOTS, R, K, device="cuda", dtype=torch.bfloat16),
                  torch.randn(M, K, device="cuda", dtype=torch.bfloat16)) for _ in range(args.pool)]
        rank_blocks = triton.cdiv(R, BLOCK_R)
        shipped_split = _k_ranges(_split_k(meta, K, rank_blocks, cfg, torch.device("cuda")), K, cfg.shrink_block_k)[0]

        def shipped(banks=banks):
            for a, x in banks:
                lora_shrink(x, a, rank, meta, cfg, mask_rank=False)

        rows.append(dict(variant=f"{group}: shipped lora_shrink", K=K, splits=shipped_split,
                         warps=cfg.shrink_num_warps, us=time_graph(shipped) * 1e3 / len(banks)))
        print(json.dumps(rows[-1]), flush=True)
        for splits, warps, names in ((shipped_split, cfg.shrink_num_warps, tuple(VARIANTS)),
                                     (shipped_split * 2, cfg.shrink_num_warps, ("probe, every stage",)),
                                     (max(1, shipped_split // 2), cfg.shrink_num_warps, ("probe, every stage",)),
                                     (shipped_split, 4, ("probe, every stage",))):
            splits, k_per_split = _k_ranges(splits, K, cfg.shrink_block_k)  # as lora_shrink splits K
            u = torch.empty(splits, M, rank_blocks * BLOCK_R, device="cuda")
            for name in names:
                opts = {**dict(LOAD_X=True, LOAD_A=True, STORE=True), **VARIANTS[name]}

                def run(banks=banks):
                    for a, x in banks:
                        _probe_kernel[(meta.num_tiles, u.shape[0], rank_blocks)](
                            x, a, u, meta.tile_slot, meta.tile_rows, sink, K, R, k_per_split,
                            x.stride(0), a.stride(0), a.stride(1), u.stride(0), u.stride(1),
                            BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=cfg.shrink_block_k,
                            num_warps=warps, num_stages=cfg.shrink_num_stages, **opts)

                rows.append(dict(variant=f"{group}: {name}", K=K, splits=u.shape[0], warps=warps,
                                 us=time_graph(run) * 1e3 / len(banks)))
                print(json.dumps(rows[-1]), flush=True)
        del banks
    # Bytes of the q/k/v rows (A of 128 slots + x read once); down's rows move 128 * 8 * 8192 * 2 + M * 8192 * 2.
    write_probe(args.out, "shrink_probe", rows, SLOTS * 24 * 3072 * 2 + M * 3072 * 2, "q/k/v rows: A + x",
                ("K", "splits", "warps"), cfg)


if __name__ == "__main__":
    main()
