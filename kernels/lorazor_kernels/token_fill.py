"""Fill a step's input tokens from the step before's outputs on the device, in one launch.

With async scheduling the host prepares step n+1 before it has read step n back, so the decode rows
of step n+1 take their tokens (and StepTrim decisions) from step n's output tensor on the GPU:

    for each pending token j:
        ids[dst[j]] = values[token[j]]
        if decision[j] >= 0 and values[decision[j]] == 0:   # the forward released its adapter
            slots[dst[j]] = -1

`fill_pending_reference` is the same in torch ops (the CPU path, and what the tests compare with);
`fill_pending` is one Triton program, where the torch ops are about a dozen small kernels per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


# The count and the index's row stride (= the count) change every step: one compile serves them all.
@triton.jit(do_not_specialize=["count", "stride_index"])
def _fill_pending_kernel(ids_ptr, slots_ptr, index_ptr, values_ptr, count, stride_index, BLOCK: tl.constexpr):
    for start in range(0, count, BLOCK):
        j = start + tl.arange(0, BLOCK)
        ok = j < count
        dst = tl.load(index_ptr + j, mask=ok, other=0)
        token = tl.load(index_ptr + stride_index + j, mask=ok, other=0)
        decision = tl.load(index_ptr + 2 * stride_index + j, mask=ok, other=-1)
        tl.store(ids_ptr + dst, tl.load(values_ptr + token, mask=ok, other=0), mask=ok)
        released = tl.load(values_ptr + tl.maximum(decision, 0), mask=ok & (decision >= 0), other=1) == 0
        tl.store(slots_ptr + dst, tl.full((BLOCK,), -1, slots_ptr.dtype.element_ty), mask=ok & released)


def fill_pending_reference(ids: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """`fill_pending` in torch ops."""
    dst, token, decision = index
    ids.index_copy_(0, dst, values.index_select(0, token).to(ids.dtype))
    keep = (values.index_select(0, decision.clamp(min=0)) != 0) | (decision < 0)
    slots.index_copy_(0, dst, torch.where(keep, slots.index_select(0, dst), -1).to(slots.dtype))


def fill_pending(ids: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                 kernel: bool | None = None) -> None:
    """Write the pending tokens into `ids` and drop the adapter (slot -1) of the rows whose forward
    released it (see the module docstring).

    Args:
        ids: `[N]` int64 input tokens of the step, written at `index[0]`.
        slots: `[N]` int32/int64 adapter slot of each token, set to -1 where released.
        index: `[3, k]` int64: each pending token's position in `ids`, the position of its token in
            `values`, the position of its release decision in `values` (-1: none, it keeps its adapter).
        values: `[V]` int64 the step before's sampled tokens and decisions (1: keep, 0: release).
        kernel: run the Triton program (default: on a GPU; the torch ops elsewhere).
    """
    if index.shape[0] != 3 or index.dim() != 2:
        raise ValueError(f"index must be [3, k], got {tuple(index.shape)}")
    kernel = ids.device.type == "cuda" if kernel is None else kernel
    if not kernel or index.stride(1) != 1 or not ids.is_contiguous() or not slots.is_contiguous():
        fill_pending_reference(ids, slots, index, values)
        return
    count = index.shape[1]
    if count:
        _fill_pending_kernel[(1,)](ids, slots, index, values, count, index.stride(0), BLOCK=BLOCK)


def warm_up_fill(device: torch.device) -> None:
    """Compile `fill_pending`'s kernel for `device` now (a GPU's engine warm-up), so the first async
    step does not wait for Triton. One compile serves every count (it is not specialized on)."""
    if torch.device(device).type != "cuda":
        return
    ids = torch.zeros(1, dtype=torch.long, device=device)
    fill_pending(ids, torch.zeros(1, dtype=torch.int32, device=device),
                 torch.tensor([[0], [0], [-1]], device=device), ids.clone())
