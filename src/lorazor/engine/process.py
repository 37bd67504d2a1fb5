"""An engine in a process of its own, so its steps never wait on the server's Python: the process's
loop (`engine_main`) and the client the server holds (`EngineProcess`).

Why: in one process, the event loop (parsing requests, detokenizing, writing server-sent events)
and the engine's scheduling share the interpreter lock; each slows the other, and an H200 run
served 0.55x the in-process rate. vLLM runs its engine core in its own process for that reason.

How (two one-way pipes, pickled tuples of messages; outputs as rows of named fields):
- the server sends ("add", id, kwargs, arrival), ("abort", id), ("call", n, method, args), ("stop",);
- the engine process takes every waiting message between two steps (blocking only when it has
  nothing to run), runs the step, and sends ("out", rows): one message per step with one row per
  request that moved, holding only the new tokens. A bad request comes back as ("error", id, text);
  a call as ("reply", n, ok, value, adapter names).
- in the server, one reader thread receives, and hands each message to the event loop in one
  callback; streams rebuild each request's tokens from the rows.
- an engine loop that raises sends ("fatal", traceback) before its process ends, so the server
  answers 503 from that moment, not only once the process is gone.
`time.monotonic()` is the same clock in both processes on Linux, so TTFT and TPOT stay right.

The engine knows nothing of HTTP: what the front end adds (turning a request's plain arguments into
an engine request, compiling its grammar, the calls it may make) comes in `ProcessHooks`, which the
factory builds in the engine's process (`lorazor.serve.engines.process_hooks` for `lorazor serve`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable

from ..adapters.loader import read_adapter
from .background import merge
from .request import RequestOutput, TokenPrefix

log = logging.getLogger("lorazor.engine")


class EngineDeadError(RuntimeError):
    """The engine process has exited: nothing more can be served."""


# What a row carries across the pipe, by name: every field of RequestOutput but `tokens`, which the
# receiver rebuilds from the new tokens (a field added to RequestOutput travels without a change here).
PIPE_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput) if f.name != "tokens")


def pack(out: RequestOutput) -> dict:
    """A step's output for the pipe, as named fields (pickle writes each field name once a message)."""
    return {name: getattr(out, name) for name in PIPE_FIELDS}


def unpack(row: dict, tokens: list[int]) -> RequestOutput:
    """The output a row stands for; `tokens` (this request's tokens so far) grows by its new ones."""
    tokens.extend(row["new_token_ids"])
    return RequestOutput(tokens=TokenPrefix(tokens), **row)


@dataclasses.dataclass
class ProcessHooks:
    """What the engine's process takes from its front end.

    Attributes:
        engine: the `LoRazorEngine` to run.
        prepare: (request id, the request's plain arguments) -> a checked `Request` (not queued).
        compile: the request's plain arguments -> a job to run off the engine's loop before
            `prepare` (a grammar to compile: a new schema can take a second), or None.
        calls: the methods the client may `call` by name (adapters, stats).
        info: the engine's fixed settings the client needs (`EngineProcess.info`).
        request_errors: what `prepare` raises for a bad request (sent back to its stream alone).
    """

    engine: object
    prepare: Callable
    compile: Callable
    calls: dict
    info: dict
    request_errors: tuple = (ValueError,)


def _picklable(err: BaseException) -> BaseException:
    try:
        pickle.dumps(err)
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


# ---- the engine's side ------------------------------------------------------------------------------
def engine_main(factory, inbox, outbox, threads: int | None = None) -> None:
    """The engine process: build the engine with `factory() -> ProcessHooks`, then serve
    messages and run steps until told to stop or the server goes away. `threads`: torch's
    intra-op threads (the server process's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us
    try:
        if threads:
            import torch

            # A spawned process starts with one thread per core, whatever the server set: several
            # servers on one machine (or a test run) would each take every core.
            torch.set_num_threads(threads)
        hooks = factory()
        engine = hooks.engine
        model = engine.model
        if model.device.type == "cuda":
            import torch

            torch.cuda.set_device(model.device)
    except BaseException:
        outbox.send(("failed", traceback.format_exc()))
        return
    outbox.send(("ready", list(model.adapter_names), hooks.info))
    calls = hooks.calls

    def add(rid, kwargs, arrival):
        try:
            engine.queue_request(hooks.prepare(rid, kwargs), arrival)
        except hooks.request_errors as err:
            outbox.send(("error", rid, str(err).strip('"')))

    # Requests whose grammar compiles on a worker thread (never on this loop: a new schema can take
    # a second at a large vocabulary); each is added at the first pass after its compile is done.
    compiling: dict = {}
    compiler = None
    try:
        while True:
            if not engine.has_unfinished():
                inbox.poll(0.005 if compiling else None)  # idle: sleep until the server sends something
            for rid, (future, kwargs, arrival) in list(compiling.items()):
                if future.done():
                    del compiling[rid]
                    add(rid, kwargs, arrival)  # its grammar is cached now (or its error is raised again)
            while inbox.poll(0):
                message = inbox.recv()
                kind = message[0]
                if kind == "add":
                    _, rid, kwargs, arrival = message
                    job = hooks.compile(kwargs)
                    if job is None:
                        add(rid, kwargs, arrival)
                        continue
                    if compiler is None:
                        compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorazor-grammar")
                    compiling[rid] = (compiler.submit(job), kwargs, arrival)
                elif kind == "abort":
                    compiling.pop(message[1], None)
                    if message[1] in engine.requests:
                        outbox.send(("out", [pack(engine.abort(message[1]))]))
                elif kind == "call":
                    _, number, method, args = message
                    try:
                        outbox.send(("reply", number, True, calls[method](*args), list(model.adapter_names)))
                    except Exception as err:  # handed to the caller
                        outbox.send(("reply", number, False, _picklable(err), list(model.adapter_names)))
                elif kind == "stop":
                    outputs = engine.abort_all()
                    outbox.send(("out", [pack(o) for o in outputs]))
                    outbox.send(("stopped", len(outputs)))
                    return
            if engine.has_unfinished():
                outputs = engine.step_or_abort_all()
                if outputs:
                    outbox.send(("out", [pack(o) for o in outputs]))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the server is gone
        return
    except BaseException:  # say so at once: the process may take a while to end
        try:
            outbox.send(("fatal", traceback.format_exc()))
        except Exception:  # the pipe is gone too
            pass
        raise


# ---- the server's side ------------------------------------------------------------------------------
class EngineProcess:
    """Starts `factory` (a picklable callable returning `ProcessHooks`) in a spawned process
    and waits until the engine is built (model loaded, graphs captured).

    Raises:
        RuntimeError: the factory failed (the message holds its traceback) or took longer than
            `startup_timeout` seconds.
    """

    def __init__(self, factory, startup_timeout: float = 1800.0):
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        engine_inbox, self._send_end = context.Pipe(duplex=False)
        self._recv_end, engine_outbox = context.Pipe(duplex=False)
        import torch

        self.process = context.Process(target=engine_main, args=(factory, engine_inbox, engine_outbox,
                                                                 torch.get_num_threads()),
                                       name="lorazor-engine", daemon=True)
        self.process.start()
        engine_inbox.close()
        engine_outbox.close()
        deadline = time.monotonic() + startup_timeout
        while not self._recv_end.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} while starting")
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the engine process did not start within {startup_timeout} s")
        message = self._recv_end.recv()
        if message[0] == "failed":
            self.process.join(10)
            raise RuntimeError(f"building the engine failed in its process:\n{message[1]}")
        self.adapter_names: list[str] = message[1]
        self.info: dict = message[2]
        self._send_lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._numbers = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopped: asyncio.Future | None = None
        self._dead: BaseException | None = None
        self.on_dead: list = []  # callables run on the event loop once the engine process is gone

    @property
    def alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    def start(self) -> None:
        """Bind to the running event loop and start receiving (the app's startup).

        Raises:
            RuntimeError: it already served an app (its engine process ends with that app).
        """
        if self._loop is not None:
            raise RuntimeError("this EngineProcess already served an app; start a new one for another")
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._reader = threading.Thread(target=self._read, name="lorazor-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, message) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            with self._send_lock:
                self._send_end.send(message)
        except OSError as err:  # the process is gone: dead from now on (/health too), before the reader says so
            dead = EngineDeadError(f"the engine process exited (code {self.process.exitcode})")
            self._mark_dead(dead)
            raise dead from err

    def _read(self) -> None:
        """The reader thread: every message to the event loop, in order, one callback each."""
        while True:
            try:
                message = self._recv_end.recv()
            except (EOFError, OSError):
                message = ("dead",)
            try:
                self._loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:  # the event loop is closed
                return
            if message[0] in ("dead", "stopped"):
                return

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "out":
            for row in message[1]:
                queue = self._streams.get(row["request_id"])
                if queue is not None:
                    queue.put_nowait(row)
        elif kind == "error":
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait(ValueError(message[2]))
        elif kind == "reply":
            _, number, ok, value, names = message
            self.adapter_names = names
            future = self._replies.pop(number, None)
            if future is None or future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        elif kind == "stopped":
            if not self._stopped.done():
                self._stopped.set_result(message[1])
        elif kind == "fatal":  # the engine's loop raised: it is dead from now on, though its process still ends
            log.error("the engine process failed:\n%s", message[1])
            self._mark_dead(EngineDeadError(f"the engine process failed: {message[1].strip().splitlines()[-1]}"))
        elif kind == "dead":  # the engine process exited: end everything that waits on it
            self.process.join(5)
            self._mark_dead(EngineDeadError(f"the engine process exited (code {self.process.exitcode})"))

    def _mark_dead(self, error: EngineDeadError) -> None:
        """End every stream and call with `error`, once; then the `on_dead` callbacks."""
        if self._dead is not None:
            return
        self._dead = error
        for queue in self._streams.values():
            queue.put_nowait(error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        if not self._stopped.done():
            self._stopped.set_result(0)
        for callback in self.on_dead:
            callback()

    async def _call(self, method: str, *args):
        number = next(self._numbers)
        future = self._replies[number] = self._loop.create_future()
        self._send(("call", number, method, args))
        return await future

    async def generate(self, request_id: str, kwargs: dict, arrival_time: float | None = None):
        """The request's outputs (an async iterator, from its first output on); a bad request
        raises ValueError here, with the engine's message."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            self._send(("add", request_id, kwargs, time.monotonic() if arrival_time is None else arrival_time))
            first = await queue.get()
        except BaseException:  # cancelled while waiting (the client left): the engine forgets it
            self._leave(request_id)
            raise
        if isinstance(first, BaseException):
            self._streams.pop(request_id, None)
            raise first
        return self._outputs(request_id, queue, first)

    async def _outputs(self, request_id: str, queue: asyncio.Queue, row):
        tokens: list[int] = []
        finished = False
        try:
            while True:
                if isinstance(row, BaseException):
                    raise row
                out = unpack(row, tokens)
                while not queue.empty():  # the consumer fell behind: one output for the backlog
                    row = queue.get_nowait()
                    if isinstance(row, BaseException):
                        raise row
                    out = merge(out, unpack(row, tokens))
                finished = out.finished
                yield out
                if finished:
                    return
                row = await queue.get()
        finally:
            if not finished:  # the consumer stopped early: free the request's blocks
                self._leave(request_id)
            else:
                self._streams.pop(request_id, None)

    def _leave(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self._dead is None:
            self._send(("abort", request_id))

    async def register_adapter(self, name: str, path: str, replace: bool = False, root=None) -> None:
        """Read and check the folder on a worker thread of this process (a large or hostile file never
        stalls the engine's steps), then register what was read between two of its steps."""
        limits = self.info["adapter_limits"]
        source = await asyncio.to_thread(read_adapter, name, path, False, root, limits["module_sizes"],
                                         limits["max_rank"])
        await self._call("register_adapter", name, path, replace, source)

    async def unregister_adapter(self, name: str) -> None:
        await self._call("unregister_adapter", name)

    async def stats(self) -> dict:
        return await self._call("stats")

    async def shutdown(self, timeout: float = 30.0) -> int:
        """Abort every unfinished request (their streams end with "abort") and end the engine
        process; returns how many were aborted."""
        aborted = 0
        if self._dead is None:
            try:
                self._send(("stop",))
                aborted = await asyncio.wait_for(asyncio.shield(self._stopped), timeout)
            except EngineDeadError:  # it died before the reader thread saw it: nothing is left to stop
                pass
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.process.kill()
        return aborted
