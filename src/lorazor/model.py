"""LoRazorModel: many LoRA adapters on one Hugging Face backbone, mixed in one batch.

    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(grid="exact"))
    out = model.generate(input_ids, attention_mask=mask, adapter_ids=["math", None, "sql"], max_new_tokens=64)
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .adapters import AdapterBank, AdapterRegistry, AdapterStatus
from .attention import ATTENTION_NAME, register_attention
from .config import LoRazorConfig
from .generate import LoRazorOutput, decode_loop
from .hf_generation import GenerationPlan, plan_generation, resolve_config
from .inputs import check_batch, encode_prompts, expand_rows
from .graphs import DecodeGraphs, batch_bucket, cache_bucket
from .guard import ModelGuard
from .kv_cache import KVCache
from .build import build_from_peft, build_from_pretrained
from .layers import patch_layers, unpatch_layers
from .merged import merge_projections
from .policies.base import ReleasePolicy, ReleaseState, check_policy, release_step
from .step import StepContext

# Compiled decode-step specializations allowed (batch buckets x grid layouts, plus backbone).
COMPILED_STEP_VARIANTS = 256


def accepts_kwarg(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


class LoRazorModel(nn.Module):
    """A causal LM whose LoRA layers serve a different adapter per row. Build with `from_peft`.

    Attributes:
        model: the Hugging Face causal LM, its LoRA target layers replaced by `BatchedLoRALinear`.
        bank: the `AdapterBank` (the GPU slots: stacked weights, which adapter holds each slot).
        registry: the `AdapterRegistry` (every registered adapter; slots as an LRU cache over them).
        config: the `LoRazorConfig`.
    """

    def __init__(self, model: nn.Module, bank: AdapterBank, config: LoRazorConfig, peft_model: nn.Module | None = None):
        super().__init__()
        self.peft_model = peft_model
        self.model = model
        self.bank = bank
        self.registry = AdapterRegistry(bank, config.max_cpu_loras)
        self.config = config
        self.guard = ModelGuard()
        backend = config.backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "reference"
        if backend == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs a CUDA device, but the model is on {self.device}: use "
                             "backend='reference' (or 'auto'), or set TRITON_INTERPRET=1 before importing triton")
        self.context = StepContext(bank.num_slots, config.grid, backend, config.block_m)
        self._replaced = patch_layers(model, bank, self.context)
        self.merged_groups = merge_projections(self.model, self.context) if config.merge_projections else []
        self._decoder = self.model.get_decoder()
        self._lm_head = self.model.get_output_embeddings()
        self._previous_attn = self.model.config._attn_implementation
        register_attention()
        self.model.set_attn_implementation(ATTENTION_NAME)
        # transformers 5.24 renamed the cache argument; 5.17 only knows `past_key_values`.
        self._cache_kwarg = "cache" if accepts_kwarg(self._decoder.forward, "cache") else "past_key_values"
        self.graphs: DecodeGraphs | None = None
        self._compiled_core = None
        # The default StepTrim policy (LoRazorConfig.release != "none"), see `load_release_policy`.
        self.release_policy: ReleasePolicy | None = None
        head_dim = getattr(self.model.config, "head_dim", None) or (
            self.model.config.hidden_size // self.model.config.num_attention_heads)
        attention = config.attention
        if attention == "auto":
            attention = "triton" if self.device.type == "cuda" and head_dim >= 16 and not head_dim & (head_dim - 1) else "sdpa"
        self._triton_attention = attention == "triton"

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
    def from_pretrained(cls, base, adapters: dict | None = None, config: LoRazorConfig | None = None,
                        **load_kwargs) -> "LoRazorModel":
        """Build from a base model and PEFT adapter folders, without PEFT.

        Args:
            base: a model id or path (loaded with `AutoModelForCausalLM.from_pretrained`, in
                `config.dtype` when set, with `load_kwargs`) or a loaded `PreTrainedModel`.
            adapters: adapter name -> folder (`adapter_config.json` + `adapter_model.safetensors`
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
        """Every registered adapter, in registration order."""
        return list(self.registry.entries)

    @property
    def adapters(self) -> dict[str, AdapterStatus]:
        """Registered adapter name -> `AdapterStatus` (on disk / in host memory / in a GPU slot, rank, targets)."""
        return self.registry.statuses()

    def register_adapter(self, name: str, path) -> AdapterStatus:
        """Register a PEFT adapter folder under `name`: its config and weights' header are checked
        against the bank now, its weights are loaded into a GPU slot when a batch first uses it."""
        with self.guard.hold(f"register adapter {name!r}"):
            return self.registry.register(name, path)

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

    def reconfigure(self, grid: str | None = None, compile: bool | None = None) -> None:
        """Switch the grid mode and/or torch.compile of the decode step (drops captured graphs)."""
        changes = {k: v for k, v in (("grid", grid), ("compile", compile)) if v is not None}
        with self.guard.hold("reconfigure"):
            self.config = dataclasses.replace(self.config, **changes)
            self.context.grid = self.config.grid
            self._compiled_core = None
            if self.graphs is not None:
                self.graphs.clear()

    def load_release_policy(self, root) -> ReleasePolicy:
        """Load the policies saved beside the adapters under `root/<adapter>/` as the default policy."""
        from .policies import load_release_policy

        policy = load_release_policy(root)
        if self.config.release not in ("none", policy.kind):
            raise ValueError(f"config.release={self.config.release!r} but {root} holds {policy.kind!r} policies")
        with self.guard.hold("load a release policy"):
            self.release_policy = policy
        return policy

    def set_grid(self, grid: str) -> None:
        """Switch the LoRA kernels' grid mode (drops captured graphs, keeps the KV caches)."""
        self.reconfigure(grid=grid)

    def unpatch(self) -> nn.Module:
        """Put the replaced layers (PEFT's, or plain linears) and attention back; returns the PeftModel
        (or the base model). This object is then unusable."""
        with self.guard.hold("unpatch"):
            unpatch_layers(self.model, self._replaced)
            self.model.set_attn_implementation(self._previous_attn)
            self._replaced = []
            self.guard.closed = True
        return self.peft_model if self.peft_model is not None else self.model

    # ---- forwards -------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and max_len > window:
            raise NotImplementedError(f"cache length {max_len} exceeds the sliding window {window}")
        dtype = self._lm_head.weight.dtype
        return KVCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, head_dim, dtype, device)

    @property
    def uses_graphs(self) -> bool:
        # The reference backend loops over slots on the host (a sync per layer): it runs eagerly.
        return self.config.cuda_graphs and self.device.type == "cuda" and self.context.backend != "reference"

    def cache_for(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        """A fresh cache, or with CUDA graphs the persistent cache of the graph bucket."""
        if not self.uses_graphs:
            return self.new_cache(batch_size, max_len, device)
        if self.graphs is None:
            self.graphs = DecodeGraphs(self)
        return self.graphs.cache(batch_size, max_len, device)

    def begin_release(self, state: ReleaseState, policy: ReleasePolicy | None, cache: KVCache) -> ReleaseState:
        """Start a generate call's StepTrim state; with CUDA graphs it moves into the graph's static
        buffers (use the returned state from then on)."""
        if self.graphs is not None and self.uses_graphs:
            return self.graphs.begin_call(cache, state, policy)
        return state

    def capture(self, batch_sizes, policy: ReleasePolicy | None = None) -> int:
        """Capture the decode graphs of these batch sizes now (LoRA and backbone-only, with `policy`'s
        class or none deciding release), at the cache length `max_cache_len`. With the `exact` grid
        there is one LoRA graph per class of distinct adapters in a batch (16, 32, ... up to
        `max_loras`), so a batch of few adapters launches a grid sized for few.

        Does nothing without CUDA graphs (CPU, or `cuda_graphs=False`). Returns the graphs captured.
        """
        with self.guard.hold("capture graphs"):
            return self._capture(batch_sizes, policy)

    def _capture(self, batch_sizes, policy: ReleasePolicy | None) -> int:
        if not self.uses_graphs:
            return 0
        if self.config.max_cache_len is None:
            raise ValueError("capture needs LoRazorConfig.max_cache_len: graphs are captured per cache length")
        device = self.device
        before = self.graphs.num_graphs() if self.graphs is not None else 0
        enabled, slot_bound = self.context.enabled, self.context.slot_bound
        policy = policy if policy is not None else self.release_policy
        if policy is not None:
            policy.bind(self.bank.names, self.bank.num_slots, device)
        hidden_size = self.model.config.hidden_size
        try:
            for size in sorted({self._graph_batch(b) for b in batch_sizes}):
                cache = self.cache_for(size, self.config.max_cache_len, device)
                # Rows without adapters: every kernel program exits, but the graph holds the full step.
                state = self.begin_release(ReleaseState.create(torch.full((size,), -1, dtype=torch.int32,
                                                                          device=device)), policy, cache)
                zeros = torch.zeros(size, dtype=torch.long, device=device)
                hidden = torch.zeros(size, hidden_size, dtype=self._lm_head.weight.dtype, device=device)
                for bound in self.context.slot_bound_classes():
                    self.context.enabled, self.context.slot_bound = True, bound
                    self.run_decode_step(zeros, zeros, zeros, cache, state, policy, 0, hidden)
                self.context.enabled, self.context.slot_bound = False, None  # the backbone-only graph
                self.run_decode_step(zeros, zeros, zeros, cache, state, policy, 0, hidden)
        finally:
            self.context.enabled, self.context.slot_bound = enabled, slot_bound
        return self.graphs.num_graphs() - before

    def _graph_batch(self, batch_size: int) -> int:
        """The batch size a graph serves `batch_size` rows with: its bucket, or itself past max_batch_size."""
        bucket = batch_bucket(batch_size)
        return bucket if bucket <= self.config.max_batch_size else batch_size

    def run_decode_step(self, tokens, positions, write_pos, cache: KVCache, state: ReleaseState,
                        policy: ReleasePolicy | None, step: int, hidden: torch.Tensor):
        """StepTrim decision for decode step `step` from the previous `hidden`, then the decode forward.

        With CUDA graphs both run in one replayed graph (`exact`/`full` grids and graph-safe
        policies). Returns (hidden `[B, H]`, logits `[B, V]`, the step's row -> slot map `[B]`).
        """
        if self.graphs is not None and self.uses_graphs:
            return self.graphs.step(tokens, positions, write_pos, cache, state, policy, step, hidden)
        if self.context.enabled:
            row_slot = release_step(policy, step, hidden, state, compiled=self.config.compile)
        else:
            row_slot = torch.full_like(state.slot, -1)
        hidden, logits = self.decode_step(tokens, positions, write_pos, cache, row_slot)
        return hidden, logits, row_slot

    def _decoder_forward(self, input_ids, position_ids, mask, cache, row_slot, tokens_per_row, meta=None,
                         **attention_kwargs):
        with torch.inference_mode(), self.context.step(row_slot, tokens_per_row, meta):
            out = self._decoder(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                **{self._cache_kwarg: cache}, **attention_kwargs,
            )
        return out.last_hidden_state

    def _prefill_hidden(self, input_ids, attention_mask, cache: KVCache, row_slot) -> torch.Tensor:
        """Prompt forward with adapters into `cache`; final hidden states `[B, T, H]`."""
        mask4d = cache.begin_prefill(attention_mask)
        # HF's positions for left padding: real tokens count from 0, pads get 1.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        return self._decoder_forward(input_ids, position_ids, mask4d, cache, row_slot, input_ids.shape[1])

    def prefill(self, input_ids, attention_mask, cache: KVCache, row_slot):
        """Prompt forward with adapters. Returns (last hidden `[B, H]`, last logits `[B, V]`)."""
        last = self._prefill_hidden(input_ids, attention_mask, cache, row_slot)[:, -1]
        with torch.inference_mode():
            return last, self._lm_head(last)

    def _decode_core(self, tokens, positions, write_pos, cache: KVCache, row_slot, meta=None):
        # Straight-line code (no context managers) so torch.compile traces it whole.
        mask4d = cache.begin_decode(write_pos)
        self.context.begin(row_slot, 1, meta)
        extra = cache.attention_kwargs(self._triton_attention)
        out = self._decoder(
            input_ids=tokens[:, None], attention_mask=mask4d, position_ids=positions[:, None], use_cache=True,
            **{self._cache_kwarg: cache}, **extra,
        )
        self.context.meta = None
        return out.last_hidden_state[:, -1]

    def new_step_outputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (hidden `[B, H]`, logits `[B, V]`) buffers for `decode_step(..., logits_out=)`."""
        weight = self._lm_head.weight
        hidden = torch.empty(batch_size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        return hidden, torch.empty(batch_size, weight.shape[0], dtype=weight.dtype, device=weight.device)

    def _head(self, last: torch.Tensor, logits_out: torch.Tensor | None) -> torch.Tensor:
        if logits_out is None:
            return self._lm_head(last)
        if isinstance(self._lm_head, nn.Linear) and self._lm_head.bias is None:
            return torch.mm(last, self._lm_head.weight.t(), out=logits_out)
        return logits_out.copy_(self._lm_head(last))

    def decode_step(self, tokens, positions, write_pos, cache: KVCache, row_slot, meta=None, logits_out=None):
        """One decode forward for every row: token `[B]` at position `[B]` written at `write_pos [B]`.

        With `LoRazorConfig(compile=True)` the decoder runs through torch.compile (elementwise ops
        fused; the LoRA kernels stay opaque custom ops). Returns (last hidden `[B, H]`, logits `[B, V]`);
        the logits are written into `logits_out` when given (CUDA graphs share one buffer).
        """
        with torch.inference_mode():
            if meta is None and self.context.enabled:
                # Built here, once per step (inside a captured graph when graphs are on), and
                # outside the compiled function: see below.
                meta = self.context.build(row_slot)
            if self.config.compile:
                if self._compiled_core is None:
                    self._compiled_core = torch.compile(self._decode_core, dynamic=False)
                if meta is not None:
                    # The tile table's length is dynamic: one compiled step serves every slot-bound
                    # class instead of one compile (~a minute) per class.
                    for table in (meta.tile_slot, meta.tile_rows):
                        if table is not None:
                            torch._dynamo.maybe_mark_dynamic(table, 0)
                # One specialization per (batch bucket, grid layout): more than dynamo's default
                # limit of 8, past which it would silently run the step eagerly.
                with torch._dynamo.config.patch(recompile_limit=COMPILED_STEP_VARIANTS):
                    last = self._compiled_core(tokens, positions, write_pos, cache, row_slot, meta)
            else:
                last = self._decode_core(tokens, positions, write_pos, cache, row_slot, meta)
            # The LM head stays outside the compiled function: it is one GEMM either way, and here
            # it can write into a caller's buffer.
            return last, self._head(last, logits_out)

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
        cache = self.new_cache(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        hidden = self._prefill_hidden(input_ids, attention_mask, cache, row_slot)
        with torch.inference_mode():
            return self._lm_head(hidden)

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
        streamer=None,
        tokenizer=None,
        prefix_allowed_tokens_fn=None,
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
            logits_processor, stopping_criteria: extra HF processors / criteria, merged with HF's.
            streamer: an HF streamer (`put` with each step's tokens, `end` at the end).
            tokenizer: needed for `stop_strings`.
            prefix_allowed_tokens_fn: as in HF.

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
        if limit is not None and T + max_new > limit:
            raise ValueError(f"prompt length {T} + max_new_tokens {max_new} exceeds max_cache_len={limit}")
        max_pos = getattr(self.model.config, "max_position_embeddings", None)
        if max_pos is not None and T + max_new > max_pos:
            raise ValueError(f"prompt length {T} + max_new_tokens {max_new} exceeds max_position_embeddings={max_pos}")
        if max_new == 0:
            empty = torch.zeros(B, dtype=torch.long, device=input_ids.device)
            return LoRazorOutput(sequences=input_ids.clone(), release_steps=empty - 1, decode_steps=empty,
                                 lora_decode_steps=empty)
        cache_len = T + max_new
        if self.uses_graphs:
            # Pad the batch to its graph bucket with backbone rows of one token; sliced off below.
            bucket = self._graph_batch(B)
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
