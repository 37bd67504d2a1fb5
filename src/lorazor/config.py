"""LoRazorConfig: how a LoRazorModel is built and run. Frozen, validated, JSON round-trip."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from lorazor_kernels import GRID_MODES

BACKENDS = ("auto", "triton", "reference")
RELEASE_MODES = ("none", "profiled", "learned", "custom")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoRazorConfig:
    """Configuration of a `LoRazorModel`.

    Attributes:
        grid: LoRA kernel grid mode: "exact" (default: a device-built tile table, no host sync),
            "full" (vLLM/Punica baseline), "active_rows" or "two_class" (the paper's GridTrim).
        release: default release policy when `generate` gets none: "none" (keep adapters to the
            end), "profiled" or "learned" (loaded beside each adapter, see `lorazor.policies`), or
            "custom" (your own `ReleasePolicy`, set with `LoRazorModel.set_release_policy`).
        max_batch_size: the largest batch `generate` accepts (sizes buffers and graphs).
        max_loras: GPU adapter slots. More adapters than slots may be registered: slots are an
            LRU cache over them. None: one slot per adapter given at build time (at least 1).
        max_lora_rank: the largest rank a slot can hold; None: the largest rank given at build
            time (16 when none is given).
        max_cpu_loras: host copies of folder adapters kept for fast reloads into slots (pinned
            memory on a GPU machine); None: no limit. Adapters without a folder always keep theirs.
        lora_target_modules: module names (or name suffixes such as "q_proj") that adapters may
            target; None: every linear layer of the decoder (with `from_peft`: the modules its
            adapters target). Declare them up front to register adapters with other targets later.
        dtype: "float32", "float16" or "bfloat16" to cast the model and adapters; None keeps them.
        cuda_graphs: capture and replay the decode step as a CUDA graph on the GPU (with the Triton
            backend; the reference backend syncs with the host and always runs eagerly).
        compile: run the decoder's layers through torch.compile (fuses the backbone's elementwise
            ops; the LoRA and attention kernels stay opaque custom ops), captured in the step graphs.
            One decoder layer is compiled and reused by every layer, so compile time does not grow
            with depth. Batch and token counts are dynamic: a few compiles per step kind (decode-only
            and packed steps, with LoRA and backbone only) serve every batch bucket.
        backend: "auto" (Triton kernels on the GPU, the pure-torch reference on the CPU),
            "triton" or "reference".
        attention: decode attention: "auto" (the Triton kernel that reads only each row's valid
            keys, on the GPU; SDPA over the masked cache elsewhere), "triton" or "sdpa".
        block_m: row-tile height of the LoRA kernels (a power of two >= 16).
        max_cache_len: KV-cache length per row; None sizes it per call as prompt + max_new_tokens
            (rounded up to 64 with CUDA graphs, one set of graphs per length bucket). Set it for a
            server: every call then shares one cache and one set of graphs per batch bucket.
        merge_projections: run q/k/v and gate/up as one base GEMM and one LoRA shrink + expand
            each (4 base GEMMs and 8 LoRA launches per layer instead of 7 and 14), when the
            members' adapters share one rank; other layers keep the per-module path. On the H200
            this cuts LoRA time per layer by a fifth (benchmarks/results/kernels.md).
        capture_batch_sizes: batch sizes whose decode graphs `from_peft` captures up front (with
            CUDA graphs on the GPU; needs `max_cache_len`), so no request pays for capture (or,
            with `compile=True`, compilation). Other sizes are captured when first used.
    """

    grid: str = "exact"
    release: str = "none"
    max_batch_size: int = 256
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    dtype: str | None = None
    cuda_graphs: bool = True
    compile: bool = False
    backend: str = "auto"
    attention: str = "auto"
    block_m: int = 16
    max_cache_len: int | None = None
    capture_batch_sizes: tuple[int, ...] = ()
    merge_projections: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.grid not in GRID_MODES:
            raise ValueError(f"grid must be one of {GRID_MODES}, got {self.grid!r}")
        if self.release not in RELEASE_MODES:
            raise ValueError(f"release must be one of {RELEASE_MODES}, got {self.release!r}")
        if self.attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'sdpa', got {self.attention!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}")
        if self.lora_target_modules is not None:
            targets = (self.lora_target_modules,) if isinstance(self.lora_target_modules, str) else tuple(
                self.lora_target_modules)
            object.__setattr__(self, "lora_target_modules", targets)
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(
                    f"lora_target_modules must be non-empty module names, got {self.lora_target_modules!r}"
                )
        if self.max_cpu_loras is not None and (
            not isinstance(self.max_cpu_loras, int) or isinstance(self.max_cpu_loras, bool) or self.max_cpu_loras < 0
        ):
            raise ValueError(f"max_cpu_loras must be an int >= 0 or None, got {self.max_cpu_loras!r}")
        for name in ("max_batch_size", "max_loras", "max_lora_rank", "max_cache_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        sizes = tuple(self.capture_batch_sizes)
        object.__setattr__(self, "capture_batch_sizes", sizes)  # a JSON list comes back as a tuple
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= self.max_batch_size:
                raise ValueError(f"capture_batch_sizes entries must be ints in [1, max_batch_size="
                                 f"{self.max_batch_size}], got {size!r}")
        if sizes and self.max_cache_len is None:
            raise ValueError("capture_batch_sizes needs max_cache_len: graphs are captured per cache length")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.dtype] if self.dtype else None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialize to a JSON string, and write it to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "LoRazorConfig":
        """Load from a JSON string or a path to a JSON file; unknown keys are an error."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown LoRazorConfig keys {unknown}")
        return cls(**data)
