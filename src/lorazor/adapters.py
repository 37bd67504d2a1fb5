"""AdapterBank: every LoRA adapter of a multi-adapter PeftModel as stacked slot tensors per module.

For each LoRA-wrapped linear module the bank holds PEFT's layouts stacked over slots:
    lora_a [L, r_max, K]   (lora_A.weight of each adapter, zero past its rank)
    lora_b [L, N, r_max]   (lora_B.weight)
    scaling [L]            (alpha / r, or alpha / sqrt(r) with rsLoRA: PEFT's own value)
    rank [L] int32         (0 where the adapter does not target this module: no delta there)
Slot s holds the s-th adapter in `names`; unused slots (max_loras > adapters) have rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

NO_ADAPTER = -1
# Adapter names become folder names (release policies are saved per adapter) and URL-ish model
# names in a server: letters, digits, '_', '-' and '.', not starting with '.', no path separators.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


class AdapterError(ValueError):
    """An adapter LoRazor cannot serve as asked; the message names the adapter and the reason."""


def check_adapter_name(name) -> str:
    """Return `name` if it is a valid adapter name, else raise AdapterError naming it."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise AdapterError(
            f"invalid adapter name {name!r}: use 1-128 letters, digits, '_', '-' or '.', not starting with '.' "
            "(no path separators: names are used as folder names)")
    return name


@dataclass
class ModuleLoRA:
    """Stacked LoRA weights of one target module over all slots.

    `host_rank` mirrors `rank` on the host, so the layers know without a sync whether the kernels
    must mask per-slot ranks (`mask_rank`).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: torch.Tensor
    rank: torch.Tensor
    host_rank: list[int]

    @property
    def mask_rank(self) -> bool:
        """True when some slot's rank is between 0 and the bank's r_max: the kernels then read each
        slot's rank and load only that many rows. Otherwise weights past a slot's rank are zero
        (rank-0 slots: all zero) and the kernels skip the rank load."""
        r_max = self.lora_a.shape[1]
        return any(0 < r < r_max for r in self.host_rank)

    def set_rank(self, slot: int, rank: int) -> None:
        self.rank[slot] = rank
        self.host_rank[slot] = rank


def _lora_layer_types():
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear

    return LoraLayer, LoraLinear


def find_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> PEFT LoraLayer, for every LoRA-wrapped module of `model`."""
    lora_layer, _ = _lora_layer_types()
    return {name: m for name, m in model.named_modules() if isinstance(m, lora_layer)}


def _check_adapter_config(name: str, cfg) -> None:
    peft_type = getattr(cfg, "peft_type", None)
    if str(getattr(peft_type, "value", peft_type)) != "LORA":
        raise AdapterError(f"adapter {name!r} is {peft_type}, only LoRA adapters are supported")
    if getattr(cfg, "use_dora", False):
        raise AdapterError(f"adapter {name!r} uses DoRA, which LoRazor does not support")
    if getattr(cfg, "modules_to_save", None):
        raise AdapterError(
            f"adapter {name!r} has modules_to_save={cfg.modules_to_save}: fully trained modules cannot be "
            "batched per row"
        )
    if getattr(cfg, "lora_bias", False):
        raise AdapterError(f"adapter {name!r} has lora_bias=True, which LoRazor does not support")


def _check_layer(module_name: str, layer: nn.Module, adapters: list[str]) -> None:
    _, lora_linear = _lora_layer_types()
    present = [a for a in adapters if a in layer.r]
    if not present:
        return
    if not isinstance(layer, lora_linear) or not isinstance(layer.get_base_layer(), nn.Linear):
        raise AdapterError(
            f"adapter {present[0]!r} targets {module_name} ({type(layer).__name__} over "
            f"{type(layer.get_base_layer()).__name__}): only nn.Linear targets are supported, not embeddings or conv"
        )
    if module_name.split(".")[-1] == "lm_head":
        raise AdapterError(f"adapter {present[0]!r} targets lm_head, which LoRazor does not support")
    if layer.merged_adapters:
        raise AdapterError(f"adapters {layer.merged_adapters} are merged into {module_name}: unmerge them first")
    if getattr(layer, "fan_in_fan_out", False):
        raise AdapterError(f"{module_name} uses fan_in_fan_out (Conv1D), which LoRazor does not support")
    variants = [a for a in present if a in getattr(layer, "lora_variant", {})]
    if variants:
        raise AdapterError(f"adapter {variants[0]!r} is a LoRA variant (DoRA/aLoRA/...) at {module_name}")


def _load_adapter_weights(name: str, folder) -> dict[str, torch.Tensor]:
    """PEFT's saved weights: `adapter_model.safetensors`, else an older `adapter_model.bin` read with
    `torch.load(weights_only=True)` (tensors only, never arbitrary pickled objects)."""
    from safetensors.torch import load_file

    safe, legacy = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safe.is_file():
            return load_file(str(safe))
        if legacy.is_file():
            tensors = torch.load(str(legacy), map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise AdapterError(f"adapter {name!r}: {legacy} does not hold a dict of tensors")
            return tensors
    except AdapterError:
        raise
    except Exception as err:  # safetensors / the weights-only unpickler raise their own error types
        bad = safe if safe.is_file() else legacy
        kind = "safetensors" if bad is safe else "weights-only torch"
        raise AdapterError(f"adapter {name!r}: {bad} is not a valid {kind} file ({err})") from err
    raise AdapterError(f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {folder}")


def _module_rank_alpha(cfg, module: str) -> tuple[int, float]:
    """The rank and alpha PEFT gives `module`: `rank_pattern` / `alpha_pattern` entries whose key
    matches the end of the module name, else the config's `r` / `lora_alpha`."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = cfg.rank_pattern or {}, cfg.alpha_pattern or {}
    rank = ranks.get(get_pattern_key(ranks.keys(), module), cfg.r)
    return rank, alphas.get(get_pattern_key(alphas.keys(), module), cfg.lora_alpha)


def _check_weight_shapes(name: str, module: str, pair: dict, rank: int, lora: "ModuleLoRA") -> None:
    """A and B of one module must both be there, of the config's rank and the module's sizes."""
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"adapter {name!r} has lora_{'A' if 'A' not in pair else 'B'} missing for {module}")
    a, b = pair["A"], pair["B"]
    in_features, out_features = lora.lora_a.shape[2], lora.lora_b.shape[1]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                           f"which disagree with the config's r={rank}")
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(
            f"adapter {name!r} was trained for another model: {module} expects lora_A [r, {in_features}] and "
            f"lora_B [{out_features}, r], the folder has {tuple(a.shape)} and {tuple(b.shape)}")


class AdapterBank:
    """All adapters of a PeftModel, stacked per target module, and the adapter name -> slot map.

    Args:
        names: adapter names, slot i holds `names[i]`.
        modules: module qualified name -> `ModuleLoRA`.
        num_slots: L, slots per module (>= len(names)).
    """

    def __init__(self, names: list[str], modules: dict[str, ModuleLoRA], num_slots: int):
        self.names = list(names)
        self.slot_of = {n: i for i, n in enumerate(self.names)}
        self.modules = modules
        self.num_slots = num_slots

    @classmethod
    def from_peft(
        cls, peft_model: nn.Module, max_loras: int | None = None, max_lora_rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> "AdapterBank":
        """Read and validate every LoRA adapter of `peft_model` (a `peft.PeftModel`).

        Raises:
            AdapterError: DoRA or other variants, non-Linear targets (embeddings, conv), lm_head,
                merged adapters, modules_to_save, lora_bias; more adapters than `max_loras`;
                a rank above `max_lora_rank`.
        """
        configs = getattr(peft_model, "peft_config", None)
        if not configs:
            raise AdapterError(f"expected a peft.PeftModel with LoRA adapters, got {type(peft_model).__name__}")
        names = list(configs)
        for name in names:
            check_adapter_name(name)
            _check_adapter_config(name, configs[name])
        if max_loras is not None and len(names) > max_loras:
            raise AdapterError(f"{len(names)} adapters ({names}) exceed max_loras={max_loras}")
        layers = find_lora_layers(peft_model)
        ranks = {}
        for module_name, layer in layers.items():
            _check_layer(module_name, layer, names)
            for a in names:
                if a in layer.lora_A:
                    ranks[a] = max(ranks.get(a, 0), layer.r[a])
        for a, r in ranks.items():
            if max_lora_rank is not None and r > max_lora_rank:
                raise AdapterError(f"adapter {a!r} has rank {r} > max_lora_rank={max_lora_rank}")
        r_max = max_lora_rank or max(ranks.values(), default=1)
        num_slots = max_loras or len(names)
        modules = {}
        for module_name, layer in layers.items():
            base = layer.get_base_layer()
            if not any(a in layer.lora_A for a in names):
                continue
            w_dtype = dtype or base.weight.dtype
            device = base.weight.device
            lora_a = torch.zeros(num_slots, r_max, base.in_features, dtype=w_dtype, device=device)
            # Stored [L, r, N] (N contiguous) and used through a [L, N, r] view: the expand kernel then
            # loads B along N in full vectors while masking only whole rank rows.
            lora_b = torch.zeros(num_slots, r_max, base.out_features, dtype=w_dtype, device=device).transpose(1, 2)
            scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
            rank = torch.zeros(num_slots, dtype=torch.int32, device=device)
            for slot, a in enumerate(names):
                if a not in layer.lora_A:
                    continue
                r = layer.r[a]
                lora_a[slot, :r] = layer.lora_A[a].weight.detach().to(w_dtype)
                lora_b[slot, :, :r] = layer.lora_B[a].weight.detach().to(w_dtype)
                scaling[slot] = float(layer.scaling[a])
                rank[slot] = r
            modules[module_name] = ModuleLoRA(lora_a, lora_b, scaling, rank, rank.tolist())
        return cls(names, modules, num_slots)

    def add(self, name: str, adapter_dir, dtype: torch.dtype | None = None) -> int:
        """Load a PEFT-saved adapter (`adapter_config.json` + `adapter_model.safetensors`, or an older
        `adapter_model.bin`) into a free slot. `rank_pattern` / `alpha_pattern` apply per module.

        The bank's tensors are written in place, so captured CUDA graphs stay valid. The adapter may
        only target modules the bank already holds (those some adapter targeted at `from_peft`).

        Returns:
            The slot.
        """
        from pathlib import Path

        from peft import LoraConfig

        check_adapter_name(name)
        if name in self.slot_of:
            raise AdapterError(f"adapter {name!r} is already loaded (slot {self.slot_of[name]})")
        free = [s for s in range(self.num_slots) if s >= len(self.names) or self.names[s] is None]
        if not free:
            raise AdapterError(f"no free slot for adapter {name!r}: all max_loras={self.num_slots} slots are in use")
        folder = Path(adapter_dir)
        if not (folder / "adapter_config.json").is_file():
            raise AdapterError(f"adapter {name!r}: {folder} has no adapter_config.json (not a PEFT adapter folder)")
        cfg = LoraConfig.from_pretrained(str(folder))
        _check_adapter_config(name, cfg)
        tensors = _load_adapter_weights(name, folder)
        weights: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            module, _, kind = key.rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise AdapterError(f"adapter {name!r} has an unexpected tensor {key!r}")
            if module not in self.modules:
                raise AdapterError(f"adapter {name!r} targets {module}, which no adapter loaded at from_peft targets")
            weights.setdefault(module, {})[kind[0]] = value
        r_max = next(iter(self.modules.values())).lora_a.shape[1]
        scales = {}
        for module, pair in weights.items():
            rank, alpha = _module_rank_alpha(cfg, module)
            if rank > r_max:
                raise AdapterError(f"adapter {name!r} has rank {rank} at {module} > the bank's rank {r_max}")
            _check_weight_shapes(name, module, pair, rank, self.modules[module])
            scales[module] = alpha / (rank**0.5 if cfg.use_rslora else rank)
        slot = free[0]
        for module, lora in self.modules.items():
            lora.set_rank(slot, 0)  # untargeted modules give no delta
            lora.scaling[slot] = 0.0
            lora.lora_a[slot].zero_()
            lora.lora_b[slot].zero_()
            if module in weights:
                a, b = weights[module]["A"], weights[module]["B"]
                lora.lora_a[slot, : a.shape[0]] = a.to(lora.lora_a.dtype)
                lora.lora_b[slot, :, : b.shape[1]] = b.to(lora.lora_b.dtype)
                lora.scaling[slot] = scales[module]
                lora.set_rank(slot, a.shape[0])
        while len(self.names) <= slot:
            self.names.append(None)
        self.names[slot] = name
        self.slot_of[name] = slot
        return slot

    def remove(self, name: str) -> None:
        """Free an adapter's slot (its rows then raise KeyError in `slots_for`)."""
        if name not in self.slot_of:
            raise KeyError(f"unknown adapter {name!r}; loaded adapters: {[n for n in self.names if n]}")
        slot = self.slot_of.pop(name)
        self.names[slot] = None
        for lora in self.modules.values():
            lora.set_rank(slot, 0)
            # Zero the weights too: unmasked kernels (uniform ranks) rely on zeros past each rank.
            lora.lora_a[slot].zero_()
            lora.lora_b[slot].zero_()

    def slots_for(self, adapter_ids, device: torch.device | None = None) -> torch.Tensor:
        """Adapter names (None: backbone) -> `[B]` int32 slot tensor; unknown names raise KeyError."""
        slots = []
        for i, a in enumerate(adapter_ids):
            if a is None:
                slots.append(NO_ADAPTER)
            elif a in self.slot_of:
                slots.append(self.slot_of[a])
            else:
                raise KeyError(f"unknown adapter {a!r} at row {i}; loaded adapters: {[n for n in self.names if n]}")
        return torch.tensor(slots, dtype=torch.int32, device=device)
