"""Calibration runs on the engine: every (adapter, release setting, prompt) of a calibration in one
continuous batch, mixed across adapters and settings, on the model's device.

    results = run_cases(model, tokenizer, [(adapter, validation_set, policy), ...], progress=True)
    # one (per-prompt correctness, realized decode skip) per case

A case's policy is any `ReleasePolicy` (None: the model's default); each request carries its own,
so every operating point of every adapter decodes in the same steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Requests running at once; KV blocks are sized for this many of the longest.
DEFAULT_MAX_NUM_SEQS = 64
BLOCK_SIZE = 16


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a text prompt (as the tokenizer adds special tokens), or the ids themselves."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return list(prompt)


def run_requests(model, tokenizer, requests: list[dict], max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 progress: bool = False, desc: str = "generating"):
    """(answer texts, `RequestOutput`s) of engine requests (`add_request` arguments, `prompt` text
    or ids instead of `prompt_ids`), in order, through one engine sized for them."""
    from ..engine import LoRazorEngine

    if not requests:
        return [], []
    prepared = [dict({k: v for k, v in r.items() if k != "prompt"}, prompt_ids=encode_prompt(tokenizer, r["prompt"]))
                for r in requests]
    # Sizing only (a request past the length limit is refused by the engine, naming it).
    longest = max(len(r["prompt_ids"]) + (r.get("max_new_tokens") or 256) for r in prepared)
    seqs = max(1, min(max_num_seqs, len(prepared)))
    per_seq = -(-longest // BLOCK_SIZE)
    limit = model.runner.max_position_embeddings
    engine = LoRazorEngine(model, max_num_seqs=seqs, max_num_batched_tokens=max(2048, longest),
                           num_kv_blocks=seqs * per_seq + 1, block_size=BLOCK_SIZE,
                           max_model_len=min(per_seq * BLOCK_SIZE, limit) if limit else per_seq * BLOCK_SIZE)
    outputs = _with_progress(engine, prepared, desc) if progress else engine.generate(prepared)
    texts = tokenizer.batch_decode([o.token_ids for o in outputs], skip_special_tokens=True)
    return texts, outputs


def _with_progress(engine, requests, desc):
    from tqdm.auto import tqdm

    ids = [engine.add_request(**r) for r in requests]
    done = {}
    with tqdm(total=len(ids), desc=desc, unit="req") as bar:
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    return [done[i] for i in ids]


def run_cases(model, tokenizer, cases: Sequence[tuple], max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
              progress: bool = False, desc: str = "calibration") -> list[tuple[list[bool], float]]:
    """Per case `(adapter, ValidationSet, policy)`: (per-prompt correctness, decode LoRA calls
    skipped over calls needed). `adapter` None runs the backbone (skip 1.0 by definition)."""
    requests, spans = [], []
    for adapter, data, policy in cases:
        if not data.prompts:
            raise ValueError("prompts is empty: calibration needs validation prompts")
        start = len(requests)
        for prompt in data.prompts:
            requests.append(dict(prompt=prompt, adapter=adapter, release_policy=policy, **data.generate_kwargs))
        spans.append((start, len(requests)))
    with torch.inference_mode():
        texts, outputs = run_requests(model, tokenizer, requests, max_num_seqs, progress, desc)
    results = []
    for (adapter, data, _), (start, end) in zip(cases, spans):
        correct = [bool(data.score(texts[i], i - start)) for i in range(start, end)]
        needed = sum(outputs[i].decode_steps for i in range(start, end))
        used = sum(outputs[i].lora_decode_steps for i in range(start, end))
        skip = 1.0 if adapter is None else (0.0 if needed == 0 else 1.0 - used / needed)
        results.append((correct, skip))
    return results
