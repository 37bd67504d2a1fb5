"""`KernelConfig.lora_beside_gemm`: the delta's kernels on a side stream beside the base GEMM, the sum formed
outside the op; against the reference at the op, through the model against PEFT, and compiled."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, TOL
from helpers import assert_model_gives_peft_tokens, use_kernel_config
from lorazor_kernels import (
    build_batch_meta,
    dequantize,
    get_kernel_config,
    linear_lora_op,
    lora_delta_reference,
    quantize_rows,
)
from test_kernels import check_merged, make_case


@pytest.fixture
def beside_calls(monkeypatch):
    """Counts the rows of each call of the beside-GEMM op's function."""
    from lorazor_kernels import ops

    calls = []
    real = ops._linear_lora_beside
    monkeypatch.setattr(ops, "_linear_lora_beside", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    return calls


def beside_config():
    return dataclasses.replace(get_kernel_config(torch.device(DEVICE)), lora_beside_gemm=True, gemm_adds_lora=True)


@pytest.mark.parametrize("widths", [(48, 16, 32), (64, 80), (80,)], ids=["qkv", "gate_up", "plain"])
def test_merged_projections_beside_the_gemm(widths, beside_calls):
    check_merged("exact", widths, M=37, K=72, r=8, L=5, dtype=torch.float32, linear=True, cfg=beside_config())
    assert beside_calls == [37]


def test_other_grids_and_the_reference_backend_keep_the_op(beside_calls):
    # The write-only expand needs the exact grid; the reference backend has no kernels to move.
    check_merged("full", (64, 80), M=9, K=72, r=8, L=5, dtype=torch.float32, linear=True, cfg=beside_config())
    x, a, b, s, slot, rank = make_case(6, 40, 24, 8, 3, torch.float32, seed=2)
    w = torch.randn(24, 40, device=DEVICE)
    y = linear_lora_op(x, w, None, a, b, s, rank, build_batch_meta(slot, 3, "exact"), backend="reference",
                       cfg=beside_config())
    ref = x.double() @ w.double().T + lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    assert beside_calls == []


def test_bias_rank_masks_and_fp8_weights_beside_the_gemm(beside_calls):
    # Mixed ranks (rows of rank 0 and without a slot get exactly the base), a bias, fp8 channel-scaled weights.
    ranks = torch.tensor([1, 4, 0, 16, 8, 13], dtype=torch.int32)
    x, a, b, s, slot, rank = make_case(21, 80, 66, 16, 6, torch.float32, seed=11, ranks=ranks)
    w, bias = torch.randn(66, 80, device=DEVICE) / 9, torch.randn(66, device=DEVICE)
    meta = build_batch_meta(slot, 6, "exact")
    delta = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    y = linear_lora_op(x, w, bias, a, b, s, rank, meta, cfg=beside_config())
    torch.testing.assert_close(y.double(), x.double() @ w.double().T + bias.double() + delta, **TOL[torch.float32])
    w8, scale = quantize_rows(w)
    y8 = linear_lora_op(x, w8, None, a, b, s, rank, meta, cfg=beside_config(), weight_scale=scale)
    ref8 = x.double() @ dequantize(w8, scale, torch.float32).double().T + delta
    torch.testing.assert_close(y8.double(), ref8, **TOL[torch.float32])
    assert beside_calls == [21, 21] and delta.abs().max() > 0.1


def test_model_with_lora_beside_the_gemm_gives_peft_tokens(tmp_path, monkeypatch, beside_calls):
    use_kernel_config(tmp_path, monkeypatch, lora_beside_gemm=True)
    from lorazor import LoRazorConfig

    assert_model_gives_peft_tokens(LoRazorConfig(backend="triton", grid="exact", cuda_graphs=False))
    assert beside_calls and set(beside_calls) >= {5, 25}, beside_calls  # the decode steps' 5 rows, the prefill's 25


def test_compiled_steps_take_the_op_beside_the_gemm_with_no_graph_break(tmp_path, monkeypatch):
    # Compiled, the op returns (y, delta) and the step adds them; the tokens are the eager engine's.
    from helpers import PAD, build_pair
    from lorazor import LoRazorConfig, LoRazorEngine
    from lorazor_kernels import ops
    from torch._dynamo.utils import counters

    use_kernel_config(tmp_path, monkeypatch, lora_beside_gemm=True)
    calls = []
    real = ops._linear_lora_beside
    monkeypatch.setattr(ops, "_linear_lora_beside", lambda x, *args: calls.append(1) or real(x, *args))
    # Compiled code is shared by code object: reset before (an earlier test's graphs hold its config) and after
    # (this test's hold lora_beside_gemm for the tests after it).
    torch._dynamo.reset()
    counters.clear()
    try:
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, 96, (5 + i,), generator=g).tolist() for i in range(3)]
        outs = []
        for compile in (True, False):
            config = LoRazorConfig(backend="triton", grid="exact", compile=compile, cuda_graphs=False)
            model = build_pair("llama", config)[0]
            engine = LoRazorEngine(model, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, block_size=4)
            done = engine.generate([dict(prompt_ids=p, adapter=a, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                                         eos_token_id=None) for p, a in zip(prompts, ["math", None, "sql"])])
            outs.append([o.token_ids for o in done])
    finally:
        torch._dynamo.reset()
    assert outs[0] == outs[1]
    assert dict(counters["graph_break"]) == {}
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("widths, K, M", [((3072, 1024, 1024), 3072, 1), ((8192, 8192), 3072, 256),
                                          ((3072,), 8192, 16)])
def test_gpu_model_shapes_beside_the_gemm_in_a_graph(widths, K, M):
    # The side stream's kernels captured in the same CUDA graph as the GEMM, replayed twice from NaN.
    check_merged("exact", widths, M=M, K=K, r=8, L=128, dtype=torch.bfloat16, graph=True, linear=True,
                 cfg=beside_config())
