"""Structured outputs on the GPU: what constraining half of the mixed trace costs, and a new schema's TTFT.

    python benchmarks/bench_structured.py --out benchmarks/results/structured     # GPU, Llama-3.2-3B shape
    python benchmarks/bench_structured.py --tiny --requests 24 --out /tmp/s        # CPU check of the logic

Llama-3.2-3B shape with random bf16 weights, 128 random rank-8 adapters, LoRazor (exact grid + StepTrim)
at the engine's defaults (`bench_engine.setup`), the mixed trace of `engine_workload` (1,024 requests).
Every other request decodes under one of `SCHEMAS` (tool arguments, an extraction record, a list of
items) over a 128,256-token vocabulary (`probes/grammar_cost.synthetic_info`: no tokenizer of that
size can be downloaded on the GPU machine). One engine, in order:
1. `constrained`: the trace with its schemas (compiled beforehand: a cached schema, the steady
   state): req/s, each request's output length, the host's mask time per step; every output that
   finished "stop" is checked against its schema;
2. `plain`: the same requests without constraints, each output length set to what it was in run 1
   (EOS ignored): the same tokens of work without the grammar;
3. `constrained` again (the drift between runs).
Then, on the idle engine, TTFT of one request under a schema never seen (its compile included),
under the same schema again (cached), and unconstrained, for each of 5 new schemas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "probes")]
import engine_workload as wl  # noqa: E402
from bench_engine import offline_requests, setup  # noqa: E402
from common import environment, mask_timer  # noqa: E402

ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                                          "unit": {"enum": ["kg", "box", "piece"]}},
        "required": ["name", "quantity", "unit"], "additionalProperties": False}
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["city", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 64}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street"]}},
     "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 1},
                                      "total": {"type": "number"}}, "required": ["items", "total"]},
]


def new_schema(i: int) -> dict:
    """A schema no earlier request used (its own property names), as a new tenant's would be."""
    return {"type": "object", "properties": {f"field_{i}_{k}": {"type": t} for k, t in
                                             enumerate(["string", "integer", "boolean", "number"])},
            "required": [f"field_{i}_0", f"field_{i}_1"]}


def printable_info(size: int):
    """The tiny model's vocabulary as printable ASCII (token i is chr(32 + i)): JSON can be written."""
    import xgrammar as xgr

    vocab = [bytes([32 + i]) for i in range(size)]
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=size, stop_token_ids=[size - 1])


def valid_fraction(outs, specs, vocab_bytes, stop_ids) -> tuple[int, int]:
    """(outputs that finished "stop" under a schema, those of them whose text parses and validates;
    the grammar's stop token, which ends such an output, is not text)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    done = ok = 0
    for out, spec in zip(outs, specs):
        if spec is None or out.finish_reason != "stop":
            continue
        done += 1
        ids = out.token_ids[:-1] if out.token_ids and out.token_ids[-1] in stop_ids else out.token_ids
        text = b"".join(vocab_bytes[t] for t in ids).decode("utf-8", "replace")
        try:
            value = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(value, spec["json"])
            ok += 1
        except Exception:
            pass
    return done, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/structured"))
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on this machine (checks the logic)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    args = ap.parse_args()
    args.part, args.kv_gb, args.max_num_seqs, args.max_num_batched_tokens = "exact", None, None, None
    from grammar_cost import synthetic_info

    t0 = time.perf_counter()
    model, engine, names, vocab, shape = setup(args)
    captured = engine.warm_up()
    info = synthetic_info(vocab) if not args.tiny else printable_info(vocab)
    vocab_bytes = info.decoded_vocab
    workload = wl.build(args.requests, vocab)
    if args.tiny:
        for r in workload:
            r.prompt, r.max_new_tokens = r.prompt[:16], min(r.max_new_tokens, 24)
    ks = wl.release_lengths(workload, wl.TARGET_SKIP)
    plain = offline_requests(workload, wl.assign(workload, len(names)), names, ks, True)
    specs = [{"json": SCHEMAS[(i // 2) % len(SCHEMAS)]} if i % 2 == 0 else None for i in range(len(plain))]
    constrained = [dict(r, **({"structured_output": s, "tokenizer": info} if s else {})) for r, s in zip(plain, specs)]
    rows, meta = [], dict(environment(), requests=len(plain), constrained_share=0.5, vocab=vocab,
                          graphs_captured=captured, compile=model.config.compile, **shape)
    engine.generate(constrained[:64])  # schemas compiled, prefill tiles warm: the steady state is timed

    def record(**row):
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(row), flush=True)
        rows.append(row)

    def run(name, requests):
        engine.pool.reset_cache()
        steps, step = [0], engine.step

        def counted():
            steps[0] += 1
            return step()

        engine.step = counted  # the engine's generate() loop calls self.step()
        start = time.perf_counter()
        try:
            with mask_timer() as spent:
                outs = engine.generate(requests)
        finally:
            del engine.step
        seconds = time.perf_counter() - start
        steps = steps[0]
        record(run=name, seconds=seconds, req_s=len(outs) / seconds, out_tokens=sum(len(o.token_ids) for o in outs),
               steps=steps, mask_fills=len(spent), mask_ms_per_step=sum(spent) / max(steps, 1),
               mask_ms_max=max(spent, default=0.0))
        return outs

    outs = run("constrained", constrained)
    done, ok = valid_fraction(outs, specs, vocab_bytes, set(info.stop_token_ids))
    record(run="validity", finished_stop=done, valid=ok,
           finished_length=sum(1 for o, s in zip(outs, specs) if s and o.finish_reason == "length"))
    same_lengths = [dict(r, max_new_tokens=max(1, len(o.token_ids))) for r, o in zip(plain, outs)]
    run("plain", same_lengths)
    run("constrained", constrained)
    by_run = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append(row)
    mean_constrained = statistics.mean(r["req_s"] for r in by_run["constrained"])
    record(run="summary", constrained_vs_plain=mean_constrained / by_run["plain"][0]["req_s"])

    def ttft(spec) -> float:
        extra = {"structured_output": spec, "tokenizer": info} if spec else {}
        start = time.perf_counter()
        rid = engine.add_request(workload[0].prompt, adapter=names[0], max_new_tokens=2, **extra)
        while not engine.requests[rid].output:
            engine.step()
        first = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        return first * 1e3

    ttft(None)
    new, cached, none = [], [], []
    for i in range(5):
        schema = {"json": new_schema(i)}
        new.append(ttft(schema))
        cached.append(ttft(schema))
        none.append(ttft(None))
    record(run="ttft", new_schema_ms=statistics.median(new), cached_schema_ms=statistics.median(cached),
           unconstrained_ms=statistics.median(none), new_all_ms=[round(x, 1) for x in new])
    meta["setup_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "structured_tiny.json" if args.tiny else "structured_trace.json"
    command = "python benchmarks/bench_structured.py" + (" --tiny" if args.tiny else "")
    (args.out / name).write_text(json.dumps(dict(command=command, **meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
