"""The chained launch (`lora_chained`, `KernelConfig.chained`): shrink split and expand in one kernel,
a tile's programs waiting on per-tile counters. GPU only (the interpreter runs programs one by one,
so a waiting program would never see its tile-mates); on the CPU the config falls back."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, TOL
from lorazor_kernels import (
    KernelConfig,
    add_batched_lora_,
    build_batch_meta,
    get_kernel_config,
    lora_chained,
    lora_delta_reference,
)
from lorazor_kernels.lora_launch import tile_flags
from test_kernels import make_case


def chained_config(**changes) -> KernelConfig:
    return dataclasses.replace(get_kernel_config(torch.device(DEVICE)), chained=True, **changes)


def run_chained(case, grid, cfg, mask_rank=True):
    x, a, b, s, slot, rank = case
    y = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype, device=x.device)
    meta = build_batch_meta(slot, a.shape[0], grid)
    return add_batched_lora_(y, x, a, b, s, rank, meta, cfg=cfg, mask_rank=mask_rank)


def check_chained(case, grid, cfg, dtype, mask_rank=True):
    x, a, b, s, slot, rank = case
    out = run_chained(case, grid, cfg, mask_rank)
    ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    none = (slot < 0) | (rank[slot.clamp(min=0).long()] == 0)
    assert torch.all(out[none] == 0), "a row without an adapter got a delta"
    assert ref.abs().max() > 0.1


def assert_counters_reset():
    torch.cuda.synchronize()
    flags = tile_flags(torch.device(DEVICE), 0)
    assert int(flags.abs().sum()) == 0, "a chained launch left its per-tile counters non-zero"


def test_chained_needs_a_gpu_and_the_config_falls_back_elsewhere():
    case = make_case(7, 100, 257, 8, 3, torch.float32, seed=1)
    x, a, b, s, slot, rank = case
    meta = build_batch_meta(slot, 3, "exact")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA device only.*cpu"):
            lora_chained(x, a, b, s, rank, torch.zeros(7, 257), meta)
    # KernelConfig.chained on the CPU: shrink + expand, the same delta.
    check_chained(case, "exact", dataclasses.replace(KernelConfig(), chained=True), torch.float32)


# Each case compiles its own variants (split count, rank width, dtype): few cases, odd and model shapes.
CASES = [(7, 100, 257, 8, 3, torch.float32), (19, 128, 64, 1, 4, torch.float32),
         (256, 3072, 3072, 8, 128, torch.bfloat16), (300, 8192, 3072, 16, 7, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["exact", "full", "active_rows", "two_class"])
@pytest.mark.parametrize("M, K, N, r, L, dtype", CASES)
def test_gpu_chained_matches_reference(grid, M, K, N, r, L, dtype):
    # Deadlock check too: at (256, .., 128 slots) a tile's programs outnumber what the GPU holds
    # at once unless they are dispatched together.
    cfg = chained_config()
    check_chained(make_case(M, K, N, r, L, dtype, seed=M + r), grid, cfg, dtype)
    check_chained(make_case(M, K, N, r, L, dtype, seed=M + r), grid, cfg, dtype, mask_rank=False)
    assert_counters_reset()


@pytest.mark.gpu
def test_gpu_chained_without_programmatic_dependent_launch():
    cfg = chained_config(pdl=False)
    check_chained(make_case(256, 3072, 3072, 8, 128, torch.bfloat16, seed=2), "exact", cfg, torch.bfloat16)
    assert_counters_reset()


@pytest.mark.gpu
def test_gpu_chained_mixed_ranks_absent_slots_and_many_splits():
    # Ranks 0..16 (0: slot absent in this layer), a K that splits 64 ways, every grid in turn.
    L = 9
    ranks = torch.tensor([16, 0, 3, 8, 1, 16, 0, 5, 12], dtype=torch.int32)
    case = make_case(200, 8192, 384, 16, L, torch.bfloat16, seed=3, ranks=ranks)
    x, a, b, s, slot, rank = case
    # zero A and B past each slot's rank, as the bank stores them, so both reference and kernel agree
    for i, r in enumerate(ranks.tolist()):
        a[i, r:] = 0
        b[i, :, r:] = 0
    for split in (1, 7, 64):
        check_chained(case, "exact", chained_config(shrink_split_k=split), torch.bfloat16)
    assert_counters_reset()


@pytest.mark.gpu
def test_gpu_chained_merged_projections_replay_a_new_slot_map():
    # q/k/v merged as the model runs them: one chained launch per projection in a captured graph,
    # replayed after the slot map changes; and many launches in a row leave the counters at zero.
    M, K, r, L, widths = 256, 3072, 8, 128, (3072, 1024, 1024)
    g = torch.Generator().manual_seed(5)
    to = dict(device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(**to)
    a = [(torch.randn(L, r, K, generator=g) / K**0.5).to(**to) for _ in widths]
    b = [(torch.randn(L, n, r, generator=g) / r**0.5).to(**to) for n in widths]
    scaling = (torch.rand(len(widths), L, generator=g) + 0.5).to(DEVICE)
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    a_stack = torch.cat(a, dim=1)
    b_merged = torch.cat([bi.transpose(1, 2) for bi in b], dim=2).transpose(1, 2)
    slot = torch.randint(-1, L, (M,), generator=g).to(DEVICE)
    y = torch.zeros(M, sum(widths), **to)
    cfg = chained_config()

    def run():
        meta = build_batch_meta(slot, L, "exact")
        y.zero_()
        lora_chained(x, a_stack, b_merged, scaling, rank, y, meta, cfg, mask_rank=False, segments=(3072, 4096))

    def reference():
        return torch.cat([lora_delta_reference(x.double(), a[i].double(), b[i].double(), scaling[i].double(), slot,
                                               rank) for i in range(len(widths))], dim=1)

    for _ in range(20):
        run()
    torch.testing.assert_close(y.double(), reference(), **TOL[torch.bfloat16])
    assert_counters_reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in range(3):
        slot.copy_(torch.randint(-1, L if seed < 2 else 2, (M,), generator=g).to(DEVICE))
        y.fill_(float("nan"))
        graph.replay()
        graph.replay()
        torch.testing.assert_close(y.double(), reference(), **TOL[torch.bfloat16])
    assert_counters_reset()
