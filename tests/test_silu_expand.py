"""The gated MLP's LoRA expand + activation kernel (`silu_mul_expand`) against the fp64 reference,
and models running it against PEFT."""

import dataclasses
import json

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, KERNEL_DTYPES, TOL
from helpers import build_pair, make_batch, peft_generate
from lorazor import LoRazorConfig
from lorazor_kernels import (
    GRID_MODES, KernelConfig, build_batch_meta, linear_lora_silu_mul_op, lora_delta_reference, lora_expand_silu_mul,
    lora_shrink, silu_mul_reference,
)
from test_merged import ADAPTERS, UNIFORM, generate


def gate_up_case(M, K, I, r, L, dtype, seed=0, slots=None):
    """Random merged gate/up inputs; `slots` fixes row_slot (default: random, some rows -1)."""
    g = torch.Generator().manual_seed(seed)
    to = dict(device=DEVICE, dtype=dtype)
    x = torch.randn(M, K, generator=g).to(**to)
    a = [(torch.randn(L, r, K, generator=g) / K**0.5).to(**to) for _ in range(2)]
    b = [(torch.randn(L, I, r, generator=g) / r**0.5).to(**to) for _ in range(2)]
    scaling = (torch.rand(2, L, generator=g) + 0.5).to(DEVICE)
    slot = torch.randint(-1, L, (M,), generator=g) if slots is None else torch.as_tensor(slots)
    weight = (torch.randn(2 * I, K, generator=g) / K**0.5).to(**to)
    a_stack = torch.cat(a, dim=1)                                                 # [L, 2r, K]
    b_merged = torch.cat([bi.transpose(1, 2) for bi in b], dim=2).transpose(1, 2)  # [L, 2I, r] view
    return x, a, b, a_stack, b_merged, scaling, slot.to(DEVICE), weight


def reference_h(x, a, b, scaling, slot, y, r):
    """silu(gate + delta_gate) * (up + delta_up) in fp64, y's gate and up halves."""
    rank = torch.full((a[0].shape[0],), r, dtype=torch.int32, device=x.device)
    I = b[0].shape[1]
    gate, up = (y[:, i * I:(i + 1) * I].double() + lora_delta_reference(
        x.double(), a[i].double(), b[i].double(), scaling[i].double(), slot, rank) for i in range(2))
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("grid", GRID_MODES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("M,K,I,r,L", [(37, 48, 80, 8, 5), (64, 32, 48, 4, 3), (5, 16, 16, 16, 2)])
def test_expand_silu_mul_matches_reference(grid, dtype, M, K, I, r, L):
    x, a, b, a_stack, b_merged, scaling, slot, _ = gate_up_case(M, K, I, r, L, dtype, seed=M)
    y = torch.randn(M, 2 * I, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    meta = build_batch_meta(slot, L, grid)
    # Split K in three for the fp32 partials, small column blocks so programs loop over several.
    cfg = dataclasses.replace(KernelConfig(), shrink_split_k=3, shrink_block_k=16, expand_block_n=32, silu_block_n=16)
    u = lora_shrink(x, a_stack, torch.full((L,), 2 * r, dtype=torch.int32, device=DEVICE), meta, cfg, mask_rank=False)
    h = lora_expand_silu_mul(u, b_merged, scaling, y, meta, cfg)
    assert h.shape == (M, I) and h.dtype == dtype
    torch.testing.assert_close(h.double(), reference_h(x, a, b, scaling, slot, y, r), **TOL[dtype])


@pytest.mark.parametrize("slots", ["none", "all", "one"])
def test_expand_silu_mul_rows_without_and_with_slots(slots):
    # No row with an adapter (only the row programs write h), every row with one (the row programs
    # all exit), and one adapter for all rows but the last.
    M, K, I, r, L = 33, 32, 40, 8, 4
    row_slot = {"none": [-1] * M, "all": [i % L for i in range(M)], "one": [2] * (M - 1) + [-1]}[slots]
    x, a, b, a_stack, b_merged, scaling, slot, _ = gate_up_case(M, K, I, r, L, torch.float32, slots=row_slot)
    y = torch.randn(M, 2 * I, device=DEVICE)
    meta = build_batch_meta(slot, L, "exact")
    u = lora_shrink(x, a_stack, torch.full((L,), 2 * r, dtype=torch.int32, device=DEVICE), meta, mask_rank=False)
    h = lora_expand_silu_mul(u, b_merged, scaling, y, meta)
    torch.testing.assert_close(h.double(), reference_h(x, a, b, scaling, slot, y, r), **TOL[torch.float32])
    if slots == "none":
        torch.testing.assert_close(h, silu_mul_reference(y), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_linear_lora_silu_mul_op_matches_reference(backend):
    M, K, I, r, L = 21, 48, 64, 8, 3
    x, a, b, a_stack, b_merged, scaling, slot, weight = gate_up_case(M, K, I, r, L, torch.float32, seed=4)
    meta = build_batch_meta(slot, L, "exact")
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    h = linear_lora_silu_mul_op(x, weight, None, a_stack, b_merged, scaling, rank, meta, backend=backend)
    torch.testing.assert_close(h.double(), reference_h(x, a, b, scaling, slot, x @ weight.T, r), **TOL[torch.float32])


def test_expand_silu_mul_rejects_bad_shapes():
    x, a, b, a_stack, b_merged, scaling, slot, weight = gate_up_case(8, 16, 16, 8, 2, torch.float32)
    meta = build_batch_meta(slot, 2, "exact")
    u = torch.zeros(1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="y must be \\[M, 2 \\* I\\]"):
        lora_expand_silu_mul(u, b_merged, scaling, torch.zeros(8, 31, device=DEVICE), meta)
    with pytest.raises(ValueError, match="scaling must be \\[2, L=2\\]"):
        lora_expand_silu_mul(u, b_merged, scaling[0], torch.zeros(8, 32, device=DEVICE), meta)
    with pytest.raises(ValueError, match="u must be shrink's partials"):
        lora_expand_silu_mul(u[:, :4], b_merged, scaling, torch.zeros(8, 32, device=DEVICE), meta)
    rank = torch.full((2,), 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="merged gate/up group needs"):
        linear_lora_silu_mul_op(x, weight[:31], None, a_stack, b_merged, scaling, rank, meta)


@pytest.fixture
def silu_mul_expand_on(tmp_path, monkeypatch):
    """The device's kernel config with `silu_mul_expand` on, through LORAZOR_KERNEL_CONFIG."""
    from lorazor_kernels import get_kernel_config

    cfg = dataclasses.replace(get_kernel_config(DEVICE), silu_mul_expand=True)
    path = tmp_path / "kernel_config.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    monkeypatch.setenv("LORAZOR_KERNEL_CONFIG", str(path))


def fused_pair(arch, **config):
    model, oracle = build_pair(arch, LoRazorConfig(merge_projections=True, **config), adapters=UNIFORM)
    mlps = [m for m in model.model.modules() if "forward" in m.__dict__ and hasattr(m, "gate_proj")]
    assert len(mlps) == model.model.config.num_hidden_layers and model.context.silu_mul_expand
    return model, oracle


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_mlp_matches_peft(arch, backend, silu_mul_expand_on):
    model, oracle = fused_pair(arch, backend=backend)
    ids, mask = make_batch(6, 5, seed=21, pad_rows=(1, 4))
    assert torch.equal(generate(model, ids, mask), peft_generate(oracle, ids, mask, ADAPTERS, max_new_tokens=6))
    with torch.no_grad():  # prefill-sized forward: logits against PEFT's
        ref = oracle(input_ids=ids, attention_mask=mask,
                     adapter_names=["__base__" if a is None else a for a in ADAPTERS]).logits
    torch.testing.assert_close(model(ids, mask, ADAPTERS)[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


def test_fused_mlp_with_release_and_compile_equals_unfused(silu_mul_expand_on, monkeypatch):
    # StepTrim releases rows mid-generation (their h comes from the row programs), compiled step.
    model, _ = fused_pair("llama", backend="triton", compile=True, cuda_graphs=False)
    ids, mask = make_batch(6, 5, seed=22, pad_rows=(2,))
    fused = generate(model, ids, mask, release=[1, "never", 2, 0, 3, 1])
    monkeypatch.delenv("LORAZOR_KERNEL_CONFIG")
    model.reconfigure()
    assert not model.context.silu_mul_expand
    assert torch.equal(fused, generate(model, ids, mask, release=[1, "never", 2, 0, 3, 1]))


def test_unpatch_restores_hf_mlp(silu_mul_expand_on):
    model, _ = fused_pair("llama")
    peft_model = model.unpatch()
    assert not any("forward" in m.__dict__ for m in peft_model.modules() if hasattr(m, "gate_proj"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_expand_silu_mul_bf16_in_a_graph():
    M, K, I, r, L = 256, 3072, 8192, 8, 128
    x, a, b, a_stack, b_merged, scaling, slot, weight = gate_up_case(M, K, I, r, L, torch.bfloat16, seed=5)
    slot[::7] = -1  # some rows released
    meta = build_batch_meta(slot, L, "exact")
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    out = torch.empty(M, I, dtype=torch.bfloat16, device=DEVICE)
    run = lambda: out.copy_(linear_lora_silu_mul_op(x, weight, None, a_stack, b_merged, scaling, rank, meta))  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.fill_(float("nan"))
    graph.replay()
    ref = reference_h(x, a, b, scaling, slot, (x @ weight.T), r)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.bfloat16])
