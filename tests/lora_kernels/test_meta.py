"""The one-program metadata build (meta_kernel.py) against the torch build, its reference."""

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from lorazor_kernels import batched_lora, build_batch_meta, lora_delta_reference
from lorazor_kernels.meta_kernel import MAX_ROWS, MAX_SLOTS

FIELDS = ("sorted_rows", "slot_start", "tile_slot", "tile_rows")


def assert_same_meta(row_slot, L, grid, block_m=16, bound=None):
    mine = build_batch_meta(row_slot, L, grid, block_m, bound, builder="triton")
    ref = build_batch_meta(row_slot, L, grid, block_m, bound, builder="torch")
    for field in FIELDS:
        got, want = getattr(mine, field), getattr(ref, field)
        if want is None:
            assert got is None, field
            continue
        assert got.dtype == want.dtype and torch.equal(got, want), (field, got, want)
    assert (mine.row_bound, mine.num_rows, mine.grid) == (ref.row_bound, ref.num_rows, ref.grid)


def random_slots(M, L, seed, none_frac=0.2, used=None):
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(L, generator=g)[: used or L]
    slot = chosen[torch.randint(0, chosen.numel(), (M,), generator=g)]
    slot[torch.rand(M, generator=g) < none_frac] = -1
    return slot.to(DEVICE)


@pytest.mark.parametrize("grid", ["exact", "full"])
@pytest.mark.parametrize("M, L, block_m", [(1, 1, 16), (37, 5, 16), (256, 128, 16), (100, 300, 32), (513, 7, 16),
                                           (64, 64, 16), (200, 1, 16)])
def test_one_program_build_matches_torch(grid, M, L, block_m):
    assert_same_meta(random_slots(M, L, seed=M + L), L, grid, block_m)


@pytest.mark.parametrize("row_slot", ["none", "all_one_slot", "int32", "descending"])
def test_one_program_build_edge_batches(row_slot):
    M, L = 70, 9
    slots = {"none": torch.full((M,), -1), "all_one_slot": torch.full((M,), 4),
             "int32": random_slots(M, L, seed=3).cpu().int(), "descending": torch.arange(M - 1, -1, -1) % L}[row_slot]
    for grid in ("exact", "full"):
        assert_same_meta(slots.to(DEVICE), L, grid)


@pytest.mark.parametrize("M, used, bound", [(256, 20, 32), (64, 16, 16), (5, 5, 16)])
def test_one_program_build_bounded_by_distinct_slots(M, used, bound):
    assert_same_meta(random_slots(M, 128, seed=used, used=used), 128, "exact", bound=bound)


def test_one_program_build_at_its_limits():
    assert_same_meta(random_slots(MAX_ROWS, 200, seed=1), 200, "exact")
    assert_same_meta(random_slots(300, MAX_SLOTS, seed=2), MAX_SLOTS, "exact")
    with pytest.raises(ValueError, match=f"got {MAX_ROWS + 1} rows"):
        build_batch_meta(torch.zeros(MAX_ROWS + 1, dtype=torch.long), 4, "exact", builder="triton")
    with pytest.raises(ValueError, match=f"and {MAX_SLOTS + 1} slots"):
        build_batch_meta(torch.zeros(4, dtype=torch.long), MAX_SLOTS + 1, "exact", builder="triton")
    with pytest.raises(ValueError, match="builder must be one of"):
        build_batch_meta(torch.zeros(4, dtype=torch.long), 4, "exact", builder="numpy")


def test_one_program_build_fails_loudly_past_its_bound():
    if HAS_CUDA:
        pytest.skip("a device-side assert ends the process's CUDA context")
    slot = torch.arange(40) % 20  # 20 distinct slots of 1-2 rows: more partial tiles than 3 + 2
    with pytest.raises(RuntimeError, match="more distinct slots than max_active_slots"):
        build_batch_meta(slot, 20, "exact", max_active_slots=2, builder="triton", check_bound=False)


def test_kernels_give_the_reference_delta_from_the_one_program_meta():
    from lorazor_kernels import add_batched_lora_

    g = torch.Generator().manual_seed(5)
    M, K, N, r, L = 45, 40, 24, 8, 6
    x = torch.randn(M, K, generator=g).to(DEVICE)
    a = (torch.randn(L, r, K, generator=g) / K**0.5).to(DEVICE)
    b = torch.randn(L, N, r, generator=g).to(DEVICE)
    scaling = (torch.rand(L, generator=g) + 0.5).to(DEVICE)
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    slot = random_slots(M, L, seed=9)
    for grid in ("exact", "full"):
        y = torch.zeros(M, N, device=DEVICE)
        add_batched_lora_(y, x, a, b, scaling, rank, build_batch_meta(slot, L, grid, builder="triton"))
        ref = lora_delta_reference(x.double(), a.double(), b.double(), scaling.double(), slot, rank)
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
        assert ref.abs().max() > 0.1
    assert batched_lora(x, a, b, scaling, slot, "exact").shape == (M, N)


@pytest.mark.gpu
def test_gpu_one_program_build_in_a_replayed_graph():
    # The model's use: built inside a captured graph from a row -> slot buffer that changes between replays.
    L = 128
    row_slot = random_slots(256, L, seed=0)
    out = {}
    graph = torch.cuda.CUDAGraph()
    build_batch_meta(row_slot, L, "exact", max_active_slots=128, builder="triton")  # compile outside capture
    with torch.cuda.graph(graph):
        out["meta"] = build_batch_meta(row_slot, L, "exact", max_active_slots=128, builder="triton")
    for seed in range(4):
        row_slot.copy_(random_slots(256, L, seed=seed + 1, used=[128, 3, 40, 1][seed]))
        graph.replay()
        ref = build_batch_meta(row_slot, L, "exact", max_active_slots=128, builder="torch")
        for field in FIELDS:
            assert torch.equal(getattr(out["meta"], field), getattr(ref, field)), (seed, field)
