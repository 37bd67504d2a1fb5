"""A request in the engine: prompt, adapter, sampling plan, StepTrim state, output and timestamps."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from ..model.hf_generation import GenerationPlan
from ..policies.base import NEVER
from ..runner import decode_counts


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenPrefix:
    """The first `n` tokens of a list that only grows (a request's output): what an output reports
    without copying the whole list every step, which would make a step's host time grow with the
    outputs' lengths. Length, indexing, slicing and iteration read the list in place; equality
    compares with lists; `copy.deepcopy` (and `dataclasses.asdict`) give a plain list."""

    __slots__ = ("source", "n")

    def __init__(self, source: list, n: int | None = None):
        self.source = source
        self.n = len(source) if n is None else n

    def as_list(self) -> list:
        return self.source[:self.n]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.source[slice(*key.indices(self.n))]
        index = key + self.n if key < 0 else key
        if not 0 <= index < self.n:
            raise IndexError("token index out of range")
        return self.source[index]

    def __iter__(self):
        # islice: the list may grow while the iterator is in use (the engine's thread appends).
        return itertools.islice(self.source, self.n)

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenPrefix):
            other = other.as_list()
        return isinstance(other, list) and len(other) == self.n and self.as_list() == other

    __hash__ = None

    def __deepcopy__(self, memo) -> list:
        return self.as_list()

    def __repr__(self) -> str:
        return repr(self.as_list())


@dataclass
class RequestOutput:
    """One request's state as `LoRazorEngine.step` reports it.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated in this step (empty for a prefill chunk that produced none).
        tokens: every token generated so far, as a `TokenPrefix` (len, slices, iteration, no copy);
            `token_ids` is the same as a list.
        finished: whether the request is done; finish_reason: "eos", "length", "stop", "abort", or
            "error" (it could not run: `error` says why, e.g. its adapter failed to load).
        release_step: the decode step at which it released its adapter (-1: never, or no adapter).
        decode_steps, lora_decode_steps: decode forwards run, and of those, with the adapter.
        arrival_time, first_token_time, finish_time: `time.monotonic()` stamps (None until reached).
        num_cached_tokens: prompt tokens whose KV came from the prefix cache (vLLM's name).
    """

    request_id: str
    new_token_ids: list[int]
    tokens: TokenPrefix
    finished: bool
    finish_reason: str | None
    release_step: int
    decode_steps: int
    lora_decode_steps: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None
    # Per new token, when the request asked for log-probabilities: (its logprob, [(token, logprob)]
    # for the `logprobs` most likely tokens).
    new_logprobs: list | None = None
    scheduled_time: float | None = None  # when a step first ran it (queue time = this - arrival_time)
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        """Every token generated so far (a list, made on first use)."""
        if not isinstance(self.tokens, list):
            self.tokens = self.tokens.as_list()
        return self.tokens

    @property
    def num_tokens(self) -> int:
        """How many tokens were generated so far."""
        return len(self.tokens)

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (s)."""
        if self.finish_time is None or self.first_token_time is None or self.num_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_tokens - 1)


@dataclass(eq=False)
class Request:
    """Engine-side state of one request (see `LoRazorEngine.add_request`)."""

    request_id: str
    prompt: list[int]
    adapter: str | None
    plan: GenerationPlan
    # StepTrim: the request's policy (its own or the model's default; None: none), and its own
    # fixed release length (an int k, "never", or None: the policy decides).
    policy: object = None
    release: int | str | None = None
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose keys and values are in the cache
    block_table: list[int] = field(default_factory=list)
    release_step: int = -1
    # Tokens computed on the device but not read back yet (async scheduling: the step in flight).
    pending: int = 0
    table_row: int | None = None  # row of the engine's device block table while running
    table_synced: int = 0  # blocks of `block_table` already written to that row
    finish_reason: str | None = None
    error: str | None = None  # why it ended with finish reason "error"
    logprobs: int | None = None  # top log-probabilities reported per token (0: the chosen token's only)
    logprob_processors: object = None  # processors whose output the log-probabilities describe
    last_logprobs: tuple | None = None  # the last sampled token's (logprob, top list)
    last_scores: torch.Tensor | None = None  # the processed scores of the last sampled token
    # Greedy with no logits processor and no stopping criterion but EOS and length: sampled with the
    # whole step's other such rows in one argmax.
    plain_greedy: bool = False
    sampling: object = None  # `runner.sampling.SamplingParams` when sampled in a batch with other requests
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    scheduled_time: float | None = None
    # Prefix caching (`blocks.py`): the identity of what computes this request's KV, the hash chain of
    # its full cacheable blocks, how many of its blocks are in the cache, and how many prompt tokens
    # its first admission found there (None until admitted).
    cache_identity: bytes = b""
    adapter_digest: bytes | None = None  # its adapter's digest when it was checked (`registry.acquire`)
    constraint: object = None  # its grammar matcher (`runner.grammar.Constraint`), if structured output
    block_hashes: list = field(default_factory=list)
    blocks_cached: int = 0
    num_cached_tokens: int | None = None

    def __post_init__(self):
        self.tokens: list[int] = list(self.prompt)  # prompt and generated tokens (kept in step)

    def fail(self, what: str, err: Exception) -> None:
        """Record that this request's own code (`what`) raised `err`: it ends with finish reason "error"
        and this reason; the requests beside it go on."""
        self.error = f"{what} failed: {type(err).__name__}: {err}"

    def append(self, token: int) -> None:
        self.output.append(token)
        self.tokens.append(token)

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, those still on the device included."""
        return len(self.tokens) + self.pending

    @property
    def has_all_tokens(self) -> bool:
        """Whether the tokens on the device already reach `max_new_tokens`: nothing more to compute."""
        return len(self.output) + self.pending >= self.plan.max_new_tokens

    def record_decision(self, forward: int, keep: bool) -> None:
        """The device's release decision for decode forward `forward` (one-way: the first release
        stays; a recompute after preemption replays it through `release_step`)."""
        if not keep and self.release_step < 0:
            self.release_step = forward

    @property
    def needs_decisions(self) -> bool:
        """Whether its next decode forward needs a release decision (it holds its adapter and has a
        policy or a fixed length)."""
        return (self.adapter is not None and self.release_step < 0 and self.release != NEVER
                and (self.policy is not None or self.release is not None))

    @property
    def cacheable_len(self) -> int:
        """Positions whose KV its identity computes: tokens known on the host (their release
        decisions too), before a release (after it the backbone computed them: never cached)."""
        if self.adapter is not None and self.release_step >= 0:
            return min(len(self.tokens), len(self.prompt) + self.release_step)
        return len(self.tokens)

    def uses_adapter_at(self, position: int) -> bool:
        """Whether the forward at `position` runs with the adapter: prefill always does; decode
        forward d (at position len(prompt) + d) does while d is before the release step."""
        if self.adapter is None:
            return False
        decode = position - len(self.prompt)
        if decode < 0:
            return True
        return self.release_step < 0 or decode < self.release_step

    @property
    def holds_adapter(self) -> bool:
        """Whether its next computed position still runs with its adapter, so the adapter needs a GPU
        slot: False once the host knows it released (StepTrim releases for good: the slot may go to
        another adapter; a preempted request's recompute is admitted, and loaded, again)."""
        return self.adapter is not None and self.uses_adapter_at(self.num_computed)

    def report(self, new_tokens: list[int], new_logprobs: list | None = None) -> RequestOutput:
        decode_steps, lora_steps = decode_counts(len(self.output), self.release_step, self.adapter is not None)
        return RequestOutput(self.request_id, new_tokens, TokenPrefix(self.output), self.status is Status.FINISHED,
                             self.finish_reason, self.release_step, decode_steps, lora_steps, self.arrival_time,
                             self.first_token_time, self.finish_time, self.error, new_logprobs,
                             self.scheduled_time, self.num_cached_tokens or 0)
