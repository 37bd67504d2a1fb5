"""Shared builders for model-level tests: tiny PEFT models, batches and PEFT oracles."""

import copy

import torch
from conftest import DEVICE
from lorazor import LoRazorConfig, LoRazorModel
from lorazor.tiny import tiny_peft_model

PAD, EOS = 0, 2


def make_batch(B, T, seed=0, pad_rows=(), vocab=96):
    """Random prompts; rows in `pad_rows` get i+1 left-padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for j, i in enumerate(pad_rows):
        mask[i, : j + 1] = 0
    ids[mask == 0] = PAD
    return ids.to(DEVICE), mask.to(DEVICE)


def peft_names(adapter_ids):
    return ["__base__" if a is None else a for a in adapter_ids]


def build_pair(arch="llama", config=None, dtype=torch.float32, **kw):
    """(LoRazorModel, untouched PEFT copy) built from the same random weights."""
    peft_model = tiny_peft_model(arch, dtype=dtype, **kw).to(DEVICE)
    oracle = copy.deepcopy(peft_model)
    model = LoRazorModel.from_peft(peft_model, config or LoRazorConfig())
    return model, oracle


def peft_generate(oracle, ids, mask, adapter_ids, **gen):
    with torch.no_grad():
        return oracle.generate(input_ids=ids, attention_mask=mask, adapter_names=peft_names(adapter_ids),
                               pad_token_id=PAD, eos_token_id=EOS, do_sample=False, **gen)


def assert_model_gives_peft_tokens(config: LoRazorConfig) -> None:
    """The tiny llama served by `config` generates PEFT's tokens for a mixed batch: three adapters, a row
    without one, a padded row; 5-token prompts (a 25-token prefill), then 4 decode steps of 5 rows."""
    model, oracle = build_pair("llama", config)
    ids, mask = make_batch(5, 5, seed=6, pad_rows=(1,))
    adapters = ["math", "sql", None, "med", "sql"]
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=5)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=5, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)


def use_kernel_config(tmp_path, monkeypatch, **changes) -> None:
    """Serve this test with the device's kernel config plus `changes`, through the file the environment
    names (as the model's layers read it)."""
    import dataclasses
    import json

    from lorazor_kernels import get_kernel_config
    from lorazor_kernels.kernel_config import CONFIG_ENV

    path = tmp_path / "kernel_config.json"
    path.write_text(json.dumps({**dataclasses.asdict(get_kernel_config(torch.device(DEVICE))), **changes}))
    monkeypatch.setenv(CONFIG_ENV, str(path))

