"""Probe: one adapter's load from its folder against a plain safetensors read plus one copy (issue #56).

    python benchmarks/probes/adapter_read.py --out /tmp/probe [--targets q_proj,v_proj]

The Llama-3.2-3B shape's bank (rank 8 on `--targets` of 28 layers, q/k/v and gate/up merged as the
model lays them out), `--folders` distinct PEFT folders written to disk first (so reads come from
the page cache: the disk's own speed is not LoRazor's). Per load, the median over the folders
(cycled `--rounds` times) of:
- `reader`: `FolderReader.read` (read, check, pack into the slot layout) then `bank.write` into a
  slot (to the GPU's end on a GPU machine), the disk load the engine does;
- `full_path`: the same through `load_adapter_weights` + `bank.pack` (the path before the reader);
- `floor`: `safetensors.torch.load_file` of the same file, then one copy of its bytes into a
  (pinned, on a GPU machine) buffer and from there into the slot, the "read + copy" the target names.
Alone and beside a thread that keeps the GIL busy (the engine's loop beside the read-ahead thread).
Writes `adapter_read.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from common import environment  # noqa: E402

H, INTER, KV, LAYERS, RANK = 3072, 8192, 1024, 28, 8
PROJECTIONS = {"q_proj": ("self_attn", H, H), "k_proj": ("self_attn", H, KV), "v_proj": ("self_attn", H, KV),
               "o_proj": ("self_attn", H, H), "gate_proj": ("mlp", H, INTER), "up_proj": ("mlp", H, INTER),
               "down_proj": ("mlp", INTER, H)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--targets", default=",".join(PROJECTIONS))
    ap.add_argument("--folders", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import load_file, save_file

    from lorazor.lora.bank import AdapterBank
    from lorazor.adapters.folder_reader import FolderReader
    from lorazor.adapters.loader import load_adapter_weights, read_adapter

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sizes = {f"model.layers.{i}.{PROJECTIONS[p][0]}.{p}": PROJECTIONS[p][1:] for i in range(LAYERS)
             for p in PROJECTIONS}  # every projection in the bank; the folders target `--targets`
    stub = {n: types.SimpleNamespace(in_features=k, out_features=m, weight=torch.empty(0, dtype=torch.bfloat16,
                                                                                     device=device))
            for n, (k, m) in sizes.items()}
    bank = AdapterBank.empty(stub, 2, RANK)
    bank.lay_out([[f"model.layers.{i}.self_attn.{m}_proj" for m in "qkv"] for i in range(LAYERS)]
                 + [[f"model.layers.{i}.mlp.{m}_proj" for m in ("gate", "up")] for i in range(LAYERS)])
    targets = args.targets.split(",")
    g = torch.Generator().manual_seed(0)
    tmp = Path(tempfile.mkdtemp())
    sources = []
    for j in range(args.folders):
        folder = tmp / f"a{j}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": targets, "task_type": "CAUSAL_LM"}))
        tensors = {}
        for name, (k, m) in sizes.items():
            if name.rsplit(".", 1)[1] in targets:
                tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, k, generator=g).bfloat16()
                tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(m, RANK, generator=g).bfloat16()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        sources.append(read_adapter(folder.name, folder))
    file_bytes = (sources[0].path / "adapter_model.safetensors").stat().st_size
    reader = FolderReader(bank)
    pin = device.type == "cuda"
    staging = torch.empty(file_bytes, dtype=torch.uint8, pin_memory=pin)
    slot_bytes = bank.storage[0].view(torch.uint8)

    def floor(source):
        data = load_file(str(source.path / "adapter_model.safetensors"))
        offset = 0
        for t in data.values():  # one copy of the file's tensors into one buffer, then into the slot
            flat = t.view(-1).view(torch.uint8)
            staging[offset:offset + flat.numel()].copy_(flat)
            offset += flat.numel()
        n = min(offset, slot_bytes.numel())
        slot_bytes[:n].copy_(staging[:n], non_blocking=True)

    paths = {"reader": lambda s: bank.write(0, s.name, reader.read(s)),
             "full_path": lambda s: bank.write(0, s.name, bank.pack(load_adapter_weights(s, bank.module_sizes))),
             "floor": floor}

    def timed(fn) -> float:
        times = []
        for _ in range(args.rounds):
            for source in sources:
                sync()
                start = time.perf_counter()
                fn(source)
                sync()
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    busy_stop = threading.Event()

    def busy():  # Python work and small torch calls, as the engine's loop does
        x = torch.zeros(16)
        while not busy_stop.is_set():
            for _ in range(200):
                x.add_(1)
            sum(range(2000))

    row = dict(environment(), probe="adapter_read", device=device.type, targets=targets,
               file_mb=round(file_bytes / 1e6, 2), slot_mb=round(bank.storage[0].numel() * 2 / 1e6, 2),
               folders=args.folders)
    for fn in paths.values():
        fn(sources[0])  # first reads: the reader's plan, allocations
    for label in ("alone", "busy"):
        thread = None
        if label == "busy":
            busy_stop.clear()
            thread = threading.Thread(target=busy, daemon=True)
            thread.start()
        ms = {name: timed(fn) for name, fn in paths.items()}
        if thread is not None:
            busy_stop.set()
            thread.join()
        row[label] = {f"{k}_ms": round(v, 3) for k, v in ms.items()} | {
            "reader_vs_floor": round(ms["reader"] / ms["floor"], 2),
            "full_path_vs_floor": round(ms["full_path"] / ms["floor"], 2)}
    print(json.dumps(row), flush=True)
    (args.out / "adapter_read.json").write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
