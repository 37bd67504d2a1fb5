"""Tiny random models of every supported family with several LoRA adapters, built from configs.

Used by `lorazor demo`, the tests and the docs: nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
# Phi-3 fuses q/k/v and gate/up into one linear each: adapters target the fused modules.
PHI3_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter of a tiny model."""

    name: str
    r: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False


DEFAULT_ADAPTERS = (
    AdapterSpec("math", 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    AdapterSpec("sql", 4, 8, ("q_proj", "v_proj")),
    AdapterSpec("med", 16, 8, ("q_proj", "o_proj", "down_proj"), rslora=True),
)


def tiny_config(arch: str = "llama", vocab_size: int = 96, tie_embeddings: bool = False, num_layers: int = 2):
    """A model config of the given architecture with `num_layers` decoder layers and GQA (4 heads, 2 KV
    heads). Gemma 2's softcaps are set low (attention 2.0, final logits 1.5) so that they change a
    tiny model's outputs."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16, use_sliding_window=False)
    if arch == "gemma":
        return GemmaConfig(**common, head_dim=16)
    if arch == "gemma2":
        return Gemma2Config(**common, head_dim=16, sliding_window=512, query_pre_attn_scalar=16,
                            attn_logit_softcapping=2.0, final_logit_softcapping=1.5)
    if arch == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=512, query_pre_attn_scalar=16)
    if arch == "phi3":
        return Phi3Config(**common)
    raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")


def tiny_peft_model(
    arch: str = "llama",
    adapters: tuple[AdapterSpec, ...] = DEFAULT_ADAPTERS,
    seed: int = 0,
    tie_embeddings: bool = False,
    dtype=None,
    num_layers: int = 2,
    vocab_size: int = 96,
):
    """A random tiny causal LM (`num_layers` decoder layers, `dtype`: default float32, `vocab_size`
    tokens: a real tokenizer's length to pair it with one) wrapped in a PeftModel holding `adapters`
    (non-zero LoRA B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype
    torch.manual_seed(seed)
    # Gemma 2's softcapping is in HF's eager attention only (SDPA has none): the PEFT reference uses it.
    extra = dict(attn_implementation="eager") if arch == "gemma2" else {}
    config = tiny_config(arch, vocab_size=vocab_size, tie_embeddings=tie_embeddings, num_layers=num_layers)
    base = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    base.eval()
    peft_model = None
    for spec in adapters:
        targets = sorted({PHI3_TARGETS.get(t, t) for t in spec.targets}) if arch == "phi3" else list(spec.targets)
        cfg = LoraConfig(
            r=spec.r, lora_alpha=spec.alpha, target_modules=targets, use_rslora=spec.rslora,
            init_lora_weights=False, lora_dropout=0.0,
        )
        if peft_model is None:
            from .model.build import quiet_peft

            with quiet_peft():
                peft_model = get_peft_model(base, cfg, adapter_name=spec.name)
        else:
            peft_model.add_adapter(spec.name, cfg)
    peft_model.eval()
    return peft_model
