"""The configuration, in one place: `LoRazorConfig` (how a `LoRazorModel` is built and run) and
`EngineConfig` (how a `LoRazorEngine` batches and caches); the server's settings are
`lorazor.serve.settings.ServerSettings`. Each is a frozen, validated dataclass whose fields are
documented in its docstring; `lorazor serve`'s flags are generated from those fields
(`add_config_arguments`), their help text from those docs (`field_docs`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING


def int_in_range(value, low: int | None = None, high: int | None = None) -> bool:
    """Whether `value` is an int within [low, high] (a None bound is open). A bool is not an int
    here, though Python says it is: `max_tokens=True` is a mistake, not a 1."""
    return (isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
            and (high is None or value <= high))


BACKENDS = ("auto", "triton", "reference")
RELEASE_MODES = ("none", "profiled", "learned", "custom")
if TYPE_CHECKING:
    import torch

# torch dtypes by name (resolved on use: building the command line parser imports no torch).
DTYPES = ("float32", "float16", "bfloat16")
# `LoRazorConfig.compile`'s values; "on"/"off" (the command line's) are read as True/False.
COMPILE_MODES = ("auto", "on", "off")
# Base-weight quantizations (`lorazor.quant`).
QUANTIZATIONS = ("fp8",)


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
        compile: "auto" (default: compiled where the model runs on a GPU with the Triton kernels,
            eager elsewhere; resolved when the model is built), True ("on") or False ("off"): run
            the decoder's layers through torch.compile (fuses the backbone's elementwise ops; the
            LoRA, attention and KV-write kernels stay opaque custom ops), captured in the step
            graphs. One decoder layer is compiled and reused by every layer, so compile time does not
            grow with depth. Batch and token counts are dynamic: a few compiles per step kind
            (decode-only and padded packed steps, with LoRA and backbone only) serve every bucket.
            Compiled code is cached on disk (see `lorazor.runner.compile_cache`).
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
        quantization: "fp8": the base weights of every decoder projection quantized at build to
            float8_e4m3fn with a scale per output channel (adapters, norms, embeddings and the LM
            head keep the model's dtype); on GPUs with fp8 matrix units the base GEMMs run in fp8
            with activations quantized per token. None: the model's own dtype.
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
    compile: bool | str = "auto"
    backend: str = "auto"
    attention: str = "auto"
    block_m: int = 16
    max_cache_len: int | None = None
    capture_batch_sizes: tuple[int, ...] = ()
    merge_projections: bool = True
    quantization: str | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        from lorazor_kernels.meta import GRID_MODES

        if self.grid not in GRID_MODES:
            raise ValueError(f"grid must be one of {GRID_MODES}, got {self.grid!r}")
        if self.release not in RELEASE_MODES:
            raise ValueError(f"release must be one of {RELEASE_MODES}, got {self.release!r}")
        if self.attention not in ("auto", "triton", "sdpa"):
            raise ValueError(f"attention must be 'auto', 'triton' or 'sdpa', got {self.attention!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.compile in ("on", "off"):
            object.__setattr__(self, "compile", self.compile == "on")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ValueError(f"compile must be True, False or one of {COMPILE_MODES}, got {self.compile!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
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
            if value is not None and not int_in_range(value, 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        sizes = tuple(self.capture_batch_sizes)
        object.__setattr__(self, "capture_batch_sizes", sizes)  # a JSON list comes back as a tuple
        for size in sizes:
            if not int_in_range(size, 1, self.max_batch_size):
                raise ValueError(f"capture_batch_sizes entries must be ints in [1, max_batch_size="
                                 f"{self.max_batch_size}], got {size!r}")
        if sizes and self.max_cache_len is None:
            raise ValueError("capture_batch_sizes needs max_cache_len: graphs are captured per cache length")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return getattr(torch, self.dtype) if self.dtype else None

    def resolve_compile(self, device: torch.device, backend: str) -> "LoRazorConfig":
        """This config with `compile` a bool: "auto" is on for a CUDA model with the Triton kernels."""
        if self.compile != "auto":
            return self
        return replace(self, compile=device.type == "cuda" and backend == "triton")

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


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of a `LoRazorEngine` (its keyword arguments; `lorazor serve`'s engine flags).

    Attributes:
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per engine step (decode tokens plus prefill chunks).
        num_kv_blocks: KV-cache blocks in the pool; None: `gpu_memory_utilization` of the free GPU
            memory, less 3 GiB for activations and graphs (256 blocks on the CPU).
        block_size: token positions per KV block.
        gpu_memory_utilization: share of the free GPU memory the KV pool takes when `num_kv_blocks`
            is not given.
        max_model_len: the longest prompt + output a request may have; None: the model's
            `max_position_embeddings`, at most 4096.
        async_scheduling: queue each step before the one in flight is read back, so the host's work
            overlaps the GPU's; None: on where the model runs on a GPU, off on the CPU.
        enable_prefix_caching: reuse the KV of prompt prefixes computed before by the same adapter
            (same weights) or the backbone.
    """

    # Seats and tokens per step: on bench_engine's trace, 512 seats take most of the throughput that
    # 1,024 gain over 256, for half the graphs to capture (benchmarks/results/engine/shapes_h100/).
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 4096
    num_kv_blocks: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    async_scheduling: bool | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is None and name in ("num_kv_blocks", "max_model_len"):
                continue
            if not int_in_range(value, 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")

    def replace(self, **changes) -> "EngineConfig":
        """A copy with `changes`; an unknown name raises TypeError naming it."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown engine settings {unknown}; EngineConfig has {sorted(known)}")
        return EngineConfig(**{**asdict(self), **changes})


# ---- command-line flags from configuration fields ---------------------------------------------------
def field_docs(cls) -> dict[str, str]:
    """Field name -> its description in the class docstring's `Attributes:` section (continuation
    lines joined)."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    docs: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        match = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if match:
            names, text = match.groups()
            for name in names.split(", "):
                docs[name] = text
            current = names.split(", ")
        elif line.startswith("        ") and current:
            for name in current:
                docs[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return docs


def _value_type(annotation):
    """(the scalar type of a field's annotation, whether None is allowed)."""
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    kinds = [h for h in hints if h is not type(None)]
    return (kinds[0] if len(kinds) == 1 else str), type(None) in hints


# Fields whose flag takes one of a few words: (the words, the field's value -> its word).
FLAG_CHOICES = {"compile": (COMPILE_MODES, lambda v: {True: "on", False: "off"}.get(v, v))}


def add_config_arguments(group, cls, names=None, help_override: dict | None = None,
                         defaults: dict | None = None) -> None:
    """Add a `--kebab-case` flag per field of dataclass `cls` (those of `names`, in their order):
    booleans as `--flag/--no-flag`, others typed by their annotation, defaults from the fields (or
    `defaults`), help from `field_docs` (or `help_override`)."""
    docs = {**field_docs(cls), **(help_override or {})}
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    for name in names or [f.name for f in fields(cls)]:
        spec = by_name[name]
        kind, _ = _value_type(hints[name])
        default = (defaults or {}).get(name, spec.default if spec.default is not MISSING else None)
        flag = "--" + name.replace("_", "-")
        help_text = docs.get(name, "").replace("%", "%%")
        if name in FLAG_CHOICES:
            choices, to_flag = FLAG_CHOICES[name]
            group.add_argument(flag, choices=choices, default=to_flag(default), help=help_text)
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, type=Path if kind is Path else kind, default=default, help=help_text)


def config_from_args(cls, args: argparse.Namespace, names=None, **extra):
    """`cls` built from the parsed flags of its fields (those of `names`), plus `extra`."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)
              if (names is None or f.name in names) and hasattr(args, f.name)}
    return cls(**values, **extra)
