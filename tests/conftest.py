"""Test setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before triton is imported (GOTCHAS.md), so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two busy threads make tiny-model tests far slower on the 2-core CI machine.
torch.set_num_threads(1)

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# The Triton interpreter returns garbage from bf16 dots; test fp32/fp16 on the CPU, bf16 on the GPU.
KERNEL_DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32, torch.float16]
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),
}


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
