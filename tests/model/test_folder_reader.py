"""FolderReader: an adapter folder read into the slot layout equals the full path's image (the first
read of a header and every later one, across headers and configs), in a handful of torch calls once
the header is known; bad files are still refused, naming what is wrong."""

import dataclasses
import json
import types

import pytest
import torch
from lorazor.lora.bank import AdapterBank
from lorazor.adapters.folder_reader import FolderReader
from lorazor.adapters.loader import load_adapter_weights, read_adapter
from lorazor.lora.types import AdapterError
from safetensors.torch import load_file, save_file

SIZES = {"l0.q": (32, 48), "l0.k": (32, 16), "l0.v": (32, 16), "l0.o": (48, 32), "l0.up": (32, 80),
         "l0.down": (80, 32)}


def make_bank():
    stub = {n: types.SimpleNamespace(in_features=k, out_features=m, weight=torch.empty(0))
            for n, (k, m) in SIZES.items()}
    bank = AdapterBank.empty(stub, 2, 8)
    bank.lay_out([["l0.q", "l0.k", "l0.v"]])
    return bank


def write(folder, seed, modules=("l0.q", "l0.k", "l0.o", "l0.down"), r=4, alpha=16, dtypes=(torch.bfloat16,) * 2):
    g = torch.Generator().manual_seed(seed)
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": [m.split(".")[1] for m in modules]}))
    tensors = {}
    for m in modules:
        k, n = SIZES[m]
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(r, k, generator=g).to(dtypes[0])
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(n, r, generator=g).to(dtypes[1])
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return read_adapter(folder.name, folder)


def full(bank, source):
    return bank.pack(load_adapter_weights(source, bank.module_sizes))


def assert_same(image, want):
    for got, ref in zip((image.weights, image.scaling, image.rank), (want.weights, want.scaling, want.rank)):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_reads_equal_the_full_path_across_headers_and_configs(tmp_path):
    bank, reader = make_bank(), FolderReader(make_bank())
    same_header = [write(tmp_path / f"a{i}", seed=i) for i in range(3)]  # one header, other weights
    other_alpha = write(tmp_path / "alpha", seed=5, alpha=4)  # same header, other scaling
    other_header = write(tmp_path / "wide", seed=6, modules=tuple(SIZES), r=8)
    mixed = write(tmp_path / "mixed", seed=7, dtypes=(torch.float32, torch.bfloat16))  # the full path's
    order = same_header + [other_alpha, same_header[0], other_header, mixed, same_header[2], other_alpha, mixed]
    images = {}
    for source in order:
        image = reader.read(source)
        assert_same(image, full(bank, source))
        images.setdefault(source.name, image)
    # Each read is its own copy: the plan's buffers are reused by the next read.
    assert_same(images["a0"], full(bank, same_header[0]))
    assert not torch.equal(images["a0"].weights, images["a1"].weights)
    assert images["alpha"].scaling.max() == 1.0 and images["a0"].scaling.max() == 4.0


def test_a_known_header_is_read_in_a_few_torch_calls(tmp_path):
    # The engine's read-ahead thread waits for the GIL after every torch call: a read must not make
    # one per tensor once the header is known.
    class Count(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    reader, bank = FolderReader(make_bank()), make_bank()
    sources = [write(tmp_path / f"a{i}", seed=i, modules=tuple(SIZES), r=8) for i in range(3)]
    reader.read(sources[0])

    def calls(read, source):
        Count.calls = 0
        with Count():
            read(source)
        return Count.calls

    known, first_path = calls(reader.read, sources[1]), calls(lambda s: full(bank, s), sources[2])
    assert known <= 20 and first_path >= 3 * known, (known, first_path)


def test_bad_files_under_a_known_header_are_still_refused(tmp_path):
    reader = FolderReader(make_bank())
    reader.read(write(tmp_path / "good", seed=1))
    poisoned = write(tmp_path / "nan", seed=2)
    path = poisoned.path / "adapter_model.safetensors"
    tensors = load_file(path)  # a NaN written after registration, under the same header
    tensors["base_model.model.l0.o.lora_B.weight"][1, 2] = float("nan")
    save_file(tensors, str(path))
    with pytest.raises(AdapterError, match="changed on disk since it was registered"):
        reader.read(poisoned)  # its digest differs from the registered one
    # A source without a registered digest (none to compare) still meets the finiteness check.
    with pytest.raises(AdapterError, match=r"l0\.o\.lora_B\.weight.*non-finite"):
        reader.read(dataclasses.replace(poisoned, digest=b""))
    broken = write(tmp_path / "cut", seed=3)
    path = broken.path / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])  # truncated after registration
    with pytest.raises(AdapterError, match="not a valid safetensors file"):
        reader.read(broken)


def test_a_header_whose_shapes_do_not_match_its_offsets_is_refused_as_an_invalid_file(tmp_path):
    import struct

    source = write(tmp_path / "lying", seed=4)
    path = source.path / "adapter_model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    key = "base_model.model.l0.q.lora_A.weight"
    header[key]["shape"] = [header[key]["shape"][0] * 2, header[key]["shape"][1]]  # twice the bytes it spans
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(AdapterError, match="not a valid safetensors file"):
        FolderReader(make_bank()).read(source)
