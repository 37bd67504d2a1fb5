"""The prefix cache through the server: OpenAI's `usage.prompt_tokens_details.cached_tokens`, vLLM's
counters in `/metrics`, the same text with the cache on and off, and `--no-enable-prefix-caching`."""

import pytest

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def apps():
    from fastapi.testclient import TestClient

    from lorazor import LoRazorEngine, LoRazorModel
    from lorazor.serve import build_app
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    model = LoRazorModel.from_peft(peft_model)
    clients = {}
    for caching in (True, False):
        engine = LoRazorEngine(model, max_num_seqs=8, num_kv_blocks=256, enable_prefix_caching=caching)
        clients[caching] = TestClient(build_app(engine, tokenizer, model_name="testbed")).__enter__()
    yield clients, tasks
    for client in clients.values():
        client.__exit__(None, None, None)


def counter(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"lorazor:{name}_total"))
    return float(line.rsplit(" ", 1)[1])


def test_cached_tokens_in_usage_and_metrics_and_the_same_text(apps):
    clients, tasks = apps
    system = tasks["sql"].split("test")[0]["prompt"] * 3  # a long shared prefix (> 3 blocks of 16)
    bodies = [{"model": "sql", "prompt": system + tasks["sql"].split("test")[i]["prompt"], "max_tokens": 8,
               "temperature": 0} for i in (1, 2)]
    on, off = clients[True], clients[False]
    before = on.get("/metrics").text
    first, second = (on.post("/v1/completions", json=b).json() for b in bodies)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 and cached % 16 == 0 and cached < second["usage"]["prompt_tokens"]
    for body, got in zip(bodies, (first, second)):
        want = off.post("/v1/completions", json=body).json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = on.get("/metrics").text
    queries = counter(after, "prefix_cache_queries") - counter(before, "prefix_cache_queries")
    hits = counter(after, "prefix_cache_hits") - counter(before, "prefix_cache_hits")
    assert queries == first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert hits == cached
    assert counter(off.get("/metrics").text, "prefix_cache_hits") == 0
    # Another adapter on the same text finds nothing.
    other = on.post("/v1/completions", json=dict(bodies[1], model="math")).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_streamed_usage_reports_cached_tokens(apps):
    import json

    clients, tasks = apps
    prompt = tasks["math"].split("test")[3]["prompt"] * 4
    body = {"model": "math", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    clients[True].post("/v1/completions", json=body)
    with clients[True].stream("POST", "/v1/completions", json=dict(body, stream=True,
                                                                   stream_options={"include_usage": True})) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16


def test_the_flag_turns_the_cache_off():
    import argparse

    from lorazor.serve.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--testbed"]).enable_prefix_caching is True
    assert parser.parse_args(["--testbed", "--no-enable-prefix-caching"]).enable_prefix_caching is False
