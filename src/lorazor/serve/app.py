"""The OpenAI-compatible HTTP app over a `LoRazorEngine` (FastAPI, server-sent events for streams):
`build_app` assembles it from the routes (`routes.py`), the error handlers (`errors.py`) and the
guards (`guards.py`), with the engine started and stopped by the app's lifespan.
"""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from .. import __version__
from . import errors
from .engines import LocalEngine
from .guards import GuardMiddleware
from .settings import ServerSettings
from .metrics import ServerMetrics
from .protocol import ApiError
from .routes import ServerState, router

log = logging.getLogger("lorazor.serve")

# How often (seconds) Python hands its thread lock between threads while the server runs. At the
# default 5 ms, an engine on a thread of this process (`LocalEngine`) can wait up to 5 ms for the
# lock after each GPU wait while the event loop writes streams. On the H200 the shorter interval cut
# that engine's TPOT at 100 req/s from 46 to 31 ms, though not its knee (0.55x); `EngineProcess`
# avoids the contention altogether.
SWITCH_INTERVAL_S = 0.0005
# Routes that answer while the engine is gone (probes and scrapers).
ROUTES_WITHOUT_ENGINE = ("/health", "/metrics")


def build_app(engine, tokenizer, model_name: str = "base", chat_template: str | None = None,
              switch_interval: float | None = SWITCH_INTERVAL_S, settings: ServerSettings | None = None,
              on_engine_dead=None) -> FastAPI:
    """The app serving `engine`, with `tokenizer` for text in and out.

    Args:
        engine: a `LoRazorEngine` (its steps run on a thread of this process), or an
            `EngineProcess` (the engine in a process of its own: `lorazor serve`'s default).
        tokenizer: the served model's tokenizer (a Hugging Face tokenizer, or any callable with
            `decode` and the same call signature).
        model_name: the name under which the base model (no adapter) is served.
        chat_template: a Jinja chat template for tokenizers without one (else chat requests get 400).
        switch_interval: `sys.setswitchinterval` while the app runs (restored at shutdown); None
            leaves Python's own.
        settings: API key, runtime adapter loading and limits (`ServerSettings()`: no key, no
            runtime loading).
        on_engine_dead: called once the engine process has died (after every open stream got its
            error event); `lorazor serve` stops the server and exits non-zero.
    """
    from ..engine import LoRazorEngine

    if isinstance(engine, LoRazorEngine):
        engine = LocalEngine(engine, tokenizer)
    state = ServerState(engine, tokenizer, settings or ServerSettings(), ServerMetrics(model_name), model_name,
                        chat_template)

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
        state.tokenizing.shutdown(wait=False)
        log.info("shutdown: aborted %d in-flight requests", aborted)

    async def engine_alive(request: Request):
        if not engine.alive and request.url.path not in ROUTES_WITHOUT_ENGINE:
            raise ApiError(503, "the engine process exited: the server cannot serve requests",
                           kind="service_unavailable")

    app = FastAPI(title="LoRazor", version=__version__, lifespan=lifespan, dependencies=[Depends(engine_alive)])
    # The routes read `server`; hosts that embed the app (lorazor.ray) read `engine` and `metrics`.
    app.state.server, app.state.engine, app.state.metrics = state, engine, state.metrics
    errors.install(app)
    app.add_middleware(GuardMiddleware, settings=state.settings)
    app.include_router(router)
    return app
