"""Ways to run a layer's LoRA beside its base GEMMs, timed in place on the H200.

    python benchmarks/bench_lora_forms.py --out benchmarks/results

A Llama-3.2-3B layer (q/k/v and gate/up merged, as the model runs them), M = 256 decode rows spread
uniformly over L adapters of a 128-slot bank, rank 8, bf16, in a CUDA graph over two distinct layers
(weights come from HBM):

- `exact`: each group's base GEMM, then LoRazor's exact-grid shrink + expand (the model's path,
  the GPU's kernel config, programmatic dependent launch as the file says).
- `exact, shrink first`: the same kernels, with each group's shrink launched before its base GEMM
  (it reads only x), so the GEMM separates shrink from expand: with programmatic dependent launch the
  shrink's start overlaps the kernel ahead of the GEMM, and the expand's the GEMM's tail.
- `own GEMM, expand in epilogue`: the exact shrink, then a Triton base GEMM (`gemm_expand.py`) that
  adds each row's expand in its epilogue: 2 launches per group instead of 3, and no read-modify-write
  of y. Its block sizes are swept per group first; the same GEMM without the expand is timed against
  cuBLAS's as `own GEMMs us` (can a Triton GEMM stand in for cuBLAS at M = 256 at all?).
- `dense`: cuBLAS only, over the whole bank. The base GEMM also computes x @ A for every slot (A
  stacked under W, one GEMM), a one-hot row mask keeps each row's own slot, and one addmm per
  segment adds (masked xA) @ B for the whole bank in place. Its cost does not depend on L.
- `grouped`: torch._grouped_mm (CUTLASS grouped GEMM, device offsets) over the bank's slots with
  rows sorted by slot: gather x, grouped shrink, grouped expand per segment, index_add into y. Slots
  with no rows cost no tiles, so its bytes follow L. `grouped, presorted`: the same without the
  gather and scatter (the bound if the batch were kept sorted by adapter).

Every form is checked against an fp32 reference of the same layer before it is timed. Scalings are
folded into B once (adapter weights are constant), as a real backend would do at load time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # probes, then benchmarks/
from bench_kernels import (  # noqa: E402
    M, RANK, _merged_lora, base_weights, layer_pool, merged_pool, merged_scaling, slot_map,
)
from common import SHAPES, environment, time_graph, write_results  # noqa: E402
from gemm_expand import gemm_expand  # noqa: E402
from lorazor_kernels import build_batch_meta, get_kernel_config, lora_expand, lora_shrink, slot_bound_class  # noqa: E402
from lorazor_kernels.lora_launch import _pdl_options  # noqa: E402

BANK = 128
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried for the Triton base GEMM, per group.
GEMM_BLOCKS = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 64, 64, 4, 4),
               (64, 256, 64, 8, 3), (256, 128, 64, 8, 3)]


def segments(g) -> list[tuple[int, int]]:
    """Column ranges [lo, hi) of a merged group's outputs (one per projection)."""
    n = g["y"].shape[1]
    edges = [0, *(g["edges"] or ()), n]
    return list(zip(edges[:-1], edges[1:]))


def prepare(groups, ws, grouped_b_layout: str):
    """Per group: the weights each form reads, derived once (as at adapter load)."""
    out = []
    for g, w in zip(groups, ws):
        a = g["a"]  # [S, G*r, K]
        b_store = g["b"].transpose(1, 2)  # [S, r, N]
        segs = segments(g)
        scaled = [
            (b_store[:, :, lo:hi] * g["s"][i][:, None, None]).to(b_store.dtype) for i, (lo, hi) in enumerate(segs)
        ]
        p = dict(g=g, w=w, segs=segs, n=w.shape[0])
        # [N + G*S*r, K]: W with every slot's A under it, segment-major so each segment's xA is one block.
        n_seg = len(segs)
        a_seg_major = a.view(BANK, n_seg, RANK, -1).transpose(0, 1).reshape(-1, a.shape[-1])
        p["w_ext"] = torch.cat([w, a_seg_major])
        p["b_flat"] = [b.reshape(-1, b.shape[-1]).contiguous() for b in scaled]  # [S*r, N_g]
        p["a_t"] = in_layout(a.transpose(1, 2), grouped_b_layout)  # [S, K, G*r]
        p["b_grouped"] = [in_layout(b, grouped_b_layout) for b in scaled]  # [S, r, N_g]
        p["b_scaled"] = torch.cat(scaled, dim=2).contiguous()  # [S, r, N], each segment's scaling folded in
        out.append(p)
    return out


def in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A 3-D [S, K, N] operand stored row-major (N contiguous) or column-major (K contiguous)."""
    if layout == "row":
        return t.contiguous()
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def step_state(slots: torch.Tensor) -> dict:
    """What each form builds once per step from the row -> slot map."""
    order = torch.argsort(slots)
    return dict(
        slots=slots,
        onehot=(slots[:, None] == torch.arange(BANK, device=slots.device)).to(torch.bfloat16),
        order=order,
        offs=torch.cumsum(torch.bincount(slots, minlength=BANK), 0).to(torch.int32),
        meta=build_batch_meta(
            slots, BANK, "exact", max_active_slots=slot_bound_class(int(slots.unique().numel()), BANK)
        ),
    )


def run_exact(p, st, cfg):
    y = p["g"]["x"] @ p["w"].T
    _merged_lora(p["g"], y, st["meta"], cfg)
    return y


def run_exact_shrink_first(p, st, cfg):
    g = p["g"]
    u = lora_shrink(g["x"], g["a"], g["r"], st["meta"], cfg, mask_rank=False)
    y = g["x"] @ p["w"].T
    lora_expand(u, g["b"], merged_scaling(g), g["r"], y, st["meta"], cfg, mask_rank=False, segments=g["edges"])
    return y


def run_dense(p, st, cfg):
    y_ext = p["g"]["x"] @ p["w_ext"].T
    y, xa = y_ext[:, : p["n"]], y_ext[:, p["n"]:]
    n_seg = len(p["segs"])
    xa = xa.view(M, n_seg, BANK, RANK) * st["onehot"][:, None, :, None]  # keep each row's own slot
    for i, (lo, hi) in enumerate(p["segs"]):
        y[:, lo:hi].addmm_(xa[:, i].reshape(M, BANK * RANK), p["b_flat"][i])
    return y


def _grouped_delta(p, xs, offs):
    u = torch._grouped_mm(xs, p["a_t"], offs=offs)  # [M, G*r], rows sorted by slot
    outs = [torch._grouped_mm(u[:, i * RANK:(i + 1) * RANK].contiguous(), b, offs=offs)
            for i, b in enumerate(p["b_grouped"])]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def run_grouped(p, st, cfg):
    x = p["g"]["x"]
    y = x @ p["w"].T
    y.index_add_(0, st["order"], _grouped_delta(p, x.index_select(0, st["order"]), st["offs"]))
    return y


def run_grouped_presorted(p, st, cfg):
    """x and y already in slot order (no gather, no scatter): only correct when the batch is sorted."""
    x = p["g"]["x"]
    y = x @ p["w"].T
    y += _grouped_delta(p, x, st["offs"])
    return y


def run_own_gemm_expand(p, st, cfg):
    g = p["g"]
    u = lora_shrink(g["x"], g["a"], g["r"], st["meta"], cfg, mask_rank=False)
    return gemm_expand(g["x"], p["w"], p["expand_block"], u, p["b_scaled"], st["slots"], g["edges"] or (), RANK,
                       pdl=_pdl_options(cfg, g["x"].device)["USE_GDC"])


FORMS = {"exact": run_exact, "exact, shrink first": run_exact_shrink_first,
         "own GEMM, expand in epilogue": run_own_gemm_expand,
         "dense": run_dense, "grouped": run_grouped, "grouped, presorted": run_grouped_presorted}


def pick_gemm_blocks(pool, st, cfg) -> float:
    """Per group, the fastest of GEMM_BLOCKS for the Triton GEMM alone and with the expand, timed on
    the first layer and set on every layer's group (blocks whose BLOCK_N cuts a segment are skipped).
    Returns the chosen plain GEMMs' largest error relative to cuBLAS's output."""
    worst = 0.0
    for i, p0 in enumerate(pool[0]):
        x, w = p0["g"]["x"], p0["w"]
        fits = [b for b in GEMM_BLOCKS if not any(e % b[1] for e in p0["g"]["edges"] or ())]
        plain = min(fits, key=lambda b: time_graph(lambda: gemm_expand(x, w, b), iters=10))

        def with_expand(b):
            p0["expand_block"] = b
            return time_graph(lambda: run_own_gemm_expand(p0, st, cfg), iters=10)

        best = min(fits, key=with_expand)
        for layer in pool:
            layer[i]["gemm_block"], layer[i]["expand_block"] = plain, best
        ref = (x @ w.T).float()
        worst = max(worst, ((gemm_expand(x, w, plain).float() - ref).abs().max() / ref.abs().max()).item())
        print(f"group {i}: GEMM block {plain}, with expand {best}", flush=True)
    if worst > 2e-2:
        raise AssertionError(f"own GEMM: relative error {worst:.3g} against cuBLAS")
    return worst


def time_own_gemms(pool) -> float:
    """us per layer of the Triton base GEMMs alone."""
    return time_graph(lambda: [gemm_expand(p["g"]["x"], p["w"], p["gemm_block"]) for layer in pool for p in layer]) \
        * 1e3 / len(pool)


def reference(p, slots):
    """fp32 y = x W^T + per row: scaling * (x A[slot]^T)[segment] B[slot][segment]."""
    g = p["g"]
    x = g["x"].float()
    y = x @ p["w"].float().T
    u = torch.einsum("mk,mrk->mr", x, g["a"][slots].float())
    b_store = g["b"].transpose(1, 2)[slots].float()  # [M, r, N]
    for i, (lo, hi) in enumerate(p["segs"]):
        delta = torch.einsum("mr,mrn->mn", u[:, i * RANK:(i + 1) * RANK], b_store[:, :, lo:hi])
        y[:, lo:hi] += delta * g["s"][i][slots][:, None]
    return y


def check(form, fn, prepared, st, slots, cfg):
    """Max error of the form over the layer's groups, relative to the reference's largest value."""
    worst = 0.0
    for p in prepared:
        got = fn(p, st, cfg).float()
        ref = reference(p, slots)
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    if worst > 2e-2:
        raise AssertionError(f"{form}: relative error {worst:.3g} against the fp32 reference")
    return worst


def probe_grouped_layout() -> str:
    """torch._grouped_mm's accepted layout for the 3-D operand on this build: 'row' or 'col'."""
    a = torch.randn(32, 16, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([16, 32], device="cuda", dtype=torch.int32)
    b = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
    errors = []
    for layout in ("row", "col"):
        try:
            out = torch._grouped_mm(a, in_layout(b, layout), offs=offs)
        except RuntimeError as err:
            errors.append(f"{layout}: {err}")
            continue
        ref = torch.cat([a[:16].float() @ b[0].float(), a[16:].float() @ b[1].float()])
        if (out.float() - ref).abs().max() < 0.05 * ref.abs().max():
            return layout
        errors.append(f"{layout}: wrong result")
    raise RuntimeError(f"torch._grouped_mm accepts neither layout: {errors}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--model", default="llama-3.2-3b")
    ap.add_argument("--adapters", default="1,8,32,128")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cfg = get_kernel_config(torch.device("cuda"))
    layout = probe_grouped_layout()
    bank = merged_pool(layer_pool(SHAPES[args.model], BANK))
    ws = base_weights(bank)
    pool = [prepare(groups, w, layout) for groups, w in zip(bank, ws)]
    own_gemm_err = pick_gemm_blocks(pool, step_state(slot_map("decode", BANK, gen)), cfg)
    rows = []
    for L in (int(v) for v in args.adapters.split(",")):
        slots = slot_map("decode", L, gen)
        st = step_state(slots)
        row = dict(model=args.model, L=L)
        row["gemms_us"] = (
            time_graph(lambda: [p["g"]["x"] @ p["w"].T for layer in pool for p in layer]) * 1e3 / len(pool)
        )
        row["own_gemms_us"] = time_own_gemms(pool)
        for form, fn in FORMS.items():
            if form == "grouped, presorted":  # its check needs the rows in slot order
                sorted_st = step_state(slots.sort().values)
                row[f"{form} err"] = check(form, fn, pool[0], sorted_st, slots.sort().values, cfg)
            else:
                row[f"{form} err"] = check(form, fn, pool[0], st, slots, cfg)
            row[f"{form} us"] = time_graph(lambda: [fn(p, st, cfg) for layer in pool for p in layer]) * 1e3 / len(pool)
            row[f"{form} LoRA us"] = row[f"{form} us"] - row["gemms_us"]
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    meta = dict(
        environment(),
        command=" ".join(sys.argv),
        bank_slots=BANK,
        rank=RANK,
        rows_M=M,
        grouped_b_layout=layout,
        kernel_config=dataclasses.asdict(cfg),
        date=time.strftime("%Y-%m-%d"),
        own_gemm_blocks=[[p["gemm_block"], p["expand_block"]] for p in pool[0]],
        own_gemm_err=own_gemm_err,
    )
    head = "| L | merged GEMMs us | own GEMMs us | " + " | ".join(f"GEMMs + {f} us (LoRA us)" for f in FORMS) + " |\n"
    head += "|---" * (3 + len(FORMS)) + "|\n"
    body = "".join(f"| {r['L']} | {r['gemms_us']:.1f} | {r['own_gemms_us']:.1f} | "
                   + " | ".join(f"{r[f'{f} us']:.1f} ({r[f'{f} LoRA us']:.1f})" for f in FORMS) + " |\n" for r in rows)
    table = (
        f"# A layer's LoRA beside its base GEMMs, several ways ({args.model}, 128-slot bank, rank {RANK}, M={M}, "
        "bf16)\n\n"
        f"```\n{json.dumps(meta, indent=2)}\n```\n\n{head}{body}\n"
        "Each form is checked against an fp32 reference first (largest relative error in the JSON). "
        "See the script's docstring for what each form runs. `own GEMMs us`: the Triton base GEMMs alone, "
        "against cuBLAS's merged GEMMs; the own-GEMM form's LoRA us is measured against cuBLAS's GEMMs too.\n"
    )
    write_results(args.out, f"lora_forms_{args.model}", rows, meta, table)
    print(table)


if __name__ == "__main__":
    main()
