"""SGLang's, Cohere's and vLLM's clients through `launch_cluster` (two workers behind the real
SGLang router, a data key) answer as they do against one server, where sglang-router 0.3.2 alone
cannot take their calls: `sgl.select`'s batched /generate, Cohere's /v2/rerank (and vLLM/Jina's
/rerank), /v1/classify without `model`, /v1/score and /generative_scoring. The gate translates
those; the last tests drive it before a model-free router, where what reaches the router can be
counted."""

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


@pytest.mark.slow
def test_score_and_generative_scoring(cluster: str, single: ServerProcess) -> None:
    """SGLang's /v1/score and vLLM's /generative_scoring, which the router does not forward, get
    one server's answer through the cluster: text and token-id items, softmax over the labels or
    not, per-item labels, the item first; the workers answer them as /generate calls (never a
    /v1/score call), and a call over the workers' limits is refused as one server refuses it."""
    query, items = "Is the post about pets? Post:", [" a cat video", " tax news", " dogs play"]
    ids_query, ids_items = [1, 17, 42, 99], [[5, 6], [7, 250, 8], [9]]
    scores = [
        {"query": query, "items": items, "label_token_ids": [5, 6, 7]},
        {"query": query, "items": items, "label_token_ids": [5, 6], "apply_softmax": True, "temperature": 0.7},
        {"query": query, "items": items[0], "label_token_ids": [5, 6], "item_first": True, "return_token_logprobs": True},
        {"query": ids_query, "items": ids_items, "label_token_ids": [[5, 6], [6, 9], [11, 5]], "apply_softmax": True},
        {"query": ids_query, "items": ids_items, "label_token_ids": [5, 6], "item_first": True, "model": "mine"},
    ]  # fmt: skip
    vllm = [
        {"query": ids_query, "items": ids_items, "label_token_ids": [5, 6, 7]},
        {"query": ids_query, "items": ids_items, "label_token_ids": [6, 5], "apply_softmax": False, "item_first": True},
    ]  # fmt: skip
    with httpx.Client(timeout=120) as client:
        before = generate_calls(cluster)
        for path, bodies in (("/v1/score", scores), ("/generative_scoring", vllm)):
            for body in bodies:
                r, ref = both(client, cluster, single, path, body)
                assert r.status_code == ref.status_code == 200, (body, r.text)
                got, want = r.json(), ref.json()
                for per_call in ("id", "created"):  # vLLM's envelope
                    got.pop(per_call, None), want.pop(per_call, None)
                assert_same_answer(got, want, f"{path} {body}")
        assert generate_calls(cluster) > before  # answered as /generate calls...
        assert not any(  # ...and never as /v1/score or /generative_scoring ones
            metric(w, f'po_http_requests_total{{endpoint="{e}",status="200"}}', 0.0)
            for w in worker_urls(cluster)
            for e in ("/v1/score", "/generative_scoring")
        )
        for body, status in (
            ({"query": query, "items": ["x"] * (MAX_ITEMS + 1), "label_token_ids": [5]}, 413),
            ({"query": query, "items": items, "label_token_ids": [5, 5]}, 400),
            ({"query": query, "items": [[5]], "label_token_ids": [5]}, 400),
        ):
            r, ref = both(client, cluster, single, "/v1/score", body)
            assert_same_error(r, ref, status)
        # A token outside the vocabulary: a 400 from the worker (the gate has no model to know).
        bad = {"query": ids_query, "items": [[5], [10**6]], "label_token_ids": [5]}
        r, ref = both(client, cluster, single, "/v1/score", bad)
        assert r.status_code == ref.status_code == 400 and r.json()["object"] == "error", r.text


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


def fake_logprob(prompt: Any, token: int) -> float:
    """A made-up next-token log-prob of `token` after `prompt` (text or ids), distinct per pair."""
    return -1.0 - (sum(map(ord, prompt)) if isinstance(prompt, str) else sum(prompt)) % 7 / 3 - token / 10


def test_gate_scores_through_generate_before_a_router() -> None:
    """/v1/score and /generative_scoring, which the router does not forward, before a model-free
    router that answers /generate as a worker does (made-up log-probs): a text call goes as one
    routed /generate per item (query + item, the label tokens' log-probs asked), a token-id call
    as one batched /generate; the scores are one server's from those log-probs, in SGLang's and
    vLLM's shapes. Bad bodies and limits are refused before any call goes out; a worker's error
    comes back in the route's shape with its Retry-After."""
    from po_backend.server.protocol import ScoreRequestBody
    from po_backend.server.scoring import GenerativeScoringBody, generative_answer, score_answer

    seen: list[dict[str, Any]] = []

    def one(prompt: Any, labels: list[int]) -> dict[str, Any]:
        row = [[fake_logprob(prompt, t), t, None] for t in labels]
        n = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {"prompt_tokens": n, "output_token_ids_logprobs": [row]},
        }

    async def router(scope: Any, receive: Any, send: Any) -> None:
        data = json.loads(await read_asgi_body(receive))
        seen.append(data)
        status, headers = 200, [(b"content-type", b"application/json")]
        if "text" in data and data["text"].endswith("overloaded"):
            status, answer = (
                503,
                {"error": {"message": "queue full", "type": "ServiceUnavailableError", "code": 503}},
            )
            headers.append((b"retry-after", b"1"))
        elif any(isinstance(x, list) for x in data["token_ids_logprob"]):  # as sglang-router 0.3.2
            status, answer = 422, {"error": "token_ids_logprob[0]: invalid type: sequence, expected u32"}
        elif "text" in data:
            answer = one(data["text"], data["token_ids_logprob"])
        elif data["input_ids"] and isinstance(data["input_ids"][0], list):
            answer = [one(p, data["token_ids_logprob"]) for p in data["input_ids"]]
        else:
            answer = one(data["input_ids"], data["token_ids_logprob"])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    limits = Limits(max_items=4, model_name="served", fan_out=2, max_logprobs=12, max_tokenize_chars=200)
    gate = Gate(
        "http://router", Keys(data=None, admin="a", worker="w"), httpx.ASGITransport(app=router), limits
    )

    def expected(
        path: str, body: dict[str, Any], prompts: list[Any], labels: list[list[int]]
    ) -> dict[str, Any]:
        logprobs = [[fake_logprob(p, t) for t in ls] for p, ls in zip(prompts, labels, strict=True)]
        tokens = sum(len(p) if isinstance(p, list) else len(p.split()) for p in prompts)
        if path == "/v1/score":
            return score_answer(ScoreRequestBody.model_validate(body), logprobs, tokens, "served")
        return generative_answer(GenerativeScoringBody.model_validate(body), logprobs, tokens, "served")

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gate") as c:
            text = {"query": "Is it a", "items": [" cat", " dog", " fish"], "label_token_ids": [5, 6]}
            for extra in ({}, {"apply_softmax": True, "temperature": 2.0}, {"return_token_logprobs": True},
                          {"item_first": True, "model": "mine"}):  # fmt: skip
                body = {**text, **extra}
                prompts = [
                    it + "Is it a" if extra.get("item_first") else "Is it a" + it for it in text["items"]
                ]
                seen.clear()
                r = await c.post("/v1/score", json=body)
                assert r.status_code == 200, r.text
                want = expected("/v1/score", body, prompts, [[5, 6]] * 3)
                assert r.json() == want and ("token_logprobs" in want) == bool(
                    extra.get("return_token_logprobs")
                )
                assert sorted(s["text"] for s in seen) == sorted(prompts)  # one routed call per item
                assert all(
                    s["sampling_params"] == {"max_new_tokens": 0} and s["return_logprob"] for s in seen
                )
            ids = {
                "query": [1, 2],
                "items": [[3], [4, 5]],
                "label_token_ids": [7, 8],
                "priority": 3,
                "lora_path": "ad",
            }
            seen.clear()
            r = await c.post("/v1/score", json=ids)
            assert r.status_code == 200, r.text
            assert r.json() == expected("/v1/score", ids, [[1, 2, 3], [1, 2, 4, 5]], [[7, 8], [7, 8]])
            assert [s["input_ids"] for s in seen] == [[[1, 2, 3], [1, 2, 4, 5]]]
            assert (seen[0]["priority"], seen[0]["lora_path"]) == (
                3,
                "ad",
            )  # what a worker schedules and adapts by
            seen.clear()  # the label tokens per item: one call each
            per_item = {**ids, "label_token_ids": [[7, 8], [9, 8]]}
            r = await c.post("/v1/score", json=per_item)
            assert r.status_code == 200, r.text
            assert r.json() == expected("/v1/score", per_item, [[1, 2, 3], [1, 2, 4, 5]], [[7, 8], [9, 8]])
            assert sorted(s["input_ids"] for s in seen) == [[1, 2, 3], [1, 2, 4, 5]]
            for extra in ({}, {"apply_softmax": False, "item_first": True}):
                vllm = {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [7, 8], **extra}
                r = await c.post("/generative_scoring", json=vllm)
                prompts = [[3, 1, 2], [4, 5, 1, 2]] if extra else [[1, 2, 3], [1, 2, 4, 5]]
                want = expected("/generative_scoring", vllm, prompts, [[7, 8]] * 2)
                got = r.json()
                assert {k: v for k, v in got.items() if k not in ("id", "created")} == {
                    k: v for k, v in want.items() if k not in ("id", "created")
                }, got

            seen.clear()
            for path, body, status, words in (
                ("/v1/score", {**text, "items": ["a"] * 5}, 413, "--max-items-per-request"),
                ("/v1/score", {**text, "label_token_ids": list(range(5))}, 413, "--max-logprobs-per-request"),
                ("/v1/score", {**text, "query": "q" * 60}, 413, "--max-tokenize-chars"),
                ("/v1/score", {**text, "label_token_ids": [5, 5]}, 400, "duplicate"),
                ("/v1/score", {**text, "label_token_ids": []}, 400, "nonempty"),
                ("/v1/score", {**text, "items": [[1]]}, 400, "text query needs text items"),
                ("/v1/score", {**text, "temperature": 0.5}, 400, "temperature requires apply_softmax"),
                ("/v1/score", {**text, "apply_softmax": "maybe"}, 400, "apply_softmax"),
                (
                    "/generative_scoring",
                    {"query": "q", "items": [[1]], "label_token_ids": [1]},
                    400,
                    "token ids",
                ),
                ("/generative_scoring", {"query": [1], "items": [], "label_token_ids": [1]}, 400, "items"),
            ):
                r = await c.post(path, json=body)
                assert r.status_code == status and words in error_message(r), (body, r.text)
                assert r.json()["object"] == "error"  # the OpenAI-style shape of both routes
            assert seen == []  # none reached the router
            r = await c.post("/v1/score", json={**text, "items": [" ok", " overloaded"]})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json() == {"object": "error", "message": "queue full", "type": "ServiceUnavailableError",
                                "param": None, "code": 503}  # fmt: skip

    asyncio.run(run())
