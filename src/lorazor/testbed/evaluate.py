"""Accuracy of the testbed tasks under full LoRA, backbone only, prefill only and release at k.

    python -m lorazor.testbed.evaluate --out benchmarks/results [--assets DIR] [--limit 300] [--positions 0,4,16]

Writes `testbed_accuracy.md/.json` and `testbed_release_curve.png`: the paper's Fig. 2 for the
testbed (accuracy change against release position k, with the decode-skip % at each k, per task).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RELEASE_POSITIONS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def run_task(model, tokenizer, task, name: str, mode, split: str = "test", limit: int | None = None,
             batch: int = 100) -> tuple[float, float]:
    """(accuracy, decode-skip fraction) of one task. mode: "full", "backbone", or an int k (release)."""
    from lorazor.calibration import evaluate_release

    examples = task.split(split)[:limit]
    point = evaluate_release(
        model, tokenizer, None if mode == "backbone" else name, [ex["prompt"] for ex in examples],
        lambda text, i: task.score(text, examples[i]), mode if isinstance(mode, int) else None, batch,
        max_new_tokens=task.max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return point.accuracy, point.skip_fraction


def main(argv=None) -> None:
    from lorazor import LoRazorConfig, LoRazorModel
    from lorazor.testbed import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--assets", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=None, help="examples per task (default: the whole test split)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", default=",".join(map(str, RELEASE_POSITIONS)),
                    help="release positions k of the curve, comma-separated (0, prefill only, is always run)")
    args = ap.parse_args(argv)
    try:
        positions = sorted({0} | {int(k) for k in args.positions.split(",") if k.strip()})
    except ValueError:
        ap.error(f"--positions must be comma-separated ints, got {args.positions!r}")
    if positions[0] < 0:
        ap.error(f"--positions must be >= 0, got {positions[0]}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    peft_model, tokenizer, tasks = load(args.assets)
    model = LoRazorModel.from_peft(peft_model.to(args.device), LoRazorConfig())
    rows, start = [], time.time()
    for name, task in tasks.items():
        full, _ = run_task(model, tokenizer, task, name, "full", limit=args.limit)
        base, _ = run_task(model, tokenizer, task, name, "backbone", limit=args.limit)
        curve = {k: run_task(model, tokenizer, task, name, k, limit=args.limit) for k in positions}
        rows.append(dict(task=name, full=full, backbone=base, prefill_only=curve[0][0],
                         curve={k: dict(accuracy=a, skip=s) for k, (a, s) in curve.items()}))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(command=" ".join(sys.argv), seconds=round(time.time() - start, 1), torch=torch.__version__,
                limit=args.limit, positions=positions, date=time.strftime("%Y-%m-%d"))
    table = "# Testbed accuracy (test split, greedy)\n\n```\n" + json.dumps(meta, indent=2) + "\n```\n\n"
    table += "| task | full LoRA | backbone only | prefill only | full - backbone (points) |\n|---|---|---|---|---|\n"
    table += "".join(f"| {r['task']} | {r['full']:.1%} | {r['backbone']:.1%} | {r['prefill_only']:.1%} | "
                     f"{100 * (r['full'] - r['backbone']):+.1f} |\n" for r in rows)
    table += "\nAccuracy change against full LoRA (points) / decode LoRA calls skipped, by release position k:\n\n"
    table += (
        "| task | "
        + " | ".join(f"k={k}" for k in positions)
        + " |\n|---|"
        + "---|" * len(positions)
        + "\n"
    )
    for r in rows:
        cells = [f"{100 * (r['curve'][k]['accuracy'] - r['full']):+.1f} / {r['curve'][k]['skip']:.0%}"
                 for k in positions]
        table += f"| {r['task']} | " + " | ".join(cells) + " |\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "testbed_accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "testbed_accuracy.md").write_text(table)
    plot(rows, args.out / "testbed_release_curve.png")
    print(table)


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3), sharey=True)
    for ax, r in zip(axes, rows):
        ks = list(r["curve"])
        ax.plot(range(len(ks)), [100 * (r["curve"][k]["accuracy"] - r["full"]) for k in ks], marker="o")
        ax.axhline(100 * (r["backbone"] - r["full"]), color="k", ls="--", lw=0.8, label="backbone only")
        ax.set_xticks(range(len(ks)), [f"{k}\n{r['curve'][k]['skip']:.0%}" for k in ks], fontsize=7)
        ax.set_title(r["task"])
        ax.set_xlabel("release k / decode skip")
    axes[0].set_ylabel("accuracy change vs full LoRA (points)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
