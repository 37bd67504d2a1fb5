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
