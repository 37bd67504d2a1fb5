"""`lorazor calibrate` and `lorazor eval`: StepTrim for your own base model, adapters and data.

    lorazor calibrate --model BASE --adapter sql=./sql-lora --adapter math=./math-lora \\
        --data val.jsonl --metric exact_match --min-skip 0.5 --out policies/
    lorazor eval --model BASE --adapter sql=./sql-lora --data test.jsonl --metric exact_match \\
        --policy-dir policies/
    lorazor calibrate --testbed --min-skip 0.5 --out policies/     # the shipped testbed, same path

`calibrate` writes, per adapter, the files `load_release_policy` and `lorazor serve
--release-policy DIR` read, and `calibration.json` / `calibration.md`: accuracy with the adapter to
the end, at every release setting tried, the realized decode skip, and the chosen point and why.

Where the model, adapters and data come from is a *source*: `--model`/`--adapter`/`--data` here,
and others that plug in (`Source`): the shipped testbed's (`lorazor.testbed.calibrate`) adds
`--testbed`. This module knows no source but its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# A chosen setting that loses more validation accuracy than this (a fraction) is said loudly, not
# silently written: a --min-skip target can be met only by settings that break the adapter.
LARGE_DROP = 0.10
METRIC_HELP = ("exact_match, prefix_match, contains, regex:PATTERN, choice, python:MODULE:FUNCTION, "
               "evaluate:NAME (see docs/steptrim.md)")


class CalibrationError(SystemExit):
    """A refusal: printed as one line and exit status 2."""

    def __init__(self, message: str):
        super().__init__(f"lorazor: error: {message}")
        self.code = 2


class Source:
    """Where a run's model, tokenizer, adapters and data come from, beside `--model`/`--adapter`.

    `add_arguments(group)` adds its flags; `applies(args)` says whether the parsed arguments ask for
    it; `check(args)` refuses flags of its own given without it; `load(args, device)` returns
    (model, tokenizer, adapter names, generation settings) and may fill `args.data`,
    `args.train_data` and `args.metric` with its own."""

    def add_arguments(self, group) -> None:
        pass

    def applies(self, args) -> bool:
        return False

    def check(self, args) -> None:
        pass

    def load(self, args, device: str):
        raise NotImplementedError


def add_common(ap: argparse.ArgumentParser, sources=()) -> None:
    src = ap.add_argument_group("model and adapters")
    src.add_argument("--model", help="base model id or folder (Hugging Face)")
    src.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                     help="a PEFT adapter folder to calibrate, under NAME (repeat for several)")
    for source in sources:
        source.add_arguments(src)
    src.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    src.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu or cuda")
    data = ap.add_argument_group("data")
    data.add_argument("--data", help="jsonl, json, csv or parquet file, or a Hugging Face dataset id")
    data.add_argument("--split", help="the split of a Hugging Face dataset --data (default: validation)")
    data.add_argument(
        "--columns", help="FIELD=COLUMN pairs for other column names, e.g. prompt=question,reference=answer"
    )
    data.add_argument("--metric", help=METRIC_HELP)
    data.add_argument("--max-new-tokens", type=int, default=128, help="answer length when rows do not say (128)")
    data.add_argument("--limit", type=int, help="examples per adapter (default: all)")
    ap.add_argument("--batch-size", type=int, default=64, help="requests the engine runs at once (64)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")


def parser(command: str, sources=()) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"lorazor {command}")
    add_common(ap, sources)
    if command == "calibrate":
        ap.add_argument("--policy", choices=("profiled", "learned"), default="profiled")
        rule = ap.add_mutually_exclusive_group()
        rule.add_argument("--min-skip", help="operating points: the best validation accuracy among settings that "
                          "skip at least this share of decode LoRA calls; several: 0.25,0.5,0.75")
        rule.add_argument("--max-drop", type=float, help="the most skipping within this many accuracy points of the "
                          "adapter kept to the end (2 = two points; below 1 it is a fraction: 0.02)")
        ap.add_argument("--lengths",
                        help="profiled: release lengths k to try, e.g. 0,2,8 (default: 0-4, 8, 16, 32, 64)")
        ap.add_argument("--train-data", help="learned: the prompts heads train on (same format as --data)")
        ap.add_argument("--train-split", help="learned: the split of a Hugging Face dataset --train-data "
                        "(default: train)")
        ap.add_argument("--train-limit", type=int, default=200, help="learned: training examples per adapter (200)")
        ap.add_argument("--seed", type=int, help="learned: shuffle the training examples with this seed before "
                        "--train-limit (default: the data's order)")
        ap.add_argument("--out", type=Path, required=True, help="folder for the policies and the report")
    else:
        ap.add_argument("--policy-dir", type=Path, help="policies saved by `lorazor calibrate` (default: none, "
                        "every adapter to the end)")
        ap.add_argument("--out", type=Path, help="also write eval.json here")
    return ap


def targets_of(args) -> list[dict]:
    """The selection rules asked for: one dict of `select_point` arguments each."""
    if args.max_drop is not None:
        drop = args.max_drop / 100 if args.max_drop >= 1 else args.max_drop
        if drop < 0:
            raise CalibrationError(f"--max-drop must be >= 0, got {args.max_drop}")
        return [dict(max_accuracy_drop=drop)]
    try:
        values = [float(v) for v in (args.min_skip or "0.5").split(",")]
    except ValueError:
        raise CalibrationError(f"--min-skip {args.min_skip!r}: give fractions such as 0.5 or 0.25,0.5,0.75") from None
    bad = [v for v in values if not 0 <= v <= 1]
    if bad:
        raise CalibrationError(f"--min-skip values must be in [0, 1], got {bad}")
    return [dict(min_skip=v) for v in values]


def refuse_ignored(args) -> None:
    """A flag that would not apply to this run is refused, never ignored."""
    learned = getattr(args, "policy", None) == "learned"
    unused = [("--lengths", getattr(args, "lengths", None), learned, "sets the profiled policy's candidates"),
              ("--train-data", getattr(args, "train_data", None), not learned, "is for --policy learned"),
              ("--train-split", getattr(args, "train_split", None), not learned, "is for --policy learned"),
              ("--seed", getattr(args, "seed", None), not learned, "is for --policy learned")]
    for flag, value, ignored, why in unused:
        if value is not None and ignored:
            raise CalibrationError(f"{flag} {value} does not apply here: it {why}")


def load_inputs(args, sources=()):
    """(model, tokenizer, validation sets, training sets) from the arguments: the first source
    that applies, else `--model` and `--adapter`."""
    import torch

    from .data import DataError, load_validation, parse_columns
    from .scorers import resolve_metric

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    refuse_ignored(args)
    source = next((s for s in sources if s.applies(args)), None)
    for other in sources:
        if other is not source:
            other.check(args)
    if source is not None:
        model, tokenizer, names, gen = source.load(args, device)
    else:
        model, tokenizer, names, gen = load_model_and_adapters(args, device)
    if not args.data or not args.metric:
        raise CalibrationError("give --data (a file or a dataset id) and --metric (" + METRIC_HELP + ")")
    try:
        scorer = resolve_metric(args.metric)
        columns = parse_columns(args.columns)

        def read(data, split, limit, seed=None, default_split="validation"):
            return load_validation(data, names, scorer, args.metric, tokenizer, args.max_new_tokens, split, columns,
                                   gen, limit, seed, default_split)

        validation = read(args.data, args.split, args.limit)
        train = None
        if getattr(args, "policy", None) == "learned":
            if not args.train_data:
                raise CalibrationError("--policy learned trains its heads on other prompts: give --train-data")
            train = read(args.train_data, args.train_split, args.train_limit, args.seed, default_split="train")
    except (DataError, ValueError) as err:
        raise CalibrationError(str(err)) from None
    return model, tokenizer, validation, train


def load_model_and_adapters(args, device: str):
    """(model, tokenizer, adapter names, generation settings) from `--model` and `--adapter`."""
    from ..config import LoRazorConfig
    from ..model import LoRazorModel

    if not args.model or not args.adapter:
        raise CalibrationError("give --model BASE and at least one --adapter NAME=PATH")
    adapters = {}
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CalibrationError(f"--adapter {spec!r}: give NAME=PATH")
        if not Path(path).is_dir():
            raise CalibrationError(f"--adapter {spec!r}: {path!r} is not a folder")
        adapters[name] = path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    kw = dict(device_map=device) if device != "cpu" else {}
    try:
        model = LoRazorModel.from_pretrained(args.model, adapters, LoRazorConfig(dtype=args.dtype), **kw)
    except (NotImplementedError, ValueError, OSError) as err:  # refused from config.json, before weights
        raise CalibrationError(str(err)) from None
    return model, tokenizer, list(adapters), dict(eos_token_id=tokenizer.eos_token_id,
                                                  pad_token_id=tokenizer.pad_token_id)


def environment_line(device) -> str:
    """Commit (when run from a git checkout), package versions and device, for a results file."""
    import os
    import subprocess

    import peft
    import torch
    import transformers

    commit = os.environ.get("LORAZOR_COMMIT", "")[:7]  # the GPU machine's copy of the tree has no .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return (f"commit {commit}; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}; {device.type}")


def large_drop_warning(name: str, label: str, point, full) -> str:
    return (f"lorazor calibrate: warning: adapter {name!r} ({label}): the chosen {describe(point)} loses "
            f"{100 * (full.accuracy - point.accuracy):.1f} points of validation accuracy ({full.accuracy:.1%} -> "
            f"{point.accuracy:.1%}) to skip {point.skip_fraction:.0%} of decode LoRA calls; --max-drop bounds the "
            "loss instead")


def describe(point) -> str:
    return f"tau={point.tau:.4g}" if point.tau is not None else ("k=never" if point.k is None else f"k={point.k}")


def why(target: dict, point, full) -> str:
    if "min_skip" in target:
        return (f"the best validation accuracy among settings skipping >= {target['min_skip']:.0%} of decode "
                f"LoRA calls ({point.accuracy:.1%}, {100 * (point.accuracy - full.accuracy):+.1f} points)")
    return (f"the most skipping ({point.skip_fraction:.0%}) within {100 * target['max_accuracy_drop']:.1f} points "
            f"of the adapter kept to the end")


def write_report(out: Path, args, curves: dict, choices: dict, seconds: float, device) -> str:
    """`calibration.json` + `calibration.md` in `out`; returns the Markdown."""
    given = " ".join(args.argv)
    lines = [f"# StepTrim {args.policy} calibration", "", f"`lorazor calibrate {given}`", "",
             "| adapter | setting | validation accuracy | vs kept to the end | decode LoRA skipped | chosen for |",
             "|---|---|---|---|---|---|"]
    report = {"command": f"lorazor calibrate {given}", "policy": args.policy, "seconds": round(seconds, 1),
              "adapters": {}}
    for name, curve in curves.items():
        full = next(p for p in curve if p.is_full_lora)
        for p in curve:
            tags = [label for label, (point, _) in choices[name].items() if point is p]
            lines.append(f"| {name} | {describe(p)} | {p.accuracy:.1%} | {100 * (p.accuracy - full.accuracy):+.1f} | "
                         f"{p.skip_fraction:.0%} | {', '.join(tags)} |")
        report["adapters"][name] = {
            "kept_to_the_end": {"accuracy": full.accuracy},
            "points": [dict(p.__dict__, setting=describe(p)) for p in curve],
            "chosen": {label: dict(setting=describe(p), accuracy=p.accuracy, skip=p.skip_fraction, why=reason)
                       for label, (p, reason) in choices[name].items()},
        }
    lines += ["", "Chosen, and why:", ""]
    for name, picked in choices.items():
        full = next(p for p in curves[name] if p.is_full_lora)
        for label, (p, reason) in picked.items():
            lines.append(f"- {name}, {label}: {describe(p)}: {reason}; realized skip {p.skip_fraction:.0%}.")
            if full.accuracy - p.accuracy > LARGE_DROP:
                lines.append(f"  **Warning**: {large_drop_warning(name, label, p, full).split(': ', 2)[2]}.")
    lines += ["", f"k=never / tau=-inf keep the adapter to the end. {environment_line(device)}; "
              f"{time.strftime('%Y-%m-%d')}; took {seconds:.0f} s."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(report, indent=2))
    text = "\n".join(lines) + "\n"
    (out / "calibration.md").write_text(text)
    return text


def calibrate(argv: list[str], sources=()) -> int:
    from ..calibration import DEFAULT_RELEASE_LENGTHS, calibrate_learned, calibrate_profiled, select_point
    from ..policies import LearnedRelease, ProfiledRelease, save_release_policy
    from .data import DataError

    args = parser("calibrate", sources).parse_args(argv)
    args.command, args.argv = "calibrate", argv
    targets = targets_of(args)
    start = time.time()
    model, tokenizer, validation, train = load_inputs(args, sources)
    progress = not args.no_progress
    first = targets[0]
    try:
        lengths = [int(k) for k in args.lengths.split(",")] if args.lengths else list(DEFAULT_RELEASE_LENGTHS)
    except ValueError:
        raise CalibrationError(f"--lengths {args.lengths!r}: give ints such as 0,1,2,4,8") from None
    # The curves do not depend on the rule: compute them once, with the first rule, then select per rule.
    rule = dict(first, min_skip=0.0) if "min_skip" in first else first
    try:
        if args.policy == "profiled":
            _, curves = calibrate_profiled(model, tokenizer, validation, **rule, lengths=lengths,
                                           batch_size=args.batch_size, progress=progress)
        else:
            learned, curves = calibrate_learned(model, tokenizer, train, validation, **rule,
                                                batch_size=args.batch_size, progress=progress)
    except DataError as err:  # a scorer that raised, naming the example
        raise CalibrationError(str(err)) from None
    choices, failures = {name: {} for name in curves}, []
    for target in targets:
        label = ", ".join(f"{k.replace('_accuracy', '').replace('_', '-')} {v:g}" for k, v in target.items())
        for name, curve in curves.items():
            full = next(p for p in curve if p.is_full_lora)
            try:
                point = select_point(curve, **target)
            except ValueError:
                best = max(curve, key=lambda p: p.skip_fraction)
                failures.append(f"adapter {name!r}: no setting skips {target['min_skip']:.0%} of decode LoRA calls; "
                                f"the most any reaches is {best.skip_fraction:.0%} ({describe(best)})")
                continue
            choices[name][label] = (point, why(target, point, full))
            if full.accuracy - point.accuracy > LARGE_DROP:
                print(large_drop_warning(name, label, point, full), file=sys.stderr)
    seconds = time.time() - start
    print(write_report(args.out, args, curves, choices, seconds, model.device))
    if failures:
        raise CalibrationError("; ".join(failures) + f" (every curve is in {args.out / 'calibration.md'})")
    for label in choices[next(iter(choices))]:
        folder = args.out if len(targets) == 1 else args.out / label.replace(" ", "_")
        if args.policy == "profiled":
            policy = ProfiledRelease({name: picked[label][0].k for name, picked in choices.items()})
        else:
            policy = LearnedRelease({name: (*learned.heads[name][:2], picked[label][0].tau)
                                     for name, picked in choices.items()})
        save_release_policy(policy, folder)
        print(f"policy ({label}) saved under {folder}/<adapter>/: `lorazor serve --release-policy {folder}`")
    return 0


def evaluate(argv: list[str], sources=()) -> int:
    from ..calibration.runs import run_cases
    from ..policies import ProfiledRelease, load_release_policy
    from .data import DataError

    args = parser("eval", sources).parse_args(argv)
    args.command, args.argv = "eval", argv
    model, tokenizer, validation, _ = load_inputs(args, sources)
    policy = None
    if args.policy_dir is not None:
        try:
            policy = load_release_policy(args.policy_dir)
        except (OSError, ValueError, KeyError) as err:
            raise CalibrationError(f"--policy-dir {str(args.policy_dir)!r}: {err}") from None
    # No policy: every adapter to the end, said explicitly so the model's default does not apply.
    cases = [(name, data, policy or ProfiledRelease({name: None})) for name, data in validation.items()]
    try:
        results = run_cases(model, tokenizer, cases, args.batch_size, not args.no_progress, desc="evaluation")
    except DataError as err:
        raise CalibrationError(str(err)) from None
    rows = {name: dict(accuracy=sum(c) / len(c), decode_lora_skipped=skip, examples=len(c))
            for (name, _, _), (c, skip) in zip(cases, results)}
    print(f"policy: {args.policy_dir or 'none (adapters kept to the end)'}")
    print("| adapter | examples | accuracy | decode LoRA skipped |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['examples']} | {r['accuracy']:.1%} | {r['decode_lora_skipped']:.0%} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "eval.json").write_text(json.dumps(dict(command=f"lorazor eval {' '.join(argv)}", rows=rows,
                                                            policy_dir=str(args.policy_dir or "")), indent=2))
    return 0


def main(command: str, argv: list[str] | None = None, sources=()) -> int:
    """Run `command` with these extra `sources`; a refusal is printed as one line on stderr and
    returns 2."""
    argv = sys.argv[2:] if argv is None else argv
    try:
        return calibrate(argv, sources) if command == "calibrate" else evaluate(argv, sources)
    except CalibrationError as err:
        print(err.args[0], file=sys.stderr)
        return 2
