"""`KernelConfig.attention_o_shrink`: decode attention runs o_proj's LoRA shrink, o_proj only the expand.

The model with it must give the tokens of the model without it (and of PEFT), with StepTrim
releasing rows mid-generation, compiled without graph breaks, and on the GPU inside CUDA graphs.
"""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from helpers import EOS, PAD, make_batch, peft_generate
from lorazor import LoRazorConfig, LoRazorModel, ProfiledRelease
from lorazor.tiny import tiny_peft_model
from lorazor_kernels import get_kernel_config

ADAPTERS = ["math", "sql", None, "med", "sql"]


@pytest.fixture
def o_shrink_config(tmp_path, monkeypatch):
    """Point LORAZOR_KERNEL_CONFIG at this device's config with attention_o_shrink on."""
    cfg = dataclasses.replace(get_kernel_config(DEVICE), attention_o_shrink=True)
    path = tmp_path / "o_shrink.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setenv("LORAZOR_KERNEL_CONFIG", str(path))


def _count_calls(monkeypatch, name):
    import lorazor.attention

    calls = []
    fn = getattr(lorazor.attention, name)
    monkeypatch.setattr(lorazor.attention, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def _generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, adapter_ids=ADAPTERS, max_new_tokens=6, pad_token_id=PAD,
                          eos_token_id=EOS, **kw)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_o_shrink_in_attention_gives_peft_tokens(o_shrink_config, monkeypatch, backend):
    base = tiny_peft_model("llama").to(DEVICE)
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(backend=backend, attention="triton", cuda_graphs=False))
    fused = _count_calls(monkeypatch, "decode_attention_shrink_op")
    plain = _count_calls(monkeypatch, "decode_attention")
    ids, mask = make_batch(5, 5, seed=6, pad_rows=(1,))
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    # 5 decode steps x 2 layers took the fused path, none the plain kernel; every partial was used.
    assert (len(fused), len(plain)) == (10, 0)
    assert all(m.pending_partials is None for m in model.modules() if hasattr(m, "pending_partials"))


def test_o_shrink_with_release_equals_the_unfused_model(o_shrink_config, monkeypatch):
    base = tiny_peft_model("llama").to(DEVICE)
    cfg = LoRazorConfig(backend="triton", attention="triton", cuda_graphs=False)
    unfused_base = copy.deepcopy(base)
    fused_model = LoRazorModel.from_peft(base, cfg)
    monkeypatch.delenv("LORAZOR_KERNEL_CONFIG")
    unfused = LoRazorModel.from_peft(unfused_base, cfg)
    assert not any(getattr(m, "shrink_in_attention", False) for m in unfused.modules())
    ids, mask = make_batch(5, 5, seed=3)
    # math keeps its adapter for 2 decode steps, sql releases after prefill, med keeps it throughout.
    policy = ProfiledRelease({"math": 2, "sql": 0, "med": 99})
    a = _generate(fused_model, ids, mask, release_policy=policy)
    b = _generate(unfused, ids, mask, release_policy=policy)
    assert torch.equal(a.release_steps, b.release_steps) and (a.release_steps >= 0).any()
    assert torch.equal(a.sequences, b.sequences)


def test_o_shrink_compiles_without_graph_breaks(o_shrink_config):
    from torch._dynamo.utils import counters

    counters.clear()
    base = tiny_peft_model("llama").to(DEVICE)
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(backend="triton", attention="triton", compile=True,
                                                        cuda_graphs=False))
    ids, mask = make_batch(5, 5, seed=2)
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dict(counters["graph_break"]) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_step", [False, True])
def test_o_shrink_graph_replay_matches_peft_fp32(o_shrink_config, compile_step):
    base = tiny_peft_model("llama").cuda()
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(cuda_graphs=True, compile=compile_step))
    assert any(getattr(m, "shrink_in_attention", False) for m in model.modules())
    ids, mask = make_batch(16, 6, seed=4, pad_rows=(1, 7))
    adapters = ["math", "sql", None, "med"] * 4
    for mix in (adapters, adapters[::-1]):  # a new mix replays the same graphs
        out = model.generate(ids, attention_mask=mask, adapter_ids=mix, max_new_tokens=10, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, mix, max_new_tokens=10))
