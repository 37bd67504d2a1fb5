"""AdapterBank: every module's slot tensors are views of one storage row per slot, laid out with the
merged groups adjacent; a load is a few copies and puts exactly each module's A, B, scaling and rank
where the kernels (per module and merged) read them."""

import types

import pytest
import torch
from conftest import DEVICE
from lorazor.adapters import AdapterWeights
from lorazor.lora.bank import AdapterBank

SIZES = {"l0.q": (32, 48), "l0.k": (32, 16), "l0.v": (32, 16), "l0.o": (48, 32), "l0.up": (32, 80),
         "l0.down": (80, 32)}


def bank(num_slots=3, r_max=8, groups=(("l0.q", "l0.k", "l0.v"),)):
    stub = {n: types.SimpleNamespace(in_features=k, out_features=m, weight=torch.empty(0, device=DEVICE))
            for n, (k, m) in SIZES.items()}
    b = AdapterBank.empty(stub, num_slots, r_max)
    return b, b.lay_out([list(g) for g in groups])


def adapter(seed, ranks):
    g = torch.Generator().manual_seed(seed)
    return AdapterWeights({n: (torch.randn(r, SIZES[n][0], generator=g), torch.randn(SIZES[n][1], r, generator=g),
                               0.5 + seed) for n, r in ranks.items()})


def test_a_load_puts_each_module_where_its_views_and_the_merged_views_read():
    b, views = bank()
    a = adapter(1, {"l0.q": 8, "l0.k": 3, "l0.o": 8, "l0.down": 5})  # v and up not targeted
    b.write(1, "a", b.pack(a))
    for name, m in b.modules.items():
        r = a.modules[name][0].shape[0] if name in a.modules else 0
        assert m.rank[1].item() == r and m.host_rank[1] == r
        if r:
            A, B, scale = a.modules[name]
            assert torch.equal(m.lora_a[1, :r].cpu(), A) and torch.equal(m.lora_b[1, :, :r].cpu(), B)
            assert m.scaling[1].item() == scale
        assert not m.lora_a[1, r:].any() and not m.lora_b[1, :, r:].any()  # zero past the rank
        assert not m.lora_a[0].any() and not m.lora_a[2].any()  # other slots untouched
    merged_a, merged_b, merged_scaling = views[("l0.q", "l0.k", "l0.v")]
    assert merged_a.shape == (3, 24, 32) and merged_b.shape == (3, 80, 8) and merged_scaling.shape == (3, 3)
    assert torch.equal(merged_a[1, :8].cpu(), a.modules["l0.q"][0])  # q's rows, then k's
    assert torch.equal(merged_b[1, 48:64, :3].cpu(), a.modules["l0.k"][1])
    assert merged_scaling[:, 1].tolist() == [1.5, 1.5, 0.0]
    # One storage: every module's tensors (and the merged ones) share it.
    base = b.storage.untyped_storage().data_ptr()
    assert all(m.lora_a.untyped_storage().data_ptr() == base == m.lora_b.untyped_storage().data_ptr()
               for m in b.modules.values())
    assert b.read(1).weights.tolist() == b.storage[1].tolist()


def test_partial_ranks_switch_masking_on_and_back_off():
    b, _ = bank()
    full = {n: 8 for n in SIZES}
    b.write(0, "full", b.pack(adapter(2, full)))
    assert not any(m.mask_rank for m in b.modules.values())
    b.write(1, "small", b.pack(adapter(3, {**full, "l0.o": 4})))
    assert b.modules["l0.o"].mask_rank and not b.modules["l0.q"].mask_rank
    b.write(1, "full2", b.pack(adapter(4, full)))  # the partial slot overwritten: masking off again
    assert not b.modules["l0.o"].mask_rank
    b.write(2, "small2", b.pack(adapter(5, {"l0.o": 2})))
    b.clear(2)
    assert not b.modules["l0.o"].mask_rank and b.modules["l0.o"].host_rank == [8, 8, 0]


def test_the_layout_changes_only_while_the_slots_are_empty():
    b, _ = bank()
    b.write(0, "a", b.pack(adapter(6, {"l0.q": 8})))
    with pytest.raises(RuntimeError, match="only while its slots are empty"):
        b.lay_out([["l0.up", "l0.down"]])
    b2, _ = bank(groups=())
    with pytest.raises(ValueError, match="differ in input size"):
        b2.lay_out([["l0.o", "l0.down"]])


def test_a_stacked_block_keeps_each_experts_b_contiguous_and_in_its_views():
    # An MoE projection's experts (a stack): a load lands where the modules' views and the stack's views read
    # it, and each expert's B `[r_max, N]` is one contiguous span of its slot's row (a token-expert pair reads
    # one expert's B whole).
    sizes = {f"m.experts.{e}.up_proj": (24, 40) for e in range(3)} | {"m.o": (40, 24)}
    names = tuple(f"m.experts.{e}.up_proj" for e in range(3))
    b = AdapterBank(sizes, 2, 8, torch.float32, torch.device(DEVICE), stacks=[names])
    g = torch.Generator().manual_seed(7)
    ranks = {names[0]: 8, names[2]: 5, "m.o": 8}
    weights = AdapterWeights({n: (torch.randn(r, sizes[n][0], generator=g), torch.randn(sizes[n][1], r, generator=g),
                                  1.5) for n, r in ranks.items()})
    b.write(1, "a", b.pack(weights))
    lora_a, lora_b, scaling = b.stack(names[0])
    assert lora_a.shape == (2, 3, 8, 24) and lora_b.shape == (2, 3, 40, 8) and scaling.shape == (3, 2)
    for e, name in enumerate(names):
        assert lora_b[1, e].t().is_contiguous() and torch.equal(lora_b[1, e], b.modules[name].lora_b[1])
        assert torch.equal(lora_a[1, e], b.modules[name].lora_a[1])
        if name in ranks:
            A, B, _ = weights.modules[name]
            r = A.shape[0]
            assert torch.equal(lora_a[1, e, :r].cpu(), A) and torch.equal(lora_b[1, e, :, :r].cpu(), B)
            assert not lora_b[1, e, :, r:].any()
    assert not lora_b[1, 1].any() and not lora_b[0].any()  # expert 1 not targeted; slot 0 empty
    assert torch.equal(b.modules["m.o"].lora_b[1].cpu(), weights.modules["m.o"][1])
