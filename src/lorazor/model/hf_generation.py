"""Hugging Face generation semantics: the settings, logits processors and stopping criteria that
transformers' own `generate` would use for the same call, built by transformers' own builders.

LoRazor runs its own decode loop (batched adapters, its KV cache, CUDA graphs), but everything that
decides *which* token comes next is HF's: the `GenerationConfig` resolved with HF's precedence (the
call's config or the model's, HF's global defaults such as `top_k=50`, then keyword arguments), the
`LogitsProcessorList` in HF's order, and the `StoppingCriteriaList`. Settings that need another
decoding strategy (beam search, contrastive search, assisted decoding) or another model call per
step (classifier-free guidance) are refused with an error that names them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import threading
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StopStringCriteria)

from ..config import int_in_range

# Criteria that read at most a tail of the tokens and never the scores (a stop string reads its
# `maximum_token_len` last tokens): the engine checks them on the host from that tail, so a request
# with stop strings can still be sampled on the device.
TAIL_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria, MaxTimeCriteria)

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# Fields whose HF behaviour needs something LoRazor's loop does not do: refused, never ignored.
REFUSED_FIELDS = {
    "guidance_scale": (
        lambda v: v is not None and v != 1,
        "classifier-free guidance runs a second model call per step",
    ),
    "token_healing": (bool, "token healing rewrites the prompt"),
    "output_attentions": (bool, "attention weights are not materialized by LoRazor's attention"),
    "output_hidden_states": (bool, "only the final hidden state is kept (for the release policy)"),
}

# A sampling temperature below this is greedy (vLLM's rule): dividing logits by a subnormal or zero
# temperature gives infinities, and the softmax of those NaN.
SAMPLING_EPS = 1e-5
# Float settings HF requires as floats; JSON clients send 2 for 2.0.
FLOAT_SETTINGS = ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                  "repetition_penalty", "encoder_repetition_penalty", "length_penalty")
# Repetition penalties whose division or multiplication keeps fp32 logits finite (HF only asks > 0:
# 1e-300 turns every seen token's logit into an infinity).
REPETITION_PENALTY_RANGE = (1e-2, 1e2)


def guard_sampling(config: GenerationConfig, vocab_size: int | None) -> None:
    """Make settings that would poison a step's arithmetic safe, in place, or refuse them naming
    the setting (what vLLM does at admission): integer floats become floats; a temperature below
    `SAMPLING_EPS` is greedy; `top_k` past the vocabulary is the vocabulary (the same filter, and no
    int64 overflow); non-finite values and repetition penalties outside `REPETITION_PENALTY_RANGE`
    raise ValueError."""
    for name in FLOAT_SETTINGS:
        value = getattr(config, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        setattr(config, name, float(value))
    if config.do_sample and config.temperature is not None and 0 <= config.temperature < SAMPLING_EPS:
        config.do_sample = False
        config.temperature = 1.0  # no warper, and no "temperature is set but do_sample is False" warning
    penalty = config.repetition_penalty
    low, high = REPETITION_PENALTY_RANGE
    if penalty is not None and penalty != 1.0 and not low <= penalty <= high:
        raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {penalty!r}")
    # Probabilities in [0, 1] (HF's warpers take 0: top_p 0 keeps the one most likely token).
    for name in ("top_p", "min_p", "typical_p"):
        value = getattr(config, name, None)
        if value is not None and not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    eos = config.eos_token_id
    for token in ([] if eos is None else torch.as_tensor(eos).flatten().tolist()
                  if isinstance(eos, torch.Tensor) else [eos] if isinstance(eos, int) else list(eos)):
        if not int_in_range(token, 0, vocab_size - 1 if vocab_size else None):
            raise ValueError(f"eos_token_id holds {token!r}, not a token id in [0, {vocab_size or 'vocab'})")
    stops = config.stop_strings
    stops = [stops] if isinstance(stops, str) else stops
    if stops is not None and any(not isinstance(s, str) or not s for s in stops):
        raise ValueError(f"stop_strings must be non-empty strings, got {stops!r}")
    top_k = config.top_k
    if vocab_size and int_in_range(top_k, vocab_size + 1):
        config.top_k = vocab_size


@dataclass
class GenerationPlan:
    """What one `generate` call decodes with.

    Attributes:
        config: the resolved `GenerationConfig` (HF's precedence and defaults).
        max_new_tokens: tokens to generate at most.
        processors: HF's logits processors for `config`, user processors merged in HF's way.
        stopping: HF's stopping criteria when any goes beyond max length and EOS (stop strings,
            max_time, user criteria); None when the loop's built-in length/EOS check is exact.
        eos: EOS token ids; pad: the token finished rows emit.
        output_scores / output_logits: keep the processed scores / raw logits of every step.
    """

    config: GenerationConfig
    max_new_tokens: int
    processors: LogitsProcessorList
    stopping: StoppingCriteriaList | None
    eos: list[int]
    pad: int
    output_scores: bool
    output_logits: bool

    # ---- stop checks: the one place both decode paths ask whether a row is done ------------------
    def finished_rows(self, tokens: torch.Tensor, token: torch.Tensor, scores: torch.Tensor,
                      eos: torch.Tensor) -> torch.Tensor | None:
        """`[B]` bool, on the device: rows whose sequence `tokens` `[B, t]` (ending with `token`)
        stops here, by HF's criteria or EOS (`eos`: the ids as a device tensor); None when only the
        length limit applies (the caller's loop ends there)."""
        if self.stopping is not None:
            return self.stopping(tokens, scores)
        if self.eos:
            return torch.isin(token, eos)
        return None

    @functools.cached_property
    def stop_window(self) -> int | None:
        """How many of the last tokens the stopping criteria read, without scores: 0 when there are
        none beyond length and EOS, None when one may read more or need the scores (user criteria)."""
        if self.stopping is None:
            return 0
        if not all(isinstance(c, TAIL_CRITERIA) for c in self.stopping):
            return None
        return max((c.maximum_token_len for c in self.stopping if isinstance(c, StopStringCriteria)), default=1)

    @functools.cached_property
    def stop_string_criterion(self) -> StopStringCriteria | None:
        """The stop-string criterion when it is the only criterion beyond length and EOS (the
        engine then checks many requests' strings in one call), else None."""
        if self.stopping is None:
            return None
        strings = [c for c in self.stopping if isinstance(c, StopStringCriteria)]
        builtin = (StopStringCriteria, MaxLengthCriteria, EosTokenCriteria)
        others = [c for c in self.stopping if not isinstance(c, builtin)]
        return strings[0] if len(strings) == 1 and not others else None

    def builtin_reason(self, token: int, generated: int) -> str | None:
        """"eos" or "length" when `token`, the `generated`-th, ends the request by EOS or length."""
        if token in self.eos:
            return "eos"
        if generated >= self.max_new_tokens:
            return "length"
        return None

    def stop_reason(self, tokens: list[int], token: int, generated: int, scores: torch.Tensor | None) -> str | None:
        """Why one request stops after `token`, its `generated`-th token ("eos", "length", "stop"
        for HF's other criteria such as stop strings), or None. `tokens`: prompt and output so far;
        `scores`: the processed scores of `token` (None when the device sampled it: then every
        criterion must be a tail criterion, checked on the CPU from the last `stop_window` tokens)."""
        reason = self.builtin_reason(token, generated)
        if reason is not None:
            return reason
        if self.stopping is not None:
            window = self.stop_window
            if window is None:
                seq = torch.tensor([tokens], dtype=torch.long, device=scores.device)
            else:  # length and EOS were checked above, on the whole sequence
                seq = torch.tensor([tokens[-window:]], dtype=torch.long)
                scores = None
            if bool(self.stopping(seq, scores)[0]):
                return "stop"
        return None


@functools.cache
def _parameters(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _call(fn, **kwargs):
    """Call a transformers helper with the keyword arguments its version accepts (5.17 and 5.24+)."""
    accepted = _parameters(getattr(fn, "__func__", fn))  # per function, not per bound method
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


def _drop_redundant_min_length(processors: LogitsProcessorList, prompt_len: int) -> LogitsProcessorList:
    """HF sets min_length = prompt + min_new_tokens and then applies both min-length processors,
    each cloning the `[B, V]` scores every step. Where they suppress the same EOS ids over the same
    steps, the min_length one changes nothing: drop it (same tokens, one `[B, V]` copy less a step)."""
    news = [p for p in processors if isinstance(p, MinNewTokensLengthLogitsProcessor)]

    def redundant(p) -> bool:
        return isinstance(p, MinLengthLogitsProcessor) and any(
            n.prompt_length_to_skip == prompt_len and n.min_new_tokens + prompt_len == p.min_length
            and torch.equal(torch.as_tensor(n.eos_token_id).cpu(), torch.as_tensor(p.eos_token_id).cpu())
            for n in news)

    return LogitsProcessorList(p for p in processors if not redundant(p))


def check_max_new_tokens(value) -> None:
    if value is not None and not int_in_range(value, 0):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {value!r}")


def resolve_config(hf_model, given: GenerationConfig | None, kwargs: dict) -> tuple[GenerationConfig, dict]:
    """The call's `GenerationConfig` with HF's precedence; unknown kwargs and unsupported settings raise.

    Returns the config and the defaults flags `plan_generation` needs.
    """
    if given is not None and not isinstance(given, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers.GenerationConfig, got {type(given).__name__}")
    kwargs = dict(kwargs)
    check_max_new_tokens(kwargs.get("max_new_tokens"))
    # HF's config refuses max_new_tokens=0; LoRazor returns the prompt alone.
    zero = kwargs.get("max_new_tokens") == 0
    if zero:
        kwargs.pop("max_new_tokens")
    model_default = hf_model.generation_config
    flags = {
        "zero": zero,
        # As HF's generate defines them (its length helper warns when they are False).
        "has_default_max_length": kwargs.get("max_length") is None
        and (given is None or given.max_length is None) and model_default.max_length is None,
        "has_default_min_length": kwargs.get("min_length") is None
        and (given is None or given.min_length is None) and model_default.min_length is None,
    }
    config, unused = hf_model._prepare_generation_config(given, **kwargs)
    unused = {k for k in unused if k not in ("output_attentions", "output_hidden_states")}
    if unused:
        raise TypeError(f"unknown generation arguments {sorted(unused)}")
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise NotImplementedError(
            f"generation mode {mode.value!r} (num_beams={config.num_beams}, penalty_alpha={config.penalty_alpha}) is "
            "not supported: LoRazor runs greedy search and sampling (do_sample=True)")
    for name, (is_set, why) in REFUSED_FIELDS.items():
        if is_set(getattr(config, name, None)):
            raise NotImplementedError(f"{name}={getattr(config, name)!r} is not supported: {why}")
    guard_sampling(config, getattr(hf_model.config, "vocab_size", None))
    return config, flags


def _frozen(value):
    """A hashable stand-in for a keyword argument's value (lists and dicts by content), or raise
    TypeError for a value that cannot be compared by content (a tensor, a user object)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value), value
    if isinstance(value, (list, tuple)):
        return type(value), tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    raise TypeError(type(value).__name__)


class ResolvedConfigs:
    """`resolve_config` for many requests with the same settings, as an engine gets them.

    HF's resolution deep-copies a fresh `GenerationConfig`, reads the model's config and checks the
    model config for legacy generation fields: ~0.3 ms a call, serial before an offline batch
    starts. A call without a `generation_config` whose keyword arguments are plain values (numbers,
    strings, lists, dicts of them) is resolved once per distinct settings and handed out as a
    shallow copy (what HF then does to a request's config rebinds attributes, never mutates them in
    place). The memo holds while the model's `generation_config` and `config` keep the state they had
    when it was filled (compared by value at each call, ~3 us); a change empties it, so a setting
    changed later is resolved (or refused) as HF would.
    """

    def __init__(self, hf_model, size: int = 1024):
        self.hf_model = hf_model
        self.size = size
        self._memo: dict = {}
        self._state = None
        self._lock = threading.Lock()

    def _current(self) -> bool:
        """Whether the model's configs are as they were when the memo was filled (else forget it)."""
        model = self.hf_model
        try:
            same = self._state is not None and self._state[0] is model.generation_config and \
                self._state[1] is model.config and bool(self._state[2] == model.generation_config.__dict__) and \
                bool(self._state[3] == model.config.__dict__)
        except Exception:  # a value that does not compare as a bool (a tensor): never memoize
            same = False
        if not same:
            self._memo.clear()
            self._state = None
        return same

    def resolve(self, given: GenerationConfig | None, kwargs: dict) -> tuple[GenerationConfig, dict]:
        """`resolve_config(hf_model, given, kwargs)`; the config is the caller's own to change."""
        try:
            key = None if given is not None else _frozen(kwargs)
        except TypeError:
            key = None
        if key is None:
            return resolve_config(self.hf_model, given, kwargs)
        with self._lock:  # a server's threads may add requests at once
            hit = self._memo.get(key) if self._current() else None
            if hit is not None:
                return copy.copy(hit[0]), dict(hit[1])
            config, flags = resolve_config(self.hf_model, given, kwargs)
            if self._state is None:
                model = self.hf_model
                try:
                    snapshot = copy.deepcopy((model.generation_config.__dict__, model.config.__dict__))
                except Exception:  # a config that cannot be copied: resolve every call
                    return config, flags
                self._state = (model.generation_config, model.config, *snapshot)
            if len(self._memo) >= self.size:
                self._memo.pop(next(iter(self._memo)))
            self._memo[key] = (copy.deepcopy(config), dict(flags))
            return config, flags


def plan_generation(hf_model, config: GenerationConfig, flags: dict, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, logits_processor=None, stopping_criteria=None, tokenizer=None,
                    prefix_allowed_tokens_fn=None) -> GenerationPlan:
    """Lengths, processors and criteria for a (possibly expanded) left-padded batch, as HF builds them."""
    B, T = input_ids.shape
    device = input_ids.device
    _call(hf_model._prepare_special_tokens, generation_config=config, kwargs_has_attention_mask=True,
          device=device, batch_size=B)
    if flags["zero"]:
        max_new = 0
    else:
        config = _call(hf_model._prepare_generated_length, generation_config=config,
                       has_default_max_length=flags["has_default_max_length"],
                       has_default_min_length=flags["has_default_min_length"], model_input_name="input_ids",
                       inputs_tensor=input_ids, input_ids_length=T)
        max_new = max(config.max_length - T, 0)
    processors = _call(
        hf_model._get_logits_processor, generation_config=config, input_ids_seq_length=T,
        encoder_input_ids=input_ids, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=LogitsProcessorList(logits_processor or []), device=device,
        model_kwargs={"attention_mask": attention_mask}, negative_prompt_ids=None,
        negative_prompt_attention_mask=None)
    processors = _drop_redundant_min_length(processors, T)
    criteria = _call(hf_model._get_stopping_criteria, generation_config=config,
                     stopping_criteria=StoppingCriteriaList(stopping_criteria or []), tokenizer=tokenizer)
    # Max length and EOS are what the loop checks itself (on the device, no sync per step).
    only_builtin = all(isinstance(c, (MaxLengthCriteria, EosTokenCriteria)) for c in criteria)
    eos_tensor = config._eos_token_tensor
    eos = [] if eos_tensor is None else [int(e) for e in eos_tensor.reshape(-1).tolist()]
    pad_tensor = config._pad_token_tensor
    pad = int(pad_tensor) if pad_tensor is not None else (eos[0] if eos else 0)
    return GenerationPlan(config, max_new, processors, None if only_builtin else criteria, eos, pad,
                          bool(config.output_scores), bool(config.output_logits))
