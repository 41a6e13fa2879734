"""OpenTelemetry traces: a real OTLP/HTTP receiver on loopback (protobuf decoded with
opentelemetry-proto) gets one span per call, continuing the caller's `traceparent`, with tokenize,
queue, forward and response children; without an endpoint the OpenTelemetry packages are never
imported."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from po_backend.entrypoints.launch_server import build_parser, server_args
from po_backend.server.tracing import DEFAULT_ENDPOINT
from tests.server_utils import REPO_ROOT, ServerProcess, poll_until

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces with an ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None: ...

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(data)
                with receiver.lock:
                    receiver.paths.append(self.path)
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def of_trace(self, trace_id: str) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.http.shutdown()


@pytest.mark.slow
def test_spans_reach_a_real_receiver(tokenized_llama: Path, receiver: Receiver) -> None:
    # No path in the endpoint: /v1/traces is added, as OTLP exporters do.
    flags = ["--model-path", str(tokenized_llama), "--dtype", "fp32", "--otlp-traces-endpoint", receiver.url]
    proc = ServerProcess(flags, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}).start()
    try:
        url = proc.wait_ready().url
        body = {"query": "User profile:\nlikes cats and dogs\nPost:", "items": [" a cat video", " tax news"],
                "label_token_ids": [5, 7], "apply_softmax": True}  # fmt: skip
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        resp = httpx.post(url + "/v1/score", json=body, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text
        names = {"POST /v1/score", "tokenize", "queue", "forward", "response"}
        poll_until(
            lambda: names <= {s.name for s in receiver.of_trace(TRACE_ID)}, "the call's spans exported"
        )
    finally:
        proc.stop()
    assert set(receiver.paths) == {"/v1/traces"}
    spans = receiver.of_trace(TRACE_ID)
    (call,) = [s for s in spans if s.name == "POST /v1/score"]
    assert call.parent_span_id.hex() == PARENT_ID  # the caller's trace, continued
    assert call.kind == call.SPAN_KIND_SERVER
    children = [s for s in spans if s is not call]
    assert {s.name for s in children} >= names - {"POST /v1/score"}
    for s in children:
        assert s.parent_span_id == call.span_id, s.name
        assert (
            call.start_time_unix_nano
            <= s.start_time_unix_nano
            <= s.end_time_unix_nano
            <= call.end_time_unix_nano
        )
    attrs = {s.name: {a.key: a.value for a in s.attributes} for s in children}
    assert attrs["queue"]["po.priority_class"].string_value
    assert attrs["queue"]["po.requests"].int_value == 2
    forwards = [s for s in children if s.name == "forward"]
    computed = sum(attrs_of(s)["po.computed_tokens"].int_value for s in forwards)
    cached = sum(attrs_of(s)["po.cached_tokens"].int_value for s in forwards)
    assert computed + cached == resp.json()["usage"]["prompt_tokens"]
    assert all(
        attrs_of(s)["po.batch_size"].int_value >= attrs_of(s)["po.call_requests"].int_value >= 1
        for s in forwards
    )
    assert attrs["response"]["http.response.status_code"].int_value == 200
    # A call without a traceparent starts its own trace.
    roots = [s for s in receiver.spans if s.name.startswith("GET /health") and not s.parent_span_id]
    assert roots


def attrs_of(span: Any) -> dict[str, Any]:
    return {a.key: a.value for a in span.attributes}


def test_flags() -> None:
    def endpoint(*flags: str) -> str:
        return server_args(build_parser().parse_args(["--model-path", "m", *flags])).traces_endpoint

    assert endpoint() == ""
    assert endpoint("--enable-trace") == DEFAULT_ENDPOINT  # SGLang's switch
    assert endpoint("--otlp-traces-endpoint", "collector:4318") == "http://collector:4318/v1/traces"
    assert (
        endpoint("--otlp-traces-endpoint", "https://otel.example/api/traces")
        == "https://otel.example/api/traces"
    )
    with pytest.raises(ValueError, match="only OTLP over HTTP"):
        endpoint("--otlp-traces-endpoint", "grpc://localhost:4317")


SCRIPT = """
import json, sys
from fastapi.testclient import TestClient
from po_backend.core.request import ScoreResult
from po_backend.server import ServerArgs, Settings, create_app
from tests.server_utils import FakeService

args = ServerArgs(engine=Settings(model_path="m"), otlp_traces_endpoint=sys.argv[1])
service = FakeService(answer=lambda r: ScoreResult([-1.0] * len(r.label_token_ids), prompt_tokens=len(r.input_ids)))
with TestClient(create_app(service, args)) as client:
    resp = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}})
    assert resp.status_code == 200, resp.text
# FastAPI itself imports opentelemetry-api where it is installed: what we load is the SDK and exporter.
ours = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
print(json.dumps(sorted(m for m in sys.modules if m.startswith(ours))))
"""


@pytest.mark.parametrize("endpoint", ["", "http://127.0.0.1:9/v1/traces"])
def test_nothing_is_imported_without_an_endpoint(endpoint: str) -> None:
    """A fresh interpreter serves a call; the OpenTelemetry modules are loaded only with an
    endpoint (the second case shows the check can see them)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OTEL_BSP_SCHEDULE_DELAY": "60000"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, endpoint],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert (loaded == []) == (endpoint == "")
