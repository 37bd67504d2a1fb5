"""Who may use the server, and how much of it one client may take.

The operator's choices (API key, runtime adapter loading, limits) are `settings.ServerSettings`.
- `GuardMiddleware`: the API key on every route but `/health` and `/metrics`, and a cap on request
  bodies, checked before a body is read, so a huge or unauthenticated request costs nothing.
- `check_runtime_load`: runtime adapter loading only when enabled, from under `lora_root` when
  given, at most `max_registered_loras` adapters, never under a reserved name.
- `GuardedH11Protocol`: uvicorn's HTTP protocol with a header timeout, so connections that never
  send a request are closed instead of holding a file descriptor for good.
- `RepeatFilter`: a log line that repeats (e.g. "Too many open files" on every failed accept) is
  written once, then at most once a minute with a count.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..adapters.loader import CONFIG_FILE, LEGACY_FILE, SAFE_FILE
from .protocol import ApiError
from .settings import ServerSettings

# Routes open without the API key: probes and scrapers (as vLLM leaves them open).
OPEN_ROUTES = ("/health", "/metrics")
# The files of an adapter folder that registration reads.
ADAPTER_FILES = (CONFIG_FILE, SAFE_FILE, LEGACY_FILE)


def _send_error(status: int, message: str, kind: str, close: bool = False):
    body = json.dumps(ApiError(status, message, kind=kind).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    return [{"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body}]


class GuardMiddleware:
    """ASGI middleware: API key, body size and body time, before the app (or FastAPI's body
    parsing) runs. The body is read here, whole, within `settings.body_timeout` seconds of the
    request head (a client that trickles it is answered 408 and disconnected, instead of holding a
    connection and a task for as long as it likes), then handed to the app."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.key is not None and scope["path"] not in OPEN_ROUTES:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                return await _answer(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                     "authentication_error")
        limit = self.settings.body_limit
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _answer(send, 413, f"request body is {int(length)} bytes, more than the {limit} this server "
                                            "accepts (--max-prompt-bytes)", "invalid_request_error")
        try:
            messages = await asyncio.wait_for(_read_body(receive, limit), self.settings.body_timeout)
        except asyncio.TimeoutError:
            return await _answer(send, 408, f"the request body did not arrive within --body-timeout="
                                            f"{self.settings.body_timeout:g} s", "invalid_request_error", close=True)
        except _TooLarge:  # a body without Content-Length (chunked), counted as it arrived
            return await _answer(send, 413, f"request body is more than the {limit} bytes this server accepts "
                                            "(--max-prompt-bytes)", "invalid_request_error")

        async def replay():  # the body as read, then the client's own messages (a disconnect)
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


class _TooLarge(Exception):
    pass


async def _read_body(receive, limit: int) -> list:
    """The request's messages up to the end of its body (a disconnect ends them too)."""
    messages, seen = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        seen += len(message.get("body", b""))
        if seen > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            return messages


async def _answer(send, status: int, message: str, kind: str, close: bool = False) -> None:
    for event in _send_error(status, message, kind, close):
        await send(event)


def check_runtime_load(settings: ServerSettings, name: str, path: str, registered: list[str], reserved: set[str],
                       replace: bool) -> str:
    """The folder to register for a runtime load request, or an ApiError. The same refusal is given
    whether or not a path outside `lora_root` exists, so the endpoint cannot probe the file system."""
    if not settings.enable_runtime_lora:
        raise ApiError(403, "runtime adapter loading is disabled: start the server with --enable-runtime-lora",
                       kind="permission_error")
    if name in reserved:
        raise ApiError(400, f"{name!r} is a reserved name (the served base model): choose another lora_name",
                       param="lora_name")
    if name not in registered and len(registered) >= settings.max_registered_loras:
        raise ApiError(400, f"{len(registered)} adapters are registered, the most this server allows "
                            f"(--max-registered-loras={settings.max_registered_loras}): unload one first",
                       param="lora_name")
    if name in registered and not replace:
        raise ApiError(400, f"adapter {name!r} is already registered: unload it first, or pass load_inplace: true",
                       param="lora_name")
    if "\x00" in path:
        raise ApiError(400, "lora_path holds a NUL character", param="lora_path")
    root = settings.lora_root
    if root is not None:
        folder = os.path.realpath(path if os.path.isabs(path) else root / path)
        # The folder and every adapter file in it must resolve under the root: a link inside an
        # allowed folder must not reach a file outside it.
        inside = [folder] + [os.path.realpath(os.path.join(folder, f)) for f in ADAPTER_FILES
                             if os.path.lexists(os.path.join(folder, f))]
        if any(os.path.commonpath([p, str(root)]) != str(root) for p in inside):
            raise ApiError(403, "lora_path must be a folder under the server's --lora-root, its files too",
                           kind="permission_error", param="lora_path")
        return folder
    return path


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head within
    `HEADER_TIMEOUT_S` of opening (or of its last response): uvicorn itself times out only idle
    connections that already had a response."""

    HEADER_TIMEOUT_S = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # uvicorn answers past `limit_concurrency` with a plain-text 503; the same limit is applied
        # here, answered in OpenAI's JSON shape (as every other error of the server).
        self._concurrency, self.limit_concurrency = self.limit_concurrency, None
        self.app = functools.partial(_limited, self.app, self)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._waiting_for = self.cycle
        self._header_timer = self.loop.call_later(self.HEADER_TIMEOUT_S, self._header_timeout)

    def _header_timeout(self) -> None:
        if self.cycle is self._waiting_for and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._waiting_for:  # a request head arrived
            self._header_timer.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._header_timer.cancel()
        self._arm()

    def connection_lost(self, exc) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)


async def _limited(app, protocol: "GuardedH11Protocol", scope, receive, send):
    """`app`, or a JSON 503 when the server holds `limit_concurrency` connections or requests (this
    request's own task is already counted, which uvicorn's check is made before)."""
    limit = protocol._concurrency
    if limit is not None and (len(protocol.connections) >= limit or len(protocol.tasks) > limit):
        protocol.logger.warning("Exceeded concurrency limit.")
        return await _answer(send, 503, f"the server is at its limit of {limit} connections and requests "
                                        "(--limit-concurrency): retry later", "service_unavailable", close=True)
    return await app(scope, receive, send)


class RepeatFilter(logging.Filter):
    """Let a repeated log message through once, then once per `every` seconds with a count."""

    def __init__(self, every: float = 60.0):
        super().__init__()
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "Too many open files" not in text and "out of system resource" not in text:
            return True
        key = text[:120]
        now = time.monotonic()
        last, count = self._last.get(key, (-self.every, 0))
        if now - last < self.every:
            self._last[key] = (last, count + 1)
            return False
        if count:
            record.msg, record.args = f"{text} (repeated {count} times in the last {now - last:.0f} s)", ()
        self._last[key] = (now, 0)
        return True


def raise_open_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit; returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
