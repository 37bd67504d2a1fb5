"""Structured outputs and tools over HTTP (the testbed, in-process engine, 127.0.0.1): the names
clients send (`response_format`, vLLM's `structured_outputs`, `tools`/`tool_choice`), 200 real-world
schemas, tool calls that always parse and validate, streaming that reassembles to the full answer,
each bad input a 400 naming its field while good streams beside it get what they get alone, and
docs/structured-outputs.md run as written."""

import asyncio
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from servers import run_uvicorn  # noqa: E402
from test_serve import serve_args  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "structured-outputs.md"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_structured_outputs import SCHEMA, schemastore, validates  # noqa: E402

# Function definitions of the kind assistants ship (OpenAI's cookbook style): enums, bounded strings
# and numbers, nested objects, arrays.
FUNCTIONS = [
    {"name": "get_current_weather", "description": "Get the current weather in a given location",
     "parameters": {"type": "object", "properties": {
         "location": {"type": "string", "maxLength": 24, "description": "The city and state, e.g. San Francisco, CA"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
         "required": ["location", "unit"], "additionalProperties": False}},
    {"name": "book_table", "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string", "maxLength": 16}, "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
        "required": ["restaurant", "people", "time"], "additionalProperties": False}},
    {"name": "search_products", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 20},
        "filters": {"type": "object", "properties": {
            "max_price": {"type": "number", "minimum": 0, "maximum": 1000},
            "in_stock": {"type": "boolean"}}, "required": ["in_stock"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "maxItems": 3}},
        "required": ["query", "filters"], "additionalProperties": False}},
    {"name": "convert_currency", "parameters": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 100000},
        "from_currency": {"enum": ["USD", "EUR", "JPY"]}, "to_currency": {"enum": ["USD", "EUR", "JPY"]}},
        "required": ["amount", "from_currency", "to_currency"], "additionalProperties": False}},
]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]
ASKS = ["What is the weather in Paris?", "Book a table for 4 at 19:30 at Luigi's.", "Find eco shoes under 80.",
        "Convert 250 dollars to euros.", "Is it raining in Oslo?", "Table for two at noon, please."]


@pytest.fixture(scope="module")
def server():
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.serve.settings import ServerSettings

    engine, tokenizer = build_engine(serve_args("--max-num-seqs", "64", "--num-kv-blocks", "2048"))
    url, stop = run_uvicorn(build_app(engine, tokenizer, model_name="testbed", settings=ServerSettings()))
    yield dict(url=url, tokenizer=tokenizer, engine=engine)
    stop()


def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none", max_retries=0, timeout=300)


def post(server, path, body):
    return httpx.post(f"{server['url']}{path}", json=body, timeout=300)


def test_response_format_json_schema_json_object_and_vllms_fields(server):
    c = client(server)
    r = c.chat.completions.create(model="math", messages=[{"role": "user", "content": "How many apples?"}],
                                  max_tokens=96, temperature=0,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "answer", "schema": SCHEMA, "strict": True}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "rows?"}], max_tokens=48,
                                  temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    for field, spec, check in [
            ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
            ("structured_outputs", {"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
            ("guided_choice", ["red", "blue"], lambda t: t in ("red", "blue")),
            ("structured_outputs", {"grammar": 'root ::= "A" | "B"'}, lambda t: t in ("A", "B"))]:
        r = post(server, "/v1/completions", {"model": "medqa", "prompt": "Answer:", "max_tokens": 12, field: spec})
        assert r.status_code == 200, r.text
        assert check(r.json()["choices"][0]["text"]), (field, spec, r.json())


@pytest.mark.slow
def test_200_schemastore_schemas_over_http_give_outputs_that_validate(server):
    schemas = schemastore()

    async def run():
        limit = asyncio.Semaphore(48)
        async with httpx.AsyncClient(base_url=server["url"], timeout=600) as h:
            async def one(i, schema):
                async with limit:
                    r = await h.post("/v1/completions", json={
                        "model": [None, "math", "sql", "medqa", "science"][i % 5] or "testbed",
                        "prompt": "Answer in JSON: ", "max_tokens": 128, "temperature": 0.8, "seed": i,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]
            return await asyncio.gather(*(one(i, s) for i, (_, s) in enumerate(schemas)))

    choices = asyncio.run(run())
    stopped = [(n, s, c["text"]) for (n, s), c in zip(schemas, choices) if c["finish_reason"] == "stop"]
    assert len(stopped) >= 30, len(stopped)
    bad = [(n, t) for n, s, t in stopped if not validates(json.loads(t), s)]
    assert not bad, bad[:3]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls_always_parse_and_validate(server, choice):
    c = client(server)
    by_name = {f["name"]: f for f in FUNCTIONS}
    calls = 0
    for i, ask in enumerate(ASKS):
        named = FUNCTIONS[i % len(FUNCTIONS)]["name"]
        tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": named}}
        r = c.chat.completions.create(model=["math", "sql", "medqa"][i % 3],
                                      messages=[{"role": "user", "content": ask}], tools=TOOLS,
                                      tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=160,
                                      temperature=0)
        out = r.choices[0]
        assert out.finish_reason in ("tool_calls", "length"), out
        if out.finish_reason == "length":
            continue
        assert out.message.content is None and len(out.message.tool_calls) == 1
        for call in out.message.tool_calls:
            assert call.type == "function" and call.id
            if choice == "named":
                assert call.function.name == named
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["parameters"])
            calls += 1
    assert calls >= len(ASKS) // 2


def test_streamed_tool_calls_and_schemas_reassemble_to_the_full_answer(server):
    c = client(server)
    for kwargs in [dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                   dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book_table"}}),
                   dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})]:
        args = dict(model="math", messages=[{"role": "user", "content": "Book it"}], max_tokens=160, temperature=0,
                    **kwargs)
        full = c.chat.completions.create(**args).choices[0]
        calls, text, finish = {}, "", None
        for chunk in c.chat.completions.create(stream=True, **args):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == full.finish_reason
        assert text == (full.message.content or "")
        want = [{"name": t.function.name, "arguments": t.function.arguments} for t in full.message.tool_calls or []]
        assert [calls[k] for k in sorted(calls)] == want


def test_a_conversation_with_tool_results_is_accepted(server):
    r = post(server, "/v1/chat/completions", {"model": "math", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_current_weather", "arguments": '{"location": "Rome", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}], "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
]


def test_each_bad_input_is_a_400_naming_its_field_and_good_streams_go_on(server):
    tok = server["tokenizer"]
    good = dict(model="sql", messages=[{"role": "user", "content": "How many rows?"}], max_tokens=24, temperature=0)
    want = client(server).chat.completions.create(**good).choices[0].message.content
    results = []

    def stream():
        text = "".join(ch.choices[0].delta.content or "" for ch in
                       client(server).chat.completions.create(stream=True, **good))
        results.append(text)

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    for body, param in BAD:
        r = post(server, "/v1/chat/completions", {"model": "math", "messages": [{"role": "user", "content": "hi"}],
                                                  **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    for t in threads:
        t.join(120)
    assert results == [want] * 3
    assert tok is not None


def test_auto_tool_choice_parses_each_family_format():
    from lorazor.serve.tools import ToolPlan, parse_hermes

    plan = ToolPlan("auto", ["get_current_weather", "book_table"], "hermes")
    content, calls = plan.calls('Let me check.<tool_call>\n{"name": "get_current_weather", "arguments": '
                                '{"location": "Rome", "unit": "celsius"}}\n</tool_call>')
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"])["location"] == "Rome"
    assert plan.calls("Just text.") == ("Just text.", [])
    assert parse_hermes("<tool_call>{broken</tool_call>") == ("", [])
    plan.parser = "llama3_json"
    _, calls = plan.calls('<|python_tag|>{"name": "book_table", "parameters": {"restaurant": "A", "people": 2}}; '
                          '{"name": "get_current_weather", "parameters": {"location": "B"}}')
    assert [c["function"]["name"] for c in calls] == ["book_table", "get_current_weather"]
    plan.parser = "mistral"
    _, calls = plan.calls('[TOOL_CALLS] [{"name": "book_table", "arguments": {"people": 3}}]')
    assert json.loads(calls[0]["function"]["arguments"]) == {"people": 3}
    _, calls = plan.calls('[TOOL_CALLS]get_current_weather[ARGS]{"location": "Oslo"}')
    assert calls[0]["function"]["name"] == "get_current_weather"
    _, calls = plan.calls('[TOOL_CALLS] [{"name": "undeclared", "arguments": {}}]')
    assert calls == []  # only declared functions become calls


@pytest.fixture(scope="module")
def auto_server():
    """The testbed served with "auto" tool choice, as `lorazor serve --testbed --enable-auto-tool-choice
    --tool-call-parser hermes` does."""
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.serve.settings import ServerSettings

    engine, tokenizer = build_engine(serve_args("--max-num-seqs", "32"))
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    url, stop = run_uvicorn(build_app(engine, tokenizer, model_name="testbed", settings=settings))
    yield dict(url=url, tokenizer=tokenizer, engine=engine)
    stop()


def test_auto_tool_choice_on_the_testbeds_tool_adapter_calls_for_tool_prompts_and_talks_otherwise(auto_server):
    """The "tools" adapter on held-out prompts (`lorazor.testbed.tool_task`, test split): a prompt that
    asks for a function gets `tool_calls` (the exact call: 80% of the validation split), small talk
    gets text, a conversation holding a tool's result gets the answer in text; the same prompt
    streamed reassembles to the same call."""
    from lorazor.testbed.tool_task import TOOLS as TESTBED_TOOLS
    from lorazor.testbed.tool_task import openai_messages, tool_task

    examples = tool_task().split("test")[:60]

    async def ask(h, example):
        r = await h.post("/v1/chat/completions", json={
            "model": "tools", "messages": openai_messages(example["messages"]), "tools": TESTBED_TOOLS,
            "max_tokens": 96, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    async def run():
        async with httpx.AsyncClient(base_url=auto_server["url"], timeout=600) as h:
            return await asyncio.gather(*(ask(h, e) for e in examples))

    choices = asyncio.run(run())
    by_kind = {}
    for example, choice in zip(examples, choices):
        calls = choice["message"].get("tool_calls") or []
        if example["kind"] == "call":
            exact = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
                (example["name"], example["arguments"])]
            by_kind.setdefault("call", []).append((choice["finish_reason"] == "tool_calls", exact))
        else:
            assert not calls and choice["finish_reason"] == "stop", (example["messages"], choice)
            by_kind.setdefault(example["kind"], []).append(choice["message"]["content"].strip() == example["text"])
    called = [c for c, _ in by_kind["call"]]
    exact = [e for _, e in by_kind["call"]]
    assert sum(called) >= 0.9 * len(called) and sum(exact) >= 0.7 * len(exact), by_kind["call"]
    assert all(by_kind["plain"]) and sum(by_kind["answer"]) >= 0.4 * len(by_kind["answer"]), by_kind
    first = next(e for e, (c, x) in zip([e for e in examples if e["kind"] == "call"], by_kind["call"]) if x)
    stream = client(auto_server).chat.completions.create(
        model="tools", messages=openai_messages(first["messages"]), tools=TESTBED_TOOLS, max_tokens=96,
        temperature=0, stream=True)
    parts, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            part = parts.setdefault(delta.index, {"name": "", "arguments": ""})
            part["name"] += delta.function.name or ""
            part["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [(first["name"], first["arguments"])]


def test_auto_tool_choice_needs_the_flags_and_the_settings_check_the_parser():
    from lorazor.serve.settings import TOOL_CALL_PARSERS, ServerSettings
    from lorazor.serve.tools import PARSERS

    assert tuple(PARSERS) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        ServerSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerSettings(tool_call_parser="qwen9")


@pytest.mark.slow
def test_the_structured_outputs_page_runs_as_written():
    from servers import free_port, start_serve_command, stop_process_group, wait_healthy

    port = free_port()
    text = PAGE.read_text()
    start = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0].strip()
    assert start.startswith("lorazor serve --testbed")
    proc = start_serve_command(*start.split()[2:], "--port", str(port))
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            done = subprocess.run([sys.executable, "-c", block.replace("8000", str(port))], capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, (block, done.stderr[-3000:])
            assert done.stdout.strip()
    finally:
        stop_process_group(proc, timeout=30)


def test_the_engine_process_compiles_off_its_loop_and_serves_the_same_constraints():
    """`lorazor serve`'s default engine process: a constrained request is queued once its grammar
    is compiled on a worker thread; its answer equals the in-process engine's."""
    import functools

    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.serve.settings import ServerSettings
    from lorazor.testbed import load_tokenizer

    tokenizer = load_tokenizer()
    engine = EngineProcess(functools.partial(process_hooks, build_engine, serve_args()))
    url, stop = run_uvicorn(build_app(engine, tokenizer, model_name="testbed", settings=ServerSettings()))
    local_engine, local_tok = build_engine(serve_args())
    local_url, local_stop = run_uvicorn(build_app(local_engine, local_tok, model_name="testbed",
                                                  settings=ServerSettings()))
    try:
        body = {"model": "math", "messages": [{"role": "user", "content": "How many apples?"}], "max_tokens": 48,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "a", "schema": SCHEMA}}}
        got = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        want = httpx.post(f"{local_url}/v1/chat/completions", json=body, timeout=300)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            **body, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    finally:
        stop()
        local_stop()
