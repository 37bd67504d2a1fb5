"""OpenAI request shapes accepted by `lorazor serve`, and the error body every failure is answered with.

Every field a request may hold is declared here, with strict types (`true` is not 1, `"2"` is not 2).
A field is either honoured or refused by name: an unknown field is a 400 naming it (as OpenAI's
API answers "Unrecognized request argument"), and a known field LoRazor does not implement
(`suffix`, `tools`, a `response_format` other than text, ...) is a 400 saying so.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from ..engine.blocks import MAX_CACHE_SALT_CHARS
from ..model.hf_generation import REPETITION_PENALTY_RANGE
from ..policies.base import MAX_RELEASE

# OpenAI's default `max_tokens` for completions.
DEFAULT_MAX_TOKENS = 16
# torch.Generator takes seeds in [-2**63, 2**64).
SEED_RANGE = (-(2**63), 2**64 - 1)
# Completions and choices one request may ask for (n x prompts), as a bound on the work it queues.
MAX_CHOICES = 128
# Stop sequences per request (OpenAI allows 4; vLLM more).
MAX_STOPS = 16
# OpenAI's bounds: `logprobs` on completions up to 5 (vLLM: 20), `top_logprobs` on chat up to 20.
MAX_LOGPROBS = 20

Number = StrictFloat | StrictInt


class FieldError(ValueError):
    """A refusal that names the request field it is about (the error body's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    # NaN and infinities (which JSON parsers take) fail as "should be a finite number", before any bound.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: StrictBool = False


class SamplingFields(Strict):
    """Fields shared by completions and chat completions (OpenAI's, and vLLM's extensions marked)."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, Number] | None = None
    user: StrictStr | None = None  # OpenAI's end-user id: accepted, used for nothing
    # vLLM's extensions
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Number | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                              le=REPETITION_PENALTY_RANGE[1])
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    # LoRazor's extension: StepTrim release per request ("never", or after k decode steps)
    release: StrictInt | Literal["never"] | None = None
    # vLLM's: mixed into the prefix cache's block hashes; requests with different salts share no KV.
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="after")
    def _check(self):
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):  # JSON parsers take NaN and Infinity
                raise FieldError(name, f"{name} must be a finite number, got {value}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise FieldError("stop", "stop sequences must be non-empty strings")
        if len(stops) > MAX_STOPS:
            raise FieldError("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() also takes "²" (int() refuses it) and other scripts' digits.
            if not (key.isascii() and key.isdigit()) or not -100 <= value <= 100:
                raise FieldError(
                    "logit_bias", f"logit_bias maps token ids to values in [-100, 100]; got {key!r}: {value!r}"
                )
        if isinstance(self.release, int) and not 0 <= self.release <= MAX_RELEASE:
            raise FieldError("release", f"release must be 'never' or an int in [0, {MAX_RELEASE}], got {self.release}")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    # Text, a list of texts, token ids, or a list of token-id lists (as OpenAI's API accepts).
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: StrictInt | None = Field(default=None, ge=1)
    suffix: StrictStr | None = None

    @model_validator(mode="after")
    def _refuse(self):
        if self.suffix:
            raise FieldError("suffix", "suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", f"best_of={self.best_of} is not supported: only best_of equal to n ({self.n})")
        if self.echo and self.logprobs is not None:
            raise FieldError(
                "echo", "echo with logprobs would need the prompt's log-probabilities, which are not supported"
            )
        return self


class TextPart(Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Declared so that a request using them gets a clear refusal, not "unknown field".
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _refuse(self):
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise FieldError(name, f"{name} (function calling) is not supported")
        if self.tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice is not supported (function calling)")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise FieldError(
                "response_format", f"response_format {self.response_format.get('type')!r} is not supported: only 'text'"
            )
        if self.response_format is not None and set(self.response_format) != {"type"}:
            extra = sorted(set(self.response_format) - {"type"})
            raise FieldError("response_format", f"response_format of type 'text' takes no other field, got {extra}")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self


class TokenizeRequest(Strict):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class LoadAdapterRequest(Strict):
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False  # vLLM's: replace an adapter of that name


class UnloadAdapterRequest(Strict):
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None  # vLLM's; accepted, the name decides


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def error_kind(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
