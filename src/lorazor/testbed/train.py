"""Train the testbed: a tiny Llama backbone on domain prose, then one rank-8 LoRA per task with PEFT.

    python -m lorazor.testbed.train --out <dir>     # the shipped testbed's recipe (v2; 6 minutes on one H200)
    python -m lorazor.testbed.train --out <dir> --only tools   # one adapter on the backbone already in <dir>
    python -m lorazor.testbed.train --version 1 --out <dir> --pretrain-steps 600 --adapter-steps 400 \
        --batch 32 --seq 192                          # the earlier character-level testbed (not shipped)

Writes `backbone/` (config + safetensors), `tokenizer/`, `adapters/<task>/` (PEFT format) and
`train_log.json` (command, seeds, steps, losses, seconds). Everything is seeded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .tool_task import tool_task

BACKBONE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=512)
# v2: about 8M parameters, so the fp16 backbone ships in under 20 MB with its BPE vocabulary.
BACKBONE_V2 = dict(hidden_size=320, intermediate_size=896, num_hidden_layers=6, num_attention_heads=5,
                   num_key_value_heads=1, max_position_embeddings=1024)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def backbone_config(tokenizer, shape: dict = BACKBONE):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       tie_word_embeddings=True, **shape)


@dataclass
class Recipe:
    """What a testbed version trains on: its tasks, corpus (`corpus(num_chars, seed)`), tokenizer,
    backbone shape, characters per token of the corpus, and, when given, `documents(num_chars, seed)`:
    the same corpus as a list of documents, each closed by EOS in training (so a backbone learns to
    stop where an answer ends)."""

    tasks: dict
    corpus: object
    tokenizer: object
    shape: dict
    chars_per_token: float = 1.0
    documents: object = None


def recipe(version: int, seed: int) -> Recipe:
    """The training recipe of testbed `version` (2: shipped; 1: the earlier character-level one)."""
    from . import pretraining_documents, pretraining_text, tasks_of_version, train_tokenizer

    tasks = tasks_of_version(version)
    if version == 1:
        from .v1.corpus import pretraining_text as v1_text
        from .v1.tokenizer import build_tokenizer

        return Recipe(tasks, v1_text, build_tokenizer(), BACKBONE)
    # The tokenizer learns from a sample of the corpus and the tasks' training text.
    sample = pretraining_text(2_000_000, seed)
    texts = [sample[i:i + 10_000] for i in range(0, len(sample), 10_000)]
    texts += [ex["prompt"] + ex["reference"] for task in tasks.values() for ex in task.split("train")]
    return Recipe(tasks, pretraining_text, train_tokenizer(texts), BACKBONE_V2, 3.7, documents=pretraining_documents)


def _lr(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 20)
    return peak * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


def _autocast(device: torch.device):
    """bf16 autocast on a GPU (fp32 master weights; several times faster there), none on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def corpus_ids(recipe: Recipe, tokenizer, num_tokens: int, seed: int) -> torch.Tensor:
    """About `num_tokens` token ids of the recipe's corpus, with EOS after each document if it has them."""
    if recipe.documents is not None:
        docs = recipe.documents(int(num_tokens * recipe.chars_per_token), seed)
        return torch.tensor([t for part in tokenizer(docs)["input_ids"] for t in part + [tokenizer.eos_token_id]])
    text = recipe.corpus(int(num_tokens * recipe.chars_per_token), seed)
    chunks = [text[i:i + 100_000] for i in range(0, len(text), 100_000)]
    return torch.tensor([t for part in tokenizer(chunks)["input_ids"] for t in part])


def pretrain(model, tokenizer, steps: int, batch: int, seq: int, device, seed: int, log: dict,
             recipe: Recipe | None = None) -> None:
    if recipe is None:  # testbed v1's character corpus
        from .v1.corpus import pretraining_text as v1_text

        recipe = Recipe(None, v1_text, tokenizer, BACKBONE)
    # A quarter of the tokens the steps read, distinct (random windows revisit them), at least a batch.
    ids = corpus_ids(recipe, tokenizer, steps * batch * seq // 4 + seq * batch, seed)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model.train()
    start = time.time()
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq] for s in starts]).to(device)
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, 3e-3)
        with _autocast(device):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log.setdefault("pretrain_loss", []).append((step, round(loss.item(), 4)))
            print(f"pretrain {step}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()


def task_batches(task, tokenizer, batch: int, g: torch.Generator):
    """Left-padded prompt + reference + eos; the loss covers the reference and eos only. Examples
    are tokenized once (tokenizing each batch anew held a GPU run back)."""
    examples = [
        (tokenizer(ex["prompt"])["input_ids"], tokenizer(ex["reference"])["input_ids"] + [tokenizer.eos_token_id])
        for ex in task.split("train")
    ]
    while True:
        picks = torch.randint(0, len(examples), (batch,), generator=g).tolist()
        width = max(len(examples[i][0]) + len(examples[i][1]) for i in picks)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        lab = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for j, i in enumerate(picks):
            p, r = examples[i]
            ids[j, width - len(p) - len(r):] = torch.tensor(p + r)
            lab[j, width - len(r):] = torch.tensor(r)
            mask[j, width - len(p) - len(r):] = 1
        yield ids, lab, mask


def train_adapter(base, name: str, task, tokenizer, steps: int, batch: int, device, seed: int, log: dict,
                  rank: int = 8, lr: float = 3e-3, clip: float | None = None, fp32: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0)
    from ..model.build import quiet_peft

    with quiet_peft():
        model = get_peft_model(base, cfg, adapter_name=name)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    batches = task_batches(task, tokenizer, batch, torch.Generator().manual_seed(seed))
    model.train()
    for step in range(steps):
        ids, lab, mask = next(batches)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr)
        with _autocast(device) if not fp32 else contextlib.nullcontext():
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                         labels=lab.to(device)).loss
        loss.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
            if not torch.isfinite(norm):  # a step that would turn the weights into NaN is skipped, and counted
                opt.zero_grad(set_to_none=True)
                log[f"{name}_skipped_steps"] = log.get(f"{name}_skipped_steps", 0) + 1
                continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            log.setdefault(f"{name}_loss", []).append((step, round(loss.item(), 4)))
            print(f"{name} {step}/{steps} loss {loss.item():.3f}", flush=True)
    model.eval()
    return model


# Adapters trained on a finished backbone, beside the four task adapters (`--only NAME`): the task,
# and its LoRA settings (the tool task's answers start far from the backbone's text, loss ~12: at the
# four tasks' lr 3e-3 without clipping it diverged to NaN; rank 16 also puts two ranks in the testbed).
EXTRA_ADAPTERS = {"tools": (tool_task, dict(rank=16, lr=1e-3, clip=1.0, fp32=True))}


def save_adapter(model, out: Path, name: str) -> None:
    """The adapter in fp16 under `out/adapters/<name>`, its base named by folder, without PEFT's empty card."""
    model.half().save_pretrained(out / "adapters")  # fp16 like the backbone: the testbed ships in < 20 MB
    (out / "adapters" / "README.md").unlink(missing_ok=True)
    config = out / "adapters" / name / "adapter_config.json"
    # The backbone by its folder name, not this machine's path to it.
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "backbone"},
                                 indent=2, sort_keys=True))


@torch.no_grad()
def validation_accuracy(model, tokenizer, task, device, batch: int = 50) -> dict:
    """Greedy accuracy on the validation split, overall and by the examples' `kind` where they have one."""
    examples, right = task.split("validation"), {}
    for b in range(0, len(examples), batch):
        part = examples[b:b + batch]
        enc = tokenizer([ex["prompt"] for ex in part], return_tensors="pt", padding=True).to(device)
        with _autocast(device):
            out = model.generate(**enc, max_new_tokens=task.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for ex, row in zip(part, out[:, enc["input_ids"].shape[1]:]):
            ok = task.score(tokenizer.decode(row, skip_special_tokens=True), ex)
            for key in ("all", ex.get("kind")):
                if key is not None:
                    right.setdefault(key, []).append(ok)
    return {key: round(sum(v) / len(v), 3) for key, v in right.items()}


def train_extra(args, argv) -> None:
    """`--only NAME`: one adapter on the backbone in `args.out`; its log goes to `NAME_train_log.json`."""
    from transformers import AutoModelForCausalLM

    from . import load_tokenizer

    start = time.time()
    device = torch.device(args.device)
    make_task, settings = EXTRA_ADAPTERS[args.only]
    tokenizer, task = load_tokenizer(args.out), make_task()
    # No machine paths in what ships: the output folder by its name.
    given = [args.out.name if a == str(args.out) else a for a in (argv if argv is not None else sys.argv[1:])]
    command = " ".join(["python -m lorazor.testbed.train", *given])
    log = {"command": command, "torch": torch.__version__, "device": str(device)}
    base = AutoModelForCausalLM.from_pretrained(args.out / "backbone", dtype=torch.float32).to(device)
    settings = dict(settings, fp32=settings.get("fp32", False) and not args.bf16)
    model = train_adapter(base, args.only, task, tokenizer, args.adapter_steps, args.batch, device, args.seed, log,
                          **settings)
    log[f"{args.only}_seconds"] = round(time.time() - start, 1)
    log["validation"] = validation_accuracy(model, tokenizer, task, device)
    print(json.dumps(log["validation"]), flush=True)
    save_adapter(model, args.out, args.only)
    (args.out / f"{args.only}_train_log.json").write_text(json.dumps(log, indent=2) + "\n")


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "assets")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pretrain-steps", type=int, default=6000)
    ap.add_argument("--adapter-steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--version", type=int, choices=[1, 2], default=2,
                    help="testbed version (2: shipped; 1: the earlier character-level one)")
    ap.add_argument("--only", choices=sorted(EXTRA_ADAPTERS),
                    help="train only this adapter, on the backbone and tokenizer already in --out")
    ap.add_argument("--bf16", action="store_true", help="with --only: bf16 autocast on a GPU (default: fp32)")
    args = ap.parse_args(argv)
    if args.only:
        return train_extra(args, argv)
    start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    parts = recipe(args.version, args.seed)
    tasks, tokenizer = parts.tasks, parts.tokenizer
    # No machine paths in what ships: the command as a module call, the output folder by its name.
    command = " ".join(["python -m lorazor.testbed.train", *(argv if argv is not None else sys.argv[1:])])
    log = {"command": command, "args": {k: (v.name if isinstance(v, Path) else str(v)) for k, v in vars(args).items()},
           "torch": torch.__version__, "device": str(device)}
    base = AutoModelForCausalLM.from_config(backbone_config(tokenizer, parts.shape)).to(device)
    log["backbone_parameters"] = sum(p.numel() for p in base.parameters())
    pretrain(base, tokenizer, args.pretrain_steps, args.batch, args.seq, device, args.seed, log, parts)
    log["pretrain_seconds"] = round(time.time() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    base.half().save_pretrained(args.out / "backbone")
    from .tokenizer import CHAT_TEMPLATE

    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(args.out / "tokenizer")
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2))
    for i, (name, task) in enumerate(tasks.items()):
        fresh = AutoModelForCausalLM.from_pretrained(args.out / "backbone", dtype=torch.float32).to(device)
        t = time.time()
        model = train_adapter(fresh, name, task, tokenizer, args.adapter_steps, args.batch, device, args.seed + i, log)
        save_adapter(model, args.out, name)
        log[f"{name}_seconds"] = round(time.time() - t, 1)
        (args.out / "train_log.json").write_text(json.dumps(log, indent=2))  # a run cut short keeps its log
    log["total_seconds"] = round(time.time() - start, 1)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=2))


if __name__ == "__main__":
    main()
