"""OpenAI request shapes accepted by `lorazor serve`, their mapping to engine arguments, and the text
helpers (incremental decoding, stop sequences left out of the returned text, as OpenAI does)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's default `max_tokens` for completions.
DEFAULT_MAX_TOKENS = 16


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored, as OpenAI's API
    does; known fields of the wrong type are a 400."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, description="LoRazor extension (as vLLM's)")
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1)
    release: int | Literal["never"] | None = Field(default=None, description="LoRazor extension: StepTrim release")
    logprobs: bool | int | None = None


class CompletionRequest(SamplingFields):
    # Text, a one-element list of text, or token ids (as OpenAI's API and vLLM accept).
    prompt: str | list[str] | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class LoadAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadAdapterRequest(BaseModel):
    lora_name: str


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def stops_of(request: SamplingFields) -> list[str]:
    return [request.stop] if isinstance(request.stop, str) else list(request.stop or [])


def generation_kwargs(request: SamplingFields, tokenizer, max_tokens: int | None) -> dict:
    """Engine `add_request` arguments for an OpenAI request (OpenAI semantics: temperature 0 is
    greedy; no top-k unless `top_k` is given)."""
    if request.n != 1:
        raise ApiError(400, f"n={request.n} is not supported: send one request per completion", param="n")
    if request.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    temperature = 1.0 if request.temperature is None else request.temperature
    kwargs = dict(max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, release=request.release)
    if temperature == 0:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_p=request.top_p or 1.0, top_k=request.top_k or 0)
    stops = stops_of(request)
    if stops:
        kwargs.update(stop_strings=stops)  # the engine matches them with its tokenizer
    return kwargs


def visible_text(text: str, stops: list[str], finished: bool) -> str:
    """The part of `text` that can be sent: cut before a stop sequence, and while unfinished, held
    back where a stop sequence may be starting."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        return text[:cut]
    if finished or not stops:
        return text
    hold = max(len(s) for s in stops) - 1
    return text[:max(len(text) - hold, 0)]


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


class IncrementalText:
    """The text of a growing list of generated tokens, decoded a few tokens at a time.

    Decoding the whole output at every step costs O(length) per request and step; this decodes
    only the tokens since the last complete character (as vLLM's incremental detokenizer does):
    the text of tokens [prefix, read) is known, and the text of [prefix, end) minus it is new,
    unless it ends in an incomplete character (U+FFFD), which waits for the next token.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0
        self._read = 0

    def update(self, token_ids: list[int], finished: bool = False) -> str:
        """The full text so far. When `finished`, the whole output is decoded once, so the final
        text is exactly the tokenizer's decode of all of it."""
        if finished:
            self.text = self._decode(token_ids)
            return self.text
        known = self._decode(token_ids[self._prefix:self._read])
        new = self._decode(token_ids[self._prefix:])
        if len(new) > len(known) and not new.endswith("\ufffd"):
            self.text += new[len(known):]
            self._prefix, self._read = self._read, len(token_ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
