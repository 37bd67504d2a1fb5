"""LoRazorModel: many LoRA adapters on one Hugging Face backbone, mixed in one batch.

    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(grid="exact"))
    out = model.generate(input_ids, attention_mask=mask, adapter_ids=["math", None, "sql"], max_new_tokens=64)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import (GenerationConfig, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase,
                          StoppingCriteriaList)
from transformers.generation.streamers import BaseStreamer

from ..adapters import AdapterBank, AdapterRegistry, AdapterStatus, find_lora_layers
from ..config import RELEASE_MODES, LoRazorConfig
from ..lora.context import StepContext
from ..lora.experts import find_experts, patch_experts
from ..lora.layers import patch_layers, unpatch_layers
from ..lora.merged import merge_projections
from ..policies.base import ReleasePolicy, check_policy
from ..quant import quantize_decoder, quantize_experts
from ..runner import ModelRunner
from ..runner.attention import ATTENTION_NAME, register_attention
from ..runner.decode_graphs import DecodeGraphs
from ..runner.graphs import cache_bucket
from .build import FP8_MOE_CHECKPOINT, build_from_peft, build_from_pretrained
from .generate import LoRazorOutput, decode_loop
from .guard import ModelGuard
from .hf_generation import GenerationPlan, plan_generation, resolve_config
from .inputs import check_batch, encode_prompts, expand_rows


# Models up to this hidden size run their CPU steps on one torch thread (their matmuls are too small
# to gain from more, and lose many times over when another process keeps a core busy).
SMALL_CPU_HIDDEN = 1024


def structured_processor(specs, input_ids, tokenizer, vocab_size: int, copies: int):
    """The logits processor constraining `generate()`'s rows: one spec for every row, or one per
    input row (repeated for each of its `num_return_sequences` copies)."""
    from ..runner.grammar import StructuredLogitsProcessor, grammar_cache

    rows = input_ids.shape[0] // copies
    if isinstance(specs, (list, tuple)):
        if len(specs) != rows:
            raise ValueError(f"structured_output has {len(specs)} specs for {rows} rows")
    else:
        specs = [specs] * rows
    cache = grammar_cache(tokenizer, vocab_size)
    constraints = [None if spec is None else cache.constraint(spec) for spec in specs for _ in range(copies)]
    return StructuredLogitsProcessor(constraints, input_ids.shape[1])


class LoRazorModel(nn.Module):
    """A causal LM whose LoRA layers serve a different adapter per row. Build with `from_peft`.

    Attributes:
        model: the Hugging Face causal LM, its LoRA target layers replaced by `BatchedLoRALinear`.
        bank: the `AdapterBank` (the GPU slots: stacked weights, which adapter holds each slot).
        registry: the `AdapterRegistry` (every registered adapter; slots as an LRU cache over them).
        config: the `LoRazorConfig`.
    """

    def __init__(self, model: nn.Module, bank: AdapterBank, config: LoRazorConfig, peft_model: nn.Module | None = None,
                 fp8_weights: dict | None = None):
        super().__init__()
        self.peft_model = peft_model
        self.model = model
        self.bank = bank
        self.registry = AdapterRegistry(bank, config.max_cpu_loras)
        self.registry.base_model = getattr(model, "name_or_path", None) or None
        # One torch thread while a small model computes on the CPU (`ModelGuard.threads`).
        small = getattr(model.config, "hidden_size", 0) <= SMALL_CPU_HIDDEN
        self.guard = ModelGuard(threads=1 if self.device.type == "cpu" and small else None)
        backend = config.backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "reference"
        if backend == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs a CUDA device, but the model is on {self.device}: use "
                             "backend='reference' (or 'auto'), or set TRITON_INTERPRET=1 before importing triton")
        config = config.resolve_compile(self.device, backend)
        self.context = StepContext(bank.num_slots, config.grid, backend, config.block_m)
        if config.quantization == "fp8" and fp8_weights is not None and find_experts(model.get_decoder()):
            raise NotImplementedError(FP8_MOE_CHECKPOINT)  # before any module is replaced
        self._replaced = patch_layers(model, bank, self.context, find_lora_layers(model))
        self._replaced += patch_experts(model, bank, self.context)  # MoE experts (`lora/experts.py`)
        if config.quantization == "fp8":  # before merging: the merged GEMMs concatenate fp8 weights
            quantize_decoder(self.model.get_decoder(), fp8_weights)  # an fp8 checkpoint's own, where given
            quantize_experts(self.model.get_decoder())
        self.merged_groups = merge_projections(self.model, self.context, bank) if config.merge_projections else []
        self._previous_attn = self.model.config._attn_implementation
        register_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        # The default StepTrim policy (LoRazorConfig.release != "none"), see `load_release_policy`.
        self.release_policy: ReleasePolicy | None = None
        head_dim = getattr(self.model.config, "head_dim", None) or (
            self.model.config.hidden_size // self.model.config.num_attention_heads)
        attention = config.attention
        if attention == "auto":
            attention = (
                "triton" if self.device.type == "cuda" and head_dim >= 16 and not head_dim & (head_dim - 1) else "sdpa"
            )
        # Every forward of `generate()`, `forward()` and the engine runs through this runner.
        self.runner = ModelRunner(self.model, self.context, config, attention)

    @property
    def config(self) -> LoRazorConfig:
        """The `LoRazorConfig`, held once, by the runner that runs by it."""
        return self.runner.config

    @config.setter
    def config(self, value: LoRazorConfig) -> None:
        self.runner.config = value

    @classmethod
    def from_peft(cls, peft_model: nn.Module, config: LoRazorConfig | None = None) -> "LoRazorModel":
        """Build from a multi-adapter `peft.PeftModel` (its LoRA layers are replaced in place).

        Adapters may differ in rank, alpha, rsLoRA and target modules. The PEFT model's layers are
        restored by `unpatch()`.

        Raises:
            AdapterError: an adapter LoRazor cannot serve (DoRA, embedding/conv targets, merged,
                modules_to_save, rank above `max_lora_rank`, more than `max_loras` adapters).
            NotImplementedError: an unsupported architecture.
        """
        model = build_from_peft(cls, peft_model, config)
        if model.config.capture_batch_sizes:
            model.capture(model.config.capture_batch_sizes)
        return model

    @classmethod
    def from_pretrained(cls, base: str | os.PathLike | PreTrainedModel, adapters: dict | None = None,
                        config: LoRazorConfig | None = None, **load_kwargs) -> "LoRazorModel":
        """Build from a base model and PEFT adapter folders, without PEFT.

        Args:
            base: a model id or path (loaded with `AutoModelForCausalLM.from_pretrained`, in
                `config.dtype` when set, with `load_kwargs`) or a loaded `PreTrainedModel`.
            adapters: adapter name -> folder or Hugging Face Hub repo id (fetched into the Hub cache;
                `HF_HUB_OFFLINE=1` reads the cache only) (`adapter_config.json` + `adapter_model.safetensors`
                or `.bin`). Registered in order; as many as there are slots are loaded now.
            config: the `LoRazorConfig`; `max_loras`, `max_lora_rank`, `max_cpu_loras` and
                `lora_target_modules` size the bank (see there).
        """
        model = build_from_pretrained(cls, base, adapters, config, **load_kwargs)
        if model.config.capture_batch_sizes:
            model.capture(model.config.capture_batch_sizes)
        return model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def adapter_names(self) -> list[str]:
        """Every registered adapter, in registration order (the registry's snapshot: safe to read
        from another thread while the engine's thread changes the registry)."""
        return list(self.registry.snapshot)

    @property
    def adapters(self) -> dict[str, AdapterStatus]:
        """Registered adapter name -> `AdapterStatus` (on disk / in host memory / in a GPU slot, rank, targets)."""
        return self.registry.statuses()

    def register_adapter(self, name: str, path, allow_hub: bool = True, replace: bool = False,
                         source=None) -> AdapterStatus:
        """Register a PEFT adapter folder under `name`: its config and weights' header are checked
        against the bank now, its weights are loaded into a GPU slot when a batch first uses it.
        A Hugging Face Hub repo id (`owner/name`, not a local path) is fetched into the Hub cache
        unless `allow_hub=False` (`HF_HUB_OFFLINE=1` uses the cache only). `replace`: in place of
        an adapter of that name, once the new folder passed every check (refused while requests use
        the old one). `source`: the folder as `registry.read` already read it (on another thread)."""
        with self.guard.hold(f"register adapter {name!r}"):
            return self.registry.register(name, path, source=source, allow_hub=allow_hub, replace=replace)

    def unregister_adapter(self, name: str) -> None:
        """Forget an adapter and free its slot; later batches naming it raise KeyError."""
        with self.guard.hold(f"unregister adapter {name!r}"):
            self.registry.unregister(name)

    def add_adapter(self, adapter_dir, name: str | None = None) -> int:
        """Register a PEFT adapter folder and load it into a GPU slot now (evicting the least recently
        used adapter when every slot is taken; no recapture needed). Returns the slot."""
        from pathlib import Path

        name = Path(adapter_dir).name if name is None else name
        with self.guard.hold(f"add adapter {name!r}"):
            self.registry.register(name, adapter_dir)
            self.registry.make_resident([name])
            return self.bank.slot_of[name]

    def remove_adapter(self, name: str) -> None:
        """Same as `unregister_adapter`."""
        self.unregister_adapter(name)

    def reconfigure(self, grid: str | None = None, compile: bool | str | None = None) -> None:
        """Switch the grid mode and/or torch.compile of the decode step (drops captured graphs)."""
        changes = {k: v for k, v in (("grid", grid), ("compile", compile)) if v is not None}
        with self.guard.hold("reconfigure"):
            config = dataclasses.replace(self.config, **changes)
            self.config = config.resolve_compile(self.device, self.context.backend)
            self.context.grid = self.config.grid
            self.runner.reset_compiled()

    def load_release_policy(self, root) -> ReleasePolicy:
        """Load the policies saved beside the adapters under `root/<adapter>/` as the default policy."""
        from ..policies import load_release_policy

        policy = load_release_policy(root)
        if self.config.release not in ("none", policy.kind):
            raise ValueError(f"config.release={self.config.release!r} but {root} holds {policy.kind!r} policies")
        with self.guard.hold("load a release policy"):
            self.release_policy = policy
        return policy

    def set_release_policy(self, policy: ReleasePolicy | None) -> None:
        """Make `policy` (a `ProfiledRelease`, a `LearnedRelease` or your own `ReleasePolicy`) the
        default of `generate()` and of every engine request without its own; None: no default.
        Sets `config.release` to the policy's kind ("custom" for your own class)."""
        if policy is not None:
            check_policy(policy, self.model.config.hidden_size, self.adapter_names)
        with self.guard.hold("set the release policy"):
            kind = "none" if policy is None else getattr(policy, "kind", "custom")
            self.config = dataclasses.replace(self.config, release=kind if kind in RELEASE_MODES else "custom")
            self.release_policy = policy

    def set_grid(self, grid: str) -> None:
        """Switch the LoRA kernels' grid mode (drops captured graphs, keeps the KV caches)."""
        self.reconfigure(grid=grid)

    def unpatch(self) -> nn.Module:
        """Put the replaced layers (PEFT's, or plain linears) and attention back; returns the PeftModel
        (or the base model). This object is then unusable."""
        if self.config.quantization is not None:
            raise RuntimeError(f"a model quantized to {self.config.quantization} cannot be unpatched: its "
                               "full-precision base weights were freed")
        with self.guard.hold("unpatch"):
            unpatch_layers(self.model, self._replaced)
            self.runner.remove_compiled_layers()
            self.model.set_attn_implementation(self._previous_attn)
            self._replaced = []
            self.guard.closed = True
        return self.peft_model if self.peft_model is not None else self.model

    # ---- forwards: all through `self.runner` ------------------------------------------------------
    @property
    def graphs(self) -> DecodeGraphs | None:
        """`generate()`'s captured decode graphs (None until the first graph-backed call)."""
        return self.runner.graphs

    @property
    def uses_graphs(self) -> bool:
        """Whether `generate()` replays CUDA graphs (GPU, `cuda_graphs=True`, Triton backend)."""
        return self.runner.uses_graphs

    def capture(self, batch_sizes, policy: ReleasePolicy | None = None) -> int:
        """Capture the decode graphs of these batch sizes now (LoRA and backbone-only, with `policy`'s
        class or none deciding release), at the cache length `max_cache_len`. With the `exact` grid
        there is one LoRA graph per class of distinct adapters in a batch (16, 32, ... up to
        `max_loras`), so a batch of few adapters launches a grid sized for few.

        Does nothing without CUDA graphs (CPU, or `cuda_graphs=False`). Returns the graphs captured.
        """
        with self.guard.hold("capture graphs"):
            return self.runner.capture(batch_sizes, policy if policy is not None else self.release_policy, self.bank)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, adapter_ids=None):
        """Logits `[B, T, V]` of one full forward with per-row adapters (left or no padding).

        Matches PEFT's `model(input_ids, attention_mask, adapter_names=...)` on the real tokens.
        """
        with self.guard.hold("run a forward"):
            return self._forward(input_ids, attention_mask, adapter_ids)

    def _forward(self, input_ids, attention_mask, adapter_ids):
        attention_mask, adapter_ids = check_batch(self, input_ids, attention_mask, adapter_ids)
        row_slot = self._row_slot(input_ids, adapter_ids)
        self.context.begin_batch(row_slot)
        cache = self.runner.new_cache(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        hidden = self.runner.prefill_hidden(input_ids, attention_mask, cache, row_slot)
        with torch.inference_mode():
            return self.runner.logits(hidden)

    # ---- generation ------------------------------------------------------------------------------
    def _row_slot(self, input_ids, adapter_ids) -> torch.Tensor:
        """Per-row slots, after loading the batch's adapters that are not in a slot."""
        return self.registry.slots_for(adapter_ids, device=input_ids.device)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        adapter_ids: Sequence[str | None] | None = None,
        generation_config: GenerationConfig | None = None,
        release_policy: ReleasePolicy | None = None,
        release: Sequence[int | str | None] | None = None,
        generator: torch.Generator | None = None,
        logits_processor: LogitsProcessorList | list | None = None,
        stopping_criteria: StoppingCriteriaList | list | None = None,
        streamer: BaseStreamer | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        prefix_allowed_tokens_fn: Callable | None = None,
        structured_output: dict | list | None = None,
        **kwargs,
    ) -> LoRazorOutput:
        """Generate for a mixed-adapter batch, one forward per step for the whole batch.

        Everything that picks the next token follows `transformers`' `generate`: the settings are
        resolved with HF's precedence and defaults, and the logits processors and stopping criteria
        are built by HF's own builders, in HF's order. Greedy search and sampling are supported;
        beam search, contrastive search, assisted decoding and classifier-free guidance are refused.

        Args:
            input_ids: `[B, T]` left-padded prompts.
            attention_mask: `[B, T]` (1 = token, 0 = left padding); None means no padding.
            adapter_ids: `B` adapter names, None for a backbone-only row; None: every row backbone.
            generation_config: a `transformers.GenerationConfig`; kwargs override its fields
                (`max_new_tokens`, `do_sample`, `temperature`, `top_k`, `top_p`, `min_p`,
                `repetition_penalty`, `no_repeat_ngram_size`, `bad_words_ids`, `stop_strings`,
                `num_return_sequences`, `output_scores`, ...).
            release_policy: a StepTrim policy (`ProfiledRelease`, `LearnedRelease`); None uses the
                model's default (`load_release_policy`, when `config.release` is not "none"), else
                every adapter is kept to the end.
            release: per-row overrides: None (policy), "never", or a fixed release length k.
            generator: a seeded `torch.Generator` for sampling.
            logits_processor: extra HF logits processors, merged with HF's.
            stopping_criteria: extra HF stopping criteria, merged with HF's.
            streamer: an HF streamer (`put` with each step's tokens, `end` at the end).
            tokenizer: needed for `stop_strings`.
            prefix_allowed_tokens_fn: as in HF.
            structured_output: a constraint on the output (a dict with one of `json`, `json_object`,
                `regex`, `choice`, `grammar`, or a `StructuredOutput`; `lorazor.runner.grammar`), for
                every row, or a list with one per row (None: unconstrained); needs `tokenizer`.
                Rows stop at EOS once their grammar is complete.

        Returns:
            `LoRazorOutput` (a `ModelOutput`): `sequences [B * num_return_sequences, T + n]`, per-row
            `release_steps`, and `scores` / `logits` when asked for.
        """
        with self.guard.hold("generate"):
            config, flags = resolve_config(self.model, generation_config, kwargs)
            attention_mask, adapter_ids = check_batch(self, input_ids, attention_mask, adapter_ids)
            if (config.num_return_sequences or 1) > 1:
                input_ids, attention_mask, adapter_ids, release = expand_rows(
                    config.num_return_sequences, self.config.max_batch_size, input_ids, attention_mask, adapter_ids,
                    release)
            if structured_output is not None:
                logits_processor = [*(logits_processor or []), structured_processor(
                    structured_output, input_ids, tokenizer, self.runner.vocab_size, config.num_return_sequences or 1)]
            plan = plan_generation(self.model, config, flags, input_ids, attention_mask, logits_processor,
                                   stopping_criteria, tokenizer, prefix_allowed_tokens_fn)
            return self._generate(input_ids, attention_mask, adapter_ids, plan, release_policy, release, generator,
                                  streamer)

    def generate_text(self, prompts: Sequence[str], adapter_ids: Sequence[str | None] | None = None, *, tokenizer,
                      **kwargs) -> list[str]:
        """Generate for text prompts: left-pads them with `tokenizer` and returns each row's new text
        (special tokens skipped). Keyword arguments are `generate`'s."""
        input_ids, attention_mask = encode_prompts(tokenizer, prompts, self.device)
        kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
        kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
        out = self.generate(input_ids, attention_mask=attention_mask, adapter_ids=adapter_ids, tokenizer=tokenizer,
                            **kwargs)
        return tokenizer.batch_decode(out.sequences[:, input_ids.shape[1]:], skip_special_tokens=True)

    def _generate(self, input_ids, attention_mask, adapter_ids, plan: GenerationPlan, release_policy, release,
                  generator, streamer) -> LoRazorOutput:
        row_slot = self._row_slot(input_ids, adapter_ids)
        if release_policy is None and self.config.release != "none":
            if self.release_policy is None:
                raise ValueError(f"config.release={self.config.release!r} but no policy is loaded: "
                                 "call model.load_release_policy(path) or pass release_policy=")
            release_policy = self.release_policy
        if release_policy is not None:
            check_policy(release_policy, self.model.config.hidden_size, self.adapter_names)
        B, T = input_ids.shape
        max_new = plan.max_new_tokens
        limit = self.config.max_cache_len
        self.runner.check_length(T, max_new, limit, "max_cache_len")
        if max_new == 0:
            empty = torch.zeros(B, dtype=torch.long, device=input_ids.device)
            return LoRazorOutput(sequences=input_ids.clone(), release_steps=empty - 1, decode_steps=empty,
                                 lora_decode_steps=empty)
        cache_len = T + max_new
        if self.uses_graphs:
            # Pad the batch to its graph bucket with backbone rows of one token; sliced off below.
            bucket = self.runner.graph_batch(B)
            # One shared length when the config fixes it (one cache and graph set per bucket).
            cache_len = limit if limit is not None else cache_bucket(cache_len)
            if bucket > B:
                extra = bucket - B
                input_ids = torch.cat([input_ids, input_ids.new_zeros(extra, T)])
                attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(extra, T)])
                attention_mask[B:, -1] = 1
                row_slot = torch.cat([row_slot, row_slot.new_full((extra,), -1)])
                if release is not None:
                    release = list(release) + [None] * extra
        out = decode_loop(self, input_ids, attention_mask, row_slot, plan, release_policy, release, generator,
                          streamer, cache_len=cache_len, real_rows=B)
        return out.rows(B) if out.sequences.shape[0] != B else out
