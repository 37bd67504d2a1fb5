"""OpenAI request shapes accepted by `lorazor serve`, and the error body every failure is answered with.

Every field a request may hold is declared here, with strict types (`true` is not 1, `"2"` is not 2).
A field is either honoured or refused by name: an unknown field is a 400 naming it (as OpenAI's
API answers "Unrecognized request argument"), and a known field LoRazor does not implement
(`suffix`, the legacy `functions`, ...) is a 400 saying so. Structured outputs (`response_format`,
vLLM's `structured_outputs`) and tools (`tools`, `tool_choice`) become one grammar per request
(`structured_spec`, `serve/tools.py`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from ..engine import MAX_CACHE_SALT_CHARS
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
# Tools one chat request may declare (OpenAI allows 128).
MAX_TOOLS = 128
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


class JsonSchemaFormat(Strict):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    # "schema" shadows a pydantic BaseModel attribute: held as schema_, read and written as "schema".
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None  # honoured: outputs always follow the schema exactly

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(Strict):
    """OpenAI's `response_format`: text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError("response_format", "response_format of type 'json_schema' needs json_schema (and only "
                                                "that type takes it)")
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    # "json" shadows a pydantic BaseModel method: held as json_, read and written as "json".
    json_: StrictStr | dict[str, Any] | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="after")
    def _one(self):
        given = [k for k, v in self.spec().items()]
        if len(given) != 1:
            raise FieldError("structured_outputs", f"structured_outputs takes exactly one of json, regex, choice, "
                                                   f"grammar, json_object; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise FieldError("structured_outputs", "structured_outputs.choice must be a non-empty list of non-empty "
                                                   "strings")
        return self

    def spec(self) -> dict:
        return {k: v for k, v in self.model_dump(by_alias=True).items() if v not in (None, False)}


class FunctionDefinition(Strict):
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-.]+$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: StrictStr
    arguments: StrictStr


class ToolCall(Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


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
    # OpenAI's structured output, and vLLM's (`structured_outputs`; its older `guided_*` fields too).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

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
        given = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None and not (name == "response_format" and self.response_format.type ==
                                                             "text")]
        if len(given) > 1:
            raise FieldError(given[1], f"give one way to constrain the output, got {given}")
        return self

    def structured_spec(self) -> tuple[dict | None, str | None]:
        """(the engine's `structured_output` spec, the field it came from), or (None, None)."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return {"json_object": True}, "response_format"
        if fmt is not None and fmt.type == "json_schema":
            spec = {"json": fmt.json_schema.schema_}
            if fmt.json_schema.strict:
                spec["strict"] = True
            return spec, "response_format"
        if self.structured_outputs is not None:
            return self.structured_outputs.spec(), "structured_outputs"
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                return {kind: getattr(self, name)}, name
        return None, None

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
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result: the call it answers

    @model_validator(mode="after")
    def _check(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise FieldError("messages", f"a {self.role} message needs content (only an assistant message with "
                                         "tool_calls may leave it null)")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("messages", "only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise FieldError("messages", "a tool message needs tool_call_id (and only a tool message takes it)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Declared so that a request using it gets a clear refusal, not "unknown field".
    functions: list[Any] | None = None

    @model_validator(mode="after")
    def _refuse(self):
        if self.functions:
            raise FieldError("functions", "functions (the legacy function calling) is not supported: use tools")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", f"tools holds a function name twice: {names}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                                            f"among tools {names}")
        if choice == "required" and not names:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        if self.tools and self.tool_choice not in (None, "none") and self.structured_spec()[0] is not None:
            raise FieldError("tool_choice", "tools with a tool_choice other than none and a response format "
                                            "constrain the output twice: give one")
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
