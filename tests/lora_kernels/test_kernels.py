"""Every grid mode of the Triton LoRA kernels against the pure-torch reference."""

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, KERNEL_DTYPES, TOL
from lorazor_kernels import (
    GRID_MODES,
    add_batched_lora_,
    batched_lora,
    build_batch_meta,
    lora_delta_reference,
    row_bound,
    slot_bound_class,
)


def make_case(M, K, N, r, L, dtype, seed, frac_base=0.3, ranks=None, row_slot=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    a = torch.randn(L, r, K, generator=g) / K**0.5
    b = torch.randn(L, N, r, generator=g) / r**0.5  # non-zero B: a missing delta fails the test
    if (M + L) % 2:
        b = b.transpose(1, 2).contiguous().transpose(1, 2)  # the bank's [L, r, N] storage, as a view
    scaling = torch.rand(L, generator=g) + 0.5
    if row_slot is None:
        row_slot = torch.randint(0, L, (M,), generator=g)
        row_slot[torch.rand(M, generator=g) < frac_base] = -1
        if frac_base < 1.0:
            row_slot[0] = L - 1  # at least one row with an adapter
    rank = torch.full((L,), r, dtype=torch.int32) if ranks is None else ranks
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), a.to(dtype=dtype, **to), b.to(dtype=dtype, **to), scaling.to(**to),
            row_slot.to(**to), rank.to(**to))


def check(case, grid, dtype, fused=True, mask_rank=True):
    x, a, b, s, slot, rank = case
    out = batched_lora(x, a, b, s, slot, grid=grid, lora_rank=rank, fused=fused, mask_rank=mask_rank)
    ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    # Rows without an adapter (or with a rank-0 slot) must be exactly zero.
    none = (slot < 0) | (rank[slot.clamp(min=0).long()] == 0)
    assert torch.all(out[none] == 0)
    assert ref.abs().max() > 0.1, "the case must have a non-trivial delta"


SHAPES = [
    # M, K, N, r, L
    (1, 64, 48, 8, 1),
    (7, 100, 257, 8, 3),
    (33, 257, 100, 4, 5),
    (40, 96, 80, 16, 12),
    (19, 128, 64, 1, 4),
]


# Both ways to run the kernels: one fused launch, or shrink + expand.
FUSED = [pytest.param(True, id="fused"), pytest.param(False, id="split")]


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("grid", GRID_MODES)
@pytest.mark.parametrize("M, K, N, r, L", SHAPES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_grid_modes_match_reference(grid, M, K, N, r, L, dtype, fused):
    check(make_case(M, K, N, r, L, dtype, seed=M * 7 + L), grid, dtype, fused)


@pytest.mark.parametrize("grid", GRID_MODES)
def test_every_row_with_an_adapter(grid):
    check(make_case(21, 64, 40, 8, 3, torch.float32, seed=3, frac_base=0.0), grid, torch.float32)


@pytest.mark.parametrize("grid", GRID_MODES)
def test_no_row_with_an_adapter_gets_exact_zero(grid):
    x, a, b, s, slot, rank = make_case(21, 64, 40, 8, 3, torch.float32, seed=3, frac_base=1.0)
    out = batched_lora(x, a, b, s, slot, grid=grid, lora_rank=rank)
    assert torch.all(out == 0)


@pytest.mark.parametrize("grid", GRID_MODES)
def test_all_rows_on_one_adapter(grid):
    slot = torch.full((37,), 2)
    check(make_case(37, 96, 72, 8, 4, torch.float32, seed=5, row_slot=slot), grid, torch.float32)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("grid", GRID_MODES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mixed_ranks_and_absent_slots(grid, dtype, fused):
    # rank 0 = the adapter does not target this module: its rows must get no delta.
    ranks = torch.tensor([1, 4, 0, 16, 8, 13], dtype=torch.int32)
    check(make_case(45, 80, 66, 16, 6, dtype, seed=11, ranks=ranks), grid, dtype, fused)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("grid", GRID_MODES)
def test_unmasked_ranks_on_a_zero_padded_bank(grid, fused):
    # The bank's layout: zeros past each slot's rank, rank-0 slots all zero. Without the rank load the
    # kernels must give the same delta; rank-0 rows must still get exactly nothing.
    x, a, b, s, slot, _ = make_case(45, 80, 66, 16, 6, torch.float32, seed=12)
    ranks = torch.tensor([16, 0, 16, 16, 0, 16], dtype=torch.int32, device=a.device)
    a[ranks == 0] = 0
    b[ranks == 0] = 0
    check((x, a, b, s, slot, ranks), grid, torch.float32, fused, mask_rank=False)


@pytest.mark.parametrize("fused", FUSED)
def test_rank_64_bank_with_small_ranks(fused):
    # The bank pads to its largest rank (64, four shrink rank blocks); smaller slots mask the rest.
    ranks = torch.tensor([64, 8, 1, 40], dtype=torch.int32)
    check(make_case(30, 70, 50, 64, 4, torch.float32, seed=4, ranks=ranks), "exact", torch.float32, fused)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("grid", GRID_MODES)
def test_prefill_group_beside_decode_rows(grid, fused):
    # One 200-row prefill group plus 12 small decode groups: enables the two-class expand.
    g = torch.Generator().manual_seed(2)
    decode = torch.randint(1, 13, (40,), generator=g)
    slot = torch.cat([torch.zeros(200, dtype=torch.long), decode, torch.tensor([-1, -1, 5])])
    slot = slot[torch.randperm(slot.numel(), generator=g)]
    case = make_case(slot.numel(), 64, 48, 8, 13, torch.float32, seed=2, row_slot=slot)
    if grid == "two_class":
        meta = build_batch_meta(case[4], 13, "two_class")
        assert meta.class_split and meta.row_bound == slot.numel()  # 16*2^k >= 200 exceeds M: R = M
    check(case, grid, torch.float32, fused)


@pytest.mark.parametrize("L", [1, 16, 128])
def test_many_slots(L):
    for grid in GRID_MODES:
        check(make_case(64, 64, 32, 4, L, torch.float32, seed=L), grid, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("grid", GRID_MODES)
@pytest.mark.parametrize("r", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("M, K, N, L", [(256, 3072, 3072, 128), (256, 3072, 8192, 32), (300, 8192, 3072, 7)])
def test_gpu_bf16_model_shapes(grid, r, M, K, N, L, fused):
    check(make_case(M, K, N, r, L, torch.bfloat16, seed=r + L), grid, torch.bfloat16, fused)
    check(make_case(M, K, N, r, L, torch.bfloat16, seed=r + L), grid, torch.bfloat16, fused, mask_rank=False)


def test_exact_tile_table_covers_every_row_once():
    g = torch.Generator().manual_seed(0)
    for M, L in [(1, 1), (50, 7), (256, 128), (300, 3)]:
        slot = torch.randint(-1, L, (M,), generator=g)
        meta = build_batch_meta(slot, L, "exact", block_m=16)
        seen = torch.zeros(M, dtype=torch.long)
        for t in range(meta.num_tiles):
            s = int(meta.tile_slot[t])
            rows = meta.tile_rows[t][meta.tile_rows[t] >= 0].long()
            if s < 0:
                assert rows.numel() == 0
                continue
            assert rows.numel() > 0 and torch.all(slot[rows] == s)
            seen[rows] += 1
        assert torch.equal(seen, (slot >= 0).long())


@pytest.mark.parametrize("M, used, bound", [(64, 3, 16), (64, 16, 16), (256, 20, 32), (5, 5, 16)])
def test_exact_grid_bounded_by_distinct_slots_in_a_big_bank(M, used, bound):
    # A bank of 128 slots of which the batch uses `used` (scattered over the bank): the bounded tile
    # table launches M/BM + bound tiles, and every row still gets its own adapter's delta.
    L = 128
    g = torch.Generator().manual_seed(M + used)
    chosen = torch.randperm(L, generator=g)[:used]
    slot = chosen[torch.randint(0, used, (M,), generator=g)]
    slot[torch.rand(M, generator=g) < 0.2] = -1
    x, a, b, s, slot, rank = make_case(M, 96, 80, 8, L, torch.float32, seed=used, row_slot=slot)
    assert slot_bound_class(int(torch.unique(slot[slot >= 0]).numel()), L) == bound
    meta = build_batch_meta(slot, L, "exact", max_active_slots=bound)
    assert meta.num_tiles == -(-M // 16) + min(bound, M) <= build_batch_meta(slot, L, "exact").num_tiles
    y = torch.zeros(M, 80, device=DEVICE)
    add_batched_lora_(y, x, a, b, s, rank, meta)
    ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    assert torch.all(y[slot < 0] == 0) and ref.abs().max() > 0.1


def test_slot_bound_classes_and_a_broken_bound_fails_loudly():
    assert [slot_bound_class(n, 128) for n in (0, 1, 16, 17, 64, 65, 128)] == [16, 16, 16, 32, 64, 128, 128]
    assert slot_bound_class(3, 5) == 5
    with pytest.raises(ValueError, match="max_active_slots must be >= 1"):
        build_batch_meta(torch.zeros(4, dtype=torch.long), 8, "exact", max_active_slots=0)
    if not HAS_CUDA:  # on the GPU this is a device-side assert, which ends the process's CUDA context
        slot = torch.arange(40) % 20  # 20 distinct slots of 1-2 rows: more partial tiles than 3 + 2
        with pytest.raises(RuntimeError, match="more distinct slots than max_active_slots"):
            build_batch_meta(slot, 20, "exact", max_active_slots=2, check_bound=False)


def test_row_bound_buckets():
    assert [row_bound(m, 256) for m in (1, 16, 17, 100, 129, 256)] == [16, 16, 32, 128, 256, 256]
    assert row_bound(5, 8) == 8


def test_bad_arguments_are_named():
    x, a, b, s, slot, rank = make_case(4, 32, 16, 4, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="grid must be one of"):
        batched_lora(x, a, b, s, slot, grid="fast")
    with pytest.raises(ValueError, match="lora_a has K=32 but x has K=31"):
        batched_lora(x[:, :31], a, b, s, slot)
    with pytest.raises(ValueError, match="row_slot must be"):
        batched_lora(x, a, b, s, slot[:3])
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        build_batch_meta(slot, 2, "exact", block_m=24)


@pytest.mark.skipif(not HAS_CUDA, reason="graph capture needs CUDA")
@pytest.mark.gpu
def test_exact_graph_replay_follows_new_slot_map():
    x, a, b, s, slot, rank = make_case(256, 512, 384, 8, 32, torch.bfloat16, seed=9)
    static_slot = slot.clone()
    out = torch.zeros(256, 384, dtype=torch.bfloat16, device=DEVICE)
    batched_lora(x, a, b, s, static_slot, lora_rank=rank)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(batched_lora(x, a, b, s, static_slot, lora_rank=rank))
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        new = torch.randint(-1, 32 if seed < 2 else 2, (256,), generator=g).to(DEVICE)
        static_slot.copy_(new)
        graph.replay()
        ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), new, rank)
        torch.testing.assert_close(out.double(), ref, **TOL[torch.bfloat16])


def check_merged(grid, widths, M, K, r, L, dtype, cfg=None, graph=False, linear=False):
    # q/k/v (or gate/up) share x: one shrink over A stacked [L, G*r, K], one expand into the merged
    # [M, sum(N)] output, segment g using its r columns of u, its B columns and its scaling row.
    # linear: the base GEMM too, through the model layers' op `linear_lora_op` (the device's kernel config).
    from lorazor_kernels import linear_lora_op, lora_expand, lora_fused, lora_shrink

    g = torch.Generator().manual_seed(len(widths))
    G = len(widths)
    to = dict(device=DEVICE, dtype=dtype)
    x = torch.randn(M, K, generator=g).to(**to)
    a = [(torch.randn(L, r, K, generator=g) / K**0.5).to(**to) for _ in widths]
    b = [(torch.randn(L, n, r, generator=g) / r**0.5).to(**to) for n in widths]
    scaling = (torch.rand(G, L, generator=g) + 0.5).to(DEVICE)
    slot = torch.randint(-1, L, (M,), generator=g).to(DEVICE)
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    a_stack = torch.cat(a, dim=1)                                        # [L, G*r, K]
    b_merged = torch.cat([bi.transpose(1, 2) for bi in b], dim=2).transpose(1, 2)  # [L, sum(N), r] view
    edges = tuple(torch.tensor(widths[:-1]).cumsum(0).tolist())
    meta = build_batch_meta(slot, L, grid)
    y = torch.zeros(M, sum(widths), **to)
    weight = (torch.randn(sum(widths), K, generator=g) / K**0.5).to(**to) if linear else None

    group_scaling = scaling if G > 1 else scaling[0]  # [G, L] for merged members, [L] for one

    def run():
        if linear:  # as a merged group calls it: the members' rank (unread without mask_rank)
            y.copy_(linear_lora_op(x, weight, None, a_stack, b_merged, group_scaling, rank, meta, mask_rank=False,
                                   segments=edges, cfg=cfg))
            return
        if cfg is not None and cfg.fused:  # one launch: each program shrinks once per segment it covers
            lora_fused(x, a_stack, b_merged, group_scaling, rank, y, meta, cfg, mask_rank=False,
                       segments=edges or None)
            return
        u = lora_shrink(x, a_stack, torch.full((L,), G * r, dtype=torch.int32, device=DEVICE), meta, cfg,
                        mask_rank=False)
        lora_expand(u, b_merged, group_scaling, rank, y, meta, cfg, mask_rank=False, segments=edges or None)

    run()
    if graph:  # replay twice more from zero: a captured launch sequence must give the same delta
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            y.zero_()
            run()
        y.fill_(float("nan"))
        captured.replay()
        captured.replay()
    ref = torch.cat([lora_delta_reference(x.double(), a[i].double(), b[i].double(), scaling[i].double(), slot, rank)
                     for i in range(G)], dim=1)
    if linear:
        ref = ref + x.double() @ weight.double().T
    torch.testing.assert_close(y.double(), ref, **TOL[dtype])
    assert ref.abs().max() > 0.1


@pytest.mark.parametrize("grid", GRID_MODES)
@pytest.mark.parametrize("widths", [(48, 16, 32), (64, 80)], ids=["qkv", "gate_up"])
def test_merged_projections_in_one_shrink_and_one_expand(grid, widths):
    check_merged(grid, widths, M=37, K=72, r=8, L=5, dtype=torch.float32)


@pytest.mark.parametrize("grid", ["exact", "full"])
@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("widths", [(48, 16, 32), (64, 80), (80,)], ids=["qkv", "gate_up", "plain"])
def test_merged_projections_in_one_fused_launch(grid, widths, block_n):
    # block_n 32: programs of several column blocks, some crossing a segment edge (48 | 16 | 32).
    import dataclasses

    from lorazor_kernels import KernelConfig

    cfg = dataclasses.replace(KernelConfig(), fused=True, fused_block_n=block_n, fused_block_k=32)
    check_merged(grid, widths, M=37, K=72, r=8, L=5, dtype=torch.float32, cfg=cfg)


def test_expand_names_a_u_of_the_wrong_shape():
    from lorazor_kernels import lora_expand

    L, r, M = 4, 8, 6
    b = torch.randn(L, 48, r, device=DEVICE)
    meta = build_batch_meta(torch.zeros(M, dtype=torch.long, device=DEVICE), L, "exact")
    args = (b, torch.ones(2, L, device=DEVICE), torch.full((L,), r, dtype=torch.int32, device=DEVICE),
            torch.zeros(M, 48, device=DEVICE), meta)
    for u in (torch.zeros(M, 16, device=DEVICE), torch.zeros(2, M + 1, 16, device=DEVICE),
              torch.zeros(2, M, 8, device=DEVICE)):  # 2-D; other rows than y; narrower than 2 segments x r
        with pytest.raises(ValueError, match=r"u must be lora_shrink's partials \[S, M = 6, >= 16\], got"):
            lora_expand(u, *args, mask_rank=False, segments=(16,))


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["exact", "full"])
@pytest.mark.parametrize("widths, K", [((3072, 1024, 1024), 3072), ((8192, 8192), 3072), ((4096, 1024, 1024), 4096),
                                       ((3072,), 8192)])
def test_gpu_bf16_merged_projections(grid, widths, K):
    # The exact grid as the model runs it: captured in a CUDA graph and replayed.
    check_merged(grid, widths, M=256, K=K, r=8, L=128, dtype=torch.bfloat16, graph=grid == "exact")


@pytest.mark.gpu
@pytest.mark.parametrize("widths, K", [((3072, 1024, 1024), 3072), ((8192, 8192), 3072)])
def test_gpu_programmatic_dependent_launch_matches_reference(widths, K):
    import dataclasses

    from lorazor_kernels import get_kernel_config

    cfg = dataclasses.replace(get_kernel_config(torch.device(DEVICE)), pdl=True)
    check_merged("exact", widths, M=256, K=K, r=8, L=128, dtype=torch.bfloat16, cfg=cfg, graph=True)


@pytest.mark.parametrize("widths", [(48, 16, 32), (80,)], ids=["qkv", "plain"])
def test_linear_with_lora_is_the_gemm_plus_the_delta(widths):
    check_merged("exact", widths, M=37, K=72, r=8, L=5, dtype=torch.float32, linear=True)


@pytest.mark.gpu
@pytest.mark.parametrize("widths, K", [((3072, 1024, 1024), 3072), ((3072,), 8192)])
def test_gpu_linear_with_lora_in_a_graph(widths, K):
    check_merged("exact", widths, M=256, K=K, r=8, L=128, dtype=torch.bfloat16, graph=True, linear=True)


def test_programmatic_dependent_launch_is_ignored_off_hopper():
    import dataclasses

    from lorazor_kernels import KernelConfig
    from lorazor_kernels.lora_launch import _pdl_options

    assert _pdl_options(dataclasses.replace(KernelConfig(), pdl=True), torch.device("cpu")) == {"USE_GDC": False}
    check_merged("exact", (48, 16, 32), M=37, K=72, r=8, L=5, dtype=torch.float32,
                 cfg=dataclasses.replace(KernelConfig(), pdl=True))


def test_kernel_config_file_from_the_environment(tmp_path, monkeypatch):
    import json

    from lorazor_kernels import get_kernel_config
    from lorazor_kernels.kernel_config import CONFIG_ENV

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"shrink_block_k": 64, "pdl": True}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    cfg = get_kernel_config(torch.device("cpu"))
    assert (cfg.shrink_block_k, cfg.pdl) == (64, True)
    path_bad = tmp_path / "bad.json"
    path_bad.write_text(json.dumps({"shrink_blok_k": 64}))
    monkeypatch.setenv(CONFIG_ENV, str(path_bad))
    with pytest.raises(ValueError, match="shrink_blok_k"):
        get_kernel_config(torch.device("cpu"))
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        get_kernel_config(torch.device("cpu"))
    monkeypatch.delenv(CONFIG_ENV)  # back to the package's file, nothing of the override kept
    from lorazor_kernels import KernelConfig
    from lorazor_kernels.kernel_config import CONFIG_DIR

    assert get_kernel_config(torch.device("cpu")) == KernelConfig.from_json(CONFIG_DIR / "default.json")


def test_step_caps_split_long_loops_and_keep_the_result():
    import dataclasses

    from lorazor_kernels import KernelConfig
    from lorazor_kernels.lora_launch import _at_most_steps

    assert [_at_most_steps(2, 64, s) for s in (0, 4, 16, 64)] == [2, 16, 4, 2]
    # One K chunk and one column block per program: many more programs, the same delta.
    cfg = dataclasses.replace(KernelConfig(), shrink_block_k=16, shrink_max_steps=1, expand_block_n=16,
                              expand_max_steps=1)
    check_merged("exact", (48, 16, 32), M=37, K=72, r=8, L=5, dtype=torch.float32, cfg=cfg)
    x, a, b, s, slot, rank = make_case(29, 72, 40, 8, 4, torch.float32, seed=4)
    meta = build_batch_meta(slot, 4, "exact")
    y = torch.zeros(29, 40, device=DEVICE)
    add_batched_lora_(y, x, a, b, s, rank, meta, cfg=cfg)
    ref = lora_delta_reference(x.double(), a.double(), b.double(), s.double(), slot, rank)
    torch.testing.assert_close(y.double(), ref, **TOL[torch.float32])
    assert ref.abs().max() > 0.1


def test_merged_projections_reject_bad_segments():
    from lorazor_kernels import lora_expand

    meta = build_batch_meta(torch.tensor([0, 1]), 2, "exact")
    u = torch.zeros(1, 2, 16)
    b = torch.zeros(2, 8, 40).transpose(1, 2)
    rank = torch.full((2,), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="need mask_rank=False"):
        lora_expand(u, b, torch.ones(2, 2), rank, torch.zeros(2, 40), meta, segments=(16,))
    with pytest.raises(ValueError, match="need scaling \\[len\\(segments\\) \\+ 1, L\\]"):
        lora_expand(u, b, torch.ones(2), rank, torch.zeros(2, 40), meta, mask_rank=False, segments=(16,))
    with pytest.raises(ValueError, match="multiples of 16"):
        lora_expand(u, b, torch.ones(2, 2), rank, torch.zeros(2, 40), meta, mask_rank=False, segments=(20,))
