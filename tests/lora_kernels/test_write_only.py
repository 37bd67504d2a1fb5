"""The write-only expand and `KernelConfig.gemm_adds_lora` (LoRA first, then the GEMM adds x @ W.T)
against the reference: every row overwritten, rows without a slot or rank exactly zero."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, TOL
from lorazor_kernels import (
    build_batch_meta,
    get_kernel_config,
    lora_delta_reference,
    lora_expand,
    lora_fused,
    lora_shrink,
)
from helpers import use_kernel_config
from test_kernels import check_merged, make_case


@pytest.fixture
def gemm_adds_lora(tmp_path, monkeypatch):
    """The device's kernel config with `gemm_adds_lora` on, through the environment (as the model reads it)."""
    use_kernel_config(tmp_path, monkeypatch, gemm_adds_lora=True)
    from lorazor_kernels import ops

    calls = []
    real = ops._lora_then_gemm
    monkeypatch.setattr(ops, "_lora_then_gemm", lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("block_n", [16, 64])
def test_write_only_expand_overwrites_every_row(block_n, fused):
    # Rows without a slot, a slot of rank 0 in this layer, mixed ranks; y starts as NaN.
    ranks = torch.tensor([1, 4, 0, 16, 8, 13], dtype=torch.int32)
    x, a, b, s, slot, rank = make_case(45, 80, 66, 16, 6, torch.float32, seed=11, ranks=ranks)
    cfg = dataclasses.replace(get_kernel_config(torch.device(DEVICE)), expand_block_n=block_n, fused_block_n=block_n)
    meta = build_batch_meta(slot, 6, "exact")
    y = torch.full((45, 66), float("nan"), device=DEVICE)
    if fused:
        lora_fused(x, a, b, s, rank, y, meta, cfg, write_only=True)
    else:
        lora_expand(lora_shrink(x, a, rank, meta, cfg), b, s, rank, y, meta, cfg, write_only=True)
    ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    no_lora = (slot < 0) | (rank.to(slot.device)[slot.clamp(min=0)] == 0)
    assert (slot < 0).any() and ((slot >= 0) & no_lora).any()
    assert torch.equal(y[no_lora], torch.zeros_like(y[no_lora])) and ref.abs().max() > 0.1


def test_write_only_needs_the_exact_grid():
    x, a, b, s, slot, rank = make_case(12, 32, 16, 8, 3, torch.float32, seed=1)
    meta = build_batch_meta(slot, 3, "full")
    with pytest.raises(ValueError, match="write_only needs the exact grid, got grid 'full'"):
        lora_expand(lora_shrink(x, a, rank, meta), b, s, rank, torch.empty(12, 16, device=DEVICE), meta,
                    write_only=True)
    with pytest.raises(ValueError, match="write_only needs the exact grid, got grid 'full'"):
        lora_fused(x, a, b, s, rank, torch.empty(12, 16, device=DEVICE), meta, write_only=True)


@pytest.mark.parametrize("fused, fused_calls", [(True, 1), (False, 0)])
def test_gemm_adds_lora_with_the_fused_kernel(gemm_adds_lora, monkeypatch, fused, fused_calls):
    # With `fused`, the delta is one fused launch (write-only, then the GEMM adds x @ W.T); without,
    # shrink + expand. Both are the GEMM plus the delta, merged q/k/v included.
    from lorazor_kernels import lora_launch, ops

    calls = []
    real = lora_launch.lora_fused
    monkeypatch.setattr(ops, "lora_fused", lambda *args, **kw: calls.append(kw["write_only"]) or real(*args, **kw))
    cfg = dataclasses.replace(get_kernel_config(torch.device(DEVICE)), gemm_adds_lora=True, fused=fused,
                              fused_block_n=16)
    check_merged("exact", (48, 16, 32), M=5, K=72, r=8, L=5, dtype=torch.float32, linear=True, cfg=cfg)
    assert calls == [True] * fused_calls and gemm_adds_lora


@pytest.mark.parametrize("widths", [(48, 16, 32), (80,)], ids=["qkv", "plain"])
def test_gemm_adds_lora_is_the_gemm_plus_the_delta(gemm_adds_lora, widths):
    check_merged("exact", widths, M=37, K=72, r=8, L=5, dtype=torch.float32, linear=True)
    assert gemm_adds_lora, "the op did not take the gemm_adds_lora path"


def test_gemm_adds_lora_leaves_layers_with_a_bias_on_the_add_path(gemm_adds_lora):
    from lorazor_kernels import linear_lora_op

    x, a, b, s, slot, rank = make_case(21, 40, 24, 8, 4, torch.float32, seed=3)
    weight, bias = torch.randn(24, 40, device=DEVICE), torch.randn(24, device=DEVICE)
    y = linear_lora_op(x, weight, bias, a, b, s, rank, build_batch_meta(slot, 4, "exact"))
    ref = x.double() @ weight.double().T + bias.double() + lora_delta_reference(
        x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    assert not gemm_adds_lora


@pytest.mark.gpu
@pytest.mark.parametrize("widths, K", [((3072, 1024, 1024), 3072), ((8192, 8192), 3072), ((3072,), 8192)])
def test_gpu_gemm_adds_lora_in_a_graph(gemm_adds_lora, widths, K):
    check_merged("exact", widths, M=256, K=K, r=8, L=128, dtype=torch.bfloat16, graph=True, linear=True)
    assert gemm_adds_lora


def test_model_with_gemm_adds_lora_gives_peft_tokens(gemm_adds_lora):
    # The model end to end (Triton kernels, interpreter on the CPU): merged q/k/v and gate/up, a row
    # without an adapter (zeros from the write-only expand), a padded row.
    from helpers import assert_model_gives_peft_tokens
    from lorazor import LoRazorConfig

    assert_model_gives_peft_tokens(LoRazorConfig(backend="triton", grid="exact", cuda_graphs=False))
    assert gemm_adds_lora, "the model's layers did not take the gemm_adds_lora path"


def compiled_variants(kernel) -> int:
    """How many binaries Triton's JIT holds for `kernel` (over every device)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_one_compile_serves_every_batch_size_of_a_class():
    # A warm-up launches each kernel at 20+ row counts and tile-table lengths: they must not each
    # compile a specialization of their own (== 1, divisible by 16).
    from lorazor_kernels import lora_kernels, meta_kernel

    kernels = (lora_kernels._lora_shrink_kernel, lora_kernels._lora_expand_kernel, meta_kernel._batch_meta_kernel)
    counts = []
    for M in (1, 2, 3, 8, 16, 17, 32, 48, 64):
        x, a, b, s, slot, rank = make_case(M, 64, 48, 8, 6, torch.bfloat16, seed=M)
        b = b.transpose(1, 2).contiguous().transpose(1, 2)  # the bank's layout for every M (make_case alternates)
        meta = build_batch_meta(slot, 6, "exact", max_active_slots=16 if M > 1 else None, builder="triton")
        y = torch.empty(M, 48, dtype=torch.bfloat16, device=DEVICE)
        lora_expand(lora_shrink(x, a, rank, meta), b, s, rank, y, meta, write_only=True, mask_rank=True)
        ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
        torch.testing.assert_close(y.double(), ref, **TOL[torch.bfloat16])
        counts.append([compiled_variants(k) for k in kernels])
    assert counts[-1] == counts[0], counts  # every row count after the first reused its binaries
