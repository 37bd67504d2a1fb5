"""Adapters at scale through the server: residency metrics a router can read, consistent with the
GPU slots and host copies after requests that evict; the filesystem resolver serving a folder's
adapter on first use, once for concurrent first requests, 404 for names it cannot resolve."""

import re
import shutil
import threading

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from servers import run_uvicorn  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The testbed's backbone with its four adapters registered from folders, 2 GPU slots and 1 host
    copy (so requests evict), behind the app with the filesystem resolver over a root holding a copy
    of the sql adapter under another name."""
    import torch

    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
    from lorazor.serve import build_app
    from lorazor.serve.settings import ServerSettings
    from lorazor.testbed import ASSETS, load, load_tokenizer

    root = tmp_path_factory.mktemp("lora_root")
    shutil.copytree(ASSETS / "adapters" / "sql", root / "sql-copy")
    adapters = {name: ASSETS / "adapters" / name for name in ("math", "sql", "medqa", "science")}
    model = LoRazorModel.from_pretrained(ASSETS / "backbone", adapters, LoRazorConfig(max_loras=2, max_cpu_loras=1),
                                         dtype=torch.float32)
    engine = LoRazorEngine(model, max_num_seqs=8, num_kv_blocks=128)
    tokenizer = load_tokenizer()
    settings = ServerSettings(enable_runtime_lora=True, lora_root=root, lora_resolver="filesystem")
    url, stop = run_uvicorn(build_app(engine, tokenizer, model_name="testbed", settings=settings))
    _, _, tasks = load()
    yield dict(url=url, model=model, engine=engine, tokenizer=tokenizer, tasks=tasks, root=root)
    stop()


def complete(served, model, prompt, n=NEW):
    return httpx.post(f"{served['url']}/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0})


def scrape(served) -> str:
    return httpx.get(f"{served['url']}/metrics", timeout=30).text


def value(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_residency_metrics_follow_the_slots_through_evictions(served):
    registry = served["model"].registry
    prompt = served["tasks"]["sql"].split("test")[0]["prompt"]
    for name in ("sql", "math", "medqa", "sql", "science", "math"):  # 4 adapters through 2 slots
        assert complete(served, name, prompt, 2).status_code == 200
        text = scrape(served)
        residency = registry.residency()
        for adapter, (on_gpu, on_cpu) in residency.items():
            for level, resident in (("gpu", on_gpu), ("cpu", on_cpu)):
                got = value(text, "lorazor:lora_adapter_loaded", adapter_name=adapter, level=level)
                assert got == (1.0 if resident else None), (name, adapter, level, got)
        slots = set(registry.bank.slot_of)
        assert {a for a, (g, _) in residency.items() if g} == slots and len(slots) <= 2
        assert value(text, "lorazor:num_gpu_loaded_lora_adapters") == len(slots)
        assert value(text, "lorazor:max_gpu_lora_adapters") == 2
        counts = {source: value(text, "lorazor:lora_adapter_load_seconds_count", source=source)
                  for source in ("disk", "cpu")}
        assert counts["disk"] + counts["cpu"] == registry.loads
    assert counts["disk"] > 0 and counts["cpu"] >= 0  # evicted folder adapters came back from disk
    assert value(text, "lorazor:lora_requests_info") is not None  # kept beside the new ones


def test_the_resolver_serves_a_folder_on_first_use_as_if_registered(served):
    prompt = served["tasks"]["sql"].split("test")[1]["prompt"]
    assert "sql-copy" not in served["model"].adapter_names
    resolved = complete(served, "sql-copy", prompt)
    assert resolved.status_code == 200, resolved.text
    assert resolved.json()["choices"][0]["text"] == complete(served, "sql", prompt).json()["choices"][0]["text"]
    assert "sql-copy" in served["model"].adapter_names
    models = httpx.get(f"{served['url']}/v1/models").json()["data"]
    assert "sql-copy" in {m["id"] for m in models}


@pytest.mark.parametrize("name", ["nowhere", "../sql", "sql-copy/..", ".hidden"])
def test_names_the_resolver_cannot_resolve_are_404(served, name):
    r = complete(served, name, "How many")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_a_lookup_resolves_nothing(served, tmp_path):
    shutil.copytree(served["root"] / "sql-copy", served["root"] / "looked-up")
    assert httpx.get(f"{served['url']}/v1/models/looked-up").status_code == 404
    assert "looked-up" not in served["model"].adapter_names


def test_eight_concurrent_first_requests_load_the_adapter_once(served, monkeypatch):
    shutil.copytree(served["root"] / "sql-copy", served["root"] / "burst")
    model = served["model"]
    calls = []
    original = model.register_adapter

    def counted(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "register_adapter", counted)
    prompt = served["tasks"]["sql"].split("test")[2]["prompt"]
    results = []
    threads = [threading.Thread(target=lambda: results.append(complete(served, "burst", prompt)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [r.status_code for r in results] == [200] * 8
    assert len({r.json()["choices"][0]["text"] for r in results}) == 1
    assert calls == ["burst"]


def test_a_refused_folder_is_a_400_naming_the_model(served):
    folder = served["root"] / "broken"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{not json")
    r = complete(served, "broken", "How many")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "broken" in r.json()["error"]["message"]
    assert "broken" not in served["model"].adapter_names


def test_the_resolver_needs_runtime_loading_and_a_root():
    from lorazor.serve.settings import ServerSettings

    with pytest.raises(ValueError, match=re.escape("needs enable_runtime_lora and lora_root")):
        ServerSettings(lora_resolver="filesystem")
    with pytest.raises(ValueError, match="lora_resolver must be one of"):
        ServerSettings(lora_resolver="s3")
