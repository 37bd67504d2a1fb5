"""`lorazor serve`: the OpenAI API over the engine, driven by the official `openai` client on 127.0.0.1.

The server runs in this process (uvicorn in a thread, on a free loopback port) over the shipped
testbed; every text is compared with the offline `generate()` of the same prompts and adapters.
"""

import asyncio
import sys
import threading
import time

import httpx
import pytest
import torch
from servers import free_port, start_serve_command, stop_process_group, wait_healthy

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
NEW = 12


def serve_args(*extra):
    """`lorazor serve` arguments for the testbed, parsed as the command parses them."""
    import argparse

    from lorazor.serve.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--testbed", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                              "--num-kv-blocks", "512", *extra])


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request):
    """The server on 127.0.0.1 with its engine on a thread of this process, or in a process of its
    own (`lorazor serve`'s default); a separate copy of the testbed computes the offline references."""
    import functools

    from lorazor import LoRazorModel
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.serve.settings import ServerSettings
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    if request.param == "thread":
        engine, _ = build_engine(serve_args())
    else:
        engine = EngineProcess(functools.partial(process_hooks, build_engine, serve_args()))
    app = build_app(engine, tokenizer, model_name="testbed", chat_template=TEMPLATE,
                    settings=ServerSettings(enable_runtime_lora=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    yield dict(url=url, model=LoRazorModel.from_peft(peft_model), tokenizer=tokenizer, tasks=tasks)
    server.should_exit = True
    thread.join(timeout=30)
    if request.param == "process":
        assert not engine.process.is_alive()  # the app's shutdown ended the engine's process


def client(served):
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key="none", max_retries=0)


def offline(served, prompts, adapters, max_new_tokens=NEW):
    return served["model"].generate_text(
        prompts, adapters, tokenizer=served["tokenizer"], max_new_tokens=max_new_tokens, do_sample=False
    )


def task_prompts(served, n):
    tasks = served["tasks"]
    names = list(tasks)
    rows = [(names[i % len(names)], tasks[names[i % len(names)]].split("test")[i // len(names)]["prompt"])
            for i in range(n)]
    return [p for _, p in rows], [a if i % 5 else None for i, (a, _) in enumerate(rows)]


def test_completions_equal_offline_generate(served):
    prompts, adapters = task_prompts(served, 6)
    want = offline(served, prompts, adapters)
    c = client(served)
    for prompt, adapter, text in zip(prompts, adapters, want):
        r = c.completions.create(model=adapter or "testbed", prompt=prompt, max_tokens=NEW, temperature=0)
        assert r.choices[0].text == text
        assert r.usage.completion_tokens <= NEW and r.usage.prompt_tokens > 0
        stream = c.completions.create(model=adapter or "testbed", prompt=prompt, max_tokens=NEW, temperature=0,
                                      stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == text


def test_token_id_prompts_equal_text_prompts(served):
    c = client(served)
    prompts, adapters = task_prompts(served, 2)
    for prompt, adapter in zip(prompts, adapters):
        ids = served["tokenizer"](prompt)["input_ids"]
        by_text = c.completions.create(model=adapter or "testbed", prompt=prompt, max_tokens=NEW, temperature=0)
        by_ids = c.completions.create(model=adapter or "testbed", prompt=ids, max_tokens=NEW, temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text
        assert by_ids.usage.prompt_tokens == len(ids)


def test_incremental_text_equals_the_full_decode():
    from lorazor.serve.text import IncrementalText

    class Bytes:  # a byte-level tokenizer: a character may span several tokens
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "héllo wörld ✓ done"
    ids = list(text.encode())
    inc = IncrementalText(Bytes())
    seen = []
    for n in range(1, len(ids) + 1):
        seen.append(inc.update(ids[:n], finished=n == len(ids)))
        assert "\ufffd" not in seen[-1] and text.startswith(seen[-1])
    assert seen[-1] == text and seen[-2] == text[:-1]  # nothing held back once the characters are whole


def test_chat_equals_offline_generate_on_the_template(served):
    tok = served["tokenizer"]
    messages = [{"role": "user", "content": served["tasks"]["math"].split("test")[0]["prompt"]}]
    prompt = tok.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ref = served["model"].generate(ids, adapter_ids=["math"], max_new_tokens=NEW, do_sample=False,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    want = tok.decode(ref.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    c = client(served)
    r = c.chat.completions.create(model="math", messages=messages, max_tokens=NEW, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model="math", messages=messages, max_tokens=NEW, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want


def test_stop_sequences_are_cut_as_openai_does(served):
    prompts, adapters = task_prompts(served, 2)
    full = offline(served, prompts, adapters, max_new_tokens=20)
    c = client(served)
    for prompt, adapter, text in zip(prompts, adapters, full):
        stop = text[3:5] if len(text) > 6 else None
        if not stop:
            continue
        r = c.completions.create(model=adapter or "testbed", prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
        assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_models_and_adapter_load_unload_round_trip(served):
    from lorazor.testbed import ASSETS

    c = client(served)
    assert {m.id for m in c.models.list().data} == {"testbed", "math", "sql", "medqa", "science", "tools"}
    r = httpx.post(f"{served['url']}/v1/load_lora_adapter", json={"lora_name": "sql2",
                                                                   "lora_path": str(ASSETS / "adapters" / "sql")})
    assert r.status_code == 200, r.text
    assert "sql2" in {m.id for m in c.models.list().data}
    prompt = served["tasks"]["sql"].split("test")[0]["prompt"]
    same = [c.completions.create(model=m, prompt=prompt, max_tokens=NEW, temperature=0).choices[0].text
            for m in ("sql", "sql2")]
    assert same[0] == same[1]
    assert httpx.post(f"{served['url']}/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 200
    assert "sql2" not in {m.id for m in c.models.list().data}
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="sql2", prompt=prompt, max_tokens=2, temperature=0)


async def stream_all(served, prompts, adapters, max_tokens, *others):
    """Stream every prompt concurrently with the async `openai` client, beside the coroutines
    `others`; (their results, the texts in order)."""
    async def one(c, prompt, adapter):
        stream = await c.completions.create(model=adapter or "testbed", prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async with openai.AsyncOpenAI(base_url=f"{served['url']}/v1", api_key="none", max_retries=0, timeout=120) as c:
        results = await asyncio.gather(*others, *(one(c, p, a) for p, a in zip(prompts, adapters)))
    return results[:len(others)], results[len(others):]


def test_64_concurrent_streaming_clients_over_mixed_adapters(served):
    prompts, adapters = task_prompts(served, 64)
    want = offline(served, prompts, adapters, max_new_tokens=8)
    _, got = asyncio.run(stream_all(served, prompts, adapters, 8))
    assert got == want
    assert idle(served)


def test_an_async_engine_process_serves_concurrent_streams_and_stops():
    # The served engine in its own process with async scheduling (a GPU's default; forced on here):
    # 24 concurrent streams equal offline generate, and the process ends with the server.
    import functools

    from lorazor import LoRazorModel
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    engine = EngineProcess(functools.partial(process_hooks, build_engine, serve_args("--async-scheduling")))
    assert engine.info["async_scheduling"] is True
    # The spawned engine takes this process's torch threads (the test run's 1), not one per core.
    assert engine.info["torch_threads"] == torch.get_num_threads()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, tokenizer, model_name="testbed"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        served = dict(url=url, model=LoRazorModel.from_peft(peft_model), tokenizer=tokenizer, tasks=tasks)
        prompts, adapters = task_prompts(served, 24)
        _, got = asyncio.run(stream_all(served, prompts, adapters, 8))
        assert got == offline(served, prompts, adapters, max_new_tokens=8)
        assert idle(served)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not engine.process.is_alive()


def test_adapters_load_and_unload_while_streams_run(served):
    """Loads and unloads run between two engine steps (on the engine's thread), never inside one:
    the streams running meanwhile keep their offline outputs."""
    from lorazor.testbed import ASSETS

    prompts, adapters = task_prompts(served, 16)
    want = offline(served, prompts, adapters, max_new_tokens=16)

    async def churn():
        async with httpx.AsyncClient(base_url=served["url"], timeout=60) as h:
            codes = []
            for i in range(3):
                body = {"lora_name": f"medqa{i}", "lora_path": str(ASSETS / "adapters" / "medqa")}
                codes.append((await h.post("/v1/load_lora_adapter", json=body)).status_code)
                codes.append((await h.post("/v1/unload_lora_adapter", json={"lora_name": f"medqa{i}"})).status_code)
            return codes

    (codes,), got = asyncio.run(stream_all(served, prompts, adapters, 16, churn()))
    assert codes == [200] * 6
    assert got == want
    assert idle(served)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "physics", "prompt": "x", "max_tokens": 2}, 404, "model"),
    ({"model": "testbed", "max_tokens": 2}, 400, "prompt"),
    ({"model": "testbed", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "testbed", "prompt": "x", "max_tokens": 10**7}, 400, None),
    ({"model": "testbed", "prompt": "x " * 3000, "max_tokens": 2}, 400, None),
    ({"model": "testbed", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "testbed", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "testbed", "prompt": "x", "release": "soon"}, 400, "release"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, body, status, param):
    r = httpx.post(f"{served['url']}/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)
    assert client(served).completions.create(model="testbed", prompt="The", max_tokens=2, temperature=0).choices


def test_malformed_json_and_bad_adapter_paths(served, tmp_path):
    r = httpx.post(
        f"{served['url']}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{served['url']}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    r = httpx.post(f"{served['url']}/v1/load_lora_adapter", json={"lora_name": "../x", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "invalid adapter name" in r.json()["error"]["message"]
    r = httpx.post(f"{served['url']}/v1/chat/completions", json={"model": "testbed", "messages": []})
    assert r.status_code == 400


def metric(served, name) -> float:
    """The value of the series `name` (its first sample, whatever its labels)."""
    text = httpx.get(f"{served['url']}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith((name + " ", name + "{"))))


def idle(served) -> bool:
    """No request running or waiting, and every KV block free (as `/metrics` says)."""
    return all(metric(served, f"lorazor:{name}") == 0 for name in ("kv_cache_usage_perc", "num_requests_running",
                                                                  "num_requests_waiting"))


def test_a_client_that_disconnects_frees_its_blocks(served):
    body = {"model": "math", "prompt": served["tasks"]["math"].split("test")[0]["prompt"], "max_tokens": 100,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served['url']}/v1/completions", json=body) as r:
        for _ in r.iter_lines():
            break  # read the first event, then hang up
    deadline = time.monotonic() + 10
    while metric(served, "lorazor:kv_cache_usage_perc") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(served)
    text = httpx.get(f"{served['url']}/metrics").text
    assert "lorazor:time_to_first_token_seconds_count" in text and "lorazor:generation_tokens_total" in text
    assert 'lorazor:request_success_total{finished_reason="abort"' in text  # the client that left is counted


@pytest.mark.slow
def test_lorazor_serve_testbed_command_starts_serves_and_shuts_down():
    port = free_port()
    proc = start_serve_command("--testbed", "--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        r = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "How many", "max_tokens": 3,
                                                      "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert "lorazor" in r.json() and "release_step" in r.json()["lorazor"]
    finally:
        log = stop_process_group(proc, timeout=30)
    assert "shutdown: aborted 0 in-flight requests" in log, log[-2000:]
    # the startup configuration log
    assert "engine ready: device cpu" in log and "max_model_len 1024" in log
    assert "decode step eager, step-by-step scheduling" in log  # async only where a GPU runs the steps


def test_an_engine_process_that_fails_to_start_says_why():
    import functools

    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks

    with pytest.raises(RuntimeError, match="no_such_adapter_dir"):
        EngineProcess(functools.partial(process_hooks, build_engine,
                                        serve_args("--adapter", "x=/tmp/no_such_adapter_dir")))


def test_a_dead_engine_process_gets_503_and_health_says_so():
    """Requests to a server whose engine process died get a 503 with an OpenAI-style body (not a
    hang), and `/health` turns 503 so a supervisor can restart it."""
    import functools

    from fastapi.testclient import TestClient

    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.testbed import load_tokenizer

    engine = EngineProcess(functools.partial(process_hooks, build_engine, serve_args()))
    body = {"model": "testbed", "prompt": "The", "max_tokens": 2, "temperature": 0}
    with TestClient(build_app(engine, load_tokenizer(), model_name="testbed")) as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        engine.process.kill()
        engine.process.join(10)
        deadline = time.monotonic() + 10
        while http.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="already served an app"):  # its process ended with the app
        with TestClient(build_app(engine, load_tokenizer(), model_name="testbed")):
            pass


def test_the_app_shortens_the_thread_switch_interval_while_it_runs():
    """The engine's thread must get the GIL back soon after each GPU wait while the event loop
    streams: the app sets a short switch interval for its lifetime and restores Python's after."""

    from fastapi.testclient import TestClient

    from lorazor import LoRazorEngine, LoRazorModel
    from lorazor.serve import build_app
    from lorazor.serve.app import SWITCH_INTERVAL_S
    from lorazor.testbed import load

    peft_model, tokenizer, _ = load()
    engine = LoRazorEngine(LoRazorModel.from_peft(peft_model), max_num_seqs=4, num_kv_blocks=64)
    outer = sys.getswitchinterval()  # another app of this module may be running and have set it
    sys.setswitchinterval(0.004)
    try:
        with TestClient(build_app(engine, tokenizer)) as http:
            assert http.get("/health").status_code == 200
            assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(outer)


def test_compile_flag_takes_auto_on_off_and_refuses_other_words(capsys):
    from lorazor import LoRazorConfig
    from lorazor.config import config_from_args
    from lorazor.serve.cli import MODEL_FIELDS

    for words, value in (((), "auto"), (("--compile", "on"), True), (("--compile", "off"), False),
                         (("--compile", "auto"), "auto")):
        assert config_from_args(LoRazorConfig, serve_args(*words), MODEL_FIELDS).compile == value
    with pytest.raises(SystemExit):
        serve_args("--compile", "fast")
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_serve_quantization_fp8_builds_an_fp8_engine_equal_to_the_fp8_model():
    # `lorazor serve --testbed --quantization fp8`: every projection in fp8, and a request through
    # the served engine gets the tokens the same fp8 model gives offline (StepTrim release included).
    from lorazor import LoRazorConfig, LoRazorModel
    from lorazor.quant import Fp8Linear
    from lorazor.serve.cli import build_engine
    from lorazor.testbed import load

    engine, tokenizer = build_engine(serve_args("--quantization", "fp8"))
    assert engine.model.config.quantization == "fp8"
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.model.modules()) > 0
    offline = LoRazorModel.from_peft(load()[0], LoRazorConfig(quantization="fp8"))
    prompt = tokenizer("Q: 12 + 30 = ?\nA:")["input_ids"]
    name = engine.model.adapter_names[0]
    out = engine.generate([dict(prompt_ids=prompt, adapter=name, max_new_tokens=6, do_sample=False, release=2,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=None)])[0]
    ref = offline.generate(torch.tensor([prompt]), adapter_ids=[name], max_new_tokens=6, do_sample=False,
                           release=[2], pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
