"""Drive an ASGI app in this process: one HTTP request in, its response out as it is produced, and the
app's lifespan. A Ray Serve replica runs `lorazor serve`'s own app (`serve.app.build_app`) this way,
so every route, error body and stream is the same code with or without Ray.
"""

from __future__ import annotations

import asyncio


class Lifespan:
    """The app's startup and shutdown (ASGI lifespan protocol), run on the current event loop."""

    def __init__(self, app):
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def startup(self) -> None:
        """Run the app's startup; raises RuntimeError with the app's message if it fails."""
        self._task = asyncio.get_running_loop().create_task(
            self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, self._inbox.get,
                     self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        message = await self._outbox.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {message.get('message', message['type'])}")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._outbox.get()
        await self._task


async def call(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes):
    """Yield the response to one HTTP request: first `(status, headers)`, then each body chunk
    (bytes) as the app sends it. Closing the generator early tells the app the client left."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query,
             "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}
    sent = asyncio.Queue()
    left = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(scope, receive, sent.put)
        finally:
            await sent.put(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        left.set()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
