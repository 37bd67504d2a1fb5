"""Adapters as users name them: a Hugging Face Hub repo id (offline, from the Hub cache), a base model
that differs from the served one (a warning naming both), and LoRA outside the decoder (refused)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from lorazor import AdapterError, LoRazorModel
from lorazor.testbed import ASSETS

COMMIT = "0123456789abcdef0123456789abcdef01234567"

HUB_SCRIPT = """
import sys, torch
from lorazor import LoRazorModel
from lorazor.testbed import ASSETS
base = str(ASSETS / "backbone")
hub = LoRazorModel.from_pretrained(base, {"sql": "acme/sql-lora"})
local = LoRazorModel.from_pretrained(base, {"sql": str(ASSETS / "adapters" / "sql")})
ids = torch.tensor([[5, 6, 7, 8]])
a = hub.generate(ids, adapter_ids=["sql"], max_new_tokens=6, pad_token_id=0, eos_token_id=None).sequences
b = local.generate(ids, adapter_ids=["sql"], max_new_tokens=6, pad_token_id=0, eos_token_id=None).sequences
print("EQUAL" if torch.equal(a, b) else "DIFFERENT")
try:
    hub.register_adapter("other", "acme/not-cached")
except Exception as err:
    print("REFUSED", type(err).__name__, err)
"""


@pytest.fixture
def hub_cache(tmp_path):
    """A Hugging Face Hub cache holding `acme/sql-lora` (the testbed's sql adapter) at main."""
    repo = tmp_path / "hub" / "models--acme--sql-lora"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(ASSETS / "adapters" / "sql" / name, snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def test_hub_adapter_loads_offline_from_the_cache(hub_cache):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    done = subprocess.run([sys.executable, "-c", HUB_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "EQUAL" in lines
    refused = next(line for line in lines if line.startswith("REFUSED"))
    assert "AdapterError" in refused
    assert "there is no local folder 'acme/not-cached'; taken as a Hugging Face Hub repo id" in refused
    assert "fetching it failed" in refused


def test_runtime_registration_never_fetches_from_the_hub(hub_cache, monkeypatch):
    pytest.importorskip("fastapi")  # the `serve` extra
    import huggingface_hub

    from lorazor.serve.engines import register

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(a) or str(hub_cache))
    model = LoRazorModel.from_pretrained(ASSETS / "backbone")
    with pytest.raises(AdapterError, match="does not exist or is not a folder"):
        register(model, "sql", "acme/sql-lora")
    assert not calls


def adapter_copy(tmp_path, **config_changes):
    folder = tmp_path / "adapter"
    shutil.copytree(ASSETS / "adapters" / "sql", folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def test_adapter_of_another_base_model_warns_naming_both(tmp_path):
    model = LoRazorModel.from_pretrained(ASSETS / "backbone")
    folder = adapter_copy(tmp_path, base_model_name_or_path="Qwen/Qwen2-0.5B")
    with pytest.warns(
        UserWarning, match=r"trained on base model 'Qwen/Qwen2-0.5B', but the served model is '.*backbone'"
    ):
        model.register_adapter("sql", folder)
    with _no_warning():
        model.register_adapter("same", ASSETS / "adapters" / "math")  # trained on another copy of this backbone


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.seen = self._catch.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        assert not [w for w in self.seen if "trained on base model" in str(w.message)]


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["embed_tokens", "v_proj"]])
def test_lora_outside_the_decoder_is_refused_by_name(tmp_path, targets):
    model = LoRazorModel.from_pretrained(ASSETS / "backbone")
    folder = adapter_copy(tmp_path, target_modules=targets)
    outside = next(t for t in targets if not t.endswith("_proj"))
    with pytest.raises(AdapterError, match=f"puts LoRA on {outside}"):
        model.register_adapter("bad", folder)
