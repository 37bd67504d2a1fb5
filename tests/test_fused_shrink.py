"""Shrinks fused into the kernel ahead: `KernelConfig.attention_o_shrink` (decode attention runs
o_proj's LoRA shrink) and `mlp_down_shrink` (the MLP's SiLU-multiply runs down_proj's); the
projection then launches only its expand.

The model with them must give the tokens of the model without them (and of PEFT), with StepTrim
releasing rows mid-generation, compiled without graph breaks, and on the GPU inside CUDA graphs.
"""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, KERNEL_DTYPES, TOL
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
@pytest.mark.parametrize("switches", [{"attention_o_shrink": True}, {"mlp_down_shrink": True},
                                      {"attention_o_shrink": True, "mlp_down_shrink": True}])
@pytest.mark.parametrize("compile_step", [False, True])
def test_fused_shrinks_graph_replay_match_peft_fp32(tmp_path, monkeypatch, switches, compile_step):
    cfg = dataclasses.replace(get_kernel_config(DEVICE), **switches)
    path = tmp_path / "fused.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setenv("LORAZOR_KERNEL_CONFIG", str(path))
    base = tiny_peft_model("llama").cuda()
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(cuda_graphs=True, compile=compile_step))
    ids, mask = make_batch(16, 6, seed=4, pad_rows=(1, 7))
    adapters = ["math", "sql", None, "med"] * 4
    for mix in (adapters, adapters[::-1]):  # a new mix replays the same graphs
        out = model.generate(ids, attention_mask=mask, adapter_ids=mix, max_new_tokens=10, pad_token_id=PAD,
                             eos_token_id=EOS)
        assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, mix, max_new_tokens=10))


# ---- down_proj's shrink in the MLP's activation kernel (KernelConfig.mlp_down_shrink) ----------

@pytest.fixture
def down_shrink_config(tmp_path, monkeypatch):
    """This device's config with mlp_down_shrink on, and 3 K splits (the expand sums them)."""
    cfg = dataclasses.replace(get_kernel_config(DEVICE), mlp_down_shrink=True, shrink_split_k=3)
    path = tmp_path / "down_shrink.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setenv("LORAZOR_KERNEL_CONFIG", str(path))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_silu_mul_shrink_matches_reference(down_shrink_config, dtype):
    from lorazor_kernels import build_batch_meta, silu_mul_shrink, silu_mul_shrink_reference

    g = torch.Generator().manual_seed(1)
    M, K, L, r = 37, 600, 5, 6  # K of 3 chunks or more at any config's shrink_block_k (<= 256)
    merged = torch.randn(M, 2 * K, generator=g).to(DEVICE, dtype)  # gate and up as slices, as the model has them
    gate, up = merged[:, :K], merged[:, K:]
    lora_a = (torch.randn(L, r, K, generator=g) / K**0.5).to(DEVICE, dtype)
    row_slot = torch.randint(-1, L, (M,), generator=g).to(DEVICE)
    h, u = silu_mul_shrink(gate, up, lora_a, build_batch_meta(row_slot, L, "exact"))
    ref_h, ref_u = silu_mul_shrink_reference(gate, up, lora_a, row_slot)
    assert u.shape[0] == 3
    torch.testing.assert_close(h.float(), ref_h.float(), **TOL[dtype])
    has = row_slot >= 0
    torch.testing.assert_close(u.sum(0)[has, :r], ref_u[0, has, :r], **TOL[dtype])


def test_silu_mul_shrink_needs_the_exact_grid():
    from lorazor_kernels import build_batch_meta, silu_mul_shrink

    x = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="needs the exact grid's tile table, got grid 'full'"):
        silu_mul_shrink(x, x, torch.randn(2, 4, 32, device=DEVICE),
                        build_batch_meta(torch.zeros(4, dtype=torch.long, device=DEVICE), 2, "full"))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_down_shrink_in_activation_gives_peft_tokens(down_shrink_config, monkeypatch, backend):
    import lorazor.mlp
    from lorazor_kernels import silu_mul_shrink_op

    base = tiny_peft_model("llama").to(DEVICE)
    oracle = copy.deepcopy(base)
    model = LoRazorModel.from_peft(base, LoRazorConfig(backend=backend, cuda_graphs=False))
    calls = []
    monkeypatch.setattr(lorazor.mlp, "silu_mul_shrink_op", lambda *a: calls.append(1) or silu_mul_shrink_op(*a))
    ids, mask = make_batch(5, 5, seed=6, pad_rows=(1,))
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    # Only math and med target down_proj in the tiny testbed; every step (prefill + 5 decode) x 2 layers.
    assert len(calls) == 12
    assert all(m.pending_partials is None for m in model.modules() if hasattr(m, "pending_partials"))
    peft_model = model.unpatch()
    assert not any("forward" in m.__dict__ for m in peft_model.modules())


def test_both_fusions_with_release_and_compile_equal_the_unfused_model(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    cfg = dataclasses.replace(get_kernel_config(DEVICE), mlp_down_shrink=True, attention_o_shrink=True)
    path = tmp_path / "both.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    base = tiny_peft_model("llama").to(DEVICE)
    unfused = LoRazorModel.from_peft(copy.deepcopy(base), LoRazorConfig(backend="triton", attention="triton",
                                                                        cuda_graphs=False))
    monkeypatch.setenv("LORAZOR_KERNEL_CONFIG", str(path))
    counters.clear()
    fused = LoRazorModel.from_peft(base, LoRazorConfig(backend="triton", attention="triton", compile=True,
                                                       cuda_graphs=False))
    ids, mask = make_batch(5, 5, seed=3)
    policy = ProfiledRelease({"math": 2, "sql": 0, "med": 99})
    a = _generate(fused, ids, mask, release_policy=policy)
    b = _generate(unfused, ids, mask, release_policy=policy)
    assert torch.equal(a.sequences, b.sequences) and (a.release_steps >= 0).any()
    assert dict(counters["graph_break"]) == {}
