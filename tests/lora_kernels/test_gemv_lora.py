"""`gemv_lora`: a few rows' base GEMM and LoRA delta in one launch, against the GEMM plus the reference
delta: mixed slots (none, ranks below the bank's), bias, split K, merged projections, the model's op
and the model end to end (`KernelConfig.gemv_lora_max_rows`)."""

import dataclasses
import importlib

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, TOL
from lorazor_kernels import build_batch_meta, gemv_lora, get_kernel_config, linear_lora_op, lora_delta_reference
from test_kernels import check_merged


def make(M, K, N, r, L, dtype, seed, slots, ranks=None, bias=True):
    g = torch.Generator().manual_seed(seed)
    to = dict(device=DEVICE, dtype=dtype)
    x = torch.randn(M, K, generator=g).to(**to)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(**to)
    b = (torch.randn(N, generator=g)).to(**to) if bias else None
    a = (torch.randn(L, r, K, generator=g) / K**0.5).to(**to)
    lb = (torch.randn(L, r, N, generator=g) / r**0.5).to(**to).transpose(1, 2)  # the bank's [L, r, N] storage
    scaling = (torch.rand(L, generator=g) + 0.5).to(DEVICE)
    rank = (torch.full((L,), r) if ranks is None else torch.tensor(ranks)).to(torch.int32).to(DEVICE)
    return x, w, b, a, lb, scaling, rank, torch.tensor(slots).to(DEVICE)


def expected(x, w, b, a, lb, scaling, rank, slot):
    out = x.double() @ w.double().T + lora_delta_reference(x.double(), a.double(), lb.double(), scaling.double(),
                                                           slot, rank)
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("M, K, N, slots, ranks, launch", [
    (1, 96, 48, [2], None, None),                                  # a decode step of one row
    (5, 300, 70, [2, -1, 0, 3, 2], [8, 3, 5, 0], (32, 64, 4, 1)),  # odd K and N, a row without, rank 0 and 3
    (4, 260, 40, [-1, 1, 1, 0], None, (16, 32, 4, 1, 3)),          # K split three ways: partials summed
    (16, 64, 33, list(range(-1, 15)), None, (16, 32, 2, 1)),       # the most rows, 16 slots
])
def test_gemv_lora_is_the_gemm_plus_the_delta(dtype, M, K, N, slots, ranks, launch):
    L = max(max(slots) + 1, len(ranks or ()))
    x, w, b, a, lb, scaling, rank, slot = make(M, K, N, 8, L, dtype, seed=M + K, slots=slots, ranks=ranks)
    y = gemv_lora(x, w, b, a, lb, scaling, rank, slot, launch=launch)
    ref = expected(x, w, b, a, lb, scaling, rank, slot)
    torch.testing.assert_close(y.double(), ref, **TOL[dtype])
    delta = ref - expected(x, w, b, a, lb, scaling, rank, torch.full_like(slot, -1))
    assert delta.abs().max() > 0.1, "the case must have a non-trivial delta"
    if dtype == torch.float32:  # rows without an adapter (or rank 0) get exactly the base
        none = (slot < 0) | (rank[slot.clamp(min=0)] == 0)
        base = gemv_lora(x, w, b, a, lb, scaling, rank, torch.full_like(slot, -1), launch=launch)
        assert torch.equal(y[none], base[none])


@pytest.mark.parametrize("launch", [None, (16, 32, 4, 1, 3)], ids=["whole_k", "split_k"])
def test_fp8_weights_with_channel_scales(launch):
    # fp8 weights widened in registers, each output channel's scale on the finished sums, then the LoRA.
    from lorazor_kernels import dequantize, quantize_rows

    x, w, b, a, lb, scaling, rank, slot = make(3, 96, 48, 8, 3, torch.float32, seed=5, slots=[1, -1, 2])
    w8, w_scale = quantize_rows(w)
    y = gemv_lora(x, w8, b, a, lb, scaling, rank, slot, launch=launch, weight_scale=w_scale)
    ref = expected(x, dequantize(w8, w_scale, torch.float32), b, a, lb, scaling, rank, slot)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="weight_scale must be one scale per output channel \\[48\\], got \\(1, 1\\)"):
        gemv_lora(x, w8, b, a, lb, scaling, rank, slot, weight_scale=torch.ones(1, 1, device=DEVICE))


def test_gemv_lora_refuses_what_it_does_not_take():
    x, w, b, a, lb, scaling, rank, slot = make(17, 32, 16, 8, 2, torch.float32, seed=1, slots=[0] * 17)
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        gemv_lora(x, w, b, a, lb, scaling, rank, slot)
    with pytest.raises(ValueError, match="weight must be \\[N, K=32\\] in x's dtype torch.float32"):
        gemv_lora(x[:2], w.half(), b, a, lb, scaling, rank, slot[:2])
    with pytest.raises(ValueError, match="segments need mask_rank=False"):
        gemv_lora(x[:2], w, b, a, lb, torch.ones(2, 2, device=DEVICE), rank, slot[:2], segments=(16,))
    with pytest.raises(ValueError, match="multiples of 16"):
        gemv_lora(x[:2], w, b, a, lb, torch.ones(2, 2, device=DEVICE), rank, slot[:2], mask_rank=False,
                  segments=(8,))


def test_a_gemv_row_limit_past_the_kernel_is_refused_naming_it():
    from lorazor_kernels import KernelConfig

    with pytest.raises(ValueError, match="gemv_lora_max_rows must be 0 \\(off\\) to 16 .*got 17"):
        KernelConfig(gemv_lora_max_rows=17)
    with pytest.raises(ValueError, match="got -1"):
        dataclasses.replace(KernelConfig(), gemv_lora_max_rows=-1)


def gemv_config(rows: int):
    return dataclasses.replace(get_kernel_config(torch.device(DEVICE)), gemv_lora_max_rows=rows)


@pytest.mark.parametrize("widths", [(48, 16, 32), (64, 80), (80,)], ids=["qkv", "gate_up", "plain"])
def test_merged_projections_through_the_op(widths, monkeypatch):
    # As the model calls it: merged q/k/v (segment edges 48 | 64) or gate/up, rows <= gemv_lora_max_rows.
    from lorazor_kernels import ops

    calls = []
    monkeypatch.setattr(ops, "gemv_lora", lambda *args, **kw: calls.append(args[0].shape[0]) or gemv_lora(*args, **kw))
    check_merged("exact", widths, M=7, K=72, r=8, L=5, dtype=torch.float32, linear=True, cfg=gemv_config(16))
    check_merged("exact", widths, M=9, K=72, r=8, L=5, dtype=torch.float32, linear=True, cfg=gemv_config(8))
    assert calls == [7], "7 rows take one launch, 9 rows past gemv_lora_max_rows=8 the GEMM and the kernels"


def test_the_op_takes_channel_scaled_fp8_and_keeps_block_scales_and_the_backbone_off(monkeypatch):
    from lorazor_kernels import dequantize, ops, quantize_rows

    calls = []
    monkeypatch.setattr(ops, "gemv_lora", lambda *args, **kw: calls.append(1) or gemv_lora(*args, **kw))
    x, w, b, a, lb, scaling, rank, slot = make(3, 256, 256, 8, 2, torch.float32, seed=2, slots=[0, 1, -1])
    meta = build_batch_meta(slot, 2, "exact")
    w8, w_scale = quantize_rows(w)
    for scale in (w_scale, w_scale.amax().reshape(1, 1).expand(2, 2).contiguous()):  # per channel, 128x128 blocks
        y = linear_lora_op(x, w8, b, a, lb, scaling, rank, meta, cfg=gemv_config(16), weight_scale=scale)
        ref = expected(x, dequantize(w8, scale, torch.float32), b, a, lb, scaling, rank, slot)
        torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    assert calls == [1], "channel scales take the one launch, block scales the fp8 GEMM and the kernels"
    calls.clear()
    no_lora = dataclasses.replace(build_batch_meta(torch.full_like(slot, -1), 2, "exact"), has_lora=False)
    torch.testing.assert_close(linear_lora_op(x, w, b, a, lb, scaling, rank, no_lora, cfg=gemv_config(16)),
                               torch.nn.functional.linear(x, w, b))
    assert not calls


def test_model_with_gemv_lora_gives_peft_tokens(tmp_path, monkeypatch):
    # The model end to end (Triton kernels, interpreter on the CPU): decode steps of 5 rows take the
    # one-launch path (merged q/k/v and gate/up, a row without an adapter, a padded row); the prefill's
    # 25 tokens the GEMM and the kernels.
    from helpers import assert_model_gives_peft_tokens, use_kernel_config
    from lorazor import LoRazorConfig
    from lorazor_kernels import ops

    use_kernel_config(tmp_path, monkeypatch, gemv_lora_max_rows=8)
    calls = []
    monkeypatch.setattr(ops, "gemv_lora", lambda *args, **kw: calls.append(args[0].shape[0]) or gemv_lora(*args, **kw))
    assert_model_gives_peft_tokens(LoRazorConfig(backend="triton", grid="exact", cuda_graphs=False))
    assert calls and set(calls) == {5}, calls


@pytest.mark.gpu
@pytest.mark.parametrize("widths, K", [((3072, 1024, 1024), 3072), ((8192, 8192), 3072), ((3072,), 8192)])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gpu_bf16_model_shapes_in_a_graph(widths, K, M):
    # Llama-3.2-3B's projections at decode sizes, as the model runs them: captured and replayed.
    check_merged("exact", widths, M=M, K=K, r=8, L=128, dtype=torch.bfloat16, graph=True, linear=True,
                 cfg=gemv_config(16))


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(5120, 3072), (3072, 8192)])
@pytest.mark.parametrize("M", [1, 16])
def test_gpu_fp8_weights_at_model_shapes(N, K, M):
    # bf16 activations over fp8 weights with channel scales (an fp8 base's decode step), 128 slots.
    from lorazor_kernels import dequantize, quantize_rows

    slots = [(7 * i) % 128 if i % 3 else -1 for i in range(M)] if M > 1 else [5]
    x, w, b, a, lb, scaling, rank, slot = make(M, K, N, 8, 128, torch.bfloat16, seed=N + M, slots=slots, bias=False)
    w8, w_scale = quantize_rows(w)
    y = gemv_lora(x, w8, None, a, lb, scaling, rank, slot, weight_scale=w_scale)
    ref = expected(x, dequantize(w8, w_scale, torch.bfloat16), None, a, lb, scaling, rank, slot)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.bfloat16])



@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("M, K, N, launch, bias", [
    (1, 96, 48, None, True),                 # one row, whole K
    (5, 300, 70, (32, 64, 4, 1), False),     # odd K and N
    (16, 260, 40, (16, 32, 4, 1, 3), True),  # the most rows, K split three ways
])
def test_gemv_linear_is_the_gemm(dtype, M, K, N, launch, bias):
    # The kernel without its adapter work: a backbone product of a few rows.
    from lorazor_kernels import gemv_linear

    x, w, b, *_ = make(M, K, N, 8, 1, dtype, seed=K, slots=[-1] * M, bias=bias)
    y = gemv_linear(x, w, b, launch=launch)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("launch", [None, (16, 32, 4, 1, 3)], ids=["whole_k", "split_k"])
def test_gemv_linear_fp8_weights(launch):
    from lorazor_kernels import dequantize, gemv_linear, quantize_rows

    x, w, b, *_ = make(3, 96, 48, 8, 1, torch.float32, seed=9, slots=[-1] * 3)
    w8, w_scale = quantize_rows(w)
    ref = x.double() @ dequantize(w8, w_scale, torch.float32).double().T + b.double()
    torch.testing.assert_close(gemv_linear(x, w8, b, w_scale, launch=launch).double(), ref, **TOL[torch.float32])


def test_base_linear_takes_gemv_up_to_its_rows(tmp_path, monkeypatch):
    # `KernelConfig.gemv_max_rows`: a base product of that many rows or fewer (any leading shape) takes
    # the one kernel, more rows the plain GEMM; fp8 with channel scales too, block scales never.
    from helpers import use_kernel_config
    from lorazor_kernels import base_linear, dequantize, gemv_linear, ops, quantize_rows

    use_kernel_config(tmp_path, monkeypatch, gemv_max_rows=8)
    calls = []
    monkeypatch.setattr(ops, "_gemv_linear", lambda x, *a: calls.append(x.shape[0]) or gemv_linear(x, *a))
    x, w, b, *_ = make(9, 256, 256, 8, 1, torch.float32, seed=4, slots=[-1] * 9)
    for rows in (x[:8].view(2, 4, 256), x):
        ref = torch.nn.functional.linear(rows, w, b)
        torch.testing.assert_close(base_linear(rows, w, b), ref, **TOL[torch.float32])
    assert calls == [8], "8 rows take gemv_linear, 9 rows past gemv_max_rows=8 the GEMM"
    calls.clear()
    w8, w_scale = quantize_rows(w)
    for scale in (w_scale, w_scale.amax().reshape(1, 1).expand(2, 2).contiguous()):  # per channel, 128x128 blocks
        ref = x[:3].double() @ dequantize(w8, scale, torch.float32).double().T + b.double()
        torch.testing.assert_close(base_linear(x[:3], w8, b, scale).double(), ref, **TOL[torch.float32])
    assert calls == [3], "channel scales take gemv_linear, block scales the fp8 GEMM"


def test_a_gemv_base_row_limit_past_the_kernel_is_refused_naming_it():
    from lorazor_kernels import KernelConfig

    with pytest.raises(ValueError, match="gemv_max_rows must be 0 \\(off\\) to 16 .*got 20"):
        KernelConfig(gemv_max_rows=20)


def test_backbone_model_with_gemv_gives_hf_tokens(tmp_path, monkeypatch):
    # Rows without adapters only: every decode step's projections take gemv_linear (no LoRA in the
    # step), the rest of the model as before; the tokens are the base model's.
    from helpers import PAD, EOS, build_pair, make_batch, peft_generate, use_kernel_config
    from lorazor import LoRazorConfig
    from lorazor_kernels import gemv_linear, ops

    use_kernel_config(tmp_path, monkeypatch, gemv_max_rows=8, gemv_lora_max_rows=8)
    calls = []
    monkeypatch.setattr(ops, "_gemv_linear", lambda x, *a: calls.append(x.shape[0]) or gemv_linear(x, *a))
    model, oracle = build_pair("llama", LoRazorConfig(backend="triton", grid="exact", cuda_graphs=False))
    ids, mask = make_batch(3, 5, seed=7, pad_rows=(1,))
    ref = peft_generate(oracle, ids, mask, [None] * 3, max_new_tokens=4)
    out = model.generate(ids, attention_mask=mask, adapter_ids=[None] * 3, max_new_tokens=4, pad_token_id=PAD,
                         eos_token_id=EOS)
    assert torch.equal(out.sequences, ref)
    assert calls and set(calls) == {3}, calls



def test_compiled_backbone_steps_take_gemv_as_one_opaque_op(tmp_path, monkeypatch):
    # Compiled, the base products of a step without LoRA rows run `lorazor::gemv_linear` (opaque, no graph
    # break: the config is read once, at trace time) and give the eager engine's tokens.
    from helpers import PAD, build_pair, use_kernel_config
    from lorazor import LoRazorConfig, LoRazorEngine
    from torch._dynamo.utils import counters

    gemv_module = importlib.import_module("lorazor_kernels.gemv_lora")  # the package names the function so
    use_kernel_config(tmp_path, monkeypatch, gemv_max_rows=8)
    calls = []
    real = gemv_module.gemv_linear
    monkeypatch.setattr(gemv_module, "gemv_linear", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    counters.clear()
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 96, (5 + i,), generator=g).tolist() for i in range(3)]
    outs = []
    for compile in (True, False):
        model = build_pair("llama", LoRazorConfig(backend="triton", compile=compile, cuda_graphs=False))[0]
        engine = LoRazorEngine(model, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, block_size=4)
        done = engine.generate([dict(prompt_ids=p, adapter=None, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                                     eos_token_id=None) for p in prompts])
        outs.append([o.token_ids for o in done])
        assert calls, f"compile={compile}: the decode steps' base products take gemv_linear"
        calls.clear()
    assert outs[0] == outs[1]
    assert dict(counters["graph_break"]) == {}

@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(5120, 3072), (16384, 3072), (3072, 8192)])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_gemv_linear_at_model_shapes_in_a_graph(N, K, M, pdl):
    # Llama-3.2-3B's merged projections at decode sizes, captured and replayed after another kernel
    # writes x (with programmatic dependent launch the first weight block is read before the wait).
    from lorazor_kernels import gemv_linear

    x, w, *_ = make(M, K, N, 8, 1, torch.bfloat16, seed=N + M, slots=[-1] * M, bias=False)
    source = x.clone()
    graph = torch.cuda.CUDAGraph()
    gemv_linear(x, w, pdl=pdl)  # compile outside the capture
    with torch.cuda.graph(graph):
        x.copy_(source * 2)
        y = gemv_linear(x, w, pdl=pdl)
    x.zero_()
    graph.replay()
    torch.testing.assert_close(y.double(), (source * 2).double() @ w.double().T, **TOL[torch.bfloat16])
