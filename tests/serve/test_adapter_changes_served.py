"""Adapters that change under a running server (the in-process engine): requests racing a
`load_inplace` never get a 404 for an adapter that stays registered, nor a 500; the filesystem
resolver evicts its least recently requested idle adapters, so 10 names under a cap of 6 are all
served; a name it refused is answered from memory. On 127.0.0.1, the testbed, CPU."""

import shutil
import threading
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from servers import copy_testbed_lora_root, run_uvicorn  # noqa: E402
from test_serve import serve_args  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lorazor.serve import build_app
    from lorazor.serve.cli import build_engine
    from lorazor.serve.settings import ServerSettings

    root = copy_testbed_lora_root(tmp_path_factory)
    for i in range(10):
        shutil.copytree(root / ("sql" if i % 2 else "math"), root / f"tenant{i}")
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    engine, tokenizer = build_engine(serve_args())
    registered = len(engine.model.adapter_names)
    settings = ServerSettings(enable_runtime_lora=True, lora_root=root, lora_resolver="filesystem",
                              max_registered_loras=registered + 2)
    url, stop = run_uvicorn(build_app(engine, tokenizer, model_name="testbed", settings=settings))
    yield dict(url=url, root=root, engine=engine, cap=registered + 2)
    stop()


def post(server, path, **kw):
    return httpx.post(f"{server['url']}{path}", timeout=60, **kw)


def complete(server, model, **kw):
    return post(server, "/v1/completions", json={"model": model, "prompt": "How many", "max_tokens": 3,
                                                 "temperature": 0, **kw})


def test_requests_racing_load_inplace_never_get_404_or_500(server):
    assert post(server, "/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": "sql"}).status_code == 200
    stop, swaps = threading.Event(), []

    def swap_forever():
        i = 0
        while not stop.is_set():
            path = ("math", "sql")[i % 2]
            r = post(server, "/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": path,
                                                            "load_inplace": True})
            swaps.append(r.status_code)
            i += 1

    thread = threading.Thread(target=swap_forever)
    thread.start()
    answers = []
    try:
        deadline = time.monotonic() + 20
        while len(answers) < 40 and time.monotonic() < deadline:
            r = complete(server, "swap")
            answers.append((r.status_code, r.json().get("error", {}).get("message", "")))
    finally:
        stop.set()
        thread.join(60)
    assert swaps.count(200) >= 2  # the race really ran
    bad = [a for a in answers if a[0] != 200 and not (a[0] == 400 and "registered again" in a[1])]
    assert not bad, bad
    assert sum(a[0] == 200 for a in answers) >= len(answers) // 2
    # A replacement refused while requests use the old weights says so (400), never a 500.
    assert set(swaps) <= {200, 400}


def test_ten_resolver_names_under_a_cap_of_six_are_all_served(server):
    for i in range(10):
        r = complete(server, f"tenant{i}")
        assert r.status_code == 200, r.text
        assert len(server["engine"].model.adapter_names) <= server["cap"]
    # The least recently requested ones were evicted, the latest kept.
    names = server["engine"].model.adapter_names
    assert "tenant9" in names and "tenant0" not in names
    assert complete(server, "tenant0").status_code == 200  # resolved again


def test_a_refused_resolver_name_is_answered_from_memory(server):
    first = complete(server, "broken")
    assert first.status_code == 400 and "not valid JSON" in first.json()["error"]["message"]
    assert first.json()["error"]["param"] == "model"
    (server["root"] / "broken" / "adapter_config.json").write_text("{}")  # changed: not read again yet
    again = complete(server, "broken")
    assert again.status_code == 400 and "not valid JSON" in again.json()["error"]["message"]


def test_cache_salt_over_http_separates_tenants(server):
    prompt = "How many apples are in the box if three are taken " * 3

    def cached(**kw):
        r = post(server, "/v1/completions", json={"model": "testbed", "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    cached(cache_salt="alice")
    assert cached(cache_salt="alice") > 0
    assert cached(cache_salt="bob") == 0
    r = post(server, "/v1/completions", json={"model": "testbed", "prompt": "x", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
