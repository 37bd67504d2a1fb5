"""Sharp edges of the public kernel API: refused with a Python error naming the value, never silent."""

import pytest
import torch
from conftest import DEVICE
from lorazor_kernels import add_batched_lora_, build_batch_meta, get_kernel_config
from lorazor_kernels import kernel_config


def test_segments_with_rank_masking_are_refused_not_dropped():
    M, K, r, L = 4, 32, 16, 3
    x = torch.randn(M, K, device=DEVICE)
    a, b = torch.randn(L, 2 * r, K, device=DEVICE), torch.randn(L, 48, r, device=DEVICE)
    y = torch.zeros(M, 48, device=DEVICE)
    meta = build_batch_meta(torch.tensor([0, 1, -1, 2], device=DEVICE, dtype=torch.int32), L, "exact")
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="segments need mask_rank=False"):
        add_batched_lora_(y, x, a, b, torch.ones(2, L, device=DEVICE), rank, meta, backend="reference", mask_rank=True,
                          segments=(16,))


def test_a_batch_over_max_active_slots_raises_in_python():
    row_slot = torch.tensor([0, 3, 5, -1, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="row_slot uses 3 distinct slots but max_active_slots=2"):
        build_batch_meta(row_slot, 8, "exact", max_active_slots=2)
    build_batch_meta(row_slot, 8, "exact", max_active_slots=3)  # within the bound


def test_kernel_config_looks_the_device_up_once():
    kernel_config._device_name.cache_clear()
    for _ in range(3):
        get_kernel_config(torch.device(DEVICE))
    info = kernel_config._device_name.cache_info()
    assert info.misses == 1 and info.hits == 2


def test_kernel_config_path_names_the_file_the_kernels_read(monkeypatch, tmp_path):
    import dataclasses
    import json

    monkeypatch.delenv(kernel_config.CONFIG_ENV, raising=False)
    device = torch.device(DEVICE)
    path = kernel_config.kernel_config_path(device)
    expected = kernel_config.CONFIG_DIR / kernel_config.config_file_name(kernel_config._device_name(device.type, None))
    assert path == str(expected if expected.exists() else kernel_config.CONFIG_DIR / "default.json")
    assert get_kernel_config(device) == kernel_config.KernelConfig.from_json(path)
    # An override is the file read, whatever the device.
    custom = tmp_path / "mine.json"
    settings = dataclasses.asdict(dataclasses.replace(get_kernel_config(device), expand_block_n=64))
    custom.write_text(json.dumps(settings))
    monkeypatch.setenv(kernel_config.CONFIG_ENV, str(custom))
    assert kernel_config.kernel_config_path(device) == str(custom)
    assert get_kernel_config(device).expand_block_n == 64
    monkeypatch.setenv(kernel_config.CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        kernel_config.kernel_config_path(device)


def test_linear_lora_op_takes_a_kernel_config(monkeypatch):
    import dataclasses

    from lorazor_kernels import linear_lora_op, lora_delta_reference
    from lorazor_kernels import ops

    g = torch.Generator().manual_seed(0)
    M, K, N, r, L = 5, 32, 48, 16, 3
    x = torch.randn(M, K, generator=g).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(DEVICE)
    a, b = torch.randn(L, r, K, generator=g).to(DEVICE), torch.randn(L, N, r, generator=g).to(DEVICE)
    s, rank = torch.rand(L).to(DEVICE), torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([0, 2, -1, 1, 0], dtype=torch.int32, device=DEVICE)
    meta = build_batch_meta(slot, L, "exact")
    cfg = dataclasses.replace(get_kernel_config(torch.device(DEVICE)), fused=True)

    def no_lookup(device):
        raise AssertionError("the given config must be used, not the device's")

    monkeypatch.setattr(ops, "get_kernel_config", no_lookup)
    y = linear_lora_op(x, w, None, a, b, s, rank, meta, backend="triton", cfg=cfg)
    ref = x @ w.T + lora_delta_reference(x, a, b, s, slot)
    torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-3)


def test_row_major_b_warns_once_about_strided_loads(monkeypatch):
    from lorazor_kernels import batched_lora, lora_launch

    monkeypatch.setattr(lora_launch, "_B_LAYOUT_WARNED", False)
    x = torch.randn(4, 32, device=DEVICE)
    a = torch.randn(2, 16, 32, device=DEVICE)
    slot = torch.tensor([0, 1, -1, 0], dtype=torch.int32, device=DEVICE)
    fast_b = torch.randn(2, 16, 48, device=DEVICE).transpose(1, 2)  # [L, N, r] view, N contiguous
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched_lora(x, a, fast_b, torch.ones(2, device=DEVICE), slot, fused=False)
    with pytest.warns(UserWarning, match="contiguous along r: the expand kernel reads it with strided loads"):
        batched_lora(x, a, fast_b.contiguous(), torch.ones(2, device=DEVICE), slot, fused=False)
