"""`prefillonly run-batch`: OpenAI / vLLM batch files through the server's routes, in process and on
a running server (the same answers), bad lines as error lines, an output that is not the job's
refused, and a kill mid-run resumed with every custom_id answered exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from po_backend.server import ServerArgs, Settings
from po_lang import run_batch as rb
from po_lang.label.source import UsageError
from tests.server_utils import REPO_ROOT, ServerProcess, dead_url, poll_until

pytestmark = pytest.mark.slow  # engines and servers

CLASSIFY = ["--classify-labels", "Yes,No", "--classify-template", "Will the user engage? {input}\nAnswer:"]


def good_lines() -> list[dict[str, Any]]:
    return [
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "User profile:\nlikes cats", "max_tokens": 1, "logprobs": 3}},
        {"custom_id": "score", "method": "POST", "url": "/v1/score",
         "body": {"query": "Post: a cat video\nWill the user engage? Answer:", "items": [" Yes", " No"],
                  "label_token_ids": [5, 7], "apply_softmax": True}},
        {"custom_id": "rerank", "method": "POST", "url": "/rerank",
         "body": {"query": "cats", "documents": ["a cat video", "likes dogs"]}},
        {"custom_id": "v1rerank", "method": "POST", "url": "/v1/rerank",
         "body": {"query": "cats", "documents": ["a cat video", "likes dogs"]}},
        {"custom_id": "classify", "method": "POST", "url": "/v1/classify",
         "body": {"model": "tiny", "input": ["a cat video", "tax news"]}},
        {"custom_id": "generate", "method": "POST", "url": "/generate",
         "body": {"text": "User profile:", "sampling_params": {"max_new_tokens": 0}}},
        # A route this model does not serve: the server's own 400, kept as the line's response.
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a cat"}},
        {"custom_id": "missing-route", "method": "POST", "url": "/v1/nothing", "body": {}},
    ]  # fmt: skip


BAD_LINES = [
    "{not json",
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),  # no custom_id
    json.dumps({"custom_id": "cmpl", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}),
    json.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/completions", "body": [1]}),
]


def write_batch(path: Path, objs: list[Any], raw: list[str] = ()) -> Path:  # type: ignore[assignment]
    path.write_text("".join(json.dumps(o) + "\n" for o in objs) + "".join(r + "\n" for r in raw))
    return path


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


VOLATILE = {"id", "created", "e2e_latency", "request_id", "cached_tokens"}


def stable(x: Any) -> Any:
    """A body without what differs between two runs of one request (ids, times, cache hits)."""
    if isinstance(x, dict):
        return {k: stable(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [stable(v) for v in x]
    if isinstance(x, float):
        return round(x, 4)
    return x


@pytest.fixture(scope="module")
def server(tokenized_llama: Path) -> Iterator[ServerProcess]:
    flags = [
        "--model-path",
        str(tokenized_llama),
        "--dtype",
        "fp32",
        "--served-model-name",
        "tiny",
        *CLASSIFY,
    ]
    proc = ServerProcess(flags).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def in_process_args(model: Path) -> ServerArgs:
    return ServerArgs(
        engine=Settings(model_path=str(model), dtype="fp32"),
        served_model_name="tiny",
        classify_labels=("Yes", "No"),
        classify_template="Will the user engage? {input}\nAnswer:",
    )


def test_in_process_answers_equal_the_servers(
    tokenized_llama: Path, server: ServerProcess, tmp_path: Path
) -> None:
    batch = write_batch(tmp_path / "in.jsonl", good_lines(), BAD_LINES)
    local = rb.run(
        rb.Job(batch, tmp_path / "local.jsonl", server_args=in_process_args(tokenized_llama), progress=False)
    )
    remote = rb.run(rb.Job(batch, tmp_path / "remote.jsonl", server=server.url, progress=False))
    a, b = read(tmp_path / "local.jsonl"), read(tmp_path / "remote.jsonl")
    assert local.complete and remote.complete and local.total == remote.total == len(a) == len(b) == 13
    for x, y in zip(a, b, strict=True):
        assert x["custom_id"] == y["custom_id"] and x["id"] == y["id"]
        assert (x["response"] is None) == (y["response"] is None)
        if x["response"] is not None:
            assert x["response"]["status_code"] == y["response"]["status_code"]
            assert stable(x["response"]["body"]) == stable(y["response"]["body"])
        assert stable(x["error"]) == stable(y["error"])
    by_cid = {x["custom_id"]: x for x in a[:8]}
    for cid in ("cmpl", "score", "rerank", "v1rerank", "classify", "generate"):
        assert by_cid[cid]["response"]["status_code"] == 200 and by_cid[cid]["error"] is None, by_cid[cid]
    assert by_cid["cmpl"]["response"]["body"]["object"] == "text_completion"
    assert len(by_cid["rerank"]["response"]["body"]["results"]) == 2
    assert by_cid["embed"]["response"]["status_code"] == 400 and by_cid["embed"]["error"]["message"]
    assert by_cid["missing-route"]["response"]["status_code"] == 404 and by_cid["missing-route"]["error"]
    # The bad lines, each an error line naming its line, in input order; nothing sent for them.
    bad = a[8:]
    assert [x["response"] for x in bad] == [None] * 5
    assert [x["custom_id"] for x in bad] == [None, None, "cmpl", "get", "nobody"]
    messages = [x["error"]["message"] for x in bad]
    assert messages[0].startswith("line 9: not JSON")
    assert "custom_id" in messages[1] and "repeats line 1" in messages[2]
    assert "POST" in messages[3] and "body must be a JSON object" in messages[4]
    assert [line for line, _, _ in local.errors] == [7, 8, 9, 10, 11, 12, 13]


def test_cli_reruns_nothing_and_refuses_foreign_outputs(server: ServerProcess, tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "in.jsonl", good_lines()[:3])
    out = tmp_path / "out.jsonl"
    argv = ["-i", str(batch), "-o", str(out), "--server", server.url, "--no-progress"]
    assert rb.main(argv) == 0
    first = out.read_bytes()
    summary = rb.run(rb.Job(batch, out, server=server.url, progress=False))
    assert (summary.answered, summary.reused) == (0, 3) and out.read_bytes() == first
    # An output with other requests' results, or not a result file at all: refused, untouched.
    other = write_batch(tmp_path / "other.jsonl", good_lines()[3:5])
    with pytest.raises(UsageError, match="not this job's output"):
        rb.run(rb.Job(other, out, server=server.url, progress=False))
    assert out.read_bytes() == first
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"a": 1}\n')
    assert rb.main(["-i", str(batch), "-o", str(foreign), "--server", server.url, "--no-progress"]) == 2
    assert foreign.read_text() == '{"a": 1}\n'
    # An edited line is answered again; its result replaces the old one in place.
    edited = good_lines()[:3]
    edited[0]["body"]["prompt"] = "User profile:\nlikes dogs"
    write_batch(batch, edited)
    summary = rb.run(rb.Job(batch, out, server=server.url, progress=False))
    assert (summary.answered, summary.reused) == (1, 2)
    assert [x["custom_id"] for x in read(out)] == ["cmpl", "score", "rerank"]


def test_unreachable_server_stops_without_recording_anything(tmp_path: Path) -> None:
    batch = write_batch(tmp_path / "in.jsonl", good_lines()[:2])
    out = tmp_path / "out.jsonl"
    with dead_url() as url:
        assert rb.main(["-i", str(batch), "-o", str(out), "--server", url, "--no-progress"]) == 1
    assert out.read_text() == ""  # no request was answered: nothing recorded as done


class Gate:
    """A stand-in server that answers `/v1/completions` for the first `limit` requests, then holds
    every further request until `open` is set; it counts the requests it answered per custom_id."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = threading.Event()
        self.answered: Counter[str] = Counter()
        self.lock = threading.Lock()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None: ...

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with gate.lock:
                    hold = sum(gate.answered.values()) >= gate.limit and not gate.open.is_set()
                if hold:
                    gate.open.wait()
                    return  # never answered: the killed run's client is gone
                with gate.lock:
                    gate.answered[body["prompt"]] += 1
                data = json.dumps({"object": "text_completion", "echo": body["prompt"]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.open.set()
        self.http.shutdown()


def test_kill_and_resume_answers_every_custom_id_once(tmp_path: Path) -> None:
    n, batch_size, limit = 60, 4, 8
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"req-{i}"}}
        for i in range(n)
    ]
    batch = write_batch(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    journal = tmp_path / "out.jsonl.partial"
    gate = Gate(limit)
    try:
        argv = [sys.executable, "-m", "po_lang.cli", "run-batch", "-i", str(batch), "-o", str(out)]
        argv += ["--server", gate.url, "--batch-size", str(batch_size), "--no-progress"]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def journaled() -> int:
            return journal.read_bytes().count(b"\n") if journal.exists() else 0

        # Two full batches answered and journaled; the third is held at the gate.
        poll_until(lambda: journaled() >= 2 * batch_size or proc.poll() is not None, "two batches journaled")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kept = journaled()
        assert kept == 2 * batch_size
        gate.open.set()
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"({n - kept} now, {kept} by an earlier run)" in done.stdout
    finally:
        gate.close()
    results = read(out)
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(n)]  # each once, in order
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    assert [r["response"]["body"]["echo"] for r in results] == [f"req-{i}" for i in range(n)]
    # The server answered each request once: none of the journaled ones was sent again.
    assert set(gate.answered) == {f"req-{i}" for i in range(n)} and max(gate.answered.values()) == 1
    assert not journal.exists()


def test_embeddings_lines_in_process(tokenized_llama: Path, tmp_path: Path) -> None:
    """/v1/embeddings lines on an embedder (vLLM's --convert embed): the vectors the engine gives."""
    from transformers import AutoTokenizer

    from po_backend import Engine

    texts = ["a cat video", "tax news for the year"]
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "tiny", "input": t},
        }
        for i, t in enumerate(texts)
    ]
    batch = write_batch(tmp_path / "in.jsonl", lines)
    args = ServerArgs(engine=Settings(model_path=str(tokenized_llama), dtype="fp32", task="embed"))
    summary = rb.run(rb.Job(batch, tmp_path / "out.jsonl", server_args=args, progress=False))
    assert summary.complete and not summary.errors
    engine = Engine.from_pretrained(tokenized_llama, dtype="fp32", task="embed")
    tok = AutoTokenizer.from_pretrained(tokenized_llama)
    for text, result in zip(texts, read(tmp_path / "out.jsonl"), strict=True):
        assert result["response"]["status_code"] == 200
        (item,) = result["response"]["body"]["data"]
        want = engine.embed([tok.encode(text)])[0]
        assert item["embedding"] == pytest.approx(want, abs=1e-5)


def test_cli_in_process_with_vllms_flags(tokenized_llama: Path, tmp_path: Path, capsys: Any) -> None:
    batch = write_batch(tmp_path / "in.jsonl", good_lines()[:1], BAD_LINES[:1])
    out = tmp_path / "out.jsonl"
    argv = ["-i", str(batch), "-o", str(out), "--model", str(tokenized_llama), "--dtype", "fp32"]
    assert rb.main([*argv, "--no-progress", "--output-tmp-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    assert "2 of 2 requests answered (2 now, 0 by an earlier run), 1 with an error" in printed.out
    assert "error at line 2 (custom_id None): line 2: not JSON" in printed.err
    assert [r["custom_id"] for r in read(out)] == ["cmpl", None]
    with pytest.raises(SystemExit) as exit_:  # argparse: no model to run in process
        rb.main(["-i", str(batch), "-o", str(out), "--dtype", "fp32"])
    assert exit_.value.code == 2
