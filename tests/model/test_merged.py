"""Merged projections (q/k/v and gate/up as one GEMM + one LoRA shrink/expand) equal PEFT."""

import pytest
import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_generate
from lorazor import LoRazorConfig
from lorazor.tiny import AdapterSpec

EVERY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UNIFORM = (AdapterSpec("a", 8, 16, EVERY), AdapterSpec("b", 8, 8, EVERY), AdapterSpec("c", 8, 4, EVERY[:3]))
ADAPTERS = ["a", "b", None, "c", "a", "c"]


def generate(model, ids, mask, adapters=ADAPTERS, **kw):
    return model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                          eos_token_id=EOS, **kw).sequences


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_merged_projections_match_peft(arch, backend):
    model, oracle = build_pair(arch, LoRazorConfig(merge_projections=True, backend=backend), adapters=UNIFORM)
    assert len(model.merged_groups) == 2 * model.model.config.num_hidden_layers
    ids, mask = make_batch(6, 5, seed=11, pad_rows=(1, 4))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    # The merged computation ran, and no group holds its buffers past the last member.
    assert all(group.ran_merged and group._output is None for group in model.merged_groups)
    # Logits of a full forward too (prefill path), against PEFT's.
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask,
                     adapter_names=["__base__" if a is None else a for a in ADAPTERS]).logits
    torch.testing.assert_close(model(ids, mask, ADAPTERS)[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


def test_mixed_ranks_fall_back_to_per_module_and_stay_exact():
    # The default tiny adapters mix ranks 4, 8, 16: the groups exist but take the per-module path.
    model, oracle = build_pair("llama", LoRazorConfig(merge_projections=True))
    ids, mask = make_batch(4, 5, seed=12)
    adapters = ["math", "sql", None, "med"]
    assert torch.equal(
        generate(model, ids, mask, adapters), peft_generate(oracle, ids, mask, adapters, max_new_tokens=6)
    )
    assert not any(group.ran_merged for group in model.merged_groups)


def test_merged_weights_are_views_not_copies():
    model, _ = build_pair("llama", LoRazorConfig(merge_projections=True), adapters=UNIFORM)
    group = model.merged_groups[0]
    q, k, v = group.members
    assert q.base_layer.weight.data_ptr() == group.weight.data_ptr()
    assert k.base_layer.weight.data_ptr() == group.weight[q.out_features].data_ptr()
    assert v.lora.lora_a.data_ptr() == group.lora_a[:, 16:].data_ptr()


def test_compiled_merged_step_matches_peft():
    from torch._dynamo.utils import counters

    counters.clear()
    model, oracle = build_pair("qwen2", LoRazorConfig(merge_projections=True, compile=True, cuda_graphs=False),
                               adapters=UNIFORM)
    ids, mask = make_batch(6, 5, seed=13, pad_rows=(2,))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dict(counters["graph_break"]) == {}
