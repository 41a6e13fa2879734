"""`prefillonly run-batch`: an OpenAI / vLLM batch file through the server's routes, resumably.

    prefillonly run-batch -i requests.jsonl -o results.jsonl --model-path MODEL [server flags]
    prefillonly run-batch -i requests.jsonl -o results.jsonl --server http://127.0.0.1:30000

Input lines are `{"custom_id", "method": "POST", "url", "body"}` (OpenAI's batch input, vLLM's
run_batch); output lines `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`, in input order. Any POST route the server has works (`/v1/completions`,
`/v1/embeddings`, `/v1/score`, `/v1/rerank`, `/rerank`, `/v2/rerank`, `/v1/classify`, ...): in
process the server's own app answers (the same handlers, over httpx's ASGI transport), with
`--server` a running server does. A response other than 2xx keeps its body and puts its error in
`error`; a line that cannot be sent (bad JSON, no custom_id, a repeated custom_id, a method other
than POST) is an error line with `response` null. Nothing crashes on a bad line.

Kill it at any time and run the same command again: every result is appended to a journal
(`<output>.partial`, fsynced per batch) and the output is only ever replaced whole
(`po_lang.label.store`, the labeling job's store), so no result is lost and no request is sent
twice. A result's `id` is a hash of its request line, so an edited line is answered again (its old
result stays until then). An output holding results for custom_ids this input lacks is not this
job's: the run refuses, changing nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from tqdm.auto import tqdm

from po_lang.errors import BackendUnavailable
from po_lang.label import store
from po_lang.label.source import UsageError, file_format, to_json

RESULT_KEYS = frozenset({"id", "custom_id", "response", "error"})
MAX_REPORTED = 20  # error lines printed one by one; the rest are counted
# Answers that say "not now" rather than "not this request": retried, then the run stops (resumable).
TRANSIENT = (502, 503, 504)
RETRIES = 3
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Entry:
    """One input line: what to send, or why it cannot be sent."""

    line: int  # 1-based
    key: str  # the result's id: a hash of the line's request (and position for unsendable lines)
    custom_id: str | None
    url: str = ""
    body: Any = None
    problem: str | None = None  # set: an error line, nothing sent


@dataclass(frozen=True)
class Summary:
    output: Path
    total: int  # input lines
    answered: int  # results made in this run
    reused: int  # results an earlier run made
    errors: tuple[tuple[int, str | None, str], ...]  # (line, custom_id, message), every error line
    complete: bool


def result_id(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return "batch_req_" + hashlib.sha256(blob.encode()).hexdigest()[:24]


def read_entries(path: Path) -> list[Entry]:
    """Every non-blank line of the batch file, as something to send or an error line."""
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        entry = parse_line(n, raw)
        cid = entry.custom_id
        if cid is not None and entry.problem is None:
            if cid in seen:
                entry = Entry(
                    n,
                    result_id("line", n, raw.decode("utf-8", "replace")),
                    cid,
                    problem=f"custom_id {cid!r} repeats line {seen[cid]}'s",
                )
            else:
                seen[cid] = n
        entries.append(entry)
    return entries


def parse_line(n: int, raw: bytes) -> Entry:
    text = raw.decode("utf-8", "replace")
    bad_key = result_id("line", n, text)
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return Entry(n, bad_key, None, problem=f"not JSON: {e}")
    if not isinstance(obj, dict):
        return Entry(n, bad_key, None, problem="not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Entry(n, bad_key, None, problem="custom_id must be a non-empty string")
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        return Entry(n, bad_key, cid, problem=f"method must be POST, got {method!r}")
    if not isinstance(url, str) or not url.startswith("/"):
        return Entry(n, bad_key, cid, problem=f"url must be a path such as /v1/completions, got {url!r}")
    if not isinstance(body, dict):
        return Entry(n, bad_key, cid, problem="body must be a JSON object")
    return Entry(n, result_id(cid, url, body), cid, url, body)


def error_line(entry: Entry) -> dict[str, Any]:
    return {
        "id": entry.key,
        "custom_id": entry.custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": f"line {entry.line}: {entry.problem}"},
    }


def answer_line(entry: Entry, resp: httpx.Response) -> dict[str, Any]:
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    ok = 200 <= resp.status_code < 300
    error = None
    if not ok:
        # The server's error object (flat on /v1/*, nested on native routes), else its text.
        error = body.get("error", body) if isinstance(body, dict) else {"message": str(body)}
        if not isinstance(error, dict):
            error = {"message": str(error)}
        error = {"code": error.get("code") or resp.status_code, "message": str(error.get("message", body))}
    request_id = resp.headers.get("x-request-id") or f"prefillonly-batch-{uuid.uuid4().hex}"
    return {
        "id": entry.key,
        "custom_id": entry.custom_id,
        "response": {"status_code": resp.status_code, "request_id": request_id, "body": body},
        "error": error,
    }


def load_results(path: Path, *, journal: bool) -> tuple[list[dict[str, Any]], int]:
    """The result lines of an output (every line must be one, else it is not a batch output) or
    of a journal (a line a kill tore is dropped: that request is sent again)."""
    out: list[dict[str, Any]] = []
    torn = 0
    if not path.exists():
        return out, torn
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                rec = json.loads(raw) if raw.endswith(b"\n") or not journal else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and RESULT_KEYS <= rec.keys() and isinstance(rec["id"], str):
                out.append(rec)
            elif journal:
                torn += 1
            elif raw.strip():
                raise UsageError(
                    f"{path} line {n} is not a batch result line ({sorted(RESULT_KEYS)}): it is not this "
                    "job's output; nothing was changed. Write to a new file with -o PATH"
                )
    return out, torn


class Sender:
    """Posts one request to the server's app (in process) or to a running server."""

    def __init__(self, client: httpx.AsyncClient, concurrency: int) -> None:
        self.client = client
        self.gate = asyncio.Semaphore(concurrency)

    async def send(self, entry: Entry) -> dict[str, Any]:
        async with self.gate:
            for attempt in range(RETRIES + 1):
                try:
                    resp = await self.client.post(entry.url, json=entry.body)
                except httpx.TransportError as e:
                    if attempt == RETRIES:
                        raise BackendUnavailable(
                            f"the server cannot be reached: {type(e).__name__}: {e}"
                        ) from e
                else:
                    if resp.status_code not in TRANSIENT:
                        return answer_line(entry, resp)
                    if attempt == RETRIES:
                        raise BackendUnavailable(
                            f"the server answers {resp.status_code} (line {entry.line}): {resp.text[:200]}"
                        )
                await asyncio.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


async def _answer(sender: Sender, batch: Sequence[Entry]) -> list[dict[str, Any]]:
    lines: list[dict[str, Any] | None] = [error_line(e) if e.problem else None for e in batch]
    sent = [(i, e) for i, e in enumerate(batch) if e.problem is None]
    answers = await asyncio.gather(*(sender.send(e) for _, e in sent))
    for (i, _), a in zip(sent, answers, strict=True):
        lines[i] = a
    return [x for x in lines if x is not None]


@dataclass(frozen=True)
class Job:
    input: Path
    output: Path
    server: str | None = None  # None: in process, over `server_args`
    server_args: Any = None  # po_backend.server.ServerArgs for the in-process app
    batch_size: int = 64
    api_key: str | None = None  # --server: sent as a Bearer token
    progress: bool = True


def run(job: Job) -> Summary:
    """Answer the lines of `job.input` that have no result in `job.output` yet."""
    entries = read_entries(job.input)
    paths = store.Paths.of(job.output)
    if file_format(job.output) != "jsonl":
        raise UsageError(f"{job.output}: the output of a batch file is JSONL (.jsonl)")
    with store.exclusive(paths):
        store.remove_stale_temporaries(paths)
        finished, _ = load_results(paths.records, journal=False)
        journaled, torn = load_results(paths.journal, journal=True)
        ids = {e.key for e in entries}
        cids = {e.custom_id for e in entries if e.custom_id is not None}
        foreign = [r for r in finished + journaled if r["id"] not in ids and r["custom_id"] not in cids]
        if foreign:
            raise UsageError(
                f"{job.output} holds {len(foreign)} result(s) for requests this input does not have "
                f"(e.g. custom_id {foreign[0]['custom_id']!r}): it is not this job's output; nothing "
                "was changed. Write to a new file with -o PATH"
            )
        if torn:
            print(f"ignored {torn} torn result line(s) a killed run left behind", file=sys.stderr)
        done = {r["id"]: r for r in finished + journaled if r["id"] in ids}
        # Results of since-edited lines stay (under their custom_id) until answered again.
        stale = {r["custom_id"]: r for r in finished + journaled if r["id"] not in ids}
        todo = [e for e in entries if e.key not in done]
        reused = len(entries) - len(todo)
        answered = 0
        _save(paths, entries, done, stale)  # fold the previous journal in: this run's starts empty
        bar = tqdm(
            total=len(entries), initial=reused, desc=job.input.name, unit="req", disable=not job.progress, smoothing=0.1
        )  # fmt: skip
        try:
            with paths.journal.open("a", encoding="utf-8") as journal:
                answered = asyncio.run(_run(job, todo, journal, done, bar))
        finally:
            bar.close()
            _save(paths, entries, done, stale)
    errors = tuple(
        (e.line, e.custom_id, str(done[e.key]["error"].get("message", done[e.key]["error"])))
        for e in entries
        if e.key in done and done[e.key]["error"]
    )
    return Summary(job.output, len(entries), answered, reused, errors, all(e.key in done for e in entries))


async def _run(job: Job, todo: Sequence[Entry], journal: Any, done: dict[str, Any], bar: Any) -> int:
    answered = 0
    async with _client(job) as client:
        sender = Sender(client, job.batch_size)
        for a in range(0, len(todo), job.batch_size):
            batch = todo[a : a + job.batch_size]
            lines = await _answer(sender, batch)
            # The journal is written from the event loop's thread: a batch's fsync is short.
            store.append(journal, [to_json(x) + "\n" for x in lines])
            for x in lines:
                done[x["id"]] = x
            answered += len(lines)
            bar.update(len(batch))
    return answered


class _client:
    """An httpx client on the running server, or on the server's app in this process (its service
    shut down on exit)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.service: Any = None

    async def __aenter__(self) -> httpx.AsyncClient:
        job = self.job
        timeout = httpx.Timeout(TIMEOUT_S, connect=10.0)
        if job.server is not None:
            headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else {}
            self.http = httpx.AsyncClient(base_url=job.server.rstrip("/"), headers=headers, timeout=timeout)
            return self.http
        # Lazy: the engine and the server stack load only for an in-process run.
        from po_backend.entrypoints.launch_server import build_service
        from po_backend.server import create_app

        args = job.server_args
        self.service = await asyncio.to_thread(build_service, args)
        app = create_app(self.service, args)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        transport = httpx.ASGITransport(app=app)
        self.http = httpx.AsyncClient(
            transport=transport, base_url="http://run-batch", headers=headers, timeout=timeout
        )
        return self.http

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        if self.service is not None:
            await asyncio.to_thread(self.service.shutdown)


def _save(
    paths: store.Paths, entries: Sequence[Entry], done: Mapping[str, Any], stale: Mapping[str, Any]
) -> None:
    """The output in input order, replaced whole; then the journal goes (`store.save`'s order)."""
    lines = []
    for e in entries:
        rec = done.get(e.key) or (stale.get(e.custom_id) if e.custom_id is not None else None)
        if rec is not None:
            lines.append(to_json(rec) + "\n")
    blob = "".join(lines).encode()

    def write(f: IO[bytes]) -> None:
        f.write(blob)

    store.write_atomic(paths.records, write)
    paths.journal.unlink(missing_ok=True)


def print_summary(s: Summary) -> None:
    for line, cid, message in s.errors[:MAX_REPORTED]:
        print(f"error at line {line} (custom_id {cid!r}): {message}", file=sys.stderr)
    if len(s.errors) > MAX_REPORTED:
        print(f"... and {len(s.errors) - MAX_REPORTED} more error lines", file=sys.stderr)
    print(
        f"{s.output}: {s.answered + s.reused} of {s.total} requests answered ({s.answered} now, "
        f"{s.reused} by an earlier run), {len(s.errors)} with an error"
    )
    if not s.complete:
        print("not every request is answered yet: run the same command again to resume")


# ---- the command line ---------------------------------------------------------------------------

DESCRIPTION = __doc__.split("\n\n")[0] if __doc__ else ""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="prefillonly run-batch",
        description=DESCRIPTION,
        epilog="Without --server, the engine and server flags of `prefillonly serve` apply (--model-path "
        "or vLLM's --model, --dtype, --rerank-preset, ...). Exit status: 0 done (error lines "
        "included), 1 the server is down (the results so far are kept), 2 bad arguments, 130 interrupted.",
        add_help=False,
    )
    ap.add_argument("-h", "--help", action="store_true")
    ap.add_argument("-i", "--input-file", type=Path, required=False, help="the batch file (JSONL)")
    ap.add_argument("-o", "--output-file", type=Path, required=False, help="where the results go (JSONL)")
    ap.add_argument("--server", default=None, help="a running server's URL instead of an in-process engine")
    ap.add_argument("--batch-size", type=int, default=64, help="requests in flight, and per journal fsync")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    # vLLM's run_batch flags that change nothing here.
    ap.add_argument("--output-tmp-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--enable-metrics", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a, rest = ap.parse_known_args(args)
    if a.help:
        ap.print_help()
        return 0
    try:
        job = _job(ap, a, rest)
        summary = run(job)
    except UsageError as e:
        print(f"prefillonly run-batch: {e}", file=sys.stderr)
        return 2
    except BackendUnavailable as e:
        print(
            f"prefillonly run-batch: {e}; the results so far are kept: run again to resume", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        print("interrupted; the results so far are kept: run again to resume", file=sys.stderr)
        return 130
    print_summary(summary)
    return 0


def _job(ap: argparse.ArgumentParser, a: argparse.Namespace, rest: list[str]) -> Job:
    if a.input_file is None or a.output_file is None:
        raise UsageError("-i/--input-file and -o/--output-file are required")
    if a.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.input_file.resolve() == a.output_file.resolve():
        raise UsageError("the output file must not be the input file")
    common = dict(
        input=a.input_file, output=a.output_file, batch_size=a.batch_size, progress=not a.no_progress
    )
    if a.server is not None:
        if rest:
            raise UsageError(f"with --server the engine runs there: {' '.join(rest)} not used")
        return Job(server=a.server, api_key=os.environ.get("PREFILLONLY_API_KEY"), **common)
    from po_backend.entrypoints import launch_server

    rest = ["--model-path" if x == "--model" else x for x in rest]  # vLLM's name
    server = launch_server.build_parser()
    server.prog = "prefillonly run-batch (engine and server flags)"
    try:
        server_args = launch_server.server_args(server.parse_args(rest))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return Job(server_args=server_args, **common)
