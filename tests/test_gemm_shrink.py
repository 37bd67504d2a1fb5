"""`KernelConfig.gemm_shrink`: the A bank under each base weight, the shrink inside the base GEMM
for decode steps whose batch uses most of the bank; everything must still equal PEFT."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import DEVICE
from helpers import EOS, PAD, build_pair, make_batch, peft_generate
from lorazor import LoRazorConfig, LoRazorModel
from lorazor.tiny import AdapterSpec, tiny_peft_model
from lorazor_kernels import build_batch_meta, get_kernel_config, lora_delta_reference, lora_expand
from lorazor_kernels import ops as kernel_ops
from lorazor_kernels.kernel_config import CONFIG_ENV

EVERY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UNIFORM = (AdapterSpec("a", 8, 16, EVERY), AdapterSpec("b", 8, 8, EVERY), AdapterSpec("c", 8, 4, EVERY[:3]))
ADAPTERS = ["a", "b", None, "c", "a", "c"]


@pytest.fixture()
def gemm_shrink_on(tmp_path, monkeypatch):
    """The device's kernel config with `gemm_shrink` on, for every model built in the test."""
    cfg = dataclasses.replace(get_kernel_config(torch.device(DEVICE)), gemm_shrink=True)
    path = tmp_path / "kernel_config.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setenv(CONFIG_ENV, str(path))


@pytest.fixture()
def dense_calls(monkeypatch):
    """Counts the expands that read every slot's shrink from the stacked GEMM."""
    calls = []
    real = kernel_ops.add_lora_expand_every_slot_

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel_ops, "add_lora_expand_every_slot_", spy)
    return calls


def generate(model, ids, mask, adapters=ADAPTERS):
    return model.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=6, pad_token_id=PAD,
                          eos_token_id=EOS).sequences


@pytest.mark.parametrize("widths, M, K, L", [((48, 16, 32), 37, 72, 5), ((80,), 19, 40, 3)], ids=["qkv", "plain"])
def test_expand_from_every_slots_shrink_matches_reference(widths, M, K, L):
    # u = x @ [A of every slot].T, as the stacked GEMM returns it; each row must read its own slot's columns.
    g = torch.Generator().manual_seed(M)
    G, r = len(widths), 8
    to = dict(device=DEVICE, dtype=torch.float32)
    x = torch.randn(M, K, generator=g).to(**to)
    a = [torch.randn(L, r, K, generator=g).to(**to) for _ in widths]
    b = [torch.randn(L, n, r, generator=g).to(**to) for n in widths]
    scaling = (torch.rand(G, L, generator=g) + 0.5).to(DEVICE)
    slot = torch.randint(-1, L, (M,), generator=g).to(DEVICE)
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    a_stack = torch.cat(a, dim=1)                                                    # [L, G*r, K]
    b_merged = torch.cat([bi.transpose(1, 2) for bi in b], dim=2).transpose(1, 2)    # [L, sum N, r] view
    edges = tuple(torch.tensor(widths[:-1]).cumsum(0).tolist())
    u = x @ a_stack.reshape(-1, K).T                                                 # [M, L*G*r]
    y0 = torch.randn(M, sum(widths), generator=g).to(**to)
    ref = y0.double() + torch.cat([lora_delta_reference(x.double(), a[i].double(), b[i].double(),
                                                        scaling[i].double(), slot, rank) for i in range(G)], dim=1)
    meta = build_batch_meta(slot, L, "exact")
    group_scaling = scaling if G > 1 else scaling[0]
    y = y0.clone()
    lora_expand(u, b_merged, group_scaling, rank, y, meta, mask_rank=False, segments=edges or None)
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    y_ref = kernel_ops.add_lora_expand_every_slot_(y0.clone(), u, b_merged, group_scaling, rank, meta, "reference",
                                                   mask_rank=False, segments=edges or None)
    torch.testing.assert_close(y_ref.double(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"u of every slot must be \[M, L \* G \* r_max\]"):
        lora_expand(u[:, :-1], b_merged, group_scaling, rank, y, meta, mask_rank=False, segments=edges or None)


@pytest.mark.parametrize("arch, merge", [("llama", True), ("qwen2", True), ("llama", False)])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dense_bank_steps_match_peft(gemm_shrink_on, dense_calls, arch, merge, backend):
    # A bank of 3 slots is its own top class: every step with adapters takes the stacked GEMM.
    model, oracle = build_pair(arch, LoRazorConfig(merge_projections=merge, backend=backend), adapters=UNIFORM)
    ids, mask = make_batch(6, 5, seed=21, pad_rows=(1, 4))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dense_calls, "no step took the stacked GEMM"
    if merge:
        assert all(group.stacked is not None for group in model.merged_groups)


def test_weights_and_adapters_become_views_of_the_stacked_weight(gemm_shrink_on):
    model, _ = build_pair("llama", LoRazorConfig(merge_projections=True), adapters=UNIFORM)
    group = model.merged_groups[0]
    stacked = group.stacked
    q, k, v = group.members
    assert stacked.n == sum(m.out_features for m in group.members)
    assert q.base_layer.weight.data_ptr() == stacked.weight.data_ptr()
    assert group.lora_a.data_ptr() == stacked.weight[stacked.n].data_ptr()
    assert v.lora.lora_a.data_ptr() == group.lora_a[:, 16:].data_ptr()
    o_proj = model.model.model.layers[0].self_attn.o_proj
    assert o_proj.lora.lora_a.data_ptr() == o_proj.stacked.weight[o_proj.out_features].data_ptr()


def test_batches_in_a_lower_class_keep_the_shrink_kernel(gemm_shrink_on, dense_calls):
    # A bank of 32 slots serving 3 adapters is in class 16: the stacked A would be read for nothing.
    model, oracle = build_pair("llama", LoRazorConfig(merge_projections=True, max_loras=32), adapters=UNIFORM)
    ids, mask = make_batch(6, 5, seed=22, pad_rows=(2,))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dense_calls == []
    assert model.merged_groups[0].stacked is not None  # stacked, but not used by this batch


def test_added_adapter_is_written_where_the_stacked_gemm_reads(gemm_shrink_on, dense_calls, tmp_path):
    full = tiny_peft_model("llama").to(DEVICE)
    full.save_pretrained(tmp_path, selected_adapters=["sql"])
    partial = copy.deepcopy(full)
    partial.delete_adapter("sql")
    model = LoRazorModel.from_peft(partial, LoRazorConfig(max_loras=3))
    model.add_adapter(tmp_path / "sql")
    ids, mask = make_batch(5, 6, seed=23, pad_rows=(1,))
    adapters = ["sql", "math", None, "med", "sql"]
    assert torch.equal(generate(model, ids, mask, adapters), peft_generate(full, ids, mask, adapters, max_new_tokens=6))
    assert dense_calls


def test_switching_gemm_shrink_off_at_reconfigure(gemm_shrink_on, dense_calls, monkeypatch):
    model, oracle = build_pair("llama", LoRazorConfig(merge_projections=True), adapters=UNIFORM)
    monkeypatch.delenv(CONFIG_ENV)
    model.reconfigure()
    ids, mask = make_batch(6, 5, seed=24)
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    assert dense_calls == [] and model.merged_groups[0].stacked is None


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_dense_bank_graphs_equal_eager_and_stay_close_to_peft(gemm_shrink_on, dense_calls, compile):
    from helpers import peft_names

    base = tiny_peft_model("llama", UNIFORM, dtype=torch.bfloat16).cuda()
    oracle = copy.deepcopy(base)
    eager = LoRazorModel.from_peft(copy.deepcopy(base), LoRazorConfig(merge_projections=True, cuda_graphs=False))
    graph = LoRazorModel.from_peft(base, LoRazorConfig(merge_projections=True, cuda_graphs=True, compile=compile))
    adapters = (ADAPTERS * 3)[:16]
    ids, mask = make_batch(16, 9, seed=25, pad_rows=(1, 4))
    out = [m.generate(ids, attention_mask=mask, adapter_ids=adapters, max_new_tokens=12, pad_token_id=PAD,
                      eos_token_id=EOS).sequences for m in (eager, graph)]
    assert torch.equal(out[0], out[1])
    assert dense_calls
    with torch.no_grad():
        ref = oracle(input_ids=ids, attention_mask=mask, adapter_names=peft_names(adapters)).logits.float()
    logits = eager(ids, mask, adapters).float()
    real = mask.bool()
    err = (logits[real] - ref[real]).norm() / ref[real].norm()
    assert err < 2e-2, f"relative error {err:.3e}"
