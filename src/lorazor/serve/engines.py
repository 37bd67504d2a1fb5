"""Where the served engine runs, behind the few calls the app makes.

- `LocalEngine`: in the server's process, its steps on a background thread (`engine.background`).
  Simple, and what tests and notebooks use; but the event loop (HTTP, detokenizing, streaming)
  and the engine's Python share one interpreter lock, and an H200 run served at half the
  in-process rate that way.
- `EngineProcess` (`lorazor.engine.process`): the engine in a process of its own, as vLLM's engine
  core runs; the default of `lorazor serve`. What the server adds there comes in `process_hooks`.

Both take requests as plain `add_request` keyword arguments (a `seed` instead of a generator, no
tokenizer), so they can cross a pipe; `openai_sampling.engine_arguments` turns them back where the engine
runs.
"""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

from ..adapters import AdapterError
from ..engine import ProcessHooks
from ..runner import grammar_cache
from .openai_sampling import engine_arguments

# What a bad request raises from `prepare_request`; the app answers them with 400.
REQUEST_ERRORS = (ValueError, KeyError, TypeError, AdapterError, NotImplementedError)


def engine_stats(engine) -> dict:
    """What `/metrics` shows of the engine, read from it at each scrape."""
    pool, scheduler = engine.pool, engine.scheduler
    return dict(running=len(scheduler.running), waiting=len(scheduler.waiting),
                kv_blocks_used=pool.num_blocks - pool.num_free, kv_blocks_total=pool.num_blocks,
                adapters_resident=len(engine.model.bank.slot_of), preemptions=scheduler.num_preemptions,
                adapter_loads=engine.adapter_loads, prefix_cache_queries=pool.queries, prefix_cache_hits=pool.hits,
                running_adapters=sorted({r.adapter for r in scheduler.running if r.adapter is not None}),
                residency=engine.model.registry.residency(),
                load_times=engine.model.registry.load_times.snapshot(),
                waiting_adapters=sorted({r.adapter for r in scheduler.waiting if r.adapter is not None}),
                max_loras=engine.model.bank.num_slots)


def engine_info(engine) -> dict:
    """The engine's fixed settings the app needs (length limit for `/tokenize`, ...) or reports."""
    import torch

    bank = engine.model.bank
    return dict(max_model_len=engine.max_model_len, max_loras=engine.model.bank.num_slots,
                adapter_limits=dict(module_sizes=dict(bank.module_sizes), max_rank=bank.r_max),
                prefix_caching=engine.pool.enable_caching,
                vocab_size=engine.runner.vocab_size, async_scheduling=engine.async_scheduling,
                torch_threads=torch.get_num_threads())


def register(model, name: str, path: str, replace: bool = False, source=None) -> None:
    """Register an adapter folder at run time; with `replace`, in place of a registered adapter of
    that name (swapped once the new folder passed its checks; refused while requests use the old
    one). `source`: the folder as `registry.read` read it off the engine's thread. A client's path
    is never fetched from the Hub."""
    model.register_adapter(name, path, allow_hub=False, replace=replace, source=source)


def prepare(engine, tokenizer, request_id: str, kwargs: dict):
    """A request's plain arguments (what crosses the pipe) as a checked engine request, not queued."""
    return engine.prepare_request(request_id=request_id, **engine_arguments(kwargs, engine, tokenizer))


def process_hooks(build, *args) -> ProcessHooks:
    """The factory `EngineProcess` runs in the engine's process: `build(*args) -> (engine,
    tokenizer)`, and what the server adds there (its request conversion, grammar compiles off the
    engine's loop, adapter and stats calls)."""
    engine, tokenizer = build(*args)
    model = engine.model

    def compile_job(kwargs: dict):
        spec = kwargs.get("structured_output")
        if spec is None:
            return None
        return functools.partial(grammar_cache(tokenizer, engine.runner.vocab_size).compile, spec)

    calls = {"register_adapter": lambda *a: register(model, *a), "unregister_adapter": model.unregister_adapter,
             "stats": lambda: engine_stats(engine)}
    return ProcessHooks(engine, functools.partial(prepare, engine, tokenizer), compile_job, calls, engine_info(engine),
                        REQUEST_ERRORS)


@runtime_checkable
class EngineClient(Protocol):
    """What the server's routes use of an engine, whichever runs it: `LocalEngine` (a thread of this
    process) or `EngineProcess` (a process of its own)."""

    info: dict  # vocab_size, max_model_len, ... (`engine_info`)
    on_dead: list  # callbacks run once if the engine dies

    @property
    def adapter_names(self) -> list[str]: ...

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def generate(self, request_id: str, kwargs: dict, arrival_time: float | None = None):
        """An async iterator of the request's `RequestOutput`s (its first awaited: a bad request raises)."""

    async def register_adapter(self, name: str, path: str, replace: bool = False, root=None) -> None: ...

    async def unregister_adapter(self, name: str) -> None: ...

    async def stats(self) -> dict: ...

    async def shutdown(self) -> int: ...


class LocalEngine:
    """A `LoRazorEngine` in this process, driven through its background thread."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.info = engine_info(engine)
        self.on_dead: list = []  # never called: the engine lives as long as this process

    @property
    def adapter_names(self) -> list[str]:
        return list(self.engine.model.adapter_names)

    alive = True  # its thread ends a failed step's requests and goes on

    def start(self) -> None:
        """Nothing to start: the thread starts with the first call."""

    async def generate(self, request_id: str, kwargs: dict, arrival_time: float | None = None):
        """The request's outputs (an async iterator); a bad request raises here, before it is queued."""
        engine = self.engine
        prepared = prepare(engine, self.tokenizer, request_id, kwargs)
        return await engine.background.open(prepared, arrival_time)

    async def register_adapter(self, name: str, path: str, replace: bool = False, root=None) -> None:
        """Read and check the folder on a worker thread (never on the engine's: a large or hostile
        file must not stall the steps), then register what was read between two steps."""
        import asyncio

        model = self.engine.model
        source = await asyncio.to_thread(model.registry.read, name, path, False, root)
        await self.engine.background.call(lambda: register(model, name, path, replace, source))

    async def unregister_adapter(self, name: str) -> None:
        await self.engine.background.call(lambda: self.engine.model.unregister_adapter(name))

    async def stats(self) -> dict:
        return engine_stats(self.engine)

    async def shutdown(self) -> int:
        """Abort every unfinished request (their streams end with "abort"), stop the thread;
        returns how many were aborted."""
        background = self.engine.background
        aborted = await background.call(background.abort_all)
        background.stop(abort=False)
        return aborted
