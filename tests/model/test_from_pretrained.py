"""Adapters from folders, without PEFT: `from_pretrained`, the registry, and GPU slots as an LRU cache.

The oracle is PEFT serving the same folders with `generate(adapter_names=...)`.
"""

import copy
import json

import pytest
import torch
from conftest import DEVICE
from helpers import EOS, PAD, make_batch, peft_generate
from lorazor import AdapterError, LoRazorConfig, LoRazorModel
from lorazor.tiny import tiny_config
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (LoraConfig kwargs, safetensors?) -- ranks 1..64, alphas, rsLoRA, target sets, patterns, .bin.
# No name is a module-path part ("mlp"): PEFT's save_pretrained then drops other adapters' tensors.
ADAPTERS = {
    "r1": (dict(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"]), True),
    "r64": (dict(r=64, lora_alpha=16, target_modules=EVERY), True),
    "rs": (dict(r=8, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "down_proj"]), False),
    "ffn": (dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]), True),
    "pat": (dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"], rank_pattern={"v_proj": 16},
                 alpha_pattern={"q_proj": 24}), False),
    "kv": (dict(r=8, lora_alpha=8, target_modules=["k_proj", "v_proj"]), True),
}


def base_model(seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval().to(DEVICE)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(PEFT oracle holding every adapter, name -> folder)."""
    root = tmp_path_factory.mktemp("adapters")
    oracle, paths = None, {}
    for name, (kw, safe) in ADAPTERS.items():
        cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kw)
        if oracle is None:
            oracle = get_peft_model(base_model(), cfg, adapter_name=name)
        else:
            oracle.add_adapter(name, cfg)
        # init_lora_weights=False draws B too; scale it so every adapter changes the tokens.
        oracle.save_pretrained(root, selected_adapters=[name], safe_serialization=safe)
        paths[name] = root / name
    return oracle.eval(), paths


def generate(model, ids, mask, rows):
    return model.generate(ids, attention_mask=mask, adapter_ids=rows, max_new_tokens=6, pad_token_id=PAD,
                          eos_token_id=EOS).sequences


def test_from_pretrained_folders_equal_peft(folders):
    oracle, paths = folders
    model = LoRazorModel.from_pretrained(base_model(), adapters=paths)
    assert all(s.location == "gpu" for s in model.adapters.values())
    assert model.adapters["pat"].rank == 16 and model.adapters["r64"].rank == 64
    ids, mask = make_batch(7, 6, seed=1, pad_rows=(2, 5))
    rows = ["r1", "r64", None, "rs", "ffn", "pat", "kv"]
    assert torch.equal(generate(model, ids, mask, rows), peft_generate(oracle, ids, mask, rows, max_new_tokens=6))


def test_from_a_saved_base_path_with_declared_bank(folders, tmp_path):
    oracle, paths = folders
    base_model().save_pretrained(tmp_path / "base")
    config = LoRazorConfig(max_loras=3, max_lora_rank=64, lora_target_modules=EVERY)
    model = LoRazorModel.from_pretrained(str(tmp_path / "base"), adapters={"kv": paths["kv"]}, config=config,
                                         device_map=str(DEVICE))
    assert model.bank.num_slots == 3 and model.bank.r_max == 64
    model.register_adapter("r64", paths["r64"])  # targets every module: declared up front
    assert model.adapters["r64"].location == "disk"
    ids, mask = make_batch(2, 5, seed=2)
    assert torch.equal(generate(model, ids, mask, ["r64", "kv"]),
                       peft_generate(oracle, ids, mask, ["r64", "kv"], max_new_tokens=6))


def test_lru_churn_two_slots_six_adapters_always_equal_peft(folders):
    oracle, paths = folders
    model = LoRazorModel.from_pretrained(base_model(), adapters=paths, config=LoRazorConfig(max_loras=2,
                                                                                             max_cpu_loras=3))
    names = list(ADAPTERS)
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        pick = [names[i] for i in torch.randperm(len(names), generator=g)[:2].tolist()]
        rows = [pick[0], None, pick[1], pick[0]]
        ids, mask = make_batch(4, 5, seed=10 + step, pad_rows=(1,))
        assert torch.equal(
            generate(model, ids, mask, rows), peft_generate(oracle, ids, mask, rows, max_new_tokens=6)
        ), f"step {step}: {rows}"
        status = model.adapters
        assert sum(s.location == "gpu" for s in status.values()) == 2
        assert sum(s.location == "host" for s in status.values()) <= 3
    assert model.registry.loads > 8  # slots really churned


def test_batch_needing_more_adapters_than_slots_fails_and_keeps_serving(folders):
    oracle, paths = folders
    model = LoRazorModel.from_pretrained(base_model(), adapters=paths, config=LoRazorConfig(max_loras=2))
    ids, mask = make_batch(3, 5, seed=3)
    with pytest.raises(AdapterError, match="this batch uses 3 distinct adapters but there are only max_loras=2"):
        generate(model, ids, mask, ["r1", "kv", "ffn"])
    assert torch.equal(generate(model, ids, mask, ["r1", "kv", None]),
                       peft_generate(oracle, ids, mask, ["r1", "kv", None], max_new_tokens=6))


def test_unregister_frees_the_slot(folders):
    _, paths = folders
    model = LoRazorModel.from_pretrained(base_model(), adapters={"kv": paths["kv"], "r1": paths["r1"]})
    slot = model.adapters["kv"].slot
    model.unregister_adapter("kv")
    assert "kv" not in model.adapters and model.bank.names[slot] is None
    assert all(m.lora_a[slot].abs().sum() == 0 and m.host_rank[slot] == 0 for m in model.bank.modules.values())
    ids, mask = make_batch(1, 4)
    with pytest.raises(KeyError, match="unknown adapter 'kv' at row 0"):
        generate(model, ids, mask, ["kv"])


@pytest.fixture()
def model(folders):
    _, paths = folders
    return LoRazorModel.from_pretrained(base_model(), adapters={"kv": paths["kv"]},
                                        config=LoRazorConfig(max_loras=2, max_lora_rank=16))


def copy_folder(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_registration_refusals(model, folders, tmp_path):
    _, paths = folders
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        model.register_adapter("empty", tmp_path)
    bad = copy_folder(paths["r1"], tmp_path / "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(AdapterError, match="adapter_model.safetensors is not a valid safetensors file"):
        model.register_adapter("bad", bad)
    with pytest.raises(AdapterError, match="invalid adapter name 'a/b'"):
        model.register_adapter("a/b", paths["r1"])
    with pytest.raises(AdapterError, match="adapter 'kv' is already registered"):
        model.register_adapter("kv", paths["kv"])
    with pytest.raises(AdapterError, match="adapter 'r64' has rank 64 > max_lora_rank=16"):
        model.register_adapter("r64", paths["r64"])
    dora = copy_folder(paths["r1"], tmp_path / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="adapter 'dora' uses DoRA"):
        model.register_adapter("dora", dora)
    # Nothing refused was kept, and the model still serves.
    assert list(model.adapters) == ["kv"]


def test_registration_reads_no_weights(model, folders):
    _, paths = folders
    loads = model.registry.loads
    status = model.register_adapter("ffn", paths["ffn"])
    assert status.location == "disk" and status.slot is None and status.targets == ("down_proj", "gate_proj", "up_proj")
    assert model.registry.loads == loads and model.registry.entries["ffn"].image is None


def test_target_outside_the_bank_is_refused_at_registration(folders):
    _, paths = folders
    model = LoRazorModel.from_pretrained(base_model(), adapters={"kv": paths["kv"]},
                                         config=LoRazorConfig(lora_target_modules=["k_proj", "v_proj"]))
    with pytest.raises(
        AdapterError, match="adapter 'ffn' targets model.layers.0.mlp.(gate|up|down)_proj, which is not among"
    ):
        model.register_adapter("ffn", paths["ffn"])


def test_from_pretrained_refuses_a_peft_model(folders):
    oracle, _ = folders
    with pytest.raises(TypeError, match="for a peft.PeftModel use LoRazorModel.from_peft"):
        LoRazorModel.from_pretrained(copy.deepcopy(oracle))
