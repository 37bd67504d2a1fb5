"""No client can hurt another through `lorazor serve`: each finding of the hostile-client review gets
a test. Hostile requests run beside good greedy streams, and every good stream must get the text it
gets alone; the hostile one gets a 4xx naming its field, or its own error.

The module's server: the shipped testbed, the engine in its own process, runtime adapter loading under
a temporary root, a 1 s body timeout, on 127.0.0.1.
"""

import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from servers import (free_port, run_uvicorn, start_serve_command, stop_process_group,  # noqa: E402
                     copy_testbed_lora_root, wait_healthy)
from test_serve import serve_args  # noqa: E402

NEW = 12


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
    settings = ServerSettings(enable_runtime_lora=True, lora_root=root, body_timeout=1.0)
    url, stop = run_uvicorn(build_app(engine, tokenizer, model_name="testbed", settings=settings))
    yield dict(url=url, root=root, model=LoRazorModel.from_peft(peft_model), tokenizer=tokenizer, tasks=tasks)
    stop()


def post(server, path, **kw):
    return httpx.post(f"{server['url']}{path}", timeout=60, **kw)


def prompt_of(server, task, i=0):
    return server["tasks"][task].split("test")[i]["prompt"]


def offline(server, prompt, adapter, n=NEW):
    return server["model"].generate_text([prompt], [adapter], tokenizer=server["tokenizer"], max_new_tokens=n,
                                         do_sample=False)[0]


GOOD = [("math", 0), ("sql", 0), (None, 1), ("medqa", 0)]


def good_streams(server, results):
    """Stream every GOOD request on a thread of its own; each appends (index, text or error)."""
    def one(i, adapter, k):
        c = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            stream = c.completions.create(model=adapter or "testbed", prompt=prompt_of(server, adapter or "math", k),
                                          max_tokens=NEW, temperature=0, stream=True)
            results.append((i, "".join(chunk.choices[0].text for chunk in stream)))
        except Exception as err:  # recorded, so the test shows it
            results.append((i, f"ERROR {type(err).__name__}: {err}"))

    threads = [threading.Thread(target=one, args=(i, a, k)) for i, (a, k) in enumerate(GOOD)]
    for t in threads:
        t.start()
    return threads


HOSTILE = {
    "temperature_1e-39": {"temperature": 1e-39},
    "temperature_1e-300": {"temperature": 1e-300},
    "top_k_2**63": {"temperature": 1.0, "top_k": 2**63},
    "repetition_penalty_1e-300": {"temperature": 1.0, "repetition_penalty": 1e-300},
    "logit_bias_superscript": {"temperature": 1.0, "logit_bias": {"²": 5}},
    "echo_token_out_of_vocabulary": {"echo": True, "prompt": [5, 10**20]},
    "release_2**70": {"release": 2**70},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_good_streams_get_their_solo_text_beside_a_hostile_request(server, name):
    want = [offline(server, prompt_of(server, a or "math", k), a) for a, k in GOOD]
    results = []
    threads = good_streams(server, results)
    body = {"model": "sql", "prompt": prompt_of(server, "sql"), "max_tokens": 40, "min_tokens": 40,
            **HOSTILE[name]}
    r = post(server, "/v1/completions", json=body)
    for t in threads:
        t.join(120)
    assert sorted(results) == list(enumerate(want))
    # The hostile request: served safely, or refused with a 400 that names its field.
    if r.status_code != 200:
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] in HOSTILE[name], r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_vanishing_temperature_is_greedy(server):
    prompt = prompt_of(server, "sql", 2)
    for temperature in (1e-39, 1e-45, 1e-300, 0):
        r = post(server, "/v1/completions", json={"model": "sql", "prompt": prompt, "max_tokens": NEW,
                                                  "temperature": temperature})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline(server, prompt, "sql")


def test_an_adapter_damaged_after_registration_fails_only_its_own_requests(server, tmp_path):
    """The file is overwritten (with NaN weights) after registration, before the adapter is first
    loaded: the load finds bytes that differ from the registered digest and fails only its requests."""
    from safetensors.torch import load_file, save_file

    folder = server["root"] / "damaged"
    shutil.copytree(server["root"] / "sql", folder)
    assert post(server, "/v1/load_lora_adapter", json={"lora_name": "damaged", "lora_path": "damaged"}
                ).status_code == 200
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k: v.fill_(float("nan")) for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    want = [offline(server, prompt_of(server, a or "math", k), a) for a, k in GOOD]
    results = []
    threads = good_streams(server, results)
    r = post(server, "/v1/completions", json={"model": "damaged", "prompt": "How many", "max_tokens": 8})
    for t in threads:
        t.join(120)
    assert sorted(results) == list(enumerate(want))
    # Accepted, then ended by the engine (the server's 500 for a request that ended with an error).
    assert r.status_code == 500 and "changed on disk" in r.json()["error"]["message"], r.text


def test_a_nan_adapter_is_refused_at_load(server):
    from safetensors.torch import load_file, save_file

    folder = server["root"] / "nan"
    shutil.copytree(server["root"] / "sql", folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    next(iter(tensors.values()))[0, 0] = float("inf")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    r = post(server, "/v1/load_lora_adapter", json={"lora_name": "nan", "lora_path": "nan"})
    assert r.status_code == 400 and "non-finite" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5, -1], "echo": True}, "prompt"),
    ({"prompt": [5, 10**20], "echo": True}, "prompt"),
    ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"١٢": 1}}, "logit_bias"),  # Arabic-Indic digits: not token 12
    ({"prompt": "x", "release": 2**70}, "release"),
    ({"prompt": "x", "repetition_penalty": 1e-300, "temperature": 1.0}, "repetition_penalty"),
])
def test_client_mistakes_are_400s_naming_the_field(server, body, param):
    r = post(server, "/v1/completions", json={"model": "sql", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_non_finite_numbers_are_400s(server):
    for field in ("repetition_penalty", "temperature", "top_p", "presence_penalty"):
        content = '{"model": "sql", "prompt": "x", "max_tokens": 2, "%s": Infinity}' % field
        r = post(server, "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_integer_numbers_are_accepted_where_openai_takes_numbers(server):
    body = {"model": "sql", "prompt": "How many", "max_tokens": 3, "temperature": 2, "top_p": 1,
            "presence_penalty": 1, "frequency_penalty": 0, "repetition_penalty": 1, "seed": 3}
    r = post(server, "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert post(server, "/v1/completions", json=body).json()["choices"] == r.json()["choices"]  # seeded


def test_a_nul_in_lora_path_is_a_400(server):
    r = post(server, "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "sql\x00/etc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_links_inside_a_root_folder_must_stay_under_the_root(server, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(server["root"] / "sql", outside)
    folder = server["root"] / "linked"
    folder.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.symlink(outside / name, folder / name)
    r = post(server, "/v1/load_lora_adapter", json={"lora_name": "linked", "lora_path": "linked"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path"


def test_a_body_that_trickles_is_timed_out_with_a_json_408(server):
    port = int(server["url"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        start = time.monotonic()
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break  # the server closed the connection
            data += chunk
    assert time.monotonic() - start < 5
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == 408


def test_the_concurrency_limit_answers_json(server):
    """Past `--limit-concurrency`, the 503 is OpenAI's JSON error body."""
    from lorazor.serve import build_app
    from lorazor.serve.settings import ServerSettings

    class Idle:  # an engine stand-in: this test never reaches it
        info = {"max_model_len": 8, "vocab_size": 8}
        adapter_names: list = []
        alive = True
        on_dead: list = []

        def start(self):
            pass

        async def shutdown(self):
            return 0

    app = build_app(Idle(), server["tokenizer"], settings=ServerSettings(body_timeout=20.0))
    url, stop = run_uvicorn(app, limit_concurrency=2)
    port = int(url.rsplit(":", 1)[1])
    holders = []
    try:
        for _ in range(2):  # two slow clients hold the two places
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            holders.append(s)
        time.sleep(0.3)
        r = httpx.get(f"{url}/v1/models", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    finally:
        for s in holders:
            s.close()
        stop()


def test_an_empty_api_key_is_refused_at_startup():
    for argv, env in ((["--api-key", ""], {}), (["--api-key", "  "], {}), ([], {"LORAZOR_API_KEY": ""})):
        done = subprocess.run([sys.executable, "-m", "lorazor", "serve", "--testbed", *argv], capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})
        assert done.returncode == 2, done.stderr[-2000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "API key is empty" in lines[0], done.stderr


def faulty_engine(trigger_prompt):
    """(engine, tokenizer) whose loop raises once a request with `trigger_prompt` ids arrives, and
    whose process then lingers 5 s before it ends (a non-daemon thread)."""
    from lorazor.serve.cli import build_engine

    engine, tokenizer = build_engine(serve_args())
    original = engine.step_or_abort_all

    def step():
        if any(r.prompt == trigger_prompt for r in engine.requests.values()):
            threading.Thread(target=time.sleep, args=(5,)).start()
            raise SystemError("the engine's loop broke")
        return original()

    engine.step_or_abort_all = step
    return engine, tokenizer


@pytest.mark.slow
def test_health_is_503_from_the_moment_the_engine_loop_fails():
    from fastapi.testclient import TestClient

    from lorazor.serve import build_app
    from lorazor.engine import EngineProcess
    from lorazor.serve.engines import process_hooks
    from lorazor.testbed import load_tokenizer

    engine = EngineProcess(functools.partial(process_hooks, faulty_engine, [7, 7, 7]))
    with TestClient(build_app(engine, load_tokenizer(), model_name="testbed")) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"model": "testbed", "prompt": [7, 7, 7], "max_tokens": 4})
        assert r.status_code == 503 and "loop broke" in r.json()["error"]["message"], r.text
        assert engine.process.is_alive()  # still ending, yet already known dead
        assert http.get("/health").status_code == 503
        assert http.get("/v1/models").status_code == 503


@pytest.mark.slow
def test_sigterm_drains_for_the_shutdown_timeout_then_exits_zero_leaving_no_process():
    import psutil

    port = free_port()
    # One seat: the 8 choices run one after another, so some are still waiting when the drain ends.
    proc = start_serve_command("--testbed", "--port", str(port), "--shutdown-timeout", "2", "--max-num-seqs", "1")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120, proc)
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that never reads its stream
        body = json.dumps({"model": "math", "prompt": "Tom has", "max_tokens": 1000, "min_tokens": 1000,
                           "temperature": 0, "stream": True, "n": 8}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(2)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the engine's process (and multiprocessing's helper)
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.monotonic() - start
        s.close()
    finally:
        log = stop_process_group(proc, timeout=10)
    assert code == 0, log[-2000:]
    assert took < 2 + 10, took  # the drain's 2 s, then aborting and joining the engine
    aborted = re.search(r"shutdown: aborted (\d+) in-flight requests", log)
    assert aborted and int(aborted.group(1)) >= 1, log[-2000:]
    time.sleep(0.5)
    left = [(c.pid, c.status()) for c in children if psutil.pid_exists(c.pid)]
    assert not left, left  # nothing running, and no zombie


def test_a_decompression_bomb_is_refused_in_under_a_second_while_good_streams_run(server):
    """A 0.5 MB `.bin` that would expand to 512 MB inside `torch.load`: refused from its zip directory,
    read off the engine's loop; the 8 good streams beside it get the text they get alone."""
    import sys

    sys.path.insert(0, str(os.path.join(os.path.dirname(__file__), "..", "engine")))
    from test_adapter_changes import bomb

    bomb(server["root"] / "bomb", megabytes=512)
    want = [offline(server, prompt_of(server, a or "math", k), a) for a, k in GOOD] * 2
    results = []
    threads = good_streams(server, results) + good_streams(server, results)
    start = time.perf_counter()
    r = post(server, "/v1/load_lora_adapter", json={"lora_name": "bomb", "lora_path": "bomb"})
    took = time.perf_counter() - start
    for t in threads:
        t.join(120)
    assert r.status_code == 400 and "compressed members" in r.json()["error"]["message"], r.text
    assert took < 1.0, took
    assert sorted(text for _, text in results) == sorted(want)
