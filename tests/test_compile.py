"""torch.compile of the decode step: no graph breaks, same tokens as PEFT."""

import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_generate
from lorazor import LoRazorConfig


def test_compiled_decode_step_matches_peft():
    from torch._dynamo.utils import counters

    counters.clear()
    model, oracle = build_pair("qwen2", LoRazorConfig(compile=True, cuda_graphs=False))
    ids, mask = make_batch(4, 5, seed=7, pad_rows=(2,))
    adapters = ["med", None, "math", "sql"]
    ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=6)
    out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)
    assert dict(counters["graph_break"]) == {}
    # The adapter mix changes between calls without a recompile.
    frames = counters["stats"]["unique_graphs"]
    model.generate(ids, attention_mask=mask, adapter_ids=["sql", "sql", None, "med"], max_new_tokens=6,
                   pad_token_id=PAD, eos_token_id=EOS)
    assert counters["stats"]["unique_graphs"] == frames
