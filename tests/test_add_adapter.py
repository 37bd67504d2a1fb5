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
    assert model.adapter_names == ["sql2", "med", "sql"]


def test_add_adapter_errors(setup):
    model, _, sql_dir = setup
    model.add_adapter(sql_dir)
    with pytest.raises(AdapterError, match="adapter 'sql' is already loaded"):
        model.add_adapter(sql_dir)
    with pytest.raises(AdapterError, match="no free slot for adapter 'x'"):
        model.add_adapter(sql_dir, name="x")


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
