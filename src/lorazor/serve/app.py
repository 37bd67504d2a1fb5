"""The OpenAI-compatible HTTP app over a `LoRazorEngine` (FastAPI, server-sent events for streams).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (vLLM's shapes), `GET /health`,
`GET /metrics`. The request's `model` names an adapter, or the base model by its served name.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..adapters import AdapterError
from .engine_process import EngineDeadError
from .engines import REQUEST_ERRORS, LocalEngine
from .metrics import ServerMetrics
from .protocol import (FINISH_REASONS, ApiError, ChatRequest, CompletionRequest, IncrementalText, LoadAdapterRequest,
                       SamplingFields, UnloadAdapterRequest, generation_kwargs, stops_of, visible_text)

log = logging.getLogger("lorazor.serve")


# How often (seconds) Python hands its thread lock between threads while the server runs. At the
# default 5 ms, an engine on a thread of this process (`LocalEngine`) can wait up to 5 ms for the
# lock after each GPU wait while the event loop writes streams. On the H200 the shorter interval cut
# that engine's TPOT at 100 req/s from 46 to 31 ms, though not its knee (0.55x); `EngineProcess`
# avoids the contention altogether.
SWITCH_INTERVAL_S = 0.0005


def build_app(engine, tokenizer, model_name: str = "base", chat_template: str | None = None,
              switch_interval: float | None = SWITCH_INTERVAL_S) -> FastAPI:
    """The app serving `engine`, with `tokenizer` for text in and out.

    Args:
        engine: a `LoRazorEngine` (its steps run on a thread of this process), or an
            `EngineProcess` (the engine in a process of its own: `lorazor serve`'s default).
        model_name: the name under which the base model (no adapter) is served.
        chat_template: a Jinja chat template for tokenizers without one (else chat requests get 400).
        switch_interval: `sys.setswitchinterval` while the app runs (restored at shutdown); None
            leaves Python's own.
    """
    from ..engine.engine import LoRazorEngine

    if isinstance(engine, LoRazorEngine):
        engine = LocalEngine(engine, tokenizer)

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
        log.info("shutdown: aborted %d in-flight requests", aborted)

    app = FastAPI(title="LoRazor", lifespan=lifespan)
    metrics = ServerMetrics()

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, err: EngineDeadError):
        return JSONResponse(ApiError(503, str(err), kind="service_unavailable").body(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = first.get("loc", ())
        param = str(loc[1]) if len(loc) > 1 else None  # ("body", field, <union member>...)
        return JSONResponse(ApiError(400, f"invalid request: {first.get('msg', err)}", param=param).body(), 400)

    def adapter_for(name: str) -> str | None:
        if name == model_name:
            return None
        if name not in engine.adapter_names:
            raise ApiError(404, f"model {name!r} not found: serve {model_name!r} or one of the adapters "
                                f"{engine.adapter_names}", kind="not_found_error", param="model")
        return name

    def add_args(request: SamplingFields, prompt_ids: list[int], max_tokens: int | None) -> dict:
        kwargs = generation_kwargs(request, tokenizer, max_tokens)
        return dict(prompt_ids=prompt_ids, adapter=adapter_for(request.model), seed=request.seed, **kwargs)

    async def deltas(stream, stops: list[str]):
        """(visible text delta, RequestOutput) per step of one request's `stream` (several steps
        when the client reads slower than they come); the last has `finished`."""
        sent = ""
        decoded = IncrementalText(tokenizer)
        try:
            async for out in stream:
                text = visible_text(decoded.update(out.token_ids, out.finished), stops, out.finished)
                if not text.startswith(sent):  # the final full decode differs from the increments
                    text = sent
                if len(text) > len(sent) or out.finished:
                    yield text[len(sent):], out
                    sent = text
                if out.finished:
                    metrics.observe(out)
        finally:
            await stream.aclose()  # a client that went away aborts its request

    def usage(prompt_ids, out) -> dict:
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(prompt_ids) + len(out.token_ids)}

    def extension(out) -> dict:
        skip = 0.0 if out.decode_steps == 0 else 1.0 - out.lora_decode_steps / out.decode_steps
        return {"release_step": out.release_step, "skip_fraction": skip}

    async def respond(request: SamplingFields, prompt_ids: list[int], max_tokens, chat: bool):
        args = add_args(request, prompt_ids, max_tokens)
        stops = stops_of(request)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice(text, finish, delta: bool):
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

        try:  # every check before anything is generated: a bad request gets a 4xx, never a broken stream
            stream = await engine.generate(rid, args)
        except REQUEST_ERRORS as err:
            raise ApiError(400, str(err).strip('"')) from err
        if not request.stream:
            text, out = "", None
            async for delta, out in deltas(stream, stops):
                text += delta
            return {"id": rid, "object": kind, "created": created, "model": request.model,
                    "choices": [choice(text, FINISH_REASONS[out.finish_reason], False)],
                    "usage": usage(prompt_ids, out), "lorazor": extension(out)}

        async def events():
            async for delta, out in deltas(stream, stops):
                finish = FINISH_REASONS[out.finish_reason] if out.finished else None
                body = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "created": created,
                        "model": request.model, "choices": [choice(delta, finish, True)]}
                if out.finished:
                    body["usage"] = usage(prompt_ids, out)
                    body["lorazor"] = extension(out)
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return await respond(request, list(prompt), request.max_tokens, chat=False)  # token ids
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} strings: send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "prompt is empty", param="prompt")
        return await respond(request, tokenizer(prompt)["input_ids"], request.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions, or start the "
                                "server with --chat-template", param="messages")
        messages = [m.model_dump() for m in request.messages]
        text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return await respond(request, prompt_ids, request.max_completion_tokens or request.max_tokens, chat=True)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = [{"id": model_name, "object": "model", "created": created, "owned_by": "lorazor", "root": model_name,
                 "parent": None}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "lorazor", "root": name,
                  "parent": model_name} for name in engine.adapter_names]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(request: LoadAdapterRequest):
        try:  # between two steps of the engine
            await engine.register_adapter(request.lora_name, request.lora_path)
        except (AdapterError, ValueError, OSError) as err:
            raise ApiError(400, str(err), param="lora_path") from err
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(request: UnloadAdapterRequest):
        try:
            await engine.unregister_adapter(request.lora_name)
        except KeyError as err:
            raise ApiError(404, str(err).strip('"'), kind="not_found_error", param="lora_name") from err
        except AdapterError as err:
            raise ApiError(400, str(err), param="lora_name") from err
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():  # 503 once the engine is gone, so a supervisor restarts the server
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(await engine.stats()), media_type=metrics.content_type)

    return app
