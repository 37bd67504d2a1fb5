"""Where the expand kernel's time goes at 128 adapters: the gate/up expand with stages left out.

    python benchmarks/expand_probe.py --out benchmarks/results/expand_probe

A probe kernel repeats the shipped expand's loop (exact tile table, u summed from fp32 split-K
partials, one B tile and one y tile per column block) with constexpr switches that leave one stage
out or do it another way; each variant's time against the full probe says what that stage costs.
The shipped kernel (`lora_expand`) runs beside it as the check that the probe is the same kernel.
Llama-3.2-3B's merged gate/up: M = 256 rows over 128 adapters (2 rows per tile), N = 16384, rank 8,
a pool of distinct weight banks (~4x the L2) so B comes from HBM, CUDA-graph replay.
Variants that skip a stage compute a wrong y: this is a timing probe, never a kernel to ship.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # probes, then benchmarks/
from common import environment, time_graph  # noqa: E402
from lorazor_kernels import build_batch_meta, get_kernel_config, lora_expand  # noqa: E402

M, N, RANK, SLOTS, SPLIT_K, BLOCK_M, BLOCK_R = 256, 16384, 8, 128, 8, 16, 16


@triton.jit
def _probe_kernel(u_ptr, b_ptr, y_ptr, tile_slot_ptr, tile_rows_ptr, sink_ptr, N, n_per_program,
                  stride_us, stride_um, stride_bl, stride_br, stride_ym,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  RANK: tl.constexpr, LOAD_Y: tl.constexpr, STORE_Y: tl.constexpr, DOT: tl.constexpr,
                  ACC_Y: tl.constexpr, LOAD_B: tl.constexpr, FMA: tl.constexpr):
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_M)
    slot = tl.load(tile_slot_ptr + pid)
    rows = tl.load(tile_rows_ptr + pid * BLOCK_M + lanes)
    if slot < 0:
        return
    mask_m = rows >= 0
    rows = tl.maximum(rows, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        u += tl.load(u_ptr + s * stride_us + rows[:, None] * stride_um + offs_r[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    ub = u.to(b_ptr.dtype.element_ty)
    # FMA: the rank's RANK columns only, no padding to a dot shape, u kept in fp32.
    offs_r8 = tl.arange(0, RANK)
    u8 = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    if FMA:
        for s in tl.static_range(SPLIT_K):
            u8 += tl.load(u_ptr + s * stride_us + rows[:, None] * stride_um + offs_r8[None, :],
                          mask=mask_m[:, None], other=0.0)
    b_slot = b_ptr + slot.to(tl.int64) * stride_bl
    sink = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_lo = pid_n * n_per_program
    for n0 in range(n_lo, tl.minimum(n_lo + n_per_program, N), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if LOAD_B:
            b = tl.load(b_slot + offs_r[:, None] * stride_br + offs_n[None, :], mask=mask_r[:, None], other=0.0)
        else:
            b = tl.full((BLOCK_R, BLOCK_N), 1.0, b_ptr.dtype.element_ty)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        if LOAD_Y:
            y_old = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            y_old = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FMA:
            b8 = tl.load(b_slot + offs_r8[:, None] * stride_br + offs_n[None, :]).to(tl.float32)
            acc = y_old + tl.sum(u8[:, :, None] * b8[None, :, :], axis=1)
        elif DOT:
            if ACC_Y:
                acc = tl.dot(ub, b, acc=y_old)
            else:
                acc = y_old + tl.dot(ub, b)
        else:
            acc = y_old + tl.sum(b.to(tl.float32), axis=0)[None, :]
        if STORE_Y:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            sink += acc
    if not STORE_Y:
        tl.store(sink_ptr + pid * tl.num_programs(1) + pid_n, tl.sum(sink))


VARIANTS = {
    "probe, every stage": {},
    "acc = dot(u, B, acc=y)": dict(ACC_Y=True),
    "no y load": dict(LOAD_Y=False),
    "no y store": dict(STORE_Y=False),
    "no y load or store": dict(LOAD_Y=False, STORE_Y=False),
    "no dot (B column sums)": dict(DOT=False),
    "no B load": dict(LOAD_B=False),
    "no B load, no dot": dict(LOAD_B=False, DOT=False),
    "B load only (no y, no dot)": dict(LOAD_Y=False, STORE_Y=False, DOT=False),
    "FMA over the 8 rank columns, no dot": dict(FMA=True, LOAD_B=False),
}
# (BLOCK_N, warps, column splits, variants run): the shipped shape gets every variant.
SHAPES_RUN = (
    (256, 4, 4, tuple(VARIANTS)),
    (128, 4, 8, ("probe, every stage",)),
    (512, 8, 4, ("probe, every stage",)),
    (256, 8, 4, ("probe, every stage",)),
    (64, 4, 4, ("FMA over the 8 rank columns, no dot",)),
    (128, 4, 4, ("FMA over the 8 rank columns, no dot",)),
    (64, 2, 8, ("FMA over the 8 rank columns, no dot",)),
)


def probe_setup(name: str, pool: int, pool_help: str):
    """A probe's arguments (--out, --pool), the GPU's kernel config without PDL, and the step
    metadata of 256 rows spread uniformly over a 128-slot bank (2 rows per exact tile)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(f"benchmarks/results/{name}"))
    ap.add_argument("--pool", type=int, default=pool, help=pool_help)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_kernel_config(torch.device("cuda")), pdl=False)
    slots = (torch.arange(M) % SLOTS)[torch.randperm(M)].cuda()
    return args, cfg, build_batch_meta(slots, SLOTS, "exact", max_active_slots=SLOTS)


def main() -> None:
    args, cfg, meta = probe_setup("expand_probe", 6, "distinct weight banks (33.5 MB of B each)")
    banks = [(torch.randn(SLOTS, RANK, N, device="cuda", dtype=torch.bfloat16),
              torch.randn(SPLIT_K, M, BLOCK_R, device="cuda"),
              torch.randn(M, N, device="cuda", dtype=torch.bfloat16)) for _ in range(args.pool)]
    scaling = torch.ones(SLOTS, device="cuda")
    rank = torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda")
    sink = torch.empty(1 << 16, device="cuda")
    programs = meta.num_tiles
    rows = []

    def shipped():
        for b, u, y in banks:
            lora_expand(u, b.transpose(1, 2), scaling, rank, y, meta, cfg, mask_rank=False)

    def shipped_write_only():  # gemm_adds_lora's expand: y overwritten, never read
        for b, u, y in banks:
            lora_expand(u, b.transpose(1, 2), scaling, rank, y, meta, cfg, mask_rank=False, write_only=True)

    shape = f"({cfg.expand_block_n} columns, {cfg.expand_num_warps} warps, {cfg.expand_num_stages} stages)"
    for name, fn in (
        (f"shipped lora_expand {shape}", shipped),
        (f"shipped, write_only=True {shape}", shipped_write_only),
    ):
        rows.append(dict(variant=name, us=time_graph(fn) * 1e3 / len(banks)))
        print(json.dumps(rows[-1]), flush=True)
    for block_n, warps, splits, names in SHAPES_RUN:
        n_per_program = N // splits
        for name in names:
            opts = {**dict(LOAD_Y=True, STORE_Y=True, DOT=True, ACC_Y=False, LOAD_B=True, FMA=False), **VARIANTS[name]}

            def run():
                for b, u, y in banks:
                    _probe_kernel[(programs, splits)](
                        u, b, y, meta.tile_slot, meta.tile_rows, sink, N, n_per_program,
                        u.stride(0), u.stride(1), b.stride(0), b.stride(1), y.stride(0),
                        SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=BLOCK_R, RANK=RANK,
                        num_warps=warps, num_stages=cfg.expand_num_stages, **opts)

            us = time_graph(run) * 1e3 / len(banks)
            rows.append(dict(variant=name, block_n=block_n, warps=warps, column_splits=splits, us=us))
            print(json.dumps(rows[-1]), flush=True)
    write_probe(args.out, "expand_probe", rows, SLOTS * RANK * N * 2 + 2 * M * N * 2, "B + y read and written",
                ("block_n", "warps", "column_splits"), cfg)


def write_probe(out: Path, name: str, rows: list[dict], bytes_moved: int, bytes_what: str, keys: tuple, cfg) -> None:
    """A probe's rows as `<name>.json` (with the command, commit, GPU, versions) and a `<name>.md` table."""
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        environment(), command=" ".join(sys.argv), bytes_per_launch=bytes_moved, kernel_config=dataclasses.asdict(cfg)
    )
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [f"| variant | {' | '.join(keys)} | us per launch | GB/s ({bytes_what}) |", "|---" * (len(keys) + 3) + "|"]
    for r in rows:
        cells = " | ".join(str(r.get(k, "")) for k in keys)
        lines.append(f"| {r['variant']} | {cells} | {r['us']:.2f} | {bytes_moved / r['us'] / 1e3:.0f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
