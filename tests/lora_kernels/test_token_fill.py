"""`fill_pending`: one program writes the step before's tokens into a step's inputs and drops the
adapter of released rows; compared with the torch reference on random steps (Triton interpreter on
the CPU, the compiled kernel on a GPU)."""

import pytest
import torch
from conftest import DEVICE
from lorazor_kernels import fill_pending, fill_pending_reference


def random_step(n: int, k: int, seed: int, slot_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (n,), generator=g)
    slots = torch.randint(-1, 7, (n,), generator=g).to(slot_dtype)
    values = torch.randint(0, 1000, (k + 40,), generator=g)
    values[k:] = torch.randint(0, 2, (40,), generator=g)  # the decisions: 1 keep, 0 release
    dst = torch.randperm(n, generator=g)[:k]
    token = torch.randperm(k, generator=g)
    decision = torch.where(torch.rand(k, generator=g) < 0.5, k + torch.randint(0, 40, (k,), generator=g), -1)
    index = torch.stack([dst, token, decision])
    return [t.to(DEVICE) for t in (ids, slots, index, values)]


@pytest.mark.parametrize("n, k", [(1, 1), (7, 5), (300, 257), (520, 512)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_fill_pending_equals_the_torch_ops(n, k, slot_dtype):
    ids, slots, index, values = random_step(n, k, seed=n + k, slot_dtype=slot_dtype)
    want_ids, want_slots = ids.clone(), slots.clone()
    fill_pending_reference(want_ids, want_slots, index, values)
    fill_pending(ids, slots, index, values, kernel=True)
    assert torch.equal(ids, want_ids) and torch.equal(slots, want_slots)
    filled = index[0]
    assert torch.equal(ids[filled], values[index[1]])  # the reference itself did the fill
    released = (index[2] >= 0) & (values[index[2].clamp(min=0)] == 0)
    assert (want_slots[filled[released]] == -1).all() and (k < 5 or released.any())
    untouched = torch.ones(n, dtype=torch.bool, device=ids.device)
    untouched[filled] = False
    assert torch.equal(slots[untouched], random_step(n, k, seed=n + k, slot_dtype=slot_dtype)[1][untouched])


def test_fill_pending_refuses_a_malformed_index():
    ids, slots, index, values = random_step(8, 4, seed=0)
    with pytest.raises(ValueError, match=r"index must be \[3, k\], got \(2, 4\)"):
        fill_pending(ids, slots, index[:2], values)


@pytest.mark.gpu
def test_the_warm_up_compiles_the_one_fill_every_step_uses():
    # The engine's warm-up compiles the fill kernel; async steps of any batch reuse that binary.
    from lorazor_kernels import token_fill, warm_up_fill

    kernel = token_fill._fill_pending_kernel
    warm_up_fill(torch.device(DEVICE))
    compiled = sum(len(caches[0]) for caches in kernel.device_caches.values())
    assert compiled >= 1
    for n, k in ((7, 5), (300, 257)):
        ids, slots, index, values = random_step(n, k, seed=k)
        fill_pending(ids, slots, index, values)
    assert sum(len(caches[0]) for caches in kernel.device_caches.values()) == compiled
