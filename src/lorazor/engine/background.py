"""The engine's steps on one background thread, for asyncio servers (`LoRazorEngine.stream`).

A server's event loop must not run steps itself: while it waits for a step it cannot stream the
previous step's tokens, and every stream that waits for its next token would contend to run the
next step. Here one thread owns the engine, as vLLM's engine core does:

- it runs steps back to back while any request is unfinished, and sleeps when none is;
- between two steps it runs the calls queued by the loop (`call`, `submit`): new requests, aborts,
  adapter loads, shutdown. Nothing else touches the engine's state while it runs, so the loop
  never takes a lock and a call waits at most one step;
- after each step it hands every stream its output with one `call_soon_threadsafe` per event loop;
- the GPU wait at the end of a step releases the GIL (`LaunchedStep.read`), so the loop
  writes the previous step's tokens to the sockets while the GPU computes the next.

A stream that falls behind (its client reads slower than the steps come) gets its pending
outputs merged into one (`merge`), so the server sends fewer, larger chunks instead of a backlog.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading

import torch

from .request import RequestOutput


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request: the newer state, with both steps' tokens."""
    logprobs = None if older.new_logprobs is None and newer.new_logprobs is None else (
        (older.new_logprobs or []) + (newer.new_logprobs or []))
    return dataclasses.replace(newer, new_token_ids=older.new_token_ids + newer.new_token_ids, new_logprobs=logprobs)


class BackgroundLoop:
    """The thread that runs `engine`'s steps, and the calls queued for it between steps."""

    def __init__(self, engine):
        self.engine = engine
        self._calls: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- from the event loop ---------------------------------------------------------------------
    def submit(self, fn) -> concurrent.futures.Future:
        """Run `fn()` on the engine's thread before its next step; a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine's background loop is stopped")
            self._calls.append((fn, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lorazor-engine", daemon=True)
                self._thread.start()
            self._wake.notify()
        return future

    async def call(self, fn):
        """`await loop.call(fn)`: `fn()`'s result, run between two steps on the engine's thread."""
        return await asyncio.wrap_future(self.submit(fn))

    async def stream(self, request, arrival_time: float | None = None):
        """The outputs of `request` (built by `engine.prepare_request`) as its steps produce them,
        merged when the consumer falls behind. A consumer that stops early aborts the request."""
        outputs = await self.open(request, arrival_time)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    async def open(self, request, arrival_time: float | None = None):
        """Queue `request` on the engine's thread and return its outputs (an async iterator). What the
        engine's thread refuses at queueing (its adapter re-registered or unregistered since the
        request was checked) raises here, before any output."""
        engine = self.engine
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request.request_id
        if request_id in self._streams:  # two streams that passed prepare_request with one id
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        try:
            await self.call(lambda: engine.queue_request(request, arrival_time))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._follow(request_id, queue)

    async def _follow(self, request_id: str, queue: asyncio.Queue):
        engine = self.engine
        finished = False
        try:
            while not finished:
                out = await queue.get()
                while not queue.empty():
                    out = merge(out, queue.get_nowait())
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopping:  # the consumer left: free its blocks
                self.submit(lambda: engine.requests.get(request_id) and engine.abort(request_id))

    def stop(self, abort: bool = True, timeout: float = 30.0) -> int:
        """Stop the thread after its current step; with `abort`, abort every unfinished request
        first (their streams end with finish reason "abort"). Returns how many were aborted."""
        if self._thread is None:
            return 0
        aborted = self.submit(self.abort_all).result(timeout) if abort else 0
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():  # a step outlived the timeout: stay stopped rather than start a second thread
            raise TimeoutError(f"the engine's thread did not stop within {timeout} s")
        self._thread = None
        self._stopping = False
        return aborted

    # ---- on the engine's thread ------------------------------------------------------------------
    def abort_all(self) -> int:
        """Abort every unfinished request and end their streams (call it on the engine's thread)."""
        outputs = self.engine.abort_all()
        self._deliver(outputs)
        return len(outputs)

    def _run(self) -> None:
        engine = self.engine
        device = engine.model.device
        if device.type == "cuda":  # a new thread starts on GPU 0: run kernels where the model lives
            torch.cuda.set_device(device)
        while True:
            with self._wake:
                while not self._calls and not self._stopping and not engine.has_unfinished():
                    self._wake.wait()
                calls = list(self._calls)
                self._calls.clear()
                stopping = self._stopping
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as err:  # handed to the caller, who awaits the future
                        future.set_exception(err)
            if stopping:
                return
            if engine.has_unfinished():
                self._deliver(engine.step_or_abort_all())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream's queue: one callback per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: its streams are gone
                pass


def _put_all(items) -> None:
    for queue, out in items:
        queue.put_nowait(out)
