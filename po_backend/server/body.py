"""How the routes read a JSON body: parsed once, and refused with our 400 when it holds text no
tokenizer or JSON encoder takes (a lone UTF-16 surrogate), in time linear in the body's bytes.

Parsing holds the GIL, so it stalls the event loop whatever thread runs it; `--max-body-bytes`
bounds that. What follows the parse must stay cheap: the surrogate search is a byte scan (a
lone surrogate arrives only as a `\\ud800`-`\\udfff` escape or as its raw UTF-8 bytes, which
`json.loads` lets through), and only a body that has one is walked to name the field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

# A surrogate escape (a preceding escaped backslash only costs a walk that finds nothing) or
# the raw UTF-8 of one (0xED 0xA0..0xBF).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def lone_surrogate(data: Any) -> str | None:
    """Where the first string (or key) holding a lone surrogate is ('text[1]', 'a key of
    sampling_params'), or None. Iterative, so a deeply nested body cannot exhaust the stack; a
    path is built only for the one found."""
    # (value, key in its parent, parent's entry): the path is read back along the parents.
    stack: list[tuple[Any, Any, Any]] = [(data, None, None)]
    while stack:
        entry = stack.pop()
        value = entry[0]
        if isinstance(value, str):
            if not _valid(value):
                return _path(entry)
        elif isinstance(value, dict):
            for k, v in value.items():
                if not _valid(str(k)):
                    return f"a key of {_path(entry) or 'the body'}"
                if isinstance(v, str | list | dict):
                    stack.append((v, str(k), entry))
        elif isinstance(value, list):
            stack.extend((v, i, entry) for i, v in enumerate(value) if isinstance(v, str | list | dict))
    return None


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(entry: tuple[Any, Any, Any]) -> str:
    parts: list[str] = []
    while entry[2] is not None:
        key = entry[1]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        entry = entry[2]
    return "".join(reversed(parts)).lstrip(".")


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            data = json.loads(body)
            # Substring tests first (memchr speed); the pattern only where one could match.
            if (b"\\u" in body or b"\xed" in body) and _SURROGATE.search(body):
                where = lone_surrogate(data)
                if where is not None:
                    raise HTTPException(
                        400, f"{where or 'body'} contains a lone UTF-16 surrogate (not valid Unicode text)"
                    )
            self._json = data
        return self._json


class BodyRoute(APIRoute):
    """Every route of the API: its JSON body read through `_CheckedRequest` (FastAPI's pattern for
    a custom request class)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_CheckedRequest(request.scope, request.receive))

        return route
