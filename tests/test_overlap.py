"""overlap_shrink: LoRA's shrink beside the base GEMM, through the `lorazor::linear_lora` op.

On the CPU the op runs its serial path (no streams), so these tests check the op's plumbing:
registration, its fake implementation under torch.compile, shapes, per-module and merged layers.
The side-stream path itself is covered by the GPU test at the end.
"""

import copy

import pytest
import torch
from helpers import EOS, PAD, build_pair, make_batch, peft_generate, peft_names
from lorazor import LoRazorConfig, LoRazorModel
from lorazor.tiny import AdapterSpec, tiny_peft_model

EVERY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UNIFORM = (AdapterSpec("math", 8, 16, EVERY), AdapterSpec("sql", 8, 8, EVERY), AdapterSpec("med", 8, 4, EVERY[:3]))
ADAPTERS = ["math", None, "sql", "med", "math", "sql"]


def generate(model, ids, mask, adapters=ADAPTERS):
    return model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                          eos_token_id=EOS).sequences


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_module"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_overlap_matches_peft(arch, merge, monkeypatch):
    import lorazor.layers

    calls = []
    op = lorazor.layers.linear_lora_op
    monkeypatch.setattr(lorazor.layers, "linear_lora_op", lambda *a, **k: calls.append(1) or op(*a, **k))
    # Eager, so every forward calls the op from Python (a graph replay would not: counted once).
    config = LoRazorConfig(overlap_shrink=True, merge_projections=merge, backend="triton", cuda_graphs=False)
    model, oracle = build_pair(arch, config, adapters=UNIFORM)
    assert model.context.overlap
    ids, mask = make_batch(6, 5, seed=21, pad_rows=(1, 3))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    # Every LoRA layer ran through the op: 4 (merged) or 7 per decoder layer, per forward.
    per_forward = (4 if merge else 7) * model.model.config.num_hidden_layers
    assert len(calls) >= 6 * per_forward
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(ADAPTERS)).logits
    torch.testing.assert_close(model(ids, mask, ADAPTERS)[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


def test_compiled_overlap_step_has_no_graph_breaks():
    from torch._dynamo.utils import counters

    counters.clear()
    config = LoRazorConfig(overlap_shrink=True, compile=True, cuda_graphs=False, backend="triton")
    model, oracle = build_pair("llama", config, adapters=UNIFORM)
    ids, mask = make_batch(6, 5, seed=22, pad_rows=(2,))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dict(counters["graph_break"]) == {}


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "graphs+compile"])
def test_gpu_overlap_graph_replay_equals_serial_and_fp32_peft(compile):
    base = tiny_peft_model("llama", UNIFORM, dtype=torch.float32).cuda()
    oracle = copy.deepcopy(base)
    serial = LoRazorModel.from_peft(copy.deepcopy(base), LoRazorConfig(cuda_graphs=False))
    overlap = LoRazorModel.from_peft(base, LoRazorConfig(overlap_shrink=True, compile=compile))
    ids, mask = make_batch(16, 6, seed=23, pad_rows=(1, 7))
    mixes = [ADAPTERS + ADAPTERS + ["sql"] * 4, ["med"] * 16, [None] * 8 + ["math"] * 8]
    for adapters in mixes:
        ref = peft_generate(oracle, ids, mask, adapters, max_new_tokens=8)
        got = overlap.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=8, pad_token_id=PAD,
                               eos_token_id=EOS).sequences
        assert torch.equal(got, ref), f"mix {adapters[:4]}..."
        assert torch.equal(serial.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=8,
                                           pad_token_id=PAD, eos_token_id=EOS).sequences, ref)
