"""torch.compile of the decode step: no graph breaks, same tokens as PEFT."""

import pytest
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


def test_one_compile_serves_every_slot_bound_class():
    from torch._dynamo.utils import counters

    from lorazor.tiny import AdapterSpec

    counters.clear()
    specs = tuple(AdapterSpec(f"a{i}", 4, 8, ("q_proj", "v_proj")) for i in range(20))
    model, oracle = build_pair("llama", LoRazorConfig(compile=True, cuda_graphs=False, backend="triton"),
                               adapters=specs)
    ids, mask = make_batch(24, 5, seed=8, pad_rows=(1,))
    few = [f"a{3 + i % 2}" for i in range(24)]
    many = [f"a{i % 20}" if i < 21 else None for i in range(24)]
    graphs = []
    for adapters in (few, many):
        out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=4, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, adapters, max_new_tokens=4))
        graphs.append(counters["stats"]["unique_graphs"])
    # Slot-bound classes 16 and 20 (tile tables of 2 + 16 and 2 + 20 tiles): the same compiled step.
    assert graphs[0] >= 1 and graphs[1] == graphs[0]
    assert dict(counters["graph_break"]) == {}


@pytest.mark.gpu
def test_gpu_compiled_graphs_match_fp32_peft_across_adapter_mixes():
    # The benchmarks' fastest setup (torch.compile inside the captured CUDA graphs, merged projections,
    # the Triton kernels) against PEFT, and again after the adapter mix changes (same graphs).
    from lorazor.tiny import AdapterSpec

    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    specs = (AdapterSpec("math", 8, 16, every), AdapterSpec("sql", 8, 8, every), AdapterSpec("med", 8, 4, every))
    model, oracle = build_pair("llama", LoRazorConfig(compile=True), adapters=specs)
    ids, mask = make_batch(16, 6, seed=9, pad_rows=(1, 7))
    captured = []
    for adapters in (["math", "sql", None, "med"] * 4, ["med"] * 5 + ["sql"] * 11):
        out = model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=10, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, adapters, max_new_tokens=10))
        captured.append(model.graphs.num_graphs())
    assert captured[0] >= 1 and captured[1] == captured[0]  # the new mix replays the graphs it found
