"""HTTP backend for our server (SGLang's native API plus two small extensions).

Endpoints used:
- `POST /tokenize {"prompt": text, "text": text, "add_special_tokens": bool} -> {"tokens": [int]}`
  (SGLang's endpoint names the field `prompt`, our server contract `text`: both are sent).
- `POST /apply_chat_template {"messages": [...], "add_generation_prompt": bool} -> {"text": str}`
  (ours).
- `POST /generate` with a batch of `input_ids`, `sampling_params: {"max_new_tokens": 0}`,
  `return_logprob`, per-item `logprob_start_len` and `token_ids_logprob`, and our per-item
  `cache_prefix_len` extension. A batch with one bad item is rejected whole (HTTP 400); the
  client then resends the items one by one so only the bad one fails.

A server that is busy (HTTP 503 / 429), behind a gateway that could not reach it (502 / 504) or not
reachable yet is retried a few times, waiting what
its `Retry-After` header asks (else a doubling backoff), within a bounded total wait; after that
the call fails with `BackendUnavailable`, which batch jobs treat as "the backend is down".
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from po_lang.backends import LabelRequest, ScoreOutcome
from po_lang.errors import BackendError, BackendUnavailable

LOW = "low"  # the priority just below the server's default, whichever order the server uses
# Overloaded or starting (429, 503), or a gateway in front (the SGLang router) that could not reach a
# worker or timed out on it (502, 504): worth asking again, a prefill-only call being idempotent.
# A 500 is a server bug the same call would meet again: not retried.
RETRY_STATUS = frozenset({429, 502, 503, 504})
FIRST_BACKOFF = 0.25  # seconds before the first retry when the server names no Retry-After


class Remote:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 300.0,
        *,
        max_batch: int = 256,
        retries: int = 4,
        max_retry_wait: float = 60.0,
        transport: Any = None,
        priority: int | Literal["low"] | None = None,
        lora: str | None = None,
    ) -> None:
        """`retries`: extra attempts of a request refused with HTTP 503 / 429 or a failed
        connection; `max_retry_wait`: the most seconds one request spends waiting between them (a
        Retry-After beyond it fails at once rather than sleep past the budget). `priority`: of
        every request sent (SGLang's); "low": just below the server's default priority in its
        order (-1, or 1 under --schedule-low-priority-values-first; read from /server_info once),
        batch work that yields to the server's online calls. `lora`: the server's LoRA adapter
        (its name) every request runs with unless a classifier names its own."""
        import httpx  # lazy: only the HTTP backend needs it

        if retries < 0 or max_retry_wait < 0:
            raise ValueError("retries and max_retry_wait must be >= 0")
        self.url = url.rstrip("/")
        self.lora = lora
        self.max_batch = max_batch
        self.retries = retries
        self.max_retry_wait = max_retry_wait
        if not (priority is None or priority == LOW or type(priority) is int):
            raise ValueError(f"priority must be an integer, 'low' or None, got {priority!r}")
        self.priority = priority
        self._resolved: int | None = None if priority == LOW else priority  # type: ignore[assignment]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # `transport` lets tests pass httpx.MockTransport (no server needed).
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        self._card: dict[str, Any] | None = None  # /v1/models: whether the model is a classifier head

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def close(self) -> None:
        self._client.close()

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        payload = {"prompt": text, "text": text, "add_special_tokens": add_special_tokens}
        body = self._post("/tokenize", payload)
        return [int(t) for t in body["tokens"]]

    def chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        body = self._post(
            "/apply_chat_template",
            {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt},
        )
        return str(body["text"])

    def head_labels(self) -> tuple[str, ...] | None:
        """The server model's classifier labels (its /v1/models card) when it is a classifier head."""
        if self._card is None:
            # A server that does not answer it (an older one, SGLang's) scores label tokens.
            try:
                resp = self._client.get("/v1/models")
                data = resp.json().get("data") if resp.status_code == 200 else None
            except Exception:  # no answer a head could come from: label tokens, as before
                data = None
            self._card = data[0] if data else {}
        return tuple(self._card["labels"]) if self._card.get("task") == "classify" else None

    def score(self, requests: Sequence[LabelRequest]) -> list[ScoreOutcome | Exception]:
        out: list[ScoreOutcome | Exception] = []
        for a in range(0, len(requests), self.max_batch):
            batch = list(requests[a : a + self.max_batch])
            if len({r.lora for r in batch}) > 1:  # a call runs one adapter: one call per adapter
                results: dict[int, ScoreOutcome | Exception] = {}
                for name in dict.fromkeys(r.lora for r in batch):
                    idx = [i for i, r in enumerate(batch) if r.lora == name]
                    results.update(zip(idx, self.score([batch[i] for i in idx]), strict=True))
                out.extend(results[i] for i in range(len(batch)))
                continue
            out.extend(self._score_heads(batch) if batch[0].head_labels else self._score_batch(batch))
        return out

    def _adapter(self, batch: list[LabelRequest]) -> dict[str, Any]:
        """The body's `lora_path` (SGLang's; our server reads it on every route), if any."""
        name = batch[0].lora if batch[0].lora is not None else self.lora
        return {} if name is None else {"lora_path": name}

    def _score_heads(self, batch: list[LabelRequest]) -> list[ScoreOutcome | Exception]:
        """Classifier-head requests through vLLM's /pooling (the raw logits), then the head's
        activation as the server reports it."""
        from po_backend.core.task import ModelTask, log_probabilities

        try:
            resp = self._send(
                "/pooling", {"input": [list(r.input_ids) for r in batch], **self._adapter(batch)}
            )
        except BackendError as e:
            return [_error(str(e), e) for _ in batch]
        if resp.status_code != 200:
            return [_http_error("/pooling", resp) for _ in batch]
        card = self._card or {}
        task = ModelTask("classify", tuple(card.get("labels", ())), problem_type=card.get("problem_type", ""))
        out: list[ScoreOutcome | Exception] = []
        for r, item in zip(batch, resp.json()["data"], strict=True):
            logp = log_probabilities(task, [float(x) for x in item["data"]])
            out.append(ScoreOutcome(tuple(logp[j] for j in r.head_labels), prompt_tokens=len(r.input_ids)))
        return out

    # ---- internals ----------------------------------------------------------------------------

    def _score_batch(self, batch: list[LabelRequest]) -> list[ScoreOutcome | Exception]:
        try:
            resp = self._send(
                "/generate", {**_generate_body(batch, self._priority()), **self._adapter(batch)}
            )
        except BackendError as e:
            return [_error(str(e), e) for _ in batch]
        if resp.status_code == 400 and len(batch) > 1:
            # The server rejects a batch whole when one item is bad: find it by sending singly.
            out: list[ScoreOutcome | Exception] = []
            for r in batch:
                out.extend(self._score_batch([r]))
            return out
        if resp.status_code != 200:
            return [_http_error("/generate", resp) for _ in batch]
        try:
            items = resp.json()
            if isinstance(items, dict):
                items = [items]
            if len(items) != len(batch):
                raise BackendError(f"/generate returned {len(items)} results for {len(batch)} prompts")
        except Exception as e:
            return [_error(f"/generate: bad response: {e}", e) for _ in batch]
        out = []
        for r, item in zip(batch, items, strict=True):
            try:
                out.append(_parse_item(r, item))
            except Exception as e:
                out.append(_error(f"/generate: bad response item: {e}", e))
        return out

    def _priority(self) -> int | None:
        if self.priority == LOW and self._resolved is None:
            info = self._client.get("/server_info")
            low_first = info.status_code == 200 and bool(
                info.json().get("schedule_low_priority_values_first")
            )
            self._resolved = 1 if low_first else -1
        return self._resolved

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        resp = self._send(path, payload)
        if resp.status_code != 200:
            raise _http_error(path, resp)
        return resp.json()

    def _send(self, path: str, payload: dict[str, Any]) -> Any:
        """POST with retries: a `RETRY_STATUS` or a failed connection is tried again up to `retries`
        times within `max_retry_wait` seconds of waiting. Returns the last response (the caller
        judges its status); a connection that never succeeds raises BackendUnavailable, any other
        transport error BackendError."""
        import httpx

        waited = 0.0
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.post(path, json=payload)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                err: BackendError = BackendUnavailable(f"request to {self.url}{path} failed: {e}")
                err.__cause__ = e
                wait = FIRST_BACKOFF * 2**attempt
            except httpx.HTTPError as e:
                raise BackendError(f"request to {self.url}{path} failed: {e}") from e
            else:
                if resp.status_code not in RETRY_STATUS:
                    return resp
                asked = _retry_after(resp.headers.get("retry-after"))
                wait = FIRST_BACKOFF * 2**attempt if asked is None else asked
                err = _http_error(path, resp)
            if attempt == self.retries or waited + wait > self.max_retry_wait:
                raise BackendUnavailable(
                    f"{err} (gave up after {attempt + 1} attempt(s) and {waited:.1f}s of waiting)"
                ) from err.__cause__
            time.sleep(wait)
            waited += wait
        raise AssertionError("unreachable: the last attempt returns or raises")


def _generate_body(batch: list[LabelRequest], priority: int | None = None) -> dict[str, Any]:
    body = {
        "input_ids": [list(r.input_ids) for r in batch],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": [r.logprob_start_len for r in batch],
        "token_ids_logprob": [list(r.label_token_ids) for r in batch],
        "cache_prefix_len": [r.cache_prefix_len for r in batch],
    }
    if priority is not None:
        body["priority"] = priority
    return body


def _parse_item(req: LabelRequest, item: Mapping[str, Any]) -> ScoreOutcome:
    meta = item["meta_info"]
    label_lp: tuple[float, ...] = ()
    if req.label_token_ids:
        rows = meta.get("output_token_ids_logprobs") or []
        # One row (the next-token distribution) of [logprob, token_id, text] entries; accept it
        # bare or wrapped in the per-output-position list SGLang uses.
        row = rows[0] if rows and rows[0] and isinstance(rows[0][0], list) else rows
        by_id = {int(e[1]): float(e[0]) for e in row}
        missing = [t for t in req.label_token_ids if t not in by_id]
        if missing:
            raise BackendError(f"no log-prob returned for label token ids {missing[:5]}")
        label_lp = tuple(by_id[t] for t in req.label_token_ids)
    entries = meta.get("input_token_logprobs") or []
    # The first prompt token has no log-prob (null); it is never one a label reads.
    input_lp = tuple(math.nan if e[0] is None else float(e[0]) for e in entries)
    return ScoreOutcome(
        label_logprobs=label_lp,
        input_token_logprobs=input_lp,
        prompt_tokens=int(meta.get("prompt_tokens", len(req.input_ids))),
        cached_tokens=int(meta.get("cached_tokens", 0)),
    )


def _message(resp: Any) -> str:
    try:
        body = resp.json()
    except Exception:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


def _error(msg: str, cause: BaseException | None = None) -> BackendError:
    # The cause's own type when it is a BackendError (BackendUnavailable stays one per item).
    err = type(cause)(msg) if isinstance(cause, BackendError) else BackendError(msg)
    err.__cause__ = cause
    return err


def _http_error(path: str, resp: Any) -> BackendError:
    """A non-200 answer; 503 / 429 (what is left after the retries) mean the server is unavailable."""
    kind = BackendUnavailable if resp.status_code in RETRY_STATUS else BackendError
    return kind(f"{path}: HTTP {resp.status_code}: {_message(resp)}")


def _retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for: delta-seconds or an HTTP date; None if absent or
    unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
