"""KernelConfig.gemm_shrink: the LoRA shrink computed by the base GEMM (A stacked under W), only the
expand kernel after it. The model must give PEFT's tokens, also with StepTrim, compile, added
adapters and CUDA graphs, and prefill-sized forwards must keep the shrink kernel."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from helpers import EOS, PAD, make_batch, peft_generate
from lorazor import LoRazorConfig, LoRazorModel, ProfiledRelease
from lorazor.gemm_shrink import stack_a_under
from lorazor.tiny import tiny_peft_model
from lorazor_kernels import get_kernel_config

ADAPTERS = ["math", "sql", None, "med", "sql"]


def _gemm_shrink_config(tmp_path, monkeypatch, **extra):
    cfg = dataclasses.replace(get_kernel_config(torch.device(DEVICE)), gemm_shrink=True, **extra)
    path = tmp_path / "gemm_shrink.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setenv("LORAZOR_KERNEL_CONFIG", str(path))


def _count_gemm_shrinks(monkeypatch):
    import lorazor.layers

    calls = []
    fn = lorazor.layers.linear_with_shrink
    monkeypatch.setattr(lorazor.layers, "linear_with_shrink", lambda x, s: calls.append(x.shape) or fn(x, s))
    return calls


def _generate(model, ids, mask, adapters=ADAPTERS, **kw):
    return model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                          eos_token_id=EOS, **kw)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gemm_shrink_gives_peft_tokens_and_prefill_keeps_the_kernel(tmp_path, monkeypatch, backend):
    import lorazor.gemm_shrink

    _gemm_shrink_config(tmp_path, monkeypatch)
    # 5 rows per decode step use the GEMM; the prefill's 5 x 5 = 25 rows take the shrink kernel.
    monkeypatch.setattr(lorazor.gemm_shrink, "GEMM_SHRINK_MAX_ROWS", 5)
    base = tiny_peft_model("llama").to(DEVICE)
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(backend=backend, cuda_graphs=False))
    calls = _count_gemm_shrinks(monkeypatch)
    ids, mask = make_batch(5, 5, seed=6, pad_rows=(1,))
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    stacked = [m for m in model.modules() if getattr(m, "stacked", None) is not None] + \
        [g for g in model.merged_groups if g.stacked is not None]
    assert stacked, "no layer took the stacked layout"
    assert calls and all(shape[0] * shape[1] == 5 for shape in calls)  # decode forwards only
    assert len(calls) % 5 == 0  # 5 decode steps, each through the same stacked layers


def test_gemm_shrink_with_release_and_compile_equals_the_shrink_kernel(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    base = tiny_peft_model("llama").to(DEVICE)
    cfg = LoRazorConfig(backend="triton", compile=True, cuda_graphs=False)
    plain = LoRazorModel.from_peft(copy.deepcopy(base), cfg)
    _gemm_shrink_config(tmp_path, monkeypatch)
    counters.clear()
    stacked = LoRazorModel.from_peft(base, cfg)
    ids, mask = make_batch(5, 5, seed=3)
    # math keeps its adapter for 2 decode steps, sql releases after prefill, med keeps it throughout.
    policy = ProfiledRelease({"math": 2, "sql": 0, "med": 99})
    a = _generate(stacked, ids, mask, release_policy=policy)
    b = _generate(plain, ids, mask, release_policy=policy)
    assert torch.equal(a.release_steps, b.release_steps) and (a.release_steps >= 0).any()
    assert torch.equal(a.sequences, b.sequences)
    assert dict(counters["graph_break"]) == {}


def test_adapters_added_after_stacking_are_read_by_the_gemm(tmp_path, monkeypatch):
    full = tiny_peft_model("llama").to(DEVICE)
    full.save_pretrained(tmp_path / "saved", selected_adapters=["sql"])
    partial = copy.deepcopy(full)
    partial.delete_adapter("sql")
    _gemm_shrink_config(tmp_path, monkeypatch)
    model = LoRazorModel.from_peft(partial, LoRazorConfig(max_loras=3, backend="triton", cuda_graphs=False))
    calls = _count_gemm_shrinks(monkeypatch)
    model.add_adapter(tmp_path / "saved" / "sql")
    ids, mask = make_batch(5, 5, seed=3, pad_rows=(1,))
    out = _generate(model, ids, mask)
    assert calls
    assert torch.equal(out.sequences, peft_generate(full, ids, mask, ADAPTERS, max_new_tokens=6))
    # The PEFT model handed back still computes with its own (now stacked) weights.
    oracle_logits = full(input_ids=ids, attention_mask=mask).logits
    peft_back = model.unpatch()
    peft_back.set_adapter("math")
    full.set_adapter("math")
    torch.testing.assert_close(peft_back(input_ids=ids, attention_mask=mask).logits,
                               full(input_ids=ids, attention_mask=mask).logits)
    assert oracle_logits.abs().max() > 0


def test_stack_a_under_makes_views_and_names_bad_input():
    w, a = torch.randn(6, 4), torch.randn(3, 2, 4)
    stacked, w_view, bias_view, a_view = stack_a_under(w, None, a)
    assert stacked.weight.shape == (12, 4) and stacked.n == 6 and bias_view is None
    a_view[1, 0].fill_(7.0)  # an adapter written through the bank's view lands in the GEMM's rows
    assert torch.equal(stacked.weight[6 + 2], torch.full((4,), 7.0))
    assert torch.equal(w_view, w) and w_view.data_ptr() == stacked.weight.data_ptr()
    stacked, _, bias_view, _ = stack_a_under(w, torch.ones(6), a)
    assert torch.equal(stacked.bias, torch.cat([torch.ones(6), torch.zeros(6)]))
    with pytest.raises(ValueError, match=r"A \(3, 2, 5\) torch.float32 cannot go under W \(6, 4\)"):
        stack_a_under(w, None, torch.randn(3, 2, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_step", [False, True])
def test_gpu_gemm_shrink_graph_replay_matches_peft_fp32(tmp_path, monkeypatch, compile_step):
    _gemm_shrink_config(tmp_path, monkeypatch)
    base = tiny_peft_model("llama").cuda()
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(cuda_graphs=True, compile=compile_step))
    calls = _count_gemm_shrinks(monkeypatch)
    ids, mask = make_batch(16, 6, seed=4, pad_rows=(1, 7))
    adapters = ["math", "sql", None, "med"] * 4
    for mix in (adapters, adapters[::-1]):  # a new mix replays the same graphs
        out = model.generate(ids, attention_mask=mask, adapter_ids=mix, max_new_tokens=10, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, mix, max_new_tokens=10))
    assert calls  # traced or captured through the stacked GEMM
