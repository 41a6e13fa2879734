"""HTTP errors: `HTTPError` and `bad` for handlers to raise, SGLang's error bodies, readable messages
for pydantic validation failures, and the exception handlers that map engine errors to 400/503.

SGLang answers in two shapes and its clients parse the one their endpoint uses: OpenAI-style routes
(`/v1/*`, and vLLM's `/rerank`, `/v2/rerank`, `/generative_scoring`) a flat
`{"object": "error", "message", "type", "param", "code"}` (the openai client reads `message` from
the body itself when there is no `error` key); native routes (`/generate`, `/tokenize`, ...)
`{"error": {"message": ...}}` (we add `type` and `code` inside, which SGLang's readers ignore)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from po_backend.core.errors import (
    InvalidRequestError,
    OverloadedError,
    PrefillOnlyError,
    UnavailableError,
)

log = logging.getLogger(__name__)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class ClientGone(Exception):
    """The client disconnected while its requests were queued or running."""


def bad(message: str) -> HTTPError:
    return HTTPError(400, message)


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], data: Any) -> M:
    """`data` as `model`, or a 400 with pydantic's errors made readable (a body read by hand, not
    by a FastAPI route)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise bad(validation_message(e.errors())) from None


def check_items(n: int, what: str, limit: int) -> None:
    """The per-call item limit (--max-items-per-request): a call over it could never be served,
    so it is a 413, not a 503 to retry."""
    if n > limit:
        raise HTTPError(
            413,
            f"{n} {what} in one call, more than the limit of {limit} (--max-items-per-request): split the call",
            "PayloadTooLargeError",
        )


class CallLimits(Protocol):
    """The per-call limits a parsed call is checked against before any tokenizing or queueing:
    a server's `Runtime`, or the cluster's gate (`Limits`) holding the workers' values."""

    def check_items(self, n: int, what: str) -> None: ...

    def check_logprobs(self, n: int) -> None: ...

    def check_tokenize(self, chars: int, what: str) -> None: ...


def check_tokenize(chars: int, what: str, limit: int) -> None:
    """The per-call tokenizer input limit (--max-tokenize-chars), checked before any tokenizing."""
    if chars > limit:
        raise HTTPError(
            413,
            f"this call would tokenize {chars} characters ({what}), more than the limit of {limit} "
            "(--max-tokenize-chars): send fewer or shorter texts, or split the call",
            "PayloadTooLargeError",
        )


def check_logprobs(n: int, limit: int) -> None:
    """The per-call cap on returned log-prob values (--max-logprobs-per-request: the answer's size
    and the memory that builds it), checked on the parsed call before it is queued."""
    if n > limit:
        raise HTTPError(
            413,
            f"this call would return {n} log-prob values, more than the limit of {limit} "
            "(--max-logprobs-per-request): ask for fewer items, labels, top log-probs or prompt "
            "positions, or split the call",
            "PayloadTooLargeError",
        )


_KINDS = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "PayloadTooLargeError"}

RETRY_AFTER_S = 1  # seconds a 503's Retry-After asks for

_OPENAI_STYLE = ("/v1/", "/rerank", "/v2/", "/generative_scoring")


def error_body(status: int, message: str, kind: str, path: str = "") -> dict[str, Any]:
    if path.startswith(_OPENAI_STYLE):
        return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, kind: str, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, path), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _field_path(loc: Sequence[Any]) -> str:
    """'sampling_params.bogus' from pydantic's loc, without the union-member tags it inserts
    ('SamplingParams', 'list[int]', ...): our field names are lower snake case, tags are not."""
    keep = [
        str(x)
        for x in loc
        if x != "body"
        and (isinstance(x, int) or (re.fullmatch(r"[a-z_][a-z0-9_]*", x) and x not in _TYPE_TAGS))
    ]
    return ".".join(keep)


def validation_message(errors: Sequence[Any]) -> str:
    """A readable 400 message from pydantic's (or FastAPI's) validation errors."""
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}"
    # An unknown key is the real problem even when a union's other members also complain.
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    parts = [f"unknown field {_field_path(e.get('loc', ()))!r}" for e in extra]
    if not parts:
        parts = [f"{_field_path(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors]
    return "invalid request: " + "; ".join(list(dict.fromkeys(parts))[:5])


def add_exception_handlers(app: FastAPI) -> None:
    """HTTPError as itself, validation and engine request errors as 400, overload and engine
    failures as 503, a disconnected client as 499, anything else as 500."""

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing's 404 / 405 and a body the JSON parser gave up on (nested deeper than it
        # recurses) in our shape, not the framework's {"detail"}.
        message = str(exc.detail)
        if message == "There was an error parsing the body":
            message = "the body could not be parsed as JSON (malformed, or nested too deeply)"
        resp = error_response(
            exc.status_code, message, _KINDS.get(exc.status_code, "BadRequestError"), request.url.path
        )
        resp.headers.update(exc.headers or {})  # 405's Allow
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, validation_message(exc.errors()), "BadRequestError", request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, f"{type(exc).__name__}: {exc}", "BadRequestError", request.url.path)

    @app.exception_handler(OverloadedError)
    @app.exception_handler(UnavailableError)
    async def _overloaded(request: Request, exc: PrefillOnlyError) -> JSONResponse:
        # Retry-After: a full queue or a draining server is temporary; clients and the router
        # back off and retry (elsewhere) instead of failing the request.
        draining = isinstance(exc, UnavailableError)
        resp = error_response(
            503,
            f"{'unavailable' if draining else 'overloaded'}: {exc}",
            "ServiceUnavailableError",
            request.url.path,
        )
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        return resp

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(PrefillOnlyError)
    async def _engine_error(request: Request, exc: PrefillOnlyError) -> JSONResponse:
        log.warning("engine error: %s: %s", type(exc).__name__, exc)
        return error_response(
            503, f"{type(exc).__name__}: {exc}", "ServiceUnavailableError", request.url.path
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # The detail (which may quote the request or our internals) goes to the log only; the
        # client gets an id to quote when reporting it.
        error_id = uuid.uuid4().hex[:16]
        log.exception("internal error %s on %s %s", error_id, request.method, request.url.path)
        return error_response(
            500, f"internal server error (error id {error_id})", "InternalServerError", request.url.path
        )
