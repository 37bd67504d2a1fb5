"""The server's routes, as module-level functions on one `APIRouter`; each reads the server's
`ServerState` from `request.app.state.server` (set by `app.build_app`).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/models/{id}`,
`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (vLLM's shapes; off unless the operator
enables runtime loading), `POST /tokenize`, `POST /detokenize`, `GET /version`, `GET /health`,
`GET /metrics`. The request's `model` names an adapter, or the base model by its served name.
Tokenizing and chat templates run on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from .. import __version__
from ..adapters import AdapterError
from .engines import EngineClient
from .guards import check_runtime_load
from .settings import ServerSettings
from .metrics import ServerMetrics
from .protocol import (
    MAX_CHOICES,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    LoadAdapterRequest,
    TokenizeRequest,
    UnloadAdapterRequest,
)
from .responses import Choice, Response as OpenAIResponse
from .openai_sampling import choice_seed, generation_kwargs
from .tools import ToolPlan, plan_tools, template_messages

router = APIRouter()
log = logging.getLogger("lorazor.serve")


@dataclass
class ServerState:
    """What the routes share: the engine (`LocalEngine` or `EngineProcess`), the tokenizer, the
    operator's settings, the metrics, the served name and chat template."""

    engine: EngineClient
    tokenizer: object
    settings: ServerSettings
    metrics: ServerMetrics
    model_name: str
    chat_template: str | None = None
    # One worker thread for the tokenizer: off the event loop, and never two calls into one
    # tokenizer at once (HF's fast tokenizers can refuse concurrent use: "Already borrowed").
    tokenizing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="lorazor-tokenizer"))
    # Adapters the resolver is registering: name -> the task doing it (concurrent first requests share it).
    resolving: dict = field(default_factory=dict)
    # Adapters the resolver registered, least recently requested first (evicted when idle to make room).
    resolved: OrderedDict = field(default_factory=OrderedDict)
    # Names the resolver refused lately: name -> (monotonic time until which it stays refused, the error).
    refused: dict = field(default_factory=dict)

    async def off_loop(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, functools.partial(fn, *args, **kwargs))


def state_of(request: Request) -> ServerState:
    return request.app.state.server


# ---- helpers --------------------------------------------------------------------------------------
async def adapter_for(state: ServerState, name: str, resolve_unknown: bool = True) -> str | None:
    """The adapter a request's `model` names (None: the base model), or a 404. With the filesystem
    resolver, a generation request's unregistered name that is a folder under `--lora-root` is
    registered first (`resolve_unknown`; lookups such as `GET /v1/models/{id}` register nothing)."""
    if name == state.model_name:
        return None
    if name not in state.engine.adapter_names and resolve_unknown and state.settings.lora_resolver == "filesystem":
        await resolve(state, name)
    if name in state.resolved:
        state.resolved.move_to_end(name)
    if name not in state.engine.adapter_names:
        raise ApiError(404, f"model {name!r} not found: serve {state.model_name!r} or one of the adapters "
                            f"{state.engine.adapter_names}", kind="not_found_error", param="model")
    return name


async def resolve(state: ServerState, name: str) -> None:
    """Register adapter `name` from the folder `--lora-root/name`, once however many requests ask
    at the same time; a name that is no such folder is left unregistered (the caller's 404). The
    checks of a runtime load apply (the reserved name, links under the root), and so do the
    registration's own: a refused folder is a 400, remembered for `RESOLVER_REFUSAL_SECONDS` so a
    client repeating it costs no new read. At the `--max-registered-loras` cap, the adapter the
    resolver registered that was least recently requested and has no unfinished request is
    unregistered to make room, so the cap never locks a tenant out."""
    from ..adapters.loader import ADAPTER_NAME

    folder = state.settings.lora_root / name
    if not ADAPTER_NAME.fullmatch(name) or not folder.is_dir():
        return
    until, error = state.refused.get(name, (0.0, None))
    if time.monotonic() < until:
        raise error
    task = state.resolving.get(name)
    if task is None:
        async def register():
            try:
                await _make_room(state, name)
                path = check_runtime_load(state.settings, name, name, state.engine.adapter_names,
                                          {state.model_name}, replace=False)
                await state.engine.register_adapter(name, path, root=state.settings.lora_root)
                state.resolved[name] = None
                log.info("adapter %r resolved from %s", name, path)
            except (AdapterError, ValueError, OSError) as err:
                error = ApiError(400, f"adapter {name!r} could not be loaded from --lora-root: {err}", param="model")
                state.refused[name] = (time.monotonic() + RESOLVER_REFUSAL_SECONDS, error)
                raise error from err
            finally:
                state.resolving.pop(name, None)

        task = state.resolving[name] = asyncio.ensure_future(register())
    await asyncio.shield(task)  # a client that leaves does not cancel the registration


# How long a name the resolver refused is answered from memory (its folder may be fixed meanwhile).
RESOLVER_REFUSAL_SECONDS = 30.0


async def _make_room(state: ServerState, name: str) -> None:
    """At the registration cap, unregister the least recently requested idle adapter the resolver
    registered (one that unfinished requests use is refused by the engine and skipped)."""
    if len(state.engine.adapter_names) < state.settings.max_registered_loras:
        return
    for victim in [n for n in state.resolved if n != name]:
        try:
            await state.engine.unregister_adapter(victim)
        except (AdapterError, KeyError):  # in use (or gone): try the next
            continue
        state.resolved.pop(victim, None)
        log.info("adapter %r unregistered (least recently requested) to resolve %r", victim, name)
        return


def checked_text(state: ServerState, text: str, param: str) -> str:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{param} is not valid Unicode: {err.reason} at character {err.start}",
                       param=param) from err
    limit = state.settings.max_prompt_bytes
    if size > limit:
        raise ApiError(400, f"{param} is {size} bytes, more than --max-prompt-bytes={limit}", param=param)
    return text


async def encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    return (await state.off_loop(state.tokenizer, text, add_special_tokens=add_special_tokens))["input_ids"]


async def chat_prompt(state: ServerState, messages, add_generation_prompt: bool = True, tools=None) -> str:
    """The prompt text of chat `messages` by the chat template, with `tools` (OpenAI's tool dicts)
    rendered by it where it renders tools."""
    template = state.chat_template or getattr(state.tokenizer, "chat_template", None)
    if not template:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions, or start the "
                            "server with --chat-template", param="messages")
    for m in messages:
        checked_text(state, m.text, "messages")
    plain = template_messages(messages)
    limit = state.settings.max_prompt_bytes
    if sum(len(m["content"].encode()) for m in plain) + len(json.dumps(tools or []).encode()) > limit:
        raise ApiError(400, f"messages hold more than --max-prompt-bytes={limit} bytes", param="messages")
    try:
        return await state.off_loop(state.tokenizer.apply_chat_template, plain, chat_template=template,
                                    add_generation_prompt=add_generation_prompt, tokenize=False,
                                    **({"tools": tools} if tools else {}))
    except Exception as err:  # a template's own error (raise_exception, undefined names, ...)
        raise ApiError(400, f"the chat template failed on these messages: {type(err).__name__}: {err}",
                       param="messages") from err


async def choices_for(state: ServerState, request, prompts: list[tuple[list[int], str]], max_tokens, logprobs,
                      tool_spec: dict | None = None) -> list:
    """One engine request per prompt and choice (`n`), with the choice's seed. A structured output
    (the request's, or `tool_spec`, its tool choice's grammar) is compiled here first, on a worker
    thread: a spec the grammar engine refuses is a 400 naming its field, before anything is queued."""
    spec, field_name = request.structured_spec()
    if tool_spec is not None:
        spec, field_name = tool_spec, "tools"
    adapter = await adapter_for(state, request.model)
    if spec is not None:
        await compile_spec(state, spec, field_name)
    base = generation_kwargs(request, state.tokenizer, max_tokens, logprobs)
    if spec is not None:
        base["structured_output"] = spec
    return [Choice(p * request.n + i, ids, dict(base, prompt_ids=ids, adapter=adapter,
                                                seed=choice_seed(request.seed, p * request.n + i)), echo)
            for p, (ids, echo) in enumerate(prompts) for i in range(request.n)]


async def compile_spec(state: ServerState, spec: dict, field_name: str) -> None:
    """Compile `spec` against the served tokenizer (cached) or answer 400 naming `field_name`."""
    from ..runner.grammar import StructuredOutputError, grammar_cache

    def compile_it():
        grammar_cache(state.tokenizer, state.engine.info["vocab_size"]).compile(spec)

    try:
        await asyncio.get_running_loop().run_in_executor(None, compile_it)
    except StructuredOutputError as err:
        raise ApiError(400, f"{field_name}: {err}", param=field_name) from err


async def respond(state: ServerState, request, choices: list[Choice], chat: bool, logprobs: int | None,
                  tools: ToolPlan | None = None):
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    response = OpenAIResponse(state.engine, state.tokenizer, state.metrics, request.model, chat, request.stops,
                              logprobs, include_usage, tools)
    return await (response.streamed(choices) if request.stream else response.full(choices))


async def completion_prompts(state: ServerState, request: CompletionRequest) -> list[tuple[list[int], str]]:
    """(token ids, echoed text) per prompt of a completions request (text, texts, ids or id lists)."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if len(prompt) * request.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompt)} prompts x n={request.n} choices is more than {MAX_CHOICES}", param="n")
    prompts = []
    vocab = state.engine.info["vocab_size"]
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise ApiError(400, "prompt is empty", param="prompt")
            prompts.append((await encode(state, checked_text(state, item, "prompt")), item if request.echo else ""))
            continue
        if not item:
            raise ApiError(400, "prompt holds an empty token list", param="prompt")
        bad = next((t for t in item if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})", param="prompt")
        echo = state.tokenizer.decode(item, skip_special_tokens=True) if request.echo else ""
        prompts.append((list(item), echo))
    return prompts


def model_card(state: ServerState, name: str, parent: str | None) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "lorazor", "root": name, "parent": parent,
            "max_model_len": state.engine.info["max_model_len"]}


# ---- routes ---------------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = state_of(request)
    prompts = await completion_prompts(state, body)
    choices = await choices_for(state, body, prompts, body.max_tokens, body.logprobs)
    return await respond(state, body, choices, chat=False, logprobs=body.logprobs)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    state = state_of(request)
    settings = state.settings
    try:
        plan, tool_spec = plan_tools(body, settings.enable_auto_tool_choice, settings.tool_call_parser)
    except FieldError as err:
        raise ApiError(400, str(err), param=err.param) from err
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    ids = await encode(state, await chat_prompt(state, body.messages, tools=tools), add_special_tokens=False)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    choices = await choices_for(state, body, [(ids, "")], body.max_completion_tokens or body.max_tokens, logprobs,
                                tool_spec)
    return await respond(state, body, choices, chat=True, logprobs=logprobs, tools=plan)


@router.get("/v1/models")
async def models(request: Request):
    state = state_of(request)
    data = [model_card(state, state.model_name, None)] + [model_card(state, n, state.model_name)
                                                          for n in state.engine.adapter_names]
    return {"object": "list", "data": data}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request):
    state = state_of(request)
    await adapter_for(state, name, resolve_unknown=False)
    return model_card(state, name, None if name == state.model_name else state.model_name)


@router.post("/v1/load_lora_adapter")
async def load_adapter(body: LoadAdapterRequest, request: Request):
    state = state_of(request)
    path = check_runtime_load(state.settings, body.lora_name, body.lora_path, state.engine.adapter_names,
                              {state.model_name}, body.load_inplace)
    try:  # between two steps of the engine
        await state.engine.register_adapter(body.lora_name, path, body.load_inplace, root=state.settings.lora_root)
        state.refused.pop(body.lora_name, None)
    except (AdapterError, ValueError, OSError) as err:
        raise ApiError(400, str(err), param="lora_path") from err
    log.info("adapter %r registered from %s", body.lora_name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_adapter(body: UnloadAdapterRequest, request: Request):
    state = state_of(request)
    if not state.settings.enable_runtime_lora:
        raise ApiError(403, "runtime adapter loading is disabled: start the server with --enable-runtime-lora",
                       kind="permission_error")
    try:
        await state.engine.unregister_adapter(body.lora_name)
        state.resolved.pop(body.lora_name, None)
    except KeyError as err:
        raise ApiError(404, str(err).strip('"'), kind="not_found_error", param="lora_name") from err
    except AdapterError as err:
        raise ApiError(400, str(err), param="lora_name") from err
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = state_of(request)
    if body.model is not None:
        await adapter_for(state, body.model, resolve_unknown=False)
    if body.messages is not None:
        ids = await encode(state, await chat_prompt(state, body.messages, body.add_generation_prompt), False)
    else:
        ids = await encode(state, checked_text(state, body.prompt, "prompt"), body.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.engine.info["max_model_len"], "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = state_of(request)
    if body.model is not None:
        await adapter_for(state, body.model, resolve_unknown=False)
    vocab = state.engine.info["vocab_size"]
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"tokens holds id {bad[0]}, outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens)}


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/health")
async def health(request: Request):  # 503 once the engine is gone, so a supervisor restarts the server
    return Response(status_code=200 if state_of(request).engine.alive else 503)


@router.get("/metrics")
async def prometheus(request: Request):
    state = state_of(request)
    return Response(state.metrics.render(await state.engine.stats()), media_type=state.metrics.content_type)
