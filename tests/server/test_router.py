"""Our server behind the real SGLang router (`pip install sglang-router`, its Rust gateway) on
loopback, with the cache_aware and round_robin policies: every endpoint the router forwards
answers through it what the server answers directly, and the router loads the tokenizer our
/model_info names from local disk."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from po_backend.entrypoints import spawn
from tests.deps import require
from tests.server.test_rerank import ALPHABET, CORPUS
from tests.server_utils import REPO_ROOT, ServerProcess, assert_same_answer, free_port, poll_until
from tests.tiny_tokenizer import tokenized_copy

require("sglang_router", "pip install sglang-router")

pytestmark = pytest.mark.slow  # real servers in subprocesses


QUERY = "which pets like to play"
DOCS = ["cats like to play with a ball", "tax news for the year", "dogs play in the park"]
PROMPT = "<|im_start|>user\nwhich pets like to play<|im_end|>\n<|im_start|>assistant\n"


class RouterProcess(spawn.ServerProcess):
    """`python -m sglang_router.launch_router` in front of `workers`, started at once; health
    checks and the worker start-up poll every second so registration takes seconds, not the
    default 30. Ready once a worker answers through it."""

    def __init__(self, workers: list[str], policy: str) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers]
        args += ["--policy", policy, "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        args += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "120"]
        args += ["--health-check-interval-secs", "1", "--log-level", "info"]
        super().__init__(args, f"http://127.0.0.1:{self.port}", cwd=REPO_ROOT, health_path="/get_model_info")
        self.args = args
        self.start()

    def wait_ready(self, timeout: float = 120.0, headers: Mapping[str, str] | None = None) -> RouterProcess:
        super().wait_ready(timeout, headers)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)


@pytest.fixture(scope="module")
def model_dir(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenized_copy(tiny_model("llama")[0], tmp_path_factory.mktemp("rerank"), CORPUS, ALPHABET)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    flags = ["--model-path", str(model_dir), "--dtype", "fp32", "--max-input-len", "256"]
    flags += ["--classify-labels", "yes,no", "--classify-template", "Classify the post:\n{input}\nAnswer:"]
    proc = ServerProcess([*flags, "--served-model-name", "tiny"]).start()
    try:
        yield proc.wait_ready().url
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=["cache_aware", "round_robin"])
def router(request: pytest.FixtureRequest, server: str) -> Iterator[RouterProcess]:
    proc = RouterProcess([server], request.param)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def ok(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text}"
    return resp.json()


def tokenized(router: RouterProcess, body: dict[str, Any]) -> Any:
    """The router's /v1/tokenize answer, once it has the model's tokenizer: it registers a worker's
    tokenizer in a step of its own after adding the worker, so it can serve before it has one."""
    last: list[httpx.Response] = []

    def registered() -> bool:
        last[:] = [httpx.post(router.url + "/v1/tokenize", json=body, timeout=30)]
        return "tokenizer_not_found" not in last[0].text

    poll_until(registered, f"the router has {body['model']}'s tokenizer", interval=0.5)
    return ok(last[0])


def both(router: RouterProcess, server: str, method: str, path: str, body: Any = None) -> tuple[Any, Any]:
    """The same call through the router and directly."""
    kw: dict[str, Any] = {"timeout": 60.0} | ({"json": body} if body is not None else {})
    return (
        ok(httpx.request(method, router.url + path, **kw)),
        ok(httpx.request(method, server + path, **kw)),
    )


def test_model_info_names_a_local_tokenizer_the_router_loads(
    router: RouterProcess, server: str, model_dir: Path
) -> None:
    via, direct = both(router, server, "GET", "/get_model_info")
    assert via == direct
    assert Path(direct["tokenizer_path"]) == model_dir.resolve()
    assert (Path(direct["tokenizer_path"]) / "tokenizer.json").is_file()
    # The router answers /v1/tokenize itself, with the tokenizer it loaded from that folder.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = tokenized(router, {"model": "tiny", "prompt": QUERY})
    assert out["tokens"] in (tok.encode(QUERY), tok.encode(QUERY, add_special_tokens=False))


def test_server_info(router: RouterProcess, server: str) -> None:
    """sglang-router 0.3.2 answers /get_server_info itself (a summary of its workers) rather
    than forwarding it; the worker's own answer stays one hop away."""
    via = ok(httpx.get(router.url + "/get_server_info", timeout=30))
    assert via.get("workers_count") == 1, via
    direct = ok(httpx.get(server + "/get_server_info", timeout=30))
    assert direct["schedule_policy"] == "po" and "internal_states" in direct


def test_rerank(router: RouterProcess, server: str) -> None:
    # No `instruct`: sglang-router 0.3.2 forwards query, documents, model, return_documents only
    # (its requests get the template's default instruction).
    body = {"query": QUERY, "documents": DOCS}
    reply, direct = both(router, server, "POST", "/v1/rerank", body)
    # The router rebuilds its reply from SGLang's list that we answer: {"object": "rerank",
    # "results": [...]} with the same order, scores (as f32), documents, meta_info.
    assert reply["object"] == "rerank"
    via = reply["results"]
    assert [r["index"] for r in via] == [r["index"] for r in direct]
    assert [r["score"] for r in via] == pytest.approx([r["score"] for r in direct], abs=1e-6)
    assert [r.get("document") for r in via] == [DOCS[r["index"]] for r in direct]
    # The second call reads the query from the cache: only the prompt sizes must agree.
    assert [r["meta_info"]["prompt_tokens"] for r in via] == [r["meta_info"]["prompt_tokens"] for r in direct]


def test_classify(router: RouterProcess, server: str) -> None:
    """The router forwards SGLang/vLLM's {model, input} classify body unchanged."""
    body = {"model": "tiny", "input": ["a cat video", "tax news"]}
    via, direct = both(router, server, "POST", "/v1/classify", body)
    assert [d["label"] for d in via["data"]] == [d["label"] for d in direct["data"]]
    assert [d["probs"] for d in via["data"]] == [pytest.approx(d["probs"], abs=1e-6) for d in direct["data"]]
    assert {d["num_classes"] for d in via["data"]} == {2}


def test_flush_cache_reaches_the_worker(router: RouterProcess, server: str) -> None:
    body = {"query": "a new query about dogs", "documents": DOCS}
    ok(httpx.post(server + "/v1/rerank", json=body, timeout=60))
    warm = ok(httpx.post(server + "/v1/rerank", json=body, timeout=60))
    assert min(r["meta_info"]["cached_tokens"] for r in warm) > 0
    r = httpx.post(router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    cold = ok(httpx.post(server + "/v1/rerank", json=body, timeout=60))
    assert min(r["meta_info"]["cached_tokens"] for r in cold) == 0


def _stable_generate(out: dict[str, Any]) -> Any:
    """The answer without per-call fields."""
    meta = {k: v for k, v in out["meta_info"].items() if k not in ("id", "e2e_latency", "cached_tokens")}
    return {**out, "meta_info": meta}


def test_generate(router: RouterProcess, server: str) -> None:
    """Needs the server to accept the keys the router adds (model, background, no_logs, ...)."""
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "top_logprobs_num": 3,
    }
    via, direct = both(router, server, "POST", "/generate", body)
    assert_same_answer(_stable_generate(via), _stable_generate(direct))
    assert len(direct["output_ids"]) == 1


def test_completions(router: RouterProcess, server: str) -> None:
    """Needs the server to accept the keys the router adds (no_stop_trim, ignore_eos, ...)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "logprobs": 3}
    via, direct = both(router, server, "POST", "/v1/completions", body)
    for out in (via, direct):
        out.pop("id"), out.pop("created")
    assert_same_answer(via, direct)


@pytest.mark.embedded
def test_the_router_loads_the_embedded_models_tokenizer_from_disk() -> None:
    """`--model-path embedded` (or a .gguf file) is no hub id: the router reads the tokenizer
    folder from the worker's /server_info `model_path` and must not try the hub for "embedded"."""
    # fcfs: no JCT profile of the embedded model at start (this test is about the tokenizer). The
    # start-up memory profile's shapes (fp32, 256-token prompts, default batches) are those of the
    # session's other embedded fp32 engines (tests/conftest.py's embedded_fp32, test_lang_embedded),
    # so the session measures it once.
    flags = [
        "--model-path",
        "embedded",
        "--dtype",
        "fp32",
        "--max-input-len",
        "256",
        "--schedule-policy",
        "fcfs",
    ]
    worker = ServerProcess(flags).start()
    try:
        url = worker.wait_ready().url
        info = ok(httpx.get(url + "/server_info", timeout=30))
        assert (Path(info["model_path"]) / "tokenizer.json").is_file(), info["model_path"]
        assert info["served_model_name"] == "embedded"
        router = RouterProcess([url], "round_robin").wait_ready()
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(info["model_path"])
            out = tokenized(router, {"model": "embedded", "prompt": QUERY})
            assert out["tokens"] in (tok.encode(QUERY), tok.encode(QUERY, add_special_tokens=False))
            assert "Failed to load tokenizer" not in router.log_text(last=1 << 30)
        finally:
            router.stop()
    finally:
        worker.stop()
