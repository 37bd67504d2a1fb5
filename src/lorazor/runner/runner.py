"""ModelRunner: the one place a LoRazor model's forwards run, for `generate()` and the engine.

It owns the decoder forward (prefill of a padded batch, one-token decode steps, packed steps of
prefill chunks beside decode rows), the LM head, the LoRA step context, the KV caches (contiguous
for `generate()`, paged for the engine, one interface: `begin_decode`, `update`,
`attention_kwargs`) and the CUDA-graph families built on one base (`graphs.py`). `generate()`
(`lorazor.model.generate.decode_loop`) and the engine (`lorazor.engine`) call only its public methods.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..policies.base import ReleasePolicy, ReleaseState
from .compiled_layers import CompiledLayers
from .decode_graphs import DecodeGraphs
from .graphs import batch_bucket
from .kv_cache import KVCache
from ..lora.context import StepContext
from .paged_cache import PAGED_KWARG, PagedKVCache, PagedStep
from .paged_graphs import PagedDecodeGraphs, PendingTokens
from .paged_steps import PagedSteps
from .release import decide_release
from .uploads import to_device

def mark_dim0_dynamic(*tensors: torch.Tensor) -> None:
    """Let torch.compile treat dim 0 of these tensors as dynamic (it still specializes sizes 0 and 1)."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


def meta_tables(meta) -> tuple:
    """The `exact` grid's tile tables of LoRA metadata (none for other grids): their length varies
    with the adapters in a step, so compiled steps mark them dynamic."""
    return tuple(t for t in (meta.tile_slot, meta.tile_rows) if t is not None)


def accepts_kwarg(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


class ModelRunner:
    """Runs the forwards of one patched Hugging Face causal LM.

    Args:
        hf_model: the causal LM, its LoRA target layers already `BatchedLoRALinear`s reading `context`.
        context: the `StepContext` shared by those layers.
        config: the model's `LoRazorConfig` (the owner replaces it on `reconfigure`).
        attention: "triton" or "sdpa" (resolved from `config.attention` by the owner).
    """

    def __init__(self, hf_model: nn.Module, context: StepContext, config, attention: str):
        self.hf_model = hf_model
        self.context = context
        self.config = config
        self.triton_attention = attention == "triton"
        self.decoder = hf_model.get_decoder()
        self.lm_head = hf_model.get_output_embeddings()
        # transformers 5.24 renamed the cache argument; 5.17 only knows `past_key_values`.
        self.cache_kwarg = "cache" if accepts_kwarg(self.decoder.forward, "cache") else "past_key_values"
        self.graphs: DecodeGraphs | None = None  # generate()'s decode graphs, built on first use
        self._compiled_layers: CompiledLayers | None = None  # built on the first compiled step

    # ---- geometry --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.hf_model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf_model.get_input_embeddings().num_embeddings

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.hf_model.config, "max_position_embeddings", None)

    @property
    def final_logit_softcap(self) -> float | None:
        return getattr(self.hf_model.config, "final_logit_softcapping", None)

    @property
    def attention_softcap(self) -> float | None:
        """Gemma 2's attention-logit softcapping (None for most models)."""
        return getattr(self.hf_model.config, "attn_logit_softcapping", None)

    @property
    def sliding_window(self) -> int | None:
        cfg = self.hf_model.config
        window = getattr(cfg, "sliding_window", None)
        return window if window is not None and getattr(cfg, "use_sliding_window", True) else None

    def _kv_geometry(self) -> tuple[int, int, int]:
        cfg = self.hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token position takes over all layers."""
        layers, kv_heads, head_dim = self._kv_geometry()
        return 2 * layers * kv_heads * head_dim * self.dtype.itemsize

    @property
    def uses_graphs(self) -> bool:
        # The reference backend loops over slots on the host (a sync per layer): it runs eagerly.
        return self.config.cuda_graphs and self.device.type == "cuda" and self.context.backend != "reference"

    def check_length(self, prompt_len: int, max_new_tokens: int, limit: int | None, limit_name: str) -> None:
        """Raise ValueError when prompt + output exceed `limit` (the caller's cache or model length,
        named `limit_name`) or the model's `max_position_embeddings`. One check for both paths."""
        total = prompt_len + max_new_tokens
        for name, value in ((limit_name, limit), ("max_position_embeddings", self.max_position_embeddings)):
            if value is not None and total > value:
                raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {total} tokens "
                                 f"exceeds {name}={value}")

    # ---- caches ------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        """A contiguous cache for `generate()` / `forward()` (`[B, H_kv, max_len, D]` per layer)."""
        window = self.sliding_window
        if window is not None and max_len > window:
            raise NotImplementedError(f"cache length {max_len} exceeds the sliding window {window}")
        layers, kv_heads, head_dim = self._kv_geometry()
        return KVCache(layers, batch_size, kv_heads, max_len, head_dim, self.dtype, device)

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """The engine's paged cache of `num_blocks` blocks (plus the scratch block)."""
        layers, kv_heads, head_dim = self._kv_geometry()
        return PagedKVCache(layers, num_blocks, block_size, kv_heads, head_dim,
                            self.hf_model.config.num_attention_heads, self.dtype, self.device,
                            use_kernel=self.triton_attention)

    def step_workspace_bytes(self, tokens: int) -> int:
        """Memory a step of `tokens` tokens needs beyond the usual activations: the largest of the
        decoder modules' own estimates (`workspace_bytes`: the MoE experts' LoRA), 0 for dense models."""
        return max((m.workspace_bytes(tokens) for m in self.decoder.modules() if hasattr(m, "workspace_bytes")),
                   default=0)

    def cache_for(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        """A fresh cache, or with CUDA graphs the persistent cache of the graph bucket."""
        if not self.uses_graphs:
            return self.new_cache(batch_size, max_len, device)
        if self.graphs is None:
            self.graphs = DecodeGraphs(self)
        return self.graphs.cache(batch_size, max_len, device)

    def graph_batch(self, batch_size: int) -> int:
        """The batch size a graph serves `batch_size` rows with: its bucket, or itself past max_batch_size."""
        bucket = batch_bucket(batch_size)
        return bucket if bucket <= self.config.max_batch_size else batch_size

    # ---- forwards ----------------------------------------------------------------------------------
    def forward_tokens(self, input_ids, position_ids, mask, cache, row_slot, tokens_per_row, meta=None,
                       **attention_kwargs) -> torch.Tensor:
        """The decoder over `input_ids` `[B, T]` with per-row (or per-token) slots; final hidden states."""
        with torch.inference_mode(), self.context.step(row_slot, tokens_per_row, meta):
            out = self.decoder(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                **{self.cache_kwarg: cache}, **attention_kwargs,
            )
        return out.last_hidden_state

    def prefill_hidden(self, input_ids, attention_mask, cache: KVCache, row_slot) -> torch.Tensor:
        """Prompt forward of a left-padded batch with adapters into `cache`; hidden states `[B, T, H]`."""
        mask4d = cache.begin_prefill(attention_mask)
        # HF's positions for left padding: real tokens count from 0, pads get 1.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        return self.forward_tokens(input_ids, position_ids, mask4d, cache, row_slot, input_ids.shape[1])

    def prefill(self, input_ids, attention_mask, cache: KVCache, row_slot):
        """Prompt forward with adapters. Returns (last logits `[B, V]`, last hidden `[B, H]`)."""
        last = self.prefill_hidden(input_ids, attention_mask, cache, row_slot)[:, -1]
        with torch.inference_mode():
            return self.logits(last), last

    @property
    def compiled_layers(self) -> CompiledLayers:
        """The decoder's compiled regions (`compiled_layers.py`), installed on first use."""
        if self._compiled_layers is None:
            self._compiled_layers = CompiledLayers(self.decoder)
        return self._compiled_layers

    def _decode_core(self, tokens, positions, write_pos, cache, row_slot, meta=None):
        mask4d = cache.begin_decode(write_pos)
        self.context.begin(row_slot, 1, meta)
        extra = cache.attention_kwargs(self.triton_attention)
        out = self.decoder(
            input_ids=tokens[:, None], attention_mask=mask4d, position_ids=positions[:, None], use_cache=True,
            **{self.cache_kwarg: cache}, **extra,
        )
        self.context.meta = None
        return out.last_hidden_state[:, -1]

    def new_step_outputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (logits `[B, V]`, hidden `[B, H]`) buffers for `decode_step(..., logits_out=)`."""
        weight = self.lm_head.weight
        hidden = torch.empty(batch_size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        return torch.empty(batch_size, weight.shape[0], dtype=weight.dtype, device=weight.device), hidden

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head on `[n, H]` hidden states, into `out` when given (graphs share one buffer),
        with the model's final logit softcapping (Gemma 2) when it has one."""
        if out is None:
            logits = self.lm_head(hidden)
        elif isinstance(self.lm_head, nn.Linear) and self.lm_head.bias is None:
            logits = torch.mm(hidden, self.lm_head.weight.t(), out=out)
        else:
            logits = out.copy_(self.lm_head(hidden))
        cap = self.final_logit_softcap
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def decode_step(self, tokens, positions, write_pos, cache, row_slot, meta=None, logits_out=None):
        """One decode forward for every row: token `[B]` at position `[B]` written at `write_pos [B]`
        (a contiguous cache position, or a paged pool position with the cache's `step` set).

        With `LoRazorConfig(compile=True)` the decoder's layers run compiled (`compiled_layers.py`:
        elementwise ops fused; the LoRA and attention kernels stay opaque custom ops). Returns (logits
        `[B, V]`, last hidden `[B, H]`); the logits are written into `logits_out` when given (CUDA
        graphs share one buffer).
        """
        with torch.inference_mode():
            if meta is None and self.context.enabled:
                # Built here, once per step (inside a captured graph when graphs are on), not per
                # layer.
                meta = self.context.build(row_slot)
            if self.config.compile:
                if meta is not None:
                    # The tile table's length is dynamic: one compile serves every slot-bound class
                    # instead of one compile (~a minute) per class.
                    mark_dim0_dynamic(*meta_tables(meta))
                if isinstance(cache, PagedKVCache):
                    # The engine's batch is dynamic too: one compile serves every batch bucket (each
                    # bucket is still its own CUDA graph), so warm-up compiles a few times, not per bucket.
                    mark_dim0_dynamic(write_pos, *cache.step.decode_tiles,
                                       *(() if meta is None else (meta.row_slot, meta.sorted_rows)))
                with self.compiled_layers.active():
                    last = self._decode_core(tokens, positions, write_pos, cache, row_slot, meta)
            else:
                last = self._decode_core(tokens, positions, write_pos, cache, row_slot, meta)
            # The LM head stays outside the compiled function: it is one GEMM either way, and here
            # it can write into a caller's buffer.
            return self.logits(last, logits_out), last

    def _packed_core(self, ids, positions, cache, token_slot, meta=None):
        self.context.begin(token_slot, 1, meta)
        out = self.decoder(
            input_ids=ids[None], attention_mask=cache.packed_mask(ids.shape[0]), position_ids=positions[None],
            use_cache=True, **{self.cache_kwarg: cache}, **{PAGED_KWARG: cache},
        )
        self.context.meta = None
        return out.last_hidden_state[0]

    def packed_forward(self, cache: PagedKVCache, ids, positions, token_slot, last, logits_out=None,
                       compile: bool = False):
        """One packed sequence of tokens from many requests over the paged pool (`cache.step` set):
        returns (logits, hidden) at the packed indices `last`.

        `compile` (with `LoRazorConfig(compile=True)`): through torch.compile with a dynamic token
        count, for callers whose counts are padded to a few buckets (the engine's packed step graphs):
        two compiles, LoRA and backbone, serve every bucket. Unpadded counts would recompile."""
        with torch.inference_mode():
            if not (compile and self.config.compile):
                hidden = self._packed_core(ids, positions, cache, token_slot)
            else:
                meta = self.context.build(token_slot) if self.context.enabled else None
                step = cache.step
                mark_dim0_dynamic(step.slot_mapping, *step.decode_tiles, *step.prefill_tiles,
                                  *(() if meta is None else (meta.row_slot, meta.sorted_rows, *meta_tables(meta))))
                with self.compiled_layers.active():
                    hidden = self._packed_core(ids, positions, cache, token_slot, meta)
            hidden = hidden.index_select(0, last)
            return self.logits(hidden, logits_out), hidden

    def remove_compiled_layers(self) -> None:
        """Uninstall the compiled regions from the decoder (before the model is handed back)."""
        if self._compiled_layers is not None:
            self._compiled_layers.remove()
            self._compiled_layers = None

    def reset_compiled(self) -> None:
        """Drop the captured graphs (after a grid or compile change). The compiled regions stay:
        their guards see the change and recompile."""
        if self.graphs is not None:
            self.graphs.clear()

    # ---- generate(): StepTrim decisions and graphs --------------------------------------------
    def begin_release(self, state: ReleaseState, policy: ReleasePolicy | None, cache: KVCache) -> ReleaseState:
        """Start a generate call's StepTrim state; with CUDA graphs it moves into the graph's static
        buffers (use the returned state from then on)."""
        if self.graphs is not None and self.uses_graphs:
            return self.graphs.begin_call(cache, state, policy)
        return state

    def run_decode_step(self, tokens, positions, write_pos, cache: KVCache, state: ReleaseState,
                        policy: ReleasePolicy | None, step: int, hidden: torch.Tensor):
        """StepTrim decision for decode step `step` from the previous `hidden`, then the decode forward.

        With CUDA graphs both run in one replayed graph (`exact`/`full` grids and graph-safe
        policies). Returns (logits `[B, V]`, hidden `[B, H]`, the step's row -> slot map `[B]`).
        """
        if self.graphs is not None and self.uses_graphs:
            return self.graphs.step(tokens, positions, write_pos, cache, state, policy, step, hidden)
        if self.context.enabled:
            row_slot = decide_release(policy, step, hidden, state, compiled=self.config.compile)
        else:
            row_slot = torch.full_like(state.slot, -1)
        logits, hidden = self.decode_step(tokens, positions, write_pos, cache, row_slot)
        return logits, hidden, row_slot

    def capture(self, batch_sizes, policy: ReleasePolicy | None, bank) -> int:
        """Capture `generate()`'s decode graphs of these batch sizes (see `LoRazorModel.capture`)."""
        if not self.uses_graphs:
            return 0
        if self.config.max_cache_len is None:
            raise ValueError("capture needs LoRazorConfig.max_cache_len: graphs are captured per cache length")
        device = self.device
        before = self.graphs.num_graphs() if self.graphs is not None else 0
        context = self.context
        enabled, slot_bound = context.enabled, context.slot_bound
        if policy is not None:
            policy.bind(bank.names, bank.num_slots, device)
        try:
            for size in sorted({self.graph_batch(b) for b in batch_sizes}):
                cache = self.cache_for(size, self.config.max_cache_len, device)
                # Rows without adapters: every kernel program exits, but the graph holds the full step.
                state = self.begin_release(ReleaseState.create(torch.full((size,), -1, dtype=torch.int32,
                                                                          device=device)), policy, cache)
                zeros = torch.zeros(size, dtype=torch.long, device=device)
                hidden = torch.zeros(size, self.hidden_size, dtype=self.dtype, device=device)
                for bound in context.slot_bound_classes():
                    context.enabled, context.slot_bound = True, bound
                    self.run_decode_step(zeros, zeros, zeros, cache, state, policy, 0, hidden)
                context.enabled, context.slot_bound = False, None  # the backbone-only graph
                self.run_decode_step(zeros, zeros, zeros, cache, state, policy, 0, hidden)
        finally:
            context.enabled, context.slot_bound = enabled, slot_bound
        return self.graphs.num_graphs() - before

    # ---- the engine: paged steps ---------------------------------------------------------------
    def paged_steps(self, bank, num_blocks: int, block_size: int, max_rows: int, max_tokens: int,
                    max_blocks_per_row: int) -> PagedSteps:
        """The device side of an engine's steps (`paged_steps.py`): its KV pool, block tables and graphs."""
        return PagedSteps(self, bank, num_blocks, block_size, max_rows, max_tokens, max_blocks_per_row)

    def paged_graphs(self, cache: PagedKVCache, max_batch: int, max_tokens: int) -> PagedDecodeGraphs | None:
        """The engine's step graphs, or None where its steps run eagerly: graphs need device-built
        LoRA metadata and the Triton attention (the reference reads the tiles on the host)."""
        if self.uses_graphs and self.context.meta_on_device and cache.use_kernel:
            return PagedDecodeGraphs(self, cache, max_batch, max_tokens)
        return None

    def run_paged_step(self, cache: PagedKVCache, inputs, block_tables: torch.Tensor,
                       graphs: PagedDecodeGraphs | None = None, pending: PendingTokens | None = None):
        """Forward one engine step (`inputs`: a `StepInputs`, adapters already in slots;
        `pending`: its input tokens that the step before left on the device). Returns `[chunks, V]`
        logits and `[chunks, H]` final hidden states at each chunk's last token (views of static
        buffers after a graph replay: read them, or queue what reads them, before the next step).
        Nothing here waits for the GPU."""
        # The host knows how many distinct adapters the step uses: no sync to bound the exact grid.
        self.context.set_distinct(inputs.num_adapters)
        if graphs is not None:
            if inputs.decode_only and graphs.serves(len(inputs.chunks)):
                return graphs.run(inputs, block_tables, pending)
            if not inputs.decode_only and graphs.packed.serves(len(inputs.ids)):
                return graphs.packed.run(inputs, block_tables, pending)
        device = self.device
        slot_mapping, ids, positions, token_slot = to_device(
            [inputs.slot_mapping, inputs.ids, inputs.positions, inputs.slots], device)
        token_slot = token_slot.int()
        if pending is not None:
            pending.fill(ids, token_slot)
        step = PagedStep.build(cache, inputs.chunks, slot_mapping, block_tables, device)
        cache.step = step
        try:
            if inputs.decode_only:
                # The decode step `generate()` runs: one token per row.
                return self.decode_step(ids, positions, step.slot_mapping, cache, token_slot)
            last = to_device(inputs.last, device)
            return self.packed_forward(cache, ids, positions, token_slot, last)
        finally:
            cache.step = None
