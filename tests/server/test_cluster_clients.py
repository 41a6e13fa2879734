"""SGLang's, Cohere's and vLLM's clients through `launch_cluster` (two workers behind the real
SGLang router, a data key) answer as they do against one server, where sglang-router 0.3.2 alone
cannot take their calls: `sgl.select`'s batched /generate, Cohere's /v2/rerank (and vLLM/Jina's
/rerank), /v1/classify without `model`. The gate translates those; the last test drives it
before a model-free router, where what reaches the router can be counted."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from po_backend.entrypoints.gate import Gate, Keys, Limits
from tests.deps import require
from tests.server_utils import (
    CLUSTER_WORKER_FLAGS,
    ServerProcess,
    assert_same_answer,
    dead_url,
    error_message,
    launched_cluster,
    metric,
    read_asgi_body,
    sglang_frontend,
    worker_urls,
)

KEY = "cluster-clients-data-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_ITEMS = 6  # the workers' --max-items-per-request, which the gate checks before any call
LIMIT_FLAGS = ["--max-items-per-request", str(MAX_ITEMS)]
QUERY = "which pets like to play"
DOCS = ["cats like to play", "tax news", "dogs play in the park"]
CHOICES = [" Yes", " No", " maybe so"]


@pytest.fixture(scope="module")
def single(tokenized_llama: Path) -> Iterator[ServerProcess]:
    """One server with the workers' flags (no key): the answers the cluster must give."""
    proc = ServerProcess(["--model-path", str(tokenized_llama), *CLUSTER_WORKER_FLAGS, *LIMIT_FLAGS]).start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(tokenized_llama: Path, single: ServerProcess) -> Iterator[str]:
    """`single` first: it boots while the cluster does."""
    require("sglang_router", "pip install sglang-router")
    env = {**os.environ, "PREFILLONLY_API_KEY": KEY}
    with launched_cluster(
        tokenized_llama, ["--workers", "2", *LIMIT_FLAGS], env=env, headers=AUTH
    ) as launcher:
        single.wait_ready()
        yield launcher.url


def generate_calls(router_url: str) -> float:
    """/generate calls the cluster's workers answered, whatever their status."""
    return sum(
        metric(w, f'po_http_requests_total{{endpoint="/generate",status="{s}"}}', 0.0)
        for w in worker_urls(router_url)
        for s in (200, 400)
    )


def both(
    client: httpx.Client, cluster: str, single: ServerProcess, path: str, body: Any
) -> tuple[httpx.Response, httpx.Response]:
    """The same call through the cluster's gate (with the data key) and to one server."""
    return client.post(cluster + path, json=body, headers=AUTH), client.post(single.url + path, json=body)


def assert_same_error(r: httpx.Response, ref: httpx.Response, status: int) -> None:
    assert (r.status_code, error_message(r)) == (
        ref.status_code,
        error_message(ref),
    ) and r.status_code == status


def stable(answer: Any) -> Any:
    """A /generate answer without its per-call fields."""
    if isinstance(answer, list):
        return [stable(a) for a in answer]
    drop = ("id", "e2e_latency", "cached_tokens")
    return {**answer, "meta_info": {k: v for k, v in answer["meta_info"].items() if k not in drop}}


@pytest.mark.slow
def test_sgl_select_and_batched_generate(cluster: str, single: ServerProcess) -> None:
    """`sgl.select` sends its choices as one /generate with `text` a list: the same decision and
    log-probs through the cluster as from one server; a batch's answers in order, its stream, a
    bad prompt failing the whole call as one server fails it, and a batch over the workers' item
    limit refused before any prompt reaches a worker."""
    sgl = sglang_frontend()

    @sgl.function
    def engage(s: Any, post: str) -> None:
        s += f"Post: {post}\nWill the user engage? Answer:"
        s += sgl.select("answer", choices=CHOICES)
        s += "\nOne word:"
        s += sgl.gen("word", max_tokens=1)

    via = engage.run(post="a cat video", backend=sgl.RuntimeEndpoint(cluster, api_key=KEY))
    direct = engage.run(post="a cat video", backend=sgl.RuntimeEndpoint(single.url))
    assert (via["answer"], via["word"]) == (direct["answer"], direct["word"])
    got, want = via.get_meta_info("answer"), direct.get_meta_info("answer")
    assert got["normalized_prompt_logprobs"] == pytest.approx(want["normalized_prompt_logprobs"], abs=1e-4)

    batch = {
        "text": ["a cat video", "tax news", "a dog and a cat", "cats"],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 0}, {"max_new_tokens": 1}, {}],
        "return_logprob": [True, False, True, True],
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    with httpx.Client(timeout=120) as client:
        r, ref = both(client, cluster, single, "/generate", batch)
        assert r.status_code == ref.status_code == 200, r.text
        assert_same_answer(stable(r.json()), stable(ref.json()))

        r = client.post(cluster + "/generate", json={**batch, "stream": True}, headers=AUTH)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert [json.loads(e)["index"] for e in events[:-1]] == [0, 1, 2, 3]
        assert_same_answer(stable([{k: v for k, v in json.loads(e).items() if k != "index"} for e in events[:-1]]),
                           stable(ref.json()))  # fmt: skip

        for bad in (
            {**batch, "sampling_params": [{}, {"max_new_tokens": 5}, {}, {}]},  # one prompt's error
            {**batch, "return_logprob": [True]},  # a per-prompt list of another length
            {"text": []},
        ):
            r, ref = both(client, cluster, single, "/generate", bad)
            assert_same_error(r, ref, 400)

        before = generate_calls(cluster)
        assert before >= 4  # the batch's prompts above are counted
        r, ref = both(client, cluster, single, "/generate", {"text": ["a"] * (MAX_ITEMS + 1)})
        assert_same_error(r, ref, 413)
        assert client.post(cluster + "/generate", json=batch).status_code == 401  # the key, as everywhere
        assert generate_calls(cluster) == before  # neither reached a worker


@pytest.mark.slow
def test_cohere_and_vllm_rerank(cluster: str, single: ServerProcess) -> None:
    """Cohere's ClientV2.rerank (/v2/rerank, which the router 404s), its v1 Client.rerank (SGLang's
    /v1/rerank, told by its SDK header) and vLLM/Jina's /rerank (which the router answers in
    SGLang's shape) get one server's answer: the same ranking and documents, the
    scores as the router carries them (float32)."""
    import cohere

    via = cohere.ClientV2(base_url=cluster, api_key=KEY)
    direct = cohere.ClientV2(base_url=single.url, api_key="unused")
    for top_n in (None, 2):
        kw: dict[str, Any] = {"model": "tiny", "query": QUERY, "documents": DOCS}
        kw |= {"top_n": top_n} if top_n else {}
        got, want = via.rerank(**kw), direct.rerank(**kw)
        assert [r.index for r in got.results] == [r.index for r in want.results]
        assert len(got.results) == (top_n or len(DOCS))
        assert [r.relevance_score for r in got.results] == pytest.approx(
            [r.relevance_score for r in want.results], abs=1e-6
        )
        assert [r.document for r in got.results] == [r.document for r in want.results]
        assert got.model == want.model == "tiny" and got.usage == want.usage

    v1_via = cohere.Client(base_url=cluster, api_key=KEY).rerank(
        model="tiny", query=QUERY, documents=DOCS, top_n=2
    )
    v1_direct = cohere.Client(base_url=single.url, api_key="x").rerank(
        model="tiny", query=QUERY, documents=DOCS, top_n=2
    )
    assert [r.index for r in v1_via.results] == [r.index for r in v1_direct.results] and len(
        v1_via.results
    ) == 2
    assert [r.relevance_score for r in v1_via.results] == pytest.approx(
        [r.relevance_score for r in v1_direct.results], abs=1e-6
    )

    body = {"query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False}
    with httpx.Client(timeout=120) as client:
        r, ref = both(client, cluster, single, "/rerank", body)
        assert r.status_code == ref.status_code == 200, r.text
        got_rows, want_rows = r.json()["results"], ref.json()["results"]
        assert [x["index"] for x in got_rows] == [x["index"] for x in want_rows]
        assert [x["relevance_score"] for x in got_rows] == pytest.approx(
            [x["relevance_score"] for x in want_rows], abs=1e-6
        )
        assert all("document" not in x for x in got_rows) and r.json()["model"] == ref.json()["model"]
        # What the router would drop is refused, not ignored; the item limit is the workers'.
        r = client.post(cluster + "/v2/rerank", json={**body, "instruct": "Rank pets"}, headers=AUTH)
        assert r.status_code == 400 and "instruct" in error_message(r)
        many = {"query": QUERY, "documents": ["x"] * (MAX_ITEMS + 1)}
        r, ref = both(client, cluster, single, "/v2/rerank", many)
        assert_same_error(r, ref, 413)


@pytest.mark.slow
def test_classify_without_a_model(cluster: str, single: ServerProcess) -> None:
    """SGLang/vLLM's /v1/classify without `model`, which one server takes and the router refuses
    (422): the gate names the served model."""
    body = {"input": ["a cat video", "tax news"]}
    with httpx.Client(timeout=120) as client:
        r, ref = both(client, cluster, single, "/v1/classify", body)
        assert r.status_code == ref.status_code == 200, r.text
        assert r.json()["model"] == ref.json()["model"]
        assert [d["label"] for d in r.json()["data"]] == [d["label"] for d in ref.json()["data"]]
        assert [d["probs"] for d in r.json()["data"]] == [
            pytest.approx(d["probs"], abs=1e-6) for d in ref.json()["data"]
        ]
        named = client.post(cluster + "/v1/classify", json={**body, "model": "other"}, headers=AUTH)
        assert named.status_code == 200 and named.json()["model"] == "other"  # a given name passes as it is


def test_gate_translates_before_a_router_and_checks_limits_first() -> None:
    """The gate before a model-free router that answers each /generate prompt at once (or 400s
    the ones named "bad"): a batch fans out one call per prompt and comes back in order; the
    earliest failing prompt's answer is the call's; limits (items, body bytes) and the key are
    checked before anything reaches the router; other calls pass through unchanged."""
    seen: list[tuple[str, Any]] = []

    async def router(scope: Any, receive: Any, send: Any) -> None:
        body = await read_asgi_body(receive)
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = body.decode()
        seen.append((scope["path"], data))
        status, answer = 200, {"echo": data}
        if (
            scope["path"] == "/generate"
            and isinstance(data, dict)
            and str(data.get("text", "")).startswith("bad")
        ):
            status, answer = 400, {"error": {"message": f"{data['text']} refused"}}
        out = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"date", b"then")]})  # fmt: skip
        await send({"type": "http.response.body", "body": out})

    limits = Limits(max_body_bytes=4096, max_items=5, model_name="served", fan_out=2)
    gate = Gate(
        "http://router", Keys(data="d", admin="a", worker="w"), httpx.ASGITransport(app=router), limits
    )

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gate") as c:
            auth = {"Authorization": "Bearer d"}
            batch = {"text": ["p0", "p1", "p2", "p3"], "rid": ["a", "b", "c", "d"], "top_logprobs_num": 2}
            r = await c.post("/generate", json=batch, headers=auth)
            assert r.status_code == 200, r.text
            assert [a["echo"] for a in r.json()] == [
                {"text": f"p{i}", "rid": "abcd"[i], "top_logprobs_num": 2, "stream": False} for i in range(4)
            ]
            assert "date" not in r.headers  # the router's is dropped (uvicorn writes the gate's)
            r = await c.post("/generate", json={"text": ["ok", "bad2", "bad1", "ok"]}, headers=auth)
            assert r.status_code == 400 and error_message(r) == "bad2 refused"  # the earliest failing prompt
            n = len(seen)
            for body, status in (({"text": ["x"] * 6}, 413), ({"text": ["x" * 5000]}, 413), ({"text": []}, 400),
                                 ({"text": ["x", "y"], "rid": ["a"]}, 400)):  # fmt: skip
                r = await c.post("/generate", json=body, headers=auth)
                assert r.status_code == status, (body, r.text)
            r = await c.post("/generate", json=batch)
            assert r.status_code == 401
            assert len(seen) == n  # none of them reached the router
            await c.post("/v1/classify", json={"input": ["x"]}, headers=auth)
            assert seen[-1] == ("/v1/classify", {"input": ["x"], "model": "served"})
            await c.post("/generate", json={"input_ids": [[1, 2], [3]]}, headers=auth)  # the router takes it
            assert seen[-1] == ("/generate", {"input_ids": [[1, 2], [3]]})
            await c.post("/generate", content=b"not json", headers=auth)  # the router's to answer
            assert seen[-1] == ("/generate", "not json")
            sglang = {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}
            await c.post("/v1/rerank", json=sglang, headers=auth)
            assert seen[-1] == ("/v1/rerank", sglang)  # SGLang's callers: as sent
            await c.post("/v1/rerank", json=sglang, headers={**auth, "X-Fern-SDK-Name": "cohere"})
            assert seen[-1] == (
                "/v1/rerank",
                {"query": "q", "documents": ["a", "b"], "return_documents": False},
            )

        with dead_url() as nobody:
            down = Gate(nobody, Keys(data="d", admin="a", worker="w"))
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=down), base_url="http://gate"
            ) as c:
                for path, body in (
                    ("/generate", {"text": ["a", "b"]}),
                    ("/v2/rerank", {"query": "q", "documents": ["a"]}),
                ):
                    r = await c.post(path, json=body, headers={"Authorization": "Bearer d"})
                    assert r.status_code == 502 and "router" in error_message(r), (path, r.text)

    asyncio.run(run())
