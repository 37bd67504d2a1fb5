"""Probe: the host cost of structured outputs at a Llama-3-sized vocabulary (128,256 tokens), on this
machine's CPU: compiling a schema the first time (what a new schema adds to its first request's
TTFT), finding it cached, and filling the bitmasks of 128 constrained rows (the host's part of a
batch-256 decode step with half its rows constrained).

    python benchmarks/probes/grammar_cost.py --out benchmarks/results/structured

The vocabulary is synthetic (`synthetic_info`: no 128k tokenizer can be downloaded here): a real
tokenizer's merges change the numbers. The mask's cost depends on the grammar state far more than
on the row count: three states are timed.
The schemas: a tool call's arguments, an extraction schema with nesting, enums, arrays and `$ref`,
and the first 20 SchemaStore schemas the test suite decodes (`tests/engine/schemastore_200.json`).
"""

import argparse
import json
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 128256


def synthetic_info(size: int = VOCAB):
    """xgrammar's view of a 128,256-token vocabulary built from a real one: the testbed tokenizer's
    2,355 byte-level BPE tokens, then concatenations of 2-3 of them (seeded), as larger BPE
    vocabularies are merges of smaller pieces. Purely random pieces would put quotes and braces in
    far more tokens than a trained tokenizer has, and overstate the mask's cost."""
    import xgrammar as xgr

    from lorazor.testbed import load_tokenizer

    base = [b for b in xgr.TokenizerInfo.from_huggingface(load_tokenizer()).decoded_vocab if b]
    rng = random.Random(0)
    vocab = list(dict.fromkeys([bytes([b]) for b in range(256)] + base))
    seen = set(vocab)
    while len(vocab) < size:
        piece = b"".join(rng.choice(base) for _ in range(rng.choice((2, 2, 3))))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=size, stop_token_ids=[2])


# Grammar states whose masks 128 rows fill per step: (name, schema, the output so far).
STATES = [
    ("inside an unbounded string", {"type": "object", "properties": {"text": {"type": "string"}},
                                    "required": ["text"]}, '{"text": "ab'),
    ("inside an integer after an enum", {"type": "object", "properties": {
        "unit": {"enum": ["apples", "rows"]}, "n": {"type": "integer"}}, "required": ["unit", "n"]},
     '{"unit": "apples", "n": 1'),
    ("inside a string of maxLength 12", {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}},
     '{"text": "ab'),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "structured")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests" / "engine"), str(ROOT / "tests" / "serve"), str(ROOT / "tests")]
    import torch

    from lorazor.runner.grammar import GrammarCache, MaskBuffers, fill_masks
    from test_structured_outputs import SCHEMA, schemastore
    from test_structured_outputs_served import FUNCTIONS

    cache = GrammarCache(synthetic_info(), VOCAB)
    specs = {"tool: " + f["name"]: {"json": f["parameters"]} for f in FUNCTIONS}
    specs["extraction schema"] = {"json": SCHEMA}
    specs.update({f"schemastore: {n}": {"json": s} for n, s in schemastore(20)})
    rows = []
    for name, spec in specs.items():
        start = time.perf_counter()
        cache.compile(spec)
        cold = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        cache.compile(json.loads(json.dumps(spec)))
        cached = (time.perf_counter() - start) * 1e3
        rows.append(dict(schema=name, compile_ms=round(cold, 2), cached_ms=round(cached, 3)))
        print(json.dumps(rows[-1]), flush=True)
    masks = []
    for name, schema, prefix in STATES:
        constraints = [cache.constraint({"json": schema}) for _ in range(128)]
        for c in constraints:  # byte by byte: the vocabulary's first 256 tokens are the bytes
            assert all(c.matcher.accept_token(b) for b in prefix.encode()), name
        buffers, fills = MaskBuffers(), []
        for _ in range(5):
            mask = buffers.take(256, VOCAB, pin=False)
            start = time.perf_counter()
            fill_masks(mask, constraints, list(range(0, 256, 2)))
            fills.append((time.perf_counter() - start) * 1e3)
        masks.append(dict(state=name, fill_128_rows_ms=round(statistics.median(fills), 2)))
        print(json.dumps(masks[-1]), flush=True)
    compile_ms = [r["compile_ms"] for r in rows]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    from importlib.metadata import version

    summary = dict(command="python benchmarks/probes/grammar_cost.py", commit=commit.strip(), cpu=platform.processor()
                   or platform.machine(), torch=torch.__version__, xgrammar=version("xgrammar"), vocab=VOCAB,
                   schemas=len(rows),
                   compile_ms_median=round(statistics.median(compile_ms), 1), compile_ms_max=round(max(compile_ms), 1),
                   cached_ms_max=max(r["cached_ms"] for r in rows), masks=masks, rows=rows)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_cost_cpu.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
