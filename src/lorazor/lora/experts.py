"""LoRA on the experts of a mixture-of-experts layer (Qwen3-MoE, Mixtral, OLMoE in transformers 5).

Their experts are fused parameters of one module (`mlp.experts`): `gate_up_proj` `[E, 2I, H]` (gate
rows first) and `down_proj` `[E, H, I]`; the router (`mlp.gate`) picks each token's top-k experts
and their weights, and the experts module is called as `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`. LoRazor replaces that module with `BatchedLoRAExperts`, which runs the same
computation with each token's adapter on each of its chosen experts.

In the bank an expert projection is a module of its own, named as adapters trained against earlier
transformers versions name it: `<layer>.mlp.experts.<e>.gate_proj` / `up_proj` (H -> I) and
`down_proj` (I -> H). The E experts of one projection form one stacked block (`AdapterBank.stack`):
A `[L, E, r, K]`, B `[L, E, N, r]`, scaling `[E, L]`. PEFT's `target_parameters` adapters (one A of
rank r per expert for the fused gate_up, `lora_A` `[r * E, H]`, `lora_B` `[2I, r * E]`) are split
into these modules when they are read (`split_fused_experts`): gate and up share their A.

The step (no host sync): the token-expert pairs sorted by expert, the base projections as grouped
GEMMs over the sorted pairs (transformers' own), and each pair's LoRA delta from its token's slot
and its expert, by the model's LoRA backend. With "triton" (the default on a GPU) a Triton shrink and
expand over the pairs read each pair's slot weights in place (`lorazor_kernels.expert_lora`), and a
decode step of a few pairs (`DECODE_PAIRS`) skips the sort: its pairs stay in token order and each
reads its expert's base weights in place (`lorazor_kernels.expert_gemv`). With "reference" (the
CPU's) the deltas are torch ops on gathered A and B (`expert_lora_reference`; in a 4,096-token step
of a 30B MoE the gathered weights take ~1 GB a projection). Pairs of backbone or released tokens
(slot -1) add nothing, and a step without adapters computes no delta. The pairs' outputs return to
token order by a gather (with "triton", `lorazor_kernels.expert_combine`). fp8 experts
(`quant.fp8.quantize_experts`) run their sorted projections through `lorazor_kernels.expert_grouped_fp8`
and a decode step's through `expert_gemv` with scales.
"""

from __future__ import annotations

import torch
from lorazor_kernels import (DECODE_PAIRS, expert_combine, expert_gemv, expert_gemv_reference, expert_grouped_fp8,
                             expert_lora, expert_lora_reference)
from torch import nn

from .context import StepContext

try:
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # an older transformers
    _grouped_linear = None

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers-5 fused experts module LoRazor serves."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "num_experts"))


def check_experts(name: str, module: nn.Module) -> None:
    """Refuse an experts module whose layout the step does not compute (biases, transposed or
    interleaved gate/up, no gate, a norm after each expert)."""
    odd = [flag for flag, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                                   ("has_gate", True), ("has_post_expert_norm", False))
           if getattr(module, flag, want) != want]
    if odd:
        raise NotImplementedError(f"{name}: experts with {', '.join(odd)} set are not supported")


def find_experts(root: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> fused experts module, for every MoE layer under `root` (the innermost base
    of a PEFT wrapper, under the wrapper's name)."""
    found = {}
    for name, module in root.named_modules():
        if name.endswith(".base_layer"):
            continue
        base = module
        while hasattr(base, "base_layer") and not is_fused_experts(base):
            base = base.base_layer
        if is_fused_experts(base):
            check_experts(name, base)
            found[name] = base
    return found


def expert_module_names(prefix: str, num_experts: int, projection: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{e}.{projection}" for e in range(num_experts))


def expert_sizes(prefix: str, experts: nn.Module) -> dict[str, tuple[int, int]]:
    """The bank modules of one experts module: name -> (in_features, out_features)."""
    num, two_i, hidden = experts.gate_up_proj.shape
    sizes = {}
    for projection, size in (("gate_proj", (hidden, two_i // 2)), ("up_proj", (hidden, two_i // 2)),
                             ("down_proj", (experts.down_proj.shape[2], experts.down_proj.shape[1]))):
        sizes.update({n: size for n in expert_module_names(prefix, num, projection)})
    return sizes


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, offsets: torch.Tensor,
                   experts_g: torch.Tensor):
    """`x[p] @ weight[e_p].T` for pairs sorted by expert (`offsets`: each expert's end): one grouped
    GEMM (transformers' dispatch to torch's) in bf16 or on the CPU; otherwise (fp32 / fp16 on a GPU,
    where transformers falls back to a loop that reads the offsets on the host, which a CUDA graph
    cannot hold) a batched matmul over each pair's gathered expert weights. fp8 experts (`scale`
    given) take `expert_grouped_fp8`."""
    if scale is not None:
        return expert_grouped_fp8(x, weight, scale, offsets, experts_g)
    if _grouped_linear is not None and (weight.dtype == torch.bfloat16 or weight.device.type == "cpu"):
        return _grouped_linear(x, weight, offsets)
    return expert_gemv_reference(x, weight, experts_g)


def _delta(stacks: list, x: torch.Tensor, slot: torch.Tensor, expert: torch.Tensor, kernel: bool) -> torch.Tensor:
    """Each pair's LoRA delta `scaling * B[slot, e] (A[slot, e] x)` for one or two projections of the
    input x (side by side); zero where `slot` < 0."""
    lora_a, lora_b, scaling = ([stack[i] for stack in stacks] for i in range(3))
    if kernel:
        return expert_lora(x, lora_a, lora_b, scaling, slot, expert)
    return expert_lora_reference(x, lora_a, lora_b, scaling, slot, expert)


class BatchedLoRAExperts(nn.Module):
    """An MoE layer's experts with each token's adapter on each of its chosen experts.

    Args:
        base: the model's fused experts module (shared, not copied); fp8 experts
            (`quant.fp8.quantize_experts`) hold float8 `gate_up_proj` / `down_proj` and their scales
            `gate_up_proj_scale` / `down_proj_scale` `[E, N]`.
        prefix: its module name (the bank's expert modules are named under it).
        bank: the adapter bank, holding the expert modules (`expert_sizes`) where adapters may
            target these experts; otherwise the layer computes the experts alone.
        context: the model's shared `StepContext`.
    """

    def __init__(self, base: nn.Module, prefix: str, bank, context: StepContext):
        super().__init__()
        self.base = base
        self.prefix = prefix
        self.bank = bank
        self.context = context
        self.num_experts = base.num_experts
        # The "triton" backend runs the Triton kernels (`expert_lora`, `expert_gemv`), else torch ops.
        self.kernel = context.backend == "triton"
        # The bank's stacked blocks are found by their first module's name (a string, hashed once).
        self.blocks = {p: expert_module_names(prefix, base.num_experts, p)[0] for p in EXPERT_PROJECTIONS}
        self.has_lora = self.blocks["gate_proj"] in bank.modules

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        meta = self.context.meta
        # else no row has an adapter, or no adapter can target these experts: no delta
        lora = self.has_lora and meta is not None and meta.has_lora is not False
        tokens, top_k = top_k_index.shape
        if lora and tokens != meta.row_slot.shape[0]:
            raise RuntimeError(f"experts got {tokens} tokens but the step has {meta.row_slot.shape[0]}")
        if self.kernel and tokens * top_k <= DECODE_PAIRS:
            # A decode step's few pairs in token order, each expert read in place: no sort, no scatter.
            # int32 once for the layer's kernels (each would otherwise convert its own copy).
            experts = top_k_index.reshape(-1).int()
            slot = meta.row_slot.int().repeat_interleave(top_k) if lora else None
            out = self._pairs(hidden_states.repeat_interleave(top_k, dim=0), experts, slot,
                              lambda x, weight, scale: expert_gemv(x, weight, experts, scale))
            out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
            return out.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
        experts, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        experts = experts.int()
        token = perm // top_k
        # histc, not bincount: no host sync, so the step stays capturable (transformers does the same).
        counts = torch.histc(experts.float() if experts.device.type == "cpu" else experts,
                             bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = self._pairs(hidden_states[token], experts, meta.row_slot.int()[token] if lora else None,
                          lambda x, weight, scale: _expert_linear(x, weight, scale, offsets, experts))
        # Back to token order by a gather, not a scatter: each token reads its k pairs' rows once. A kernel of
        # ours, not torch.compile's: inductor's fused gather-sum ran 6-25x slower in some graphs than in others.
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        if self.kernel:
            return expert_combine(out, inverse, top_k_weights).to(hidden_states.dtype)
        out = out[inverse] * top_k_weights.reshape(-1, 1).to(out.dtype)
        return out.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _pairs(self, x: torch.Tensor, experts: torch.Tensor, slot: torch.Tensor | None, linear) -> torch.Tensor:
        """Each token-expert pair's expert output (gate/up, the activation, down), with its token's
        adapter delta on each projection where `slot` is given; `linear(x, weight, scale)` computes a
        base projection over the pairs in their order (scale: fp8 experts' scales, else None)."""
        base = self.base
        gate_up = linear(x, base.gate_up_proj, getattr(base, "gate_up_proj_scale", None))
        if slot is not None:
            stacks = {p: self.bank.stack(first) for p, first in self.blocks.items()}
            # gate's and up's deltas side by side, as in the fused gate_up output (one launch pair)
            gate_up = gate_up + _delta([stacks["gate_proj"], stacks["up_proj"]], x, slot, experts, self.kernel)
        hidden = base._apply_gate(gate_up) if hasattr(base, "_apply_gate") else _gated(base, gate_up)
        out = linear(hidden, base.down_proj, getattr(base, "down_proj_scale", None))
        if slot is not None:
            out = out + _delta([stacks["down_proj"]], hidden, slot, experts, self.kernel)
        return out

    def workspace_bytes(self, tokens: int) -> int:
        """The memory a step of `tokens` tokens takes here at most: per token-expert pair its gathered
        slot weights of one projection (`_delta`: A `[r, K]` and B `[N, r]`) beside the grouped
        GEMMs' inputs and outputs, counted twice (a captured graph's pool keeps more than one alive).
        The engine leaves this much GPU memory outside its KV pool. (`expert_lora` gathers nothing: its
        pairs need only the GEMMs' buffers and an fp32 rank vector.)"""
        pairs = tokens * getattr(getattr(self.base, "config", None), "num_experts_per_tok", 1)
        _, two_i, hidden = self.base.gate_up_proj.shape
        per_pair = 3 * (hidden + two_i) + (2 * self.bank.r_max if self.kernel else
                                           self.bank.r_max * (hidden + two_i // 2))
        return 2 * pairs * per_pair * self.bank.storage.element_size()  # activations: the model's dtype

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, slots={self.bank.num_slots}"


def _gated(base: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return base.act_fn(gate) * up


def patch_experts(root: nn.Module, bank, context: StepContext) -> list[tuple[str, nn.Module]]:
    """Replace every experts module (or PEFT's wrapper of one) under `root` by a `BatchedLoRAExperts`,
    whether or not the bank holds its expert modules: one expert path for every MoE layer (graph-safe
    in any dtype, `expert_gemv` at decode, fp8 experts); returns `(name, old module)` pairs to put
    back."""
    replaced = []
    for name, base in find_experts(root).items():
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        replaced.append((name, getattr(parent, attr)))
        setattr(parent, attr, BatchedLoRAExperts(base, name, bank, context))
    return replaced


# ---- adapters: PEFT's fused-expert tensors and older per-expert names --------------------------------------
# Per-expert names of earlier transformers versions: Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2`.
LEGACY_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_module(module: str) -> str:
    """An adapter's module name in the bank's terms: Mixtral's older `block_sparse_moe.experts.<e>.w1`
    is `mlp.experts.<e>.gate_proj` (w3: up_proj, w2: down_proj); other names are unchanged."""
    parts = module.split(".")
    if "experts" not in parts:
        return module
    i = parts.index("experts")
    if i > 0 and parts[i - 1] == "block_sparse_moe":
        parts[i - 1] = "mlp"
    if len(parts) == i + 3 and parts[i + 1].isdigit() and parts[i + 2] in LEGACY_PROJECTIONS:
        parts[i + 2] = LEGACY_PROJECTIONS[parts[i + 2]]
    return ".".join(parts)


def legacy_name(module: str) -> str | None:
    """The older Mixtral name of an expert module (`mlp.experts.<e>.gate_proj` ->
    `block_sparse_moe.experts.<e>.w1`), so configs that target `w1` select it; None for others."""
    parts = module.split(".")
    if len(parts) < 4 or parts[-4] != "mlp" or parts[-3] != "experts" or not parts[-2].isdigit():
        return None
    legacy = {v: k for k, v in LEGACY_PROJECTIONS.items()}.get(parts[-1])
    return None if legacy is None else ".".join([*parts[:-4], "block_sparse_moe", "experts", parts[-2], legacy])


def fused_prefix(module: str) -> str | None:
    """`<layer>.mlp.experts` for a PEFT `target_parameters` module name (`...experts` or
    `...experts.base_layer[.base_layer...]`), else None."""
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return module if module.endswith(".experts") else None


def split_fused_pair(a: torch.Tensor, b: torch.Tensor, num_experts: int, prefix: str, projection: str):
    """PEFT's LoRA of a fused expert parameter (`lora_A` `[r * E, in]`, `lora_B` `[out, r * E]`) as
    per-expert (module name, A `[r, in]`, B `[out_e, r]`) triples: gate_up's B rows split into
    gate_proj's and up_proj's, both with the expert's A."""
    r = a.shape[0] // num_experts
    a_e = a.reshape(num_experts, r, a.shape[-1])
    b_e = b.reshape(b.shape[0], r, num_experts)
    out = []
    for e in range(num_experts):
        a_i, b_i = a_e[e], b_e[:, :, e]
        if projection == "gate_up_proj":
            half = b_i.shape[0] // 2
            out += [(f"{prefix}.{e}.gate_proj", a_i, b_i[:half]), (f"{prefix}.{e}.up_proj", a_i, b_i[half:])]
        else:
            out.append((f"{prefix}.{e}.down_proj", a_i, b_i))
    return out
