"""Building a LoRazorModel: from a multi-adapter `peft.PeftModel`, or from a base model and adapter folders.

Both paths end the same way: the target linear layers are found, an empty `AdapterBank` of
`max_loras` slots is made over them, the layers are patched, and the adapters enter the registry
(PEFT's straight into slots, folders registered and loaded while slots are free).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path

import torch
from torch import nn

from ..adapters import AdapterBank, AdapterError, check_adapter_name, check_lora_config, check_lora_layer
from ..adapters import find_expert_wrappers, find_lora_layers, peft_adapter_weights, read_adapter
from ..config import LoRazorConfig
from ..quant.checkpoint import checkpoint_files, checkpoint_quantization, read_fp8_projections, without_quantization


@contextlib.contextmanager
def quiet_peft():
    """Building a PeftModel with peft 0.21 under transformers >= 5.24 warns that
    `is_gradient_checkpointing` is deprecated (PEFT reads it, not LoRazor or its user): a warning on
    every run that nobody here can act on. Silence that one warning while PEFT builds."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def unexpected_scales_quiet(quiet: bool):
    """Loaded without its quantizer, an fp8 checkpoint's `weight_scale_inv` tensors are "unexpected"
    to transformers, which prints a load report of them: LoRazor reads them itself."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


# Hugging Face `model_type`s whose decoders run through LoRazor's runner (tested against PEFT).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                           "qwen3_moe", "mixtral", "olmoe")
# Of them, the mixtures of experts (LoRA on attention and on the experts, `lora/experts.py`).
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe")
FP8_MOE_CHECKPOINT = ("fp8 checkpoints of mixtures of experts are not supported: load the bf16 checkpoint with "
                      "quantization='fp8' (its experts are quantized at build)")
# Slot rank when nothing given at build time says otherwise (vLLM's default max_lora_rank).
DEFAULT_MAX_LORA_RANK = 16


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters to `dtype` and keep every buffer as it is, as transformers'
    `from_pretrained(dtype=...)` loads a model: RoPE's float32 `inv_freq` stays float32 (cast to
    bf16 it roughly doubles the logits' error against a float32 reference)."""
    buffers = {name: buf for name, buf in model.named_buffers()}
    model.to(dtype)
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = buf


def check_config(config) -> LoRazorConfig:
    config = config or LoRazorConfig()
    if not isinstance(config, LoRazorConfig):
        raise TypeError(f"config must be a LoRazorConfig, got {type(config).__name__}")
    return config


def check_model_type(model_type) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(f"model_type {model_type!r} is not supported; supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)} (mixtures of experts: "
                                  f"{', '.join(MOE_ARCHITECTURES)})")


def check_architecture(hf_model: nn.Module) -> None:
    check_model_type(getattr(getattr(hf_model, "config", None), "model_type", None))


def check_before_loading(base, config: LoRazorConfig, load_kwargs: dict):
    """Refuse a model id or folder from its config.json alone, before any weight is read: an
    unsupported `model_type` or checkpoint quantization, or no decoder linear layer matching
    `lora_target_modules` (checked on the model's structure built with accelerate's empty weights).
    A local-looking path that does not exist is refused as such (not as a malformed Hub id).
    Returns (the model config, the checkpoint's fp8 `quantization_config` or None)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    text = str(base)
    if not Path(text).exists() and (text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text):
        raise FileNotFoundError(f"no model folder at {text!r}")
    keys = ("revision", "trust_remote_code", "token", "cache_dir", "local_files_only")
    hf_config = AutoConfig.from_pretrained(base, **{k: v for k, v in load_kwargs.items() if k in keys})
    check_model_type(getattr(hf_config, "model_type", None))
    scheme = checkpoint_quantization(hf_config)
    if scheme is not None and hf_config.model_type in MOE_ARCHITECTURES:
        raise NotImplementedError(FP8_MOE_CHECKPOINT)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(without_quantization(hf_config))
    if not linear_targets(skeleton, config.lora_target_modules):
        raise ValueError(f"no linear layer of the decoder matches lora_target_modules={config.lora_target_modules}")
    return hf_config, scheme


def decoder_prefix(hf_model: nn.Module) -> str:
    """The decoder's module name in `hf_model` (`model` for most causal LMs)."""
    decoder = hf_model.get_decoder()
    return next(name for name, m in hf_model.named_modules() if m is decoder)


def linear_targets(hf_model: nn.Module, patterns) -> dict[str, nn.Linear]:
    """The decoder's linear layers (PEFT-wrapped or plain) whose name is or ends with one of
    `patterns`; every one of them when `patterns` is None. Module name -> base nn.Linear."""
    prefix = decoder_prefix(hf_model)
    found = {}
    for name, module in hf_model.named_modules():
        # A PEFT wrapper is taken under its own name; the linear inside it is its `.base_layer`.
        if not name.startswith(f"{prefix}.") or name.endswith(".base_layer"):
            continue
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if isinstance(base, nn.Linear) and (patterns is None or any(name == p or name.endswith(f".{p}")
                                                                     for p in patterns)):
            found[name] = base
    return found


def expert_targets(hf_model: nn.Module, patterns, wanted: bool = False) -> dict[str, nn.Module]:
    """The MoE experts modules whose experts get adapter slots: all of them when `wanted` (an
    adapter targets experts), when `patterns` is None (every target) or names `experts`."""
    from ..lora.experts import find_experts

    if not (wanted or patterns is None or any("experts" in p for p in patterns)):
        return {}
    return find_experts(hf_model.get_decoder())


def _under_decoder(hf_model: nn.Module, found: dict) -> dict:
    prefix = decoder_prefix(hf_model)
    return {f"{prefix}.{name}": module for name, module in found.items()}


def build_from_peft(cls, peft_model: nn.Module, config: LoRazorConfig | None):
    config = check_config(config)
    if not hasattr(peft_model, "peft_config") or not hasattr(peft_model, "get_base_model"):
        raise TypeError(
            f"from_peft needs a peft.PeftModel holding LoRA adapters, got {type(peft_model).__name__} (a "
            "merge_and_unload()ed model has its adapters merged away: pass the PeftModel itself)")
    from ..lora.layers import BatchedLoRALinear

    if any(isinstance(m, BatchedLoRALinear) for m in peft_model.modules()):
        raise RuntimeError("this PeftModel is already patched by another LoRazorModel: call its unpatch() "
                           "first (both models would share and break the same layers)")
    names = list(peft_model.peft_config)
    if not names:
        raise AdapterError("the PeftModel holds no adapters")
    for name in names:
        check_adapter_name(name)
        check_lora_config(name, peft_model.peft_config[name])
    hf_model = peft_model.get_base_model()
    layers = find_lora_layers(hf_model)
    for module, layer in layers.items():
        check_lora_layer(module, layer, names)
    check_architecture(hf_model)
    wrappers = find_expert_wrappers(hf_model)
    layers.update(wrappers)
    ranks = {a: max((layer.r[a] for layer in layers.values() if a in layer.lora_A), default=0) for a in names}
    for a, r in ranks.items():
        if config.max_lora_rank is not None and r > config.max_lora_rank:
            raise AdapterError(f"adapter {a!r} has rank {r} > max_lora_rank={config.max_lora_rank}")
    if config.torch_dtype is not None:
        cast_parameters(peft_model, config.torch_dtype)
    peft_model.eval()
    targets = {m: layer.get_base_layer() for m, layer in layers.items() if any(a in layer.lora_A for a in names)}
    if config.lora_target_modules is not None:
        targets.update(linear_targets(hf_model, config.lora_target_modules))
    targets = {m: base for m, base in targets.items() if m not in wrappers}
    experts = _under_decoder(hf_model, expert_targets(hf_model, config.lora_target_modules, bool(wrappers)))
    bank = AdapterBank.empty(targets, config.max_loras or len(names), config.max_lora_rank or max(ranks.values()),
                             config.torch_dtype, experts=experts)
    model = cls(hf_model, bank, config, peft_model=peft_model)
    for name in names:
        model.registry.add_loaded(name, peft_adapter_weights(layers, name))
    return model


def build_from_pretrained(cls, base, adapters: dict | None, config: LoRazorConfig | None, **load_kwargs):
    config = check_config(config)
    adapters = dict(adapters or {})
    fp8_weights = None
    if isinstance(base, (str, Path)):
        from transformers import AutoModelForCausalLM

        hf_config, scheme = check_before_loading(base, config, load_kwargs)
        if scheme is not None:  # an fp8 checkpoint: loaded without transformers' quantizer, kept in fp8
            config = dataclasses.replace(config, quantization="fp8")
            load_kwargs["config"] = without_quantization(hf_config)
            load_kwargs.setdefault("dtype", config.torch_dtype or torch.bfloat16)
        if config.torch_dtype is not None:
            load_kwargs.setdefault("dtype", config.torch_dtype)
        with unexpected_scales_quiet(scheme is not None):
            hf_model = AutoModelForCausalLM.from_pretrained(base, **load_kwargs)
        if scheme is not None:
            fp8_weights = read_fp8_projections(checkpoint_files(base, load_kwargs), hf_model,
                                               scheme["weight_block_size"])
    else:
        if hasattr(base, "peft_config"):
            raise TypeError("from_pretrained takes a base model; for a peft.PeftModel use LoRazorModel.from_peft")
        if not hasattr(base, "get_decoder"):
            raise TypeError(
                f"base must be a model id/path or a transformers PreTrainedModel, got {type(base).__name__}"
            )
        hf_model = base
        if config.torch_dtype is not None:
            cast_parameters(hf_model, config.torch_dtype)
    check_architecture(hf_model)
    hf_model.eval()
    sources = {name: read_adapter(name, path, allow_hub=True) for name, path in adapters.items()}
    max_rank = config.max_lora_rank or max((s.max_rank for s in sources.values()), default=DEFAULT_MAX_LORA_RANK)
    targets = linear_targets(hf_model, config.lora_target_modules)
    if not targets:
        raise ValueError(f"no linear layer of the decoder matches lora_target_modules={config.lora_target_modules}")
    # Expert LoRA (`lora/experts.py`): PEFT's fused tensors are split per expert once the model's
    # experts are known, so those folders are read again at registration.
    fused = {name for name, s in sources.items() if s.config.get("target_parameters")}
    wanted = bool(fused) or any(".experts." in module for s in sources.values() for module in s.shapes or {})
    experts = _under_decoder(hf_model, expert_targets(hf_model, config.lora_target_modules, wanted))
    bank = AdapterBank.empty(targets, config.max_loras or max(1, len(adapters)), max_rank, config.torch_dtype,
                             experts=experts)
    model = cls(hf_model, bank, config, fp8_weights=fp8_weights)
    for name, source in sources.items():
        model.registry.register(name, source.path, source=None if name in fused else source)
    model.registry.make_resident(list(adapters)[: bank.num_slots])
    return model
