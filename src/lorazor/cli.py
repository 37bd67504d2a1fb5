"""`lorazor` command line.

    lorazor demo                 one mixed-adapter batch on the testbed, checked against PEFT
    lorazor serve ...            an OpenAI-compatible server (`lorazor serve --testbed` on the CPU)
    lorazor calibrate ...        StepTrim calibration of your adapters on your data (`lorazor.calibration.cli`)
    lorazor eval ...             accuracy and decode skip of adapters under a policy folder (or none)
"""

from __future__ import annotations

import argparse
import copy
import sys
import time


NEXT_STEPS = """
What ran: one batch mixing four adapters and the backbone, decoded by LoRazor and by PEFT (the
reference), then again with StepTrim releasing adapters after a few decode steps.
Try next:
  lorazor serve --testbed                  the same model behind an OpenAI-compatible API (docs/serving.md;
                                           needs the serve extra: pip install "lorazor[serve]")
  lorazor demo --random --arch qwen2       a random tiny model of another architecture
  docs/quickstart.md                       your own PeftModel or adapter folders (docs/adapters.md)"""


def demo(args: argparse.Namespace) -> int:
    """The shipped testbed when its weights are installed, else a tiny random model."""
    from lorazor.testbed import ASSETS

    if not args.random and (ASSETS / "backbone" / "model.safetensors").exists():
        return demo_testbed(args)
    return demo_random(args)


def demo_testbed(args: argparse.Namespace) -> int:
    """Two test prompts per task plus two backbone rows in one batch: LoRazor vs PEFT, then StepTrim."""
    import torch

    from lorazor import LoRazorConfig, LoRazorModel, ProfiledRelease
    from lorazor.testbed import load

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    peft_model, tokenizer, tasks = load()
    oracle = copy.deepcopy(peft_model)
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(grid=args.grid))
    rows = [(name, ex) for name, task in tasks.items() for ex in task.split("test")[:2]]
    rows += [(None, tasks["medqa"].split("test")[2]), (None, tasks["sql"].split("test")[2])]
    adapters = [name for name, _ in rows]
    enc = tokenizer([ex["prompt"] for _, ex in rows], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=max(t.max_new_tokens for t in tasks.values()), eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id)
    start = time.perf_counter()
    out = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], adapter_ids=adapters, **kw)
    took = time.perf_counter() - start
    with torch.no_grad():
        ref = oracle.generate(**enc, do_sample=False, adapter_names=["__base__" if a is None else a for a in adapters],
                              **kw)
    T = enc["input_ids"].shape[1]
    texts = tokenizer.batch_decode(out.sequences[:, T:], skip_special_tokens=True)
    print(f"testbed: {sum(p.numel() for p in peft_model.parameters()) / 1e6:.1f}M-parameter Llama, adapters "
          f"{', '.join(tasks)}; one batch of {len(rows)} rows in {took:.2f} s on the CPU\n")
    ok = torch.equal(out.sequences, ref)
    for (name, ex), text in zip(rows, texts):
        task = tasks[name] if name else None
        verdict = ("correct" if task.score(text, ex) else "wrong") if task else "(backbone)"
        prompt = ex["prompt"].replace("\n", " / ")
        print(f"[{str(name):7}] {prompt[-60:]!r}\n          -> {text.strip()[:70]!r} {verdict}")
    print(f"\nall {len(rows)} rows equal PEFT generate(adapter_names=...): {ok}")
    print("(correct/wrong is each task's own check on the first two test prompts; docs/testbed.md has each task's "
          "accuracy. The backbone rows show what the adapters add.)")
    # Release lengths from the testbed's validation curves (docs/testbed.md): math, medqa and science
    # keep their accuracy after a few adapter steps; sql needs its adapter to the end.
    policy = ProfiledRelease({"math": 4, "medqa": 2, "science": 8})
    released = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], adapter_ids=adapters,
                              release_policy=policy, **kw)
    texts = tokenizer.batch_decode(released.sequences[:, T:], skip_special_tokens=True)
    right = sum(tasks[n].score(t, ex) for (n, ex), t in zip(rows, texts) if n)
    print(f"StepTrim {policy.lengths}: release steps {released.release_steps.tolist()}; "
          f"{right}/{sum(1 for n in adapters if n)} adapter rows correct; decode LoRA calls skipped: "
          f"{released.skip_fraction:.0%}")
    print(NEXT_STEPS)
    return 0 if ok else 1


def demo_random(args: argparse.Namespace) -> int:
    """Tiny random model, three adapters, one left-padded mixed batch: LoRazor vs PEFT, then StepTrim."""
    import torch

    from lorazor import LoRazorConfig, LoRazorModel, ProfiledRelease
    from lorazor.tiny import DEFAULT_ADAPTERS, tiny_peft_model

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    peft_model = tiny_peft_model(args.arch).to(device)
    oracle = copy.deepcopy(peft_model)
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(grid=args.grid))
    print(f"backbone: tiny random {args.arch} on {device}; adapters: "
          + ", ".join(f"{a.name} (r={a.r}, alpha={a.alpha}{', rsLoRA' if a.rslora else ''}, {len(a.targets)} modules)"
                      for a in DEFAULT_ADAPTERS))
    g = torch.Generator().manual_seed(0)
    adapters = ["math", "sql", None, "med", "math", "sql"]
    ids = torch.randint(3, 96, (len(adapters), 8), generator=g)
    mask = torch.ones_like(ids)
    for i, pad in enumerate([0, 3, 1, 0, 5, 2]):
        mask[i, :pad] = 0
    ids[mask == 0] = 0
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(max_new_tokens=args.max_new_tokens, pad_token_id=0, eos_token_id=2)

    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, **kw)
    took = time.perf_counter() - start
    with torch.no_grad():
        ref = oracle.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                              adapter_names=["__base__" if a is None else a for a in adapters], **kw)
    T = ids.shape[1]
    print(f"\none batch of {len(adapters)} rows, {args.max_new_tokens} new tokens ({took * 1e3:.0f} ms):")
    print(f"{'row':>3}  {'adapter':8} {'pad':>3}  {'LoRazor tokens':40} PEFT")
    ok = True
    for i, a in enumerate(adapters):
        mine, theirs = out.sequences[i, T:].tolist(), ref[i, T:].tolist()
        same = mine == theirs
        ok &= same
        print(f"{i:>3}  {str(a):8} {int((mask[i] == 0).sum()):>3}  {' '.join(map(str, mine))[:40]:40} "
              f"{'same' if same else 'DIFFERENT: ' + ' '.join(map(str, theirs))}")
    print(f"\nmatches PEFT generate(adapter_names=...): {ok}")

    policy = ProfiledRelease({"math": 4, "sql": 0, "med": None})
    released = model.generate(ids, attention_mask=mask, adapter_ids=adapters, release_policy=policy, **kw)
    print(f"\nStepTrim {policy.lengths}: release step per row {released.release_steps.tolist()} "
          f"(-1: kept or no adapter); decode LoRA calls skipped: {released.skip_fraction:.0%}")
    return 0 if ok else 1


def serve(args: argparse.Namespace) -> int:
    """`lorazor serve`: one server (`lorazor.serve`), or with `--replicas` replicas of it on Ray
    Serve (`lorazor.ray`, which builds on `lorazor.serve`; the server knows nothing of Ray)."""
    from lorazor.serve.cli import main as serve_main
    from lorazor.serve.cli import require_serve_extra

    if args.replicas:
        require_serve_extra()
        from lorazor.ray import run_local

        return run_local(args)
    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    """The `lorazor` parser: `demo` and `serve` here; `calibrate` and `eval` keep their own
    (`lorazor.calibration.cli`), which get everything after the command."""
    from lorazor import __version__
    from lorazor.serve.cli import add_arguments
    from lorazor.tiny import ARCHITECTURES

    parser = argparse.ArgumentParser(prog="lorazor", description="Many LoRA adapters, one backbone, one batch.")
    parser.add_argument("--version", action="version", version=f"lorazor {__version__}")
    sub = parser.subcommands = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="one mixed-adapter batch on a tiny model, checked against PEFT")
    p.add_argument("--arch", default="llama", choices=list(ARCHITECTURES), help="the random model's family")
    p.add_argument("--grid", default="exact", choices=["full", "active_rows", "two_class", "exact"],
                   help="the LoRA kernels' grid mode")
    p.add_argument("--max-new-tokens", type=int, default=12, help="tokens per row (random-model demo)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (random-model demo)")
    p.add_argument("--random", action="store_true", help="use a tiny random model even if the testbed is installed")
    p.set_defaults(func=demo)
    p = sub.add_parser("serve", help="an OpenAI-compatible server over the engine (see docs/serving.md)")
    add_arguments(p)
    p.set_defaults(func=serve)
    sub.add_parser("calibrate", help="StepTrim calibration of your adapters on your data (`lorazor calibrate -h`)")
    sub.add_parser("eval", help="accuracy and decode skip under a policy folder (`lorazor eval -h`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("calibrate", "eval"):
        from lorazor.calibration.cli import main as calibration_main
        from lorazor.testbed.calibrate import TESTBED  # the testbed plugs into calibration as a source

        return calibration_main(argv[0], argv[1:], [TESTBED])
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    sub = parser.subcommands.choices[args.command]
    if extras:
        sub.error(unrecognized(extras, sub))
    if args.command == "serve":
        from lorazor.serve.cli import check_args, vllm_compatible

        vllm_compatible(args, sub)
        check_args(args)
    return args.func(args)


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments `parser` does not take, with the closest flag it does take."""
    import difflib

    flags = [option for action in parser._actions for option in action.option_strings]
    first = next((e for e in extras if e.startswith("-")), extras[0]).split("=", 1)[0]
    close = difflib.get_close_matches(first, flags, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


if __name__ == "__main__":
    sys.exit(main())
