"""Every failure as an OpenAI-shaped JSON body with the right status: bad fields (400 naming the
field), bad JSON or UTF-8 (400), unknown routes (404), wrong methods (405), a dead engine (503), and
anything unexpected (500, logged with its traceback, never sent to the client)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engine import EngineDeadError
from .protocol import ApiError, FieldError, error_kind

log = logging.getLogger("lorazor.serve")


def answer(err: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _validation_message(first: dict) -> tuple[str, str | None]:
    """(message, param) for pydantic's first error."""
    loc = [str(x) for x in first.get("loc", ())]
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", None
    fields = [x for x in loc[1:] if not x.isdigit() and x not in ("str", "int", "float", "bool", "list", "dict")
              and not x.startswith(("list[", "function-", "literal[", "Strict", "constrained"))]
    param = fields[0] if fields else None
    msg = first.get("msg", "invalid value")
    error = first.get("ctx", {}).get("error")
    if isinstance(error, FieldError):
        return str(error), error.param
    if kind == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"missing required field: {'.'.join(fields) or param}", param
    where = ".".join(fields)
    return (f"invalid value for {where}: {msg}" if where else f"invalid request: {msg}"), param


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""

    @app.exception_handler(ApiError)
    async def api_error(_, err: ApiError):
        return answer(err)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, err: EngineDeadError):
        return answer(ApiError(503, str(err), kind="service_unavailable"))

    @app.exception_handler(RequestValidationError)
    async def invalid(_, err: RequestValidationError):
        errors = err.errors()
        message, param = _validation_message(errors[0] if errors else {})
        return answer(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        if err.status_code == 404:
            message = f"no route {request.url.path}: see GET /v1/models and docs/serving.md for the routes"
        elif err.status_code == 400 and err.detail == "There was an error parsing the body":
            message = "the body could not be parsed: send JSON in UTF-8 with content-type application/json"
        elif err.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return answer(ApiError(err.status_code, message, kind=error_kind(err.status_code)), headers=err.headers)

    @app.exception_handler(UnicodeDecodeError)
    async def bad_utf8(_, err: UnicodeDecodeError):
        return answer(ApiError(400, f"the body is not valid UTF-8 ({err.reason} at byte {err.start})"))

    @app.exception_handler(Exception)
    async def unexpected(request, err: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return answer(ApiError(500, f"internal error ({type(err).__name__}); the server logged the details",
                               kind="server_error"))
