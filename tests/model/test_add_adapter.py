"""Adapters loaded at run time from PEFT's saved format equal PEFT serving them."""

import copy

import pytest
import torch
from conftest import DEVICE
from helpers import EOS, PAD, make_batch, peft_generate
from lorazor import AdapterError, LoRazorConfig, LoRazorModel
from lorazor.tiny import tiny_peft_model


@pytest.fixture()
def setup(tmp_path):
    full = tiny_peft_model("llama").to(DEVICE)
    full.save_pretrained(tmp_path, selected_adapters=["sql"])
    partial = copy.deepcopy(full)
    partial.delete_adapter("sql")
    model = LoRazorModel.from_peft(partial, LoRazorConfig(max_loras=3))
    return model, full, tmp_path / "sql"


def test_added_adapter_matches_peft(setup):
    model, oracle, sql_dir = setup
    assert model.add_adapter(sql_dir) == 2
    ids, mask = make_batch(5, 6, seed=3, pad_rows=(1,))
    adapters = ["sql", "math", None, "med", "sql"]
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=8, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, adapters, max_new_tokens=8))


def test_remove_then_reuse_the_slot(setup):
    model, oracle, sql_dir = setup
    model.add_adapter(sql_dir)
    model.remove_adapter("math")
    ids, mask = make_batch(2, 5, seed=4)
    with pytest.raises(KeyError, match="unknown adapter 'math' at row 0"):
        model.generate(ids, attention_mask=mask, adapter_ids=["math", None], max_new_tokens=2)
    assert model.add_adapter(sql_dir, name="sql2") == 0
    out = model.generate(ids, attention_mask=mask, adapter_ids=["sql2", "sql"], max_new_tokens=6, pad_token_id=PAD,
                         eos_token_id=EOS)
    ref = peft_generate(oracle, ids, mask, ["sql", "sql"], max_new_tokens=6)
    assert torch.equal(out.sequences, ref)
    assert model.adapter_names == ["med", "sql", "sql2"] and model.adapters["sql2"].slot == 0


def test_add_adapter_errors(setup):
    model, _, sql_dir = setup
    model.add_adapter(sql_dir)
    with pytest.raises(AdapterError, match="adapter 'sql' is already registered"):
        model.add_adapter(sql_dir)


def test_full_bank_evicts_the_least_recently_used_and_peft_adapters_come_back_from_host(setup):
    model, oracle, sql_dir = setup
    model.add_adapter(sql_dir)  # slots: math, med, sql (all 3 taken)
    ids, mask = make_batch(3, 5, seed=6)
    gen = dict(max_new_tokens=6, pad_token_id=PAD, eos_token_id=EOS)
    model.generate(ids, attention_mask=mask, adapter_ids=["med", "sql", None], **gen)  # math is now the LRU
    model.add_adapter(sql_dir, name="sql2")
    assert model.adapters["math"].location == "host" and model.adapters["sql2"].slot == 0
    # math came from the PeftModel (no folder): it is reloaded from its host copy, evicting med.
    out = model.generate(ids, attention_mask=mask, adapter_ids=["math", "sql2", "sql"], **gen)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ["math", "sql", "sql"], max_new_tokens=6))
    assert model.adapters["med"].location == "host"


def test_uniform_rank_bank_skips_rank_masking_until_a_smaller_rank_arrives(tmp_path):
    from lorazor.tiny import AdapterSpec

    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    specs = (AdapterSpec("a", 8, 16, every), AdapterSpec("b", 8, 8, every), AdapterSpec("small", 4, 8, ("q_proj",)))
    full = tiny_peft_model("llama", specs).to(DEVICE)
    full.save_pretrained(tmp_path, selected_adapters=["small"])
    partial = copy.deepcopy(full)
    partial.delete_adapter("small")
    model = LoRazorModel.from_peft(partial, LoRazorConfig(max_loras=3))
    # Ranks 8 and 8 (and an empty slot): the kernels skip the per-slot rank load everywhere...
    assert not any(m.mask_rank for m in model.bank.modules.values())
    ids, mask = make_batch(4, 6, seed=5, pad_rows=(2,))
    adapters = ["a", "b", None, "a"]
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, peft_generate(full, ids, mask, adapters, max_new_tokens=6))
    # ...until a rank-4 adapter lands in q_proj; then q_proj masks ranks and the rest still do not.
    model.add_adapter(tmp_path / "small")
    masked = {name.rsplit(".", 1)[-1] for name, m in model.bank.modules.items() if m.mask_rank}
    assert masked == {"q_proj"}
    adapters = ["small", "b", "a", "small"]
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, peft_generate(full, ids, mask, adapters, max_new_tokens=6))
    # Removing it zeroes its slot, so the unmasked path stays exact.
    slot = model.bank.slot_of["small"]
    model.remove_adapter("small")
    assert not any(m.mask_rank for m in model.bank.modules.values())
    assert all(m.lora_a[slot].abs().sum() == 0 and m.lora_b[slot].abs().sum() == 0 for m in model.bank.modules.values())


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_rank_and_alpha_patterns_and_bin_folders_match_peft(tmp_path, safe):
    from peft import LoraConfig

    full = tiny_peft_model("llama").to(DEVICE)
    # rank 2 by default, rank 8 on v_proj, alpha 32 on q_proj, other modules alpha 4.
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                     rank_pattern={"v_proj": 8}, alpha_pattern={"q_proj": 32})
    full.add_adapter("pat", cfg)
    full.save_pretrained(tmp_path, selected_adapters=["pat"], safe_serialization=safe)
    weights = "adapter_model.safetensors" if safe else "adapter_model.bin"
    assert (tmp_path / "pat" / weights).is_file()
    partial = copy.deepcopy(full)
    partial.delete_adapter("pat")
    model = LoRazorModel.from_peft(partial, LoRazorConfig(max_loras=4))
    model.add_adapter(tmp_path / "pat")
    ids, mask = make_batch(4, 6, seed=8, pad_rows=(2,))
    adapters = ["pat", "math", None, "pat"]
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=8, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, peft_generate(full.eval(), ids, mask, adapters, max_new_tokens=8))
    q = next(m for n, m in model.bank.modules.items() if n.endswith("layers.0.self_attn.q_proj"))
    v = next(m for n, m in model.bank.modules.items() if n.endswith("layers.0.self_attn.v_proj"))
    assert q.host_rank[3] == 2 and v.host_rank[3] == 8 and float(q.scaling[3]) == 16.0 and float(v.scaling[3]) == 0.5


class _Payload:
    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _Payload.ran = True
    return {}


def test_bin_with_a_pickled_object_is_refused_and_never_run(setup, tmp_path):
    import pickle

    model, _, sql_dir = setup
    (sql_dir / "adapter_model.safetensors").unlink()
    (sql_dir / "adapter_model.bin").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(AdapterError, match="adapter_model.bin is not a valid weights-only torch file"):
        model.add_adapter(sql_dir)
    assert not _Payload.ran
