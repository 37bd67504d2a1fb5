"""Block sizes for the LoRA kernels, per GPU, from JSON files in `configs/` with a default fallback."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
# A JSON file that replaces the per-GPU file, e.g. to try launch parameters without editing the package.
CONFIG_ENV = "LORAZOR_KERNEL_CONFIG"


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the shrink and expand kernels.

    Attributes:
        shrink_block_k: K chunk per shrink loop iteration.
        shrink_split_k: fixed number of K splits; 0 picks one from the grid size.
        target_programs_per_sm: with `shrink_split_k == 0`, split K until the shrink launch has
            about this many programs per multiprocessor.
        shrink_max_steps: if > 0, split K further so that no shrink program loops over more than
            this many K chunks (a long K, down_proj's, gets more programs than a short one).
        shrink_num_warps / shrink_num_stages: Triton launch options of shrink.
        expand_block_n: output columns per expand loop iteration.
        expand_programs_per_sm: split N over about this many expand programs per multiprocessor.
        expand_max_steps: if > 0, split N further so that no expand program loops over more than
            this many column blocks (gate/up's wide output gets more programs than o_proj's).
        expand_num_warps / expand_num_stages: Triton launch options of expand.
        fused: run shrink and expand as one kernel (`lora_fused`) instead of two. Off on the H200
            and the H100: measured slower there (benchmarks/results/kernels.md, defaults_h100/), the
            split-K shrink keeps more loads in flight.
        fused_block_k / fused_block_n: K chunk of the fused shrink loop, N chunk of its expand loop.
        fused_programs_per_sm: split N over about this many fused programs per multiprocessor.
        fused_num_warps / fused_num_stages: Triton launch options of the fused kernel.
        pdl: launch the kernels with programmatic dependent launch on Hopper or newer GPUs, so a
            kernel's programs are scheduled while the kernel ahead of it drains: each reads its
            tile of the step metadata and its first adapter weight tile, then waits for that
            kernel before touching activations.
            Needs the metadata written before the kernel ahead was launched (true in the model,
            which builds it at the start of the step, and in `batched_lora`). Ignored elsewhere.
            On in the H200 file: compiled decode of Llama-3.2-3B at 128 adapters went from
            33.4k to 34.7k tok/s (a bench_e2e.py A/B on the H200; its result file is in the
            history of benchmarks/results/, not in the tree).
        one_program_meta: build the `exact`/`full` step metadata in one Triton program
            (`meta_kernel.py`) instead of about 25 small torch kernels. On in the H200 file: about
            0.06 ms less per compiled decode step in one-run A/Bs
            (benchmarks/results/archive/e2e_ab_meta_95425b7/, e2e_ab_tune_d64db02/).
        gemm_adds_lora: in the model's op (`linear_lora_op`, `exact` grid, no bias), run the LoRA
            first and let the base GEMM add its product to the delta (`delta.addmm_(x, W.T)`,
            cuBLAS with beta = 1) instead of the expand reading and rewriting the GEMM's output:
            the expand then only writes (`lora_expand(write_only=True)`). Nsight Compute and
            `benchmarks/probes/expand_probe.py` put most of the expand's time at 128 adapters on that
            read of y (benchmarks/results/archive/expand_probe_b946ee5/). On in the H200 file since
            1a153d7: compiled decode of Llama-3.2-3B at 128 adapters 7.20-7.24 ms per step
            against 7.37-7.43 without it (benchmarks/results/archive/e2e_ab_gemm_adds_lora_1a153d7/).
        lora_beside_gemm: in the model's op (`linear_lora_op`, `exact` grid), run the LoRA delta's
            shrink and write-only expand on a side stream while the base GEMM (bf16 or fp8) runs,
            and add the two outside the op, where torch.compile fuses the add into the next
            elementwise kernel (rotary, SiLU-multiply, the residual add): the delta's chain of
            small kernels leaves the step's critical path. Takes precedence over `gemm_adds_lora`.
            Not measured on a GPU yet: off in every shipped file.
        fp8_block_n / fp8_block_k / fp8_num_warps / fp8_num_stages: the launch of the fp8
            weight-only GEMM (`fp8.fp8_weight_only`, decode steps of a few rows). The H100 sweep's
            best for 3 of the 4 Llama-3.2-3B GEMMs unsplit (`probes/fp8_gemm.py --sweep`, 995d0e0).
        fp8_programs_per_sm: a weight-only GEMM with fewer column blocks than the GPU has
            multiprocessors splits K until it launches about this many programs per
            multiprocessor. The H100 sweep (844ba1d): down (8,192 x 3,072: 96 blocks of 32 channels
            on 132 multiprocessors) took 0.026 ms unsplit and 0.018 ms in 4 splits; gate/up (512
            blocks) was slower split in two (0.034 against 0.027 ms).
        fp8_pdl: launch the fp8 weight-only GEMM with programmatic dependent launch (Hopper or newer),
            each program reading its first weight tile before waiting for the kernel ahead. Not
            measured on a GPU yet: off in every shipped file.
    """

    shrink_block_k: int = 128
    shrink_split_k: int = 0
    target_programs_per_sm: int = 4
    shrink_max_steps: int = 0
    shrink_num_warps: int = 4
    shrink_num_stages: int = 3
    expand_block_n: int = 128
    expand_programs_per_sm: int = 8
    expand_max_steps: int = 0
    expand_num_warps: int = 4
    expand_num_stages: int = 2
    fused: bool = False
    fused_block_k: int = 256
    fused_block_n: int = 128
    fused_programs_per_sm: int = 2
    fused_num_warps: int = 4
    fused_num_stages: int = 3
    pdl: bool = False
    one_program_meta: bool = False
    gemm_adds_lora: bool = False
    lora_beside_gemm: bool = False
    fp8_block_n: int = 32
    fp8_block_k: int = 512
    fp8_num_warps: int = 4
    fp8_num_stages: int = 3
    fp8_programs_per_sm: int = 3
    fp8_pdl: bool = False

    @classmethod
    def from_json(cls, path: str | Path) -> "KernelConfig":
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown kernel config keys {sorted(unknown)} in {path}")
        return cls(**data)


def config_file_name(device_name: str) -> str:
    """`NVIDIA H200` -> `NVIDIA_H200.json`."""
    return device_name.replace(" ", "_").replace("-", "_") + ".json"


@lru_cache(maxsize=None)
def _config_from(path: str) -> KernelConfig:
    return KernelConfig.from_json(path)


@lru_cache(maxsize=None)
def _path_for(device_name: str) -> str:
    path = CONFIG_DIR / config_file_name(device_name)
    return str(path if path.exists() else CONFIG_DIR / "default.json")


def kernel_config_path(device: torch.device) -> str:
    """The file `get_kernel_config` reads for `device`: `$LORAZOR_KERNEL_CONFIG` if set, else the
    tuned config of this device's GPU, or `configs/default.json` (also used on CPU). Benchmarks
    record it with their results."""
    override = os.environ.get(CONFIG_ENV)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{CONFIG_ENV}={override!r} is not a file")
        return override
    return _path_for(_device_name(device.type, device.index))


def get_kernel_config(device: torch.device) -> KernelConfig:
    """The launch settings for `device`, from the file `kernel_config_path` names."""
    return _config_from(kernel_config_path(device))


@lru_cache(maxsize=None)
def _device_name(kind: str, index: int | None) -> str:
    """The GPU's name (queried once per device, not at every launch)."""
    return torch.cuda.get_device_name(index) if kind == "cuda" else "cpu"
