"""The paper's accuracy results on the testbed, from its weights: Tables 1, 4 and 6, Figs 2, 13, 14.

    python -m lorazor.testbed.paper --out benchmarks/results/testbed_paper --docs docs/img/testbed \
        [--assets DIR] [--device cuda]
    python -m lorazor.testbed.paper --out /tmp/paper --limit 8 --train-limit 8     # a quick run (CI)

Per task, on the splits the paper uses them for:
- validation: the profiled curve (release after k decode steps, k in `LENGTHS`) and the learned
  head's curve over its thresholds (the head trains on paired continuations of the train split);
- test: full LoRA, backbone only, release at every k (Fig 2 and the per-request safe cutoffs of
  Fig 14), and the chosen operating points:
  - Table 1: training-free (the profiled k with the best validation accuracy at >= 50% skip) and
    learned P25 / P50 / P75 (thresholds at >= 25 / 50 / 75% validation skip), each with its
    realized test skip (Table 6);
  - Table 4: profiled and learned, each at the most validation skip within 2 points of full LoRA.
Writes `paper_tables.md/.json`, `fig2_release_step.png`, `fig13_pareto.png`, `fig14_cutoffs.png`
(the figures need matplotlib), and with `--docs DIR` copies the figures there too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

LENGTHS = (0, 1, 2, 3, 4, 8, 16, 32, 64)
SKIP_TARGETS = {"P25": 0.25, "P50": 0.5, "P75": 0.75}
BUDGET = 0.02  # Table 4's common validation accuracy budget (2 points)


def safe_cutoffs(full: list[bool], by_k: dict[int, list[bool]]) -> list[int | None]:
    """Per request that full LoRA answers correctly: the smallest k from which every later k of
    the grid stays correct (None: only full LoRA is safe). Requests full LoRA gets wrong are left out."""
    ks = sorted(by_k)
    cutoffs = []
    for i, ok in enumerate(full):
        if not ok:
            continue
        safe = None
        for k in reversed(ks):
            if not by_k[k][i]:
                break
            safe = k
        cutoffs.append(safe)
    return cutoffs


def choose(curve, **criterion):
    """`select_point` on a validation curve, or None when no point meets the criterion."""
    from lorazor.calibration.lengths import select_point

    try:
        return select_point(curve, **criterion)
    except ValueError:
        return None


def run_task(model, tokenizer, name, task, args, timings: dict) -> dict:
    from lorazor.calibration import ReleasePoint, calibrate_learned, policy_outcomes
    from lorazor.policies import LearnedRelease, ProfiledRelease
    from lorazor.testbed.calibrate import task_set

    val = task_set(task, "validation", args.limit, tokenizer)
    test = task_set(task, "test", args.limit, tokenizer)
    train = task_set(task, "train", args.train_limit, tokenizer)
    b = args.batch
    with torch.inference_mode():
        t = time.time()
        profiled = []
        for k in (None, *LENGTHS):
            correct, skip = policy_outcomes(model, tokenizer, name, val, ProfiledRelease({name: k}), b)
            profiled.append(ReleasePoint(k, sum(correct) / len(correct), skip))
        timings[f"{name}: validation, profiled"] = time.time() - t
        t = time.time()
        heads, learned_curves = calibrate_learned(model, tokenizer, {name: train}, {name: val}, min_skip=0.0,
                                                  batch_size=b)
        learned = learned_curves[name]
        w, bias, _ = heads.heads[name]
        timings[f"{name}: learned head and its validation curve"] = time.time() - t

        t = time.time()
        full, _ = policy_outcomes(model, tokenizer, name, test, ProfiledRelease({name: None}), b)
        backbone, _ = policy_outcomes(model, tokenizer, None, test, None, b)
        by_k = {k: policy_outcomes(model, tokenizer, name, test, ProfiledRelease({name: k}), b) for k in LENGTHS}
        by_tau = {}  # several rows often choose one threshold: run it on the test split once

        def on_test(point):
            if point is None:
                return None
            if point.tau is None:
                acc, skip = (full, 0.0) if point.k is None else by_k[point.k]
            else:
                if point.tau not in by_tau:
                    by_tau[point.tau] = policy_outcomes(model, tokenizer, name, test,
                                                        LearnedRelease({name: (w, bias, point.tau)}), b)
                acc, skip = by_tau[point.tau]
            return dict(k=point.k, tau=point.tau, val_accuracy=point.accuracy, val_skip=point.skip_fraction,
                        accuracy=sum(acc) / len(acc), skip=skip)

        rows = {"training-free (k, >=50% skip)": on_test(choose(profiled, min_skip=0.5))}
        rows.update({f"learned {p}": on_test(choose(learned, min_skip=q)) for p, q in SKIP_TARGETS.items()})
        budget = {"profiled": on_test(choose(profiled, max_accuracy_drop=BUDGET)),
                  "learned": on_test(choose(learned, max_accuracy_drop=BUDGET))}
        timings[f"{name}: test"] = time.time() - t
    mean = lambda c: sum(c) / len(c)  # noqa: E731
    return dict(task=name, full=mean(full), backbone=mean(backbone), prefill_only=mean(by_k[0][0]),
                curve={k: dict(accuracy=mean(c), skip=s) for k, (c, s) in by_k.items()},
                table1=rows, table4=budget, cutoffs=safe_cutoffs(full, {k: c for k, (c, _) in by_k.items()}),
                validation=dict(profiled=[p.__dict__ for p in profiled], learned=[p.__dict__ for p in learned]))


def _cell(point) -> str:
    return "n/a" if point is None else f"{point['accuracy']:.1%} ({point['skip']:.0%})"


def render(results: list[dict], meta: dict) -> str:
    names = list(results[0]["table1"]) if results else []
    lines = ["# The paper's accuracy results on the testbed", "", "```", json.dumps(meta, indent=2), "```", "",
             "## Table 1 (test accuracy; realized test decode-LoRA skip in brackets, the Table 6 analogue)", "",
             "| task | full LoRA | backbone only | prefill only | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in results:
        lines.append(f"| {r['task']} | {r['full']:.1%} | {r['backbone']:.1%} | {r['prefill_only']:.1%} | "
                     + " | ".join(_cell(r["table1"][n]) for n in names) + " |")
    lines += ["", f"## Table 4 (most validation skip within {BUDGET:.0%} of full LoRA's validation accuracy; test "
              "accuracy and skip)", "", "| task | full LoRA | profiled | learned |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['task']} | {r['full']:.1%} | {_cell(r['table4']['profiled'])} | "
                     f"{_cell(r['table4']['learned'])} |")
    lines += ["", "## Fig 2 (test accuracy after release at k; skip in brackets)", "",
              "| task | " + " | ".join(f"k={k}" for k in LENGTHS) + " |", "|---|" + "---|" * len(LENGTHS)]
    for r in results:
        lines.append(f"| {r['task']} | " + " | ".join(
            f"{r['curve'][k]['accuracy']:.0%} ({r['curve'][k]['skip']:.0%})" for k in LENGTHS) + " |")
    return "\n".join(lines) + "\n"


def _figure(results: list[dict], draw, ylabel: str, path: Path) -> None:
    """One panel per task, drawn by `draw(ax, result)`, saved to `path`."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3), squeeze=False)
    for ax, r in zip(axes[0], results):
        draw(ax, r)
        ax.set_title(r["task"])
    axes[0][0].set_ylabel(ylabel)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(results: list[dict], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # said, not skipped silently: the tables are written, the figures are not
        print("figures skipped: matplotlib is not installed (pip install matplotlib, or lorazor[bench])",
              file=sys.stderr)
        return
    matplotlib.use("Agg")

    def release_step(ax, r):  # Fig 2
        ax.plot(
            range(len(LENGTHS)), [100 * r["curve"][k]["accuracy"] for k in LENGTHS], marker="o", label="release at k"
        )
        ax.axhline(100 * r["full"], color="g", ls="--", lw=0.8, label="full LoRA")
        ax.axhline(100 * r["backbone"], color="k", ls=":", lw=0.8, label="backbone")
        ax.set_xticks(range(len(LENGTHS)), [str(k) for k in LENGTHS], fontsize=7)
        ax.set_xlabel("release step k")

    def pareto(ax, r):  # Fig 13
        for kind, marker in (("profiled", "o"), ("learned", "x")):
            pts = r["validation"][kind]
            ax.scatter([100 * p["skip_fraction"] for p in pts], [100 * p["accuracy"] for p in pts], marker=marker,
                       label=kind, s=18)
        ax.set_xlabel("validation decode-LoRA skip (%)")

    def cutoffs(ax, r):  # Fig 14
        counts = [r["cutoffs"].count(k) for k in LENGTHS] + [r["cutoffs"].count(None)]
        ax.bar(range(len(counts)), counts)
        ax.set_xticks(range(len(counts)), [str(k) for k in LENGTHS] + ["full"], fontsize=6)
        ax.set_xlabel("safe release cutoff k")

    _figure(results, release_step, "test accuracy (%)", out / "fig2_release_step.png")
    _figure(results, pareto, "validation accuracy (%)", out / "fig13_pareto.png")
    _figure(results, cutoffs, "test requests", out / "fig14_cutoffs.png")


def main(argv=None) -> None:
    from lorazor import LoRazorConfig, LoRazorModel
    from lorazor.testbed import load
    from lorazor.calibration.cli import environment_line
    from lorazor.testbed.calibrate import pick_tasks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--assets", type=Path, default=None, help="testbed weights (default: the shipped ones)")
    ap.add_argument("--limit", type=int, default=None, help="validation and test examples per task (default: all)")
    ap.add_argument("--train-limit", type=int, default=200, help="train prompts per task for the learned heads")
    ap.add_argument("--tasks", default=None, help="comma-separated tasks (default: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument(
        "--docs", type=Path, default=None, help="also copy the figures here (the docs read docs/img/testbed)"
    )
    args = ap.parse_args(argv)
    for flag in ("limit", "train_limit", "batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    start = time.time()
    peft_model, tokenizer, tasks = load(args.assets)
    tasks = pick_tasks(tasks, args.tasks)
    model = LoRazorModel.from_peft(peft_model.to(args.device), LoRazorConfig())
    from tqdm import tqdm

    timings, results = {}, []
    for name, task in tqdm(tasks.items(), desc="tasks", total=len(tasks)):
        results.append(run_task(model, tokenizer, name, task, args, timings))
    given = " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(command=f"python -m lorazor.testbed.paper {given}", environment=environment_line(model.device),
                date=time.strftime("%Y-%m-%d"), seconds=round(time.time() - start, 1),
                stage_seconds={k: round(v, 1) for k, v in timings.items()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paper_tables.json").write_text(json.dumps({"meta": meta, "tasks": results}, indent=2))
    text = render(results, meta)
    (args.out / "paper_tables.md").write_text(text)
    plot(results, args.out)
    if args.docs is not None:
        args.docs.mkdir(parents=True, exist_ok=True)
        for figure in sorted(args.out.glob("fig*.png")):
            shutil.copy(figure, args.docs / figure.name)
    print(text)


if __name__ == "__main__":
    main()
