"""`lorazor serve` as many users share it: one client never harms another, nobody gets in uninvited,
and OpenAI / vLLM clients get what they ask for. One test (or more) per finding of the hostile-client
review; the real `openai` client drives the server wherever a client is involved.

The module's server: the shipped testbed, the engine in its own process (`lorazor serve`'s default),
an API key, runtime adapter loading enabled under a temporary root, on 127.0.0.1.
"""

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from servers import run_uvicorn, copy_testbed_lora_root  # noqa: E402
from test_serve import (TEMPLATE, free_port, serve_args, start_serve_command, stop_process_group,  # noqa: E402
                        wait_healthy)

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lorazor import LoRazorModel
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.serve.settings import ServerSettings
    from lorazor.testbed import load

    root = copy_testbed_lora_root(tmp_path_factory)
    peft_model, tokenizer, tasks = load()
    engine = EngineProcess(functools.partial(process_hooks, build_engine, serve_args()))
    settings = ServerSettings(api_key=KEY, enable_runtime_lora=True, lora_root=root, max_registered_loras=7,
                              max_prompt_bytes=100_000)
    app = build_app(engine, tokenizer, model_name="testbed", chat_template=TEMPLATE, settings=settings)
    url, stop = run_uvicorn(app, header_timeout=1.0)
    yield dict(url=url, root=root, model=LoRazorModel.from_peft(peft_model), tokenizer=tokenizer, tasks=tasks,
               peft=load()[0])
    stop()


def client(server, key=KEY):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=key, max_retries=0, timeout=60)


def post(server, path, key=KEY, headers=None, **kw):
    headers = {"Authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(f"{server['url']}{path}", headers=headers, timeout=60, **kw)


def prompt_of(server, task, i=0):
    return server["tasks"][task].split("test")[i]["prompt"]


def offline(server, prompt, adapter, n):
    return server["model"].generate_text([prompt], [adapter], tokenizer=server["tokenizer"], max_new_tokens=n,
                                         do_sample=False)[0]


def load(server, name, path, **extra):
    return post(server, "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


# ---- 1. a bad adapter fails only its own requests ----------------------------------------------------
def test_an_adapter_that_fails_to_load_ends_only_its_requests(server):
    """Registered fine, then its weights went bad: the user of another adapter keeps streaming to the
    offline text; the bad adapter's request gets an OpenAI error; later requests for it a 400."""
    folder = server["root"] / "fragile"
    shutil.copytree(server["root"] / "sql", folder)
    assert load(server, "fragile", folder).status_code == 200
    (folder / "adapter_model.safetensors").write_bytes(b"\0garbage")
    prompt = prompt_of(server, "math")
    want = offline(server, prompt, "math", 40)

    async def both():
        async with openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            async def good():
                stream = await c.completions.create(model="math", prompt=prompt, max_tokens=40, temperature=0,
                                                    stream=True)
                return "".join([ch.choices[0].text async for ch in stream])

            async def bad():
                await asyncio.sleep(0.05)  # while the good stream runs
                try:
                    await c.completions.create(model="fragile", prompt=prompt, max_tokens=5, temperature=0)
                except openai.APIStatusError as err:
                    return err
                return None
            return await asyncio.gather(good(), bad())

    text, err = asyncio.run(both())
    assert text == want
    assert err is not None and err.status_code == 500 and "fragile" in err.message and "failed to load" in err.message
    with pytest.raises(openai.BadRequestError, match="out of service"):
        client(server).completions.create(model="fragile", prompt="x", max_tokens=2)
    assert post(server, "/v1/unload_lora_adapter", json={"lora_name": "fragile"}).status_code == 200


@pytest.mark.parametrize("make", ["pickle", "shapes", "not_tensors"])
def test_bad_bin_adapters_are_refused_at_registration(server, make):
    folder = server["root"] / f"bin_{make}"
    folder.mkdir()
    shutil.copy(server["root"] / "sql" / "adapter_config.json", folder)
    from safetensors.torch import load_file

    tensors = load_file(str(server["root"] / "sql" / "adapter_model.safetensors"))
    if make == "pickle":
        import pickle

        (folder / "adapter_model.bin").write_bytes(pickle.dumps(os.getcwd))  # not weights: never unpickled
    else:
        if make == "shapes":
            tensors = {k: torch.zeros(3, 5) for k in tensors}
        else:
            tensors = {k: "text" for k in tensors}
        torch.save(tensors, folder / "adapter_model.bin")
    r = load(server, f"bin_{make}", folder)
    assert r.status_code == 400 and f"bin_{make}" in r.json()["error"]["message"]
    assert client(server).completions.create(model="sql", prompt="x", max_tokens=2).choices  # still serving


# ---- 2. nobody gets in uninvited ---------------------------------------------------------------------
def test_an_api_key_is_required_everywhere_but_health_and_metrics(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").completions.create(model="testbed", prompt="x", max_tokens=2)
    for path in ("/v1/models", "/version", "/v1/load_lora_adapter"):
        r = httpx.request("GET" if "load" not in path else "POST", f"{server['url']}{path}")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server['url']}/health").status_code == 200
    assert httpx.get(f"{server['url']}/metrics").status_code == 200
    assert client(server).models.list().data


def test_runtime_loading_stays_under_the_root_and_under_the_cap(server, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(server["root"] / "sql", outside)
    answers = [load(server, "x1", outside), load(server, "x2", tmp_path / "does_not_exist"),
               load(server, "x3", server["root"] / ".." / outside.name)]
    assert {r.status_code for r in answers} == {403}
    assert len({r.json()["error"]["message"] for r in answers}) == 1  # existence is not revealed
    r = load(server, "testbed", server["root"] / "sql")
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]
    # 5 testbed adapters (4 tasks + tools) + 2 more reach the cap of 7
    codes = [load(server, f"cap{i}", server["root"] / "sql").status_code for i in range(3)]
    assert codes == [200, 200, 400]
    for i in range(2):
        assert post(server, "/v1/unload_lora_adapter", json={"lora_name": f"cap{i}"}).status_code == 200


def test_runtime_loading_is_off_unless_enabled():
    from fastapi.testclient import TestClient

    from lorazor import LoRazorEngine, LoRazorModel
    from lorazor.serve import build_app
    from lorazor.testbed import ASSETS, load as load_testbed

    peft_model, tokenizer, _ = load_testbed()
    engine = LoRazorEngine(LoRazorModel.from_peft(peft_model), max_num_seqs=4, num_kv_blocks=64)
    with TestClient(build_app(engine, tokenizer)) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": str(ASSETS / "adapters" / "sql")})
        assert r.status_code == 403 and "--enable-runtime-lora" in r.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 403


# ---- 3. the event loop and the sockets ---------------------------------------------------------------
def test_huge_bodies_are_refused_before_they_are_read_and_health_stays_fast(server):
    big = json.dumps({"model": "testbed", "prompt": "x" * 8_000_000})
    done = threading.Event()
    slowest = []

    def probe():
        while not done.is_set():
            start = time.monotonic()
            httpx.get(f"{server['url']}/health", timeout=30)
            slowest.append(time.monotonic() - start)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        r = post(server, "/v1/completions", content=big, headers={"content-type": "application/json"})
    except httpx.HTTPError:  # the server may close the socket before the client sent everything
        r = None
    finally:
        done.set()
        thread.join()
    assert r is None or (r.status_code == 413 and "--max-prompt-bytes" in r.json()["error"]["message"])
    assert max(slowest) < 2.0
    r = post(server, "/v1/completions", json={"model": "testbed", "prompt": "é" * 60_000})  # 120 kB > 100 kB
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_silent_connections_are_closed_after_the_header_timeout(server):
    port = int(server["url"].rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    try:
        for s in socks:
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the server (1 s header timeout), not by our timeout
    finally:
        for s in socks:
            s.close()
    assert httpx.get(f"{server['url']}/health").status_code == 200


def test_a_repeated_resource_error_is_logged_once_with_a_count():
    import logging

    from lorazor.serve.guards import RepeatFilter

    f = RepeatFilter(every=60)
    make = lambda: logging.LogRecord("asyncio", logging.ERROR, "", 0, "socket.accept() out of system resource: "  # noqa: E731
                                     "[Errno 24] Too many open files", None, None)
    assert [f.filter(make()) for _ in range(1000)].count(True) == 1
    assert f.filter(logging.LogRecord("x", logging.INFO, "", 0, "other", None, None))


# ---- 4. JSON errors instead of 500s ------------------------------------------------------------------
def test_lone_surrogates_raising_templates_and_deep_configs_get_400s(server):
    body = b'{"model": "testbed", "prompt": "\\ud800", "max_tokens": 2}'
    r = post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    folder = server["root"] / "deep"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    r = load(server, "deep", folder)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


def test_a_chat_template_that_raises_is_a_400():
    from fastapi.testclient import TestClient

    from lorazor import LoRazorEngine, LoRazorModel
    from lorazor.serve import build_app
    from lorazor.testbed import load as load_testbed

    peft_model, tokenizer, _ = load_testbed()
    engine = LoRazorEngine(LoRazorModel.from_peft(peft_model), max_num_seqs=4, num_kv_blocks=64)
    template = "{{ raise_exception('only one message, please') }}"
    with TestClient(build_app(engine, tokenizer, chat_template=template)) as http:
        r = http.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "only one message" in r.json()["error"]["message"]


# ---- 5. every field honoured or refused by name ------------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"), ({"stop": ""}, "stop"), ({"release": True}, "release"),
    ({"prompt": [True, False]}, "prompt"), ({"frobnicate": 1}, "frobnicate"), ({"echo": True, "logprobs": 1}, "echo"),
    ({"presence_penalty": 5}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"seed": 2**64}, "seed"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_or_mistyped_fields_are_refused_by_name(server, extra, param):
    r = post(server, "/v1/completions", json={"model": "testbed", "prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("extra, param", [
    # Tools are served; "auto" (the default with tools) needs --enable-auto-tool-choice, which this server lacks.
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_fields_that_are_not_supported_are_refused(server, extra, param):
    r = post(server, "/v1/chat/completions", json={"model": "testbed", "messages": [{"role": "user", "content": "x"}],
                                                   **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_echo_puts_the_prompt_before_the_completion(server):
    prompt = prompt_of(server, "sql")
    r = client(server).completions.create(model="sql", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == prompt + offline(server, prompt, "sql", 6)


def test_penalties_and_logit_bias_follow_openais_formula(server):
    """The served tokens equal the library's `generate` with OpenAI's formula as a logits processor,
    and the processor equals the formula written out on random scores."""
    from lorazor.serve.openai_sampling import OpenAIPenalties

    g = torch.Generator().manual_seed(0)
    scores, ids = torch.randn(2, 50, generator=g), torch.randint(0, 50, (2, 9), generator=g)
    got = OpenAIPenalties(4, 0.7, 1.3, {3: 5.0, 7: -2.0})(ids, scores)
    want = scores.clone()
    for row in range(2):
        for token in range(50):
            c = int((ids[row, 4:] == token).sum())
            want[row, token] -= 1.3 * c + 0.7 * (c > 0)
        want[row, 3] += 5.0
        want[row, 7] -= 2.0
    torch.testing.assert_close(got, want)

    tok = server["tokenizer"]
    prompt = prompt_of(server, "math", 1)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    # The backbone: the trained adapters are too sure of their tokens for a penalty to change them.
    plain = client(server).completions.create(model="testbed", prompt=prompt, max_tokens=24, temperature=0)
    penalized = client(server).completions.create(model="testbed", prompt=prompt, max_tokens=24, temperature=0,
                                                  frequency_penalty=2.0, presence_penalty=2.0)
    ref = server["model"].generate(ids, adapter_ids=[None], max_new_tokens=24, do_sample=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   logits_processor=[OpenAIPenalties(ids.shape[1], 2.0, 2.0, {})])
    assert penalized.choices[0].text == tok.decode(ref.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    assert penalized.choices[0].text != plain.choices[0].text
    token = tok(" table", add_special_tokens=False)["input_ids"][0]
    biased = client(server).completions.create(model="math", prompt=prompt, max_tokens=4, temperature=0,
                                               logit_bias={str(token): 100})
    assert biased.choices[0].text == tok.decode([token] * 4)


def test_load_inplace_replaces_an_adapter(server):
    prompt = prompt_of(server, "sql")
    assert load(server, "swap", server["root"] / "math").status_code == 200
    assert load(server, "swap", server["root"] / "sql").status_code == 400  # taken, no load_inplace
    assert load(server, "swap", server["root"] / "sql", load_inplace=True).status_code == 200
    r = client(server).completions.create(model="swap", prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == offline(server, prompt, "sql", 8)
    assert post(server, "/v1/unload_lora_adapter", json={"lora_name": "swap"}).status_code == 200


# ---- 6. an engine that dies --------------------------------------------------------------------------
def test_a_dead_engine_ends_streams_with_an_error_and_the_server_exits_nonzero():
    import psutil

    port = free_port()
    proc = start_serve_command("--testbed", "--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 120)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = c.completions.create(model="math", prompt="Tom has", max_tokens=500, temperature=0, stream=True,
                                      extra_body={"min_tokens": 500})
        engine = next(p for p in psutil.Process(proc.pid).children() if "spawn" in " ".join(p.cmdline()))
        with pytest.raises(openai.APIError) as caught:
            for i, _ in enumerate(stream):
                if i == 2:
                    engine.kill()
        assert not isinstance(caught.value, openai.APIConnectionError)
        assert "engine" in caught.value.message
        code = proc.wait(timeout=60)
        assert code == 1
    finally:
        log = stop_process_group(proc, timeout=30)
    assert "engine process died" in log, log[-2000:]


def test_every_route_answers_503_once_the_engine_is_gone():
    from fastapi.testclient import TestClient

    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.testbed import load_tokenizer

    engine = EngineProcess(functools.partial(process_hooks, build_engine, serve_args()))
    dead = []
    with TestClient(build_app(engine, load_tokenizer(), model_name="testbed",
                              on_engine_dead=lambda: dead.append(1))) as http:
        engine.process.kill()
        engine.process.join(10)
        assert http.get("/health").status_code == 503  # at once: no wait for the reader thread
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            r = http.request(method, path, json={"model": "testbed", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        deadline = time.monotonic() + 10
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead  # the callback `lorazor serve` exits on


# ---- 7. shapes ---------------------------------------------------------------------------------------
def test_unknown_routes_methods_and_bad_bodies_get_openai_errors(server):
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/models/nope", 404),
                                 ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{server['url']}{path}", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
    for body in (b'{"model": "t\xff"}', b"{not json"):
        r = post(server, "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert client(server).models.retrieve("math").id == "math"


def test_a_prompt_past_the_model_length_names_max_model_len(server):
    r = post(server, "/v1/completions", json={"model": "testbed", "prompt": list(range(5, 1505)), "max_tokens": 2})
    assert r.status_code == 400 and "max_model_len=1024" in r.json()["error"]["message"]


# ---- 8. what OpenAI and vLLM users ask for -----------------------------------------------------------
def test_logprobs_equal_peft_log_softmax(server):
    """Completions and chat: each token's log-probability and the top alternatives equal
    log_softmax of PEFT's logits for the same adapter and tokens (fp32)."""
    tok, peft = server["tokenizer"], server["peft"]
    prompt = prompt_of(server, "medqa")
    r = client(server).completions.create(model="medqa", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    ids = tok(prompt)["input_ids"]
    generated = r.choices[0].logprobs.tokens
    peft.eval()
    token_ids = []
    for step in range(len(generated)):
        with torch.no_grad():
            logits = peft(input_ids=torch.tensor([ids + token_ids]), adapter_names=["medqa"]).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        token = int(lp.argmax())
        token_ids.append(token)
        assert tok.decode([token]) == generated[step]
        assert r.choices[0].logprobs.token_logprobs[step] == pytest.approx(float(lp[token]), abs=1e-4)
        top = lp.topk(3)
        served = r.choices[0].logprobs.top_logprobs[step]
        for i, v in zip(top.indices.tolist(), top.values.tolist()):
            assert served[tok.decode([i])] == pytest.approx(v, abs=1e-4)
    messages = [{"role": "user", "content": prompt}]
    chat = client(server).chat.completions.create(model="medqa", messages=messages, max_tokens=3, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(peft(input_ids=torch.tensor([ids]), adapter_names=["medqa"]).logits[0, -1].float(), -1)
    first = chat.choices[0].logprobs.content[0]
    assert first.logprob == pytest.approx(float(lp.max()), abs=1e-4) and len(first.top_logprobs) == 2


def test_n_seeded_choices_are_independent_and_reproducible(server):
    prompt = prompt_of(server, "math", 1)
    ask = lambda: client(server).completions.create(model="testbed", prompt=prompt, max_tokens=10,  # noqa: E731
                                                    temperature=1.0, n=3, seed=1234)
    a, b = ask(), ask()
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert [c.index for c in a.choices] == [0, 1, 2] and len(set(texts)) > 1
    single = client(server).completions.create(model="testbed", prompt=prompt, max_tokens=10, temperature=1.0,
                                               seed=1235)
    assert single.choices[0].text == texts[1]  # choice i is seeded with seed + i
    assert 3 <= a.usage.completion_tokens <= 30


def test_prompt_lists_content_parts_and_stream_usage(server):
    prompts = [prompt_of(server, "sql", i) for i in range(3)]
    r = client(server).completions.create(model="sql", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [offline(server, p, "sql", 6) for p in prompts]
    ids = server["tokenizer"](prompts[0])["input_ids"]
    r = client(server).completions.create(model="sql", prompt=[ids, ids], max_tokens=4, temperature=0)
    assert r.choices[0].text == r.choices[1].text and r.usage.prompt_tokens == 2 * len(ids)
    c = client(server)
    parts = [{"type": "text", "text": "Tom has "}, {"type": "text", "text": "3 apples."}]
    by_parts = c.chat.completions.create(model="math", messages=[{"role": "user", "content": parts}], max_tokens=5,
                                         temperature=0)
    by_text = c.chat.completions.create(model="math", messages=[{"role": "user", "content": "Tom has 3 apples."}],
                                        max_tokens=5, temperature=0)
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content
    chunks = list(c.completions.create(model="sql", prompt=prompts[0], max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_tokenize_detokenize_and_version(server):
    tok = server["tokenizer"]
    r = post(server, "/tokenize", json={"model": "sql", "prompt": "How many rows"}).json()
    assert r["tokens"] == tok("How many rows")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert post(server, "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    assert post(server, "/detokenize", json={"tokens": [10**9]}).status_code == 400
    from lorazor import __version__

    v = httpx.get(f"{server['url']}/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert v == {"version": __version__}
    out = subprocess.run([sys.executable, "-m", "lorazor", "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"lorazor {__version__}"


def test_lora_modules_in_both_of_vllms_forms():
    from lorazor.serve.cli import adapter_paths

    args = serve_args("--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}')
    assert adapter_paths(args) == {"a": "/x/a", "b": "/x/b"}
    with pytest.raises(SystemExit, match="lora-modules"):
        adapter_paths(serve_args("--lora-modules", "{bad json"))
    with pytest.raises(SystemExit, match="given twice"):
        adapter_paths(serve_args("--adapter", "a=/1", "--lora-modules", "a=/2"))


def test_the_device_flag_picks_the_gpu_by_default_and_refuses_bad_devices(monkeypatch):
    import torch

    from lorazor.serve.cli import serving_device

    def device(*flags, testbed=False):
        args = serve_args(*flags)
        args.testbed = testbed  # serve_args serves the testbed; most rows here serve a --model
        return serving_device(args)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device() == torch.device("cuda")  # a model goes to the GPU by default
    assert device(testbed=True) == torch.device("cpu")  # the testbed stays on the CPU unless told
    assert device("--device", "cuda:1", testbed=True) == torch.device("cuda:1")
    assert device("--device", "cpu") == torch.device("cpu")
    for bad in ("gpu", "tpu:0", "meta"):
        with pytest.raises(SystemExit, match=f"--device takes auto, cpu, cuda or cuda:N, got '{bad}'"):
            device("--device", bad)
    with pytest.raises(SystemExit, match="'cuda:2': this machine has 2 CUDA devices"):
        device("--device", "cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device() == torch.device("cpu")
    with pytest.raises(SystemExit, match="'cuda': this machine has"):
        device("--device", "cuda")


def test_the_serve_command_names_its_extra_when_it_is_missing(monkeypatch):
    import importlib.util

    from lorazor.serve import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SystemExit, match=r"lorazor\[serve\]"):
        cli.require_serve_extra()


# ---- 9. StepTrim policies served as the default --------------------------------------------------------
def test_a_calibrated_policy_is_served_and_logged(tmp_path, caplog):
    """`--release-policy DIR`: every adapter request releases where the policy says, unless the
    request overrides it; the startup log states the configuration."""
    import logging

    from fastapi.testclient import TestClient

    from lorazor import ProfiledRelease, save_release_policy
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine

    save_release_policy(ProfiledRelease({"math": 3, "sql": 0}), tmp_path)
    with caplog.at_level(logging.INFO, logger="lorazor.serve"):
        engine, tokenizer = build_engine(serve_args("--release-policy", str(tmp_path)))
    assert "release policy: profiled for ['math', 'sql']" in caplog.text and "max_model_len 1024" in caplog.text
    with TestClient(build_app(engine, tokenizer, model_name="testbed")) as http:
        def ask(model, **extra):
            body = {"model": model, "prompt": "Tom has 3 apples", "max_tokens": 8, "temperature": 0, **extra}
            return http.post("/v1/completions", json=body).json()["lorazor"]["release_step"]
        assert ask("math") == 3 and ask("sql") == 0 and ask("medqa") == -1
        assert ask("math", release="never") == -1 and ask("math", release=5) == 5


# ---- 10. metrics -----------------------------------------------------------------------------------------
def test_metrics_follow_vllms_names(server):
    client(server).completions.create(
        model="math", prompt="Tom", max_tokens=3, temperature=0, extra_body={"release": 1}
    )
    text = httpx.get(f"{server['url']}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "kv_cache_usage_perc", "lora_requests_info", "lora_decode_steps_total",
                 "released_requests_total", "request_success_total"):
        assert f"\nlorazor:{name}{{" in text, name
    assert "_created" not in text
    released = next(line for line in text.splitlines() if line.startswith("lorazor:released_requests_total{"))
    assert float(released.split()[-1]) >= 1
