"""A bounded loopback soak of one server: mixed small and big calls, client disconnects, cache
flushes, the hostile calls of `hostile` (each over a per-call bound), `/health` probed every 0.1 s,
then SIGTERM mid-load. Reports requests sent / answered / 4xx / 5xx / lost (no answer at all: must
be 0, like 5xx), peak RSS against the memory budget, small calls' latency while big ones run and
`/health` latency; writes benchmarks/results/soak.json.

    python -m benchmarks.bench_soak [--duration 300] [--model-path embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import signal
import subprocess
import time
from collections import Counter
from typing import Any

import httpx
import numpy as np
import psutil

from benchmarks import harness
from benchmarks.workloads import WORDS

Request = tuple[str, str, Any, str]  # method, path, body, kind


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def hostile(rng: random.Random) -> Request:
    """One call a hostile client sends: each is over a per-call bound (tests/server/test_hardening2.py
    checks each one's status and message), so it must be refused fast with a 4xx while everyone
    else is served."""
    ids = [rng.randrange(100, 40000) for _ in range(2048)]
    calls: list[Request] = [
        ("POST", "/generate", {"input_ids": ids[:8],
         "sampling_params": {"logit_bias": {str(i): 1.0 for i in range(49151)}}}, "logit_bias"),
        ("POST", "/v1/score", {"query": ids[:16], "items": [ids[16:24]] * 32,
         "label_token_ids": list(range(49151))}, "labels_x_items"),
        ("POST", "/generate", {"input_ids": [ids] * 8, "return_logprob": True, "logprob_start_len": 0,
         "top_logprobs_num": 20}, "prompt_logprobs"),
        ("POST", "/v1/classify", {"prompt": [f"Post {i}: {text(rng, 5)}\nAnswer:" for i in range(1024)],
         "labels": ["strongly agree", "mildly agree", "no opinion at all", "mildly disagree",
                    "strongly disagree"]}, "never_fits_queue"),
        ("POST", "/v1/classify", {"prompt": "Answer:", "labels": ["yes", "word " * 5000]}, "long_label"),
        ("POST", "/generate", b'{"input_ids": [' + b"12345, " * 300_000 + b'1], "rid": "\\ud800"}',
         "surrogate_body"),
        ("POST", "/generate", b"[" * 100_000 + b"]" * 100_000, "deep_json"),
        ("POST", "/generate", {"text": "x" * (5 << 20)}, "oversized"),  # over --max-body-bytes 4 MiB
        ("POST", "/health", b"x" * (1 << 20), "wrong_method"),
        ("GET", "/flush_cache", None, "flush_by_get"),
        ("POST", "/generate", b'{"text": "broken', "malformed"),
    ]  # fmt: skip
    return rng.choice(calls)


def call(rng: random.Random, big: bool) -> Request:
    """One call of the soak; some are hostile."""
    if rng.random() < 0.08:
        return hostile(rng)
    if big:
        profile = "User profile: " + text(rng, 400) + "\nWill the user like this post?\n"
        items = [f"Post: {text(rng, 20)}\nAnswer:" for _ in range(40)]
        return "POST", "/v1/score", {"query": profile, "items": items, "label_token_ids": [5, 6]}, "big"
    return "POST", "/generate", {"text": text(rng, 12), "sampling_params": {"max_new_tokens": 1}}, "small"


async def soak(
    url: str, pid: int, args: argparse.Namespace
) -> tuple[list[tuple[str, str, float]], list[float], int]:
    """`--duration` seconds of mixed load: per call (kind, status, latency), the /health latencies
    and the server's peak RSS."""
    rng, health, peak_rss, server = random.Random(args.seed), [], 0, psutil.Process(pid)
    end = time.monotonic() + args.duration
    # No client-side connection limit: a pool that is full of slow calls would queue the next
    # ones (and the probes) in the client and charge that wait to the server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client,
        httpx.AsyncClient(base_url=url, timeout=10) as prober,
    ):

        async def one(request: Request, abandon: bool) -> tuple[str, str, float]:
            method, path, body, kind = request
            content = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
            req = client.request(method, path, content=content, headers={"content-type": "application/json"})
            t0 = time.monotonic()
            try:
                r = await (asyncio.wait_for(req, 0.05) if abandon else req)
                return kind, str(r.status_code), time.monotonic() - t0
            except TimeoutError:
                return kind, "abandoned", math.nan  # the client hung up: nobody is owed an answer
            except httpx.HTTPError as e:
                return kind, f"lost: {type(e).__name__}", math.nan

        async def monitor() -> None:  # until cancelled: RSS while any call is out, /health until `end`
            nonlocal peak_rss
            while True:
                with contextlib.suppress(psutil.NoSuchProcess):  # a server that died shows as lost calls
                    peak_rss = max(peak_rss, server.memory_info().rss)
                t0 = time.monotonic()
                if t0 < end:
                    try:
                        await prober.get("/health")
                        health.append(time.monotonic() - t0)
                    except httpx.HTTPError:
                        health.append(math.inf)
                await asyncio.sleep(0.1)

        watch, calls = asyncio.ensure_future(monitor()), []
        while time.monotonic() < end:
            request = call(rng, big=rng.random() < args.big_share)
            calls.append(asyncio.ensure_future(one(request, abandon=rng.random() < 0.05)))
            if rng.random() < 0.01:
                calls.append(asyncio.ensure_future(one(("POST", "/flush_cache", {}, "flush"), False)))
            await asyncio.sleep(rng.expovariate(args.rate))  # Poisson arrivals
        records = await asyncio.gather(*calls)
        watch.cancel()
    return records, health, peak_rss


async def drain(url: str, proc: subprocess.Popen[bytes], n: int) -> Counter[str]:
    """A burst of `n` small calls, SIGTERM once the server has taken all of them: each gets 200
    or 503 (SIGTERM closes the listening socket, so a call not yet read would be refused)."""
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=httpx.Limits(max_connections=n + 1)
    ) as client:

        async def submitted() -> int:  # every request the server took, under the loop's lock
            return int((await client.get("/server_info")).json()["internal_states"][0]["submitted"])

        body = {"text": "a short prompt to score", "sampling_params": {"max_new_tokens": 1}}
        before, deadline = await submitted(), time.monotonic() + 120
        tasks = [asyncio.ensure_future(client.post("/generate", json=body)) for _ in range(n)]
        while await submitted() - before < n and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out = await asyncio.gather(*tasks, return_exceptions=True)
    return Counter(str(r.status_code) if isinstance(r, httpx.Response) else "lost" for r in out)


def percentile(xs: list[float], q: float, scale: float = 1.0) -> float | None:
    return float(np.percentile(xs, q)) * scale if xs else None


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, harness.RESULTS / "soak.json")
    harness.flags(ap, model_path="embedded", duration=300.0, memory_budget="1GiB", seed=0)
    harness.flags(ap, rate=(4.0, "calls per second (Poisson)"))
    harness.flags(ap, big_share=(0.1, "share of calls that are 40-item scorings"))
    args = ap.parse_args(argv)
    server = harness.our_server(
        ["--memory-budget", args.memory_budget, "--max-body-bytes", "4MiB"], args.model_path
    )
    with harness.servers_up([server]):  # SIGTERMed by `drain`; stopped (killed if need be) on the way out
        assert server.proc is not None, "started"
        records, health, peak_rss = asyncio.run(soak(server.url, server.proc.pid, args))
        drained = asyncio.run(drain(server.url, server.proc, 200))
        code = server.proc.wait(timeout=120)
    statuses = Counter(status for _, status, _ in records)
    small = [latency for kind, status, latency in records if kind == "small" and status == "200"]
    summary = {
        "machine": harness.machine_info(),
        "duration_s": args.duration,
        "rate": args.rate,
        "big_share": args.big_share,
        "requests_sent": len(records),
        "statuses": dict(statuses),
        "answered": sum(n for s, n in statuses.items() if s.isdigit()),
        "4xx": sum(n for s, n in statuses.items() if s.startswith("4")),
        "5xx": sum(n for s, n in statuses.items() if s.startswith("5")),
        "lost": sum(n for s, n in statuses.items() if s.startswith("lost")),
        "abandoned_by_client": statuses.get("abandoned", 0),
        "peak_rss_mib": peak_rss / 2**20,
        "memory_budget": args.memory_budget,
        "small_p50_s": percentile(small, 50),
        "small_p99_s": percentile(small, 99),
        "health_p50_ms": percentile(health, 50, 1e3),
        "health_p99_ms": percentile(health, 99, 1e3),
        "health_max_ms": max(health) * 1e3 if health else None,
        "hostile": {
            k: dict(Counter(status for kind, status, _ in records if kind == k))
            for k in sorted({kind for kind, _, _ in records} - {"small", "big", "flush"})
        },
        "sigterm_burst": dict(drained),
        "exit_code": code,
    }
    print(json.dumps(summary, indent=2))
    harness.save(args.out, summary)


if __name__ == "__main__":
    main()
