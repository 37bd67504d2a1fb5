"""Probe: one decoder layer's base GEMMs in fp8 against bf16, by rows (issue #55).

    python benchmarks/probes/fp8_gemm.py --out /tmp/probe [--model llama-3.2-3b]

The layer's four products as the model runs them (q/k/v merged, o, gate/up merged, down), each timed
in a CUDA graph (20 replays of the four, median): bf16 `F.linear`; fp8 through `fp8_weight_only`
(the weights widened in registers, x unquantized; up to `WEIGHT_ONLY_ROWS` rows); fp8 through
`_scaled_mm` with per-token activation quantization (the path for more rows); against the fp8
bytes floor (the layer's fp8 weights at the measured copy bandwidth). Writes `fp8_gemm.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from common import SHAPES, copy_bandwidth, environment, time_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--model", default="llama-3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--sweep", action="store_true", help="also every weight-only launch shape per GEMM, 1 and 16 rows")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor_kernels.fp8 import WEIGHT_ONLY_ROWS, fp8_linear, fp8_weight_only, quantize_rows

    s = SHAPES[args.model]
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    gemms = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * s["inter"]), "down": (s["inter"], h)}
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {n: torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * K**-0.5
               for n, (K, N) in gemms.items()}
    fp8 = {n: quantize_rows(w) for n, w in weights.items()}
    bandwidth = copy_bandwidth()  # bytes moved per second (a copy reads and writes: a read-only floor)
    floor_ms = sum(w.numel() for w in weights.values()) / bandwidth * 1e3  # one byte per fp8 weight
    rows = []
    for M in map(int, args.rows.split(",")):
        xs = {n: torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16) for n, (K, N) in gemms.items()}
        paths = {"bf16": lambda: [torch.nn.functional.linear(xs[n], weights[n]) for n in gemms],
                 "fp8_scaled_mm": lambda: [fp8_linear(xs[n], *fp8[n], scaled=True) for n in gemms]}
        if M <= WEIGHT_ONLY_ROWS:
            paths["fp8_weight_only"] = lambda: [fp8_weight_only(xs[n], *fp8[n]) for n in gemms]
        row = dict(rows=M, fp8_floor_ms=round(floor_ms, 4),
                   **{f"{p}_ms": round(time_graph(fn, iters=20), 4) for p, fn in paths.items()})
        row["fp8_default_ms"] = row.get("fp8_weight_only_ms", row["fp8_scaled_mm_ms"])
        row["fp8_default_vs_bf16"] = round(row["fp8_default_ms"] / row["bf16_ms"], 3)
        row["fp8_default_vs_floor"] = round(row["fp8_default_ms"] / floor_ms, 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    sweep = run_sweep(gemms, weights, fp8, g, bandwidth) if args.sweep else None
    result = dict(environment(), probe="fp8_gemm", model=args.model, gemms=gemms, read_gb_s=round(bandwidth / 1e9),
                  rows=rows, sweep=sweep)
    (args.out / "fp8_gemm.json").write_text(json.dumps(result, indent=1) + "\n")


def run_sweep(gemms, weights, fp8, g, bandwidth) -> dict:
    """Per GEMM and rows (1, 16): every (BLOCK_N, BLOCK_K, warps, stages, split_k) that runs and equals the
    reference, timed alone in a graph (20 replays, median); the best and the default against the
    GEMM's fp8 bytes floor."""
    import itertools

    from lorazor_kernels.fp8 import fp8_linear_reference, fp8_weight_only

    # (BLOCK_N, BLOCK_K, warps, stages, split_k); split 0: `fp8_weight_only` picks it from the program count.
    shapes = list(itertools.product((32, 64), (128, 256, 512), (4,), (3, 4), (0, 1, 2, 3, 4, 6, 8)))
    out = {}
    for (name, (K, N)), M in itertools.product(gemms.items(), (1, 16)):
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = fp8_linear_reference(x, *fp8[name]).float()
        floor_ms = N * K / bandwidth * 1e3
        timings = {}
        for launch in [None, *shapes]:
            try:
                y = fp8_weight_only(x, *fp8[name], launch=launch).float()
                if ((y - ref).norm() / ref.norm()).item() > 1e-2:
                    continue
                timings[str(launch)] = round(time_graph(lambda: fp8_weight_only(x, *fp8[name], launch=launch),
                                                        iters=20), 4)
            except Exception as err:  # a shape that does not compile or fit (shared memory)
                timings[str(launch)] = f"{type(err).__name__}"
        ok = {k: v for k, v in timings.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        out[f"{name}_{M}"] = dict(K=K, N=N, rows=M, floor_ms=round(floor_ms, 4), default_ms=ok.get("None"),
                                  best=best, best_ms=ok[best], best_vs_floor=round(ok[best] / floor_ms, 2),
                                  default_vs_floor=round(ok.get("None", float("nan")) / floor_ms, 2), all=timings)
        print(json.dumps({k: v for k, v in out[f"{name}_{M}"].items() if k != "all"}), flush=True)
    return out


if __name__ == "__main__":
    main()
