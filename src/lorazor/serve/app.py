"""The OpenAI-compatible HTTP app over a `LoRazorEngine` (FastAPI, server-sent events for streams).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/models/{id}`,
`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (vLLM's shapes; off unless the operator
enables runtime loading), `POST /tokenize`, `POST /detokenize`, `GET /version`, `GET /health`,
`GET /metrics`. The request's `model` names an adapter, or the base model by its served name.
Tokenizing and chat templates run on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from .. import __version__
from ..adapters import AdapterError
from . import errors
from .engines import LocalEngine
from .guards import GuardMiddleware, ServerSettings, check_runtime_load
from .metrics import ServerMetrics
from .protocol import (
    MAX_CHOICES,
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadAdapterRequest,
    TokenizeRequest,
    UnloadAdapterRequest,
)
from .responses import Choice, Response as OpenAIResponse
from .sampling import choice_seed, generation_kwargs

log = logging.getLogger("lorazor.serve")

# How often (seconds) Python hands its thread lock between threads while the server runs. At the
# default 5 ms, an engine on a thread of this process (`LocalEngine`) can wait up to 5 ms for the
# lock after each GPU wait while the event loop writes streams. On the H200 the shorter interval cut
# that engine's TPOT at 100 req/s from 46 to 31 ms, though not its knee (0.55x); `EngineProcess`
# avoids the contention altogether.
SWITCH_INTERVAL_S = 0.0005


def build_app(engine, tokenizer, model_name: str = "base", chat_template: str | None = None,
              switch_interval: float | None = SWITCH_INTERVAL_S, settings: ServerSettings | None = None,
              on_engine_dead=None) -> FastAPI:
    """The app serving `engine`, with `tokenizer` for text in and out.

    Args:
        engine: a `LoRazorEngine` (its steps run on a thread of this process), or an
            `EngineProcess` (the engine in a process of its own: `lorazor serve`'s default).
        model_name: the name under which the base model (no adapter) is served.
        chat_template: a Jinja chat template for tokenizers without one (else chat requests get 400).
        switch_interval: `sys.setswitchinterval` while the app runs (restored at shutdown); None
            leaves Python's own.
        settings: API key, runtime adapter loading and limits (`ServerSettings()`: no key, no
            runtime loading).
        on_engine_dead: called once the engine process has died (after every open stream got its
            error event); `lorazor serve` stops the server and exits non-zero.
    """
    from ..engine.engine import LoRazorEngine

    if isinstance(engine, LoRazorEngine):
        engine = LocalEngine(engine, tokenizer)
    settings = settings or ServerSettings()
    metrics = ServerMetrics(model_name)
    # One worker thread for the tokenizer: off the event loop, and never two calls into one
    # tokenizer at once (HF's fast tokenizers can refuse concurrent use: "Already borrowed").
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="lorazor-tokenizer")

    async def off_loop(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(tokenizing, functools.partial(fn, *args, **kwargs))

    def engine_died():
        log.error("the engine process died: answering 503 from now on")
        if on_engine_dead is not None:
            on_engine_dead()

    engine.on_dead.append(engine_died)

    @asynccontextmanager
    async def lifespan(_):
        before = sys.getswitchinterval()
        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)
        engine.start()
        try:
            yield
        finally:
            sys.setswitchinterval(before)
        aborted = await engine.shutdown()
        tokenizing.shutdown(wait=False)
        log.info("shutdown: aborted %d in-flight requests", aborted)

    async def engine_alive(request: Request):
        if not engine.alive and request.url.path not in ("/health", "/metrics"):
            raise ApiError(503, "the engine process exited: the server cannot serve requests",
                           kind="service_unavailable")

    app = FastAPI(title="LoRazor", version=__version__, lifespan=lifespan, dependencies=[Depends(engine_alive)])
    app.state.engine, app.state.metrics = engine, metrics  # for hosts that embed the app (lorazor.ray)
    errors.install(app)
    app.add_middleware(GuardMiddleware, settings=settings)

    def adapter_for(name: str) -> str | None:
        if name == model_name:
            return None
        if name not in engine.adapter_names:
            raise ApiError(404, f"model {name!r} not found: serve {model_name!r} or one of the adapters "
                                f"{engine.adapter_names}", kind="not_found_error", param="model")
        return name

    def checked_text(text: str, param: str) -> str:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as err:
            raise ApiError(400, f"{param} is not valid Unicode: {err.reason} at character {err.start}",
                           param=param) from err
        if size > settings.max_prompt_bytes:
            raise ApiError(400, f"{param} is {size} bytes, more than --max-prompt-bytes={settings.max_prompt_bytes}",
                           param=param)
        return text

    async def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return (await off_loop(tokenizer, text, add_special_tokens=add_special_tokens))["input_ids"]

    async def chat_prompt(messages, add_generation_prompt: bool = True) -> str:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions, or start the "
                                "server with --chat-template", param="messages")
        plain = [{"role": m.role, "content": checked_text(m.text, "messages")} for m in messages]
        if sum(len(m["content"].encode()) for m in plain) > settings.max_prompt_bytes:
            raise ApiError(400, f"messages hold more than --max-prompt-bytes={settings.max_prompt_bytes} bytes",
                           param="messages")
        try:
            return await off_loop(tokenizer.apply_chat_template, plain, chat_template=template,
                                  add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as err:  # a template's own error (raise_exception, undefined names, ...)
            raise ApiError(400, f"the chat template failed on these messages: {type(err).__name__}: {err}",
                           param="messages") from err

    def choices_for(request, prompts: list[tuple[list[int], str]], max_tokens, logprobs) -> list[Choice]:
        adapter = adapter_for(request.model)
        base = generation_kwargs(request, tokenizer, max_tokens, logprobs)
        return [Choice(p * request.n + i, ids, dict(base, prompt_ids=ids, adapter=adapter,
                                                    seed=choice_seed(request.seed, p * request.n + i)), echo)
                for p, (ids, echo) in enumerate(prompts) for i in range(request.n)]

    async def respond(request, choices: list[Choice], chat: bool, logprobs: int | None):
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        response = OpenAIResponse(engine, tokenizer, metrics, request.model, chat, request.stops, logprobs,
                                  include_usage)
        return await (response.streamed(choices) if request.stream else response.full(choices))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(prompt) * request.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompt)} prompts x n={request.n} choices is more than {MAX_CHOICES}", param="n")
        prompts = []
        for item in prompt:
            if isinstance(item, str):
                if not item:
                    raise ApiError(400, "prompt is empty", param="prompt")
                ids = await encode(checked_text(item, "prompt"))
                prompts.append((ids, item if request.echo else ""))
            else:
                if not item:
                    raise ApiError(400, "prompt holds an empty token list", param="prompt")
                vocab = engine.info["vocab_size"]
                bad = next((t for t in item if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ApiError(400, f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})",
                                   param="prompt")
                echo = tokenizer.decode(item, skip_special_tokens=True) if request.echo else ""
                prompts.append((list(item), echo))
        choices = choices_for(request, prompts, request.max_tokens, request.logprobs)
        return await respond(request, choices, chat=False, logprobs=request.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        text = await chat_prompt(request.messages)
        ids = await encode(text, add_special_tokens=False)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        choices = choices_for(request, [(ids, "")], request.max_completion_tokens or request.max_tokens, logprobs)
        return await respond(request, choices, chat=True, logprobs=logprobs)

    def model_card(name: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "lorazor", "root": name, "parent": parent,
                "max_model_len": engine.info["max_model_len"]}

    @app.get("/v1/models")
    async def models():
        data = [model_card(model_name, None)] + [model_card(n, model_name) for n in engine.adapter_names]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        adapter_for(name)
        return model_card(name, None if name == model_name else model_name)

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(request: LoadAdapterRequest):
        path = check_runtime_load(settings, request.lora_name, request.lora_path, engine.adapter_names, {model_name},
                                  request.load_inplace)
        try:  # between two steps of the engine
            await engine.register_adapter(request.lora_name, path, request.load_inplace)
        except (AdapterError, ValueError, OSError) as err:
            raise ApiError(400, str(err), param="lora_path") from err
        log.info("adapter %r registered from %s", request.lora_name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(request: UnloadAdapterRequest):
        if not settings.enable_runtime_lora:
            raise ApiError(403, "runtime adapter loading is disabled: start the server with --enable-runtime-lora",
                           kind="permission_error")
        try:
            await engine.unregister_adapter(request.lora_name)
        except KeyError as err:
            raise ApiError(404, str(err).strip('"'), kind="not_found_error", param="lora_name") from err
        except AdapterError as err:
            raise ApiError(400, str(err), param="lora_name") from err
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        if request.model is not None:
            adapter_for(request.model)
        if request.messages is not None:
            ids = await encode(await chat_prompt(request.messages, request.add_generation_prompt), False)
        else:
            ids = await encode(checked_text(request.prompt, "prompt"), request.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.info["max_model_len"], "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        if request.model is not None:
            adapter_for(request.model)
        vocab = engine.info["vocab_size"]
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens holds id {bad[0]}, outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await off_loop(tokenizer.decode, request.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():  # 503 once the engine is gone, so a supervisor restarts the server
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(await engine.stats()), media_type=metrics.content_type)

    return app
