"""Many small calls against one server: what the server adds on top of the engine, and what a full
prefix pool adds on top of an empty one.

    python -m benchmarks.bench_small_calls [--clients 32] [--calls-per-client 2] [--tiny-calls 1000]

1. items/s (fcfs on both sides, so the difference is the server's own work): `--clients` closed-loop clients, each sending `--calls-per-client` /v1/score calls
   (a `--query-tokens` query and 1-10 items of `--item-tokens`), against the in-process engine
   given the same calls at once (its serving loop, `EngineLoop`) on the same model: the ratio, and the server's
   CPU seconds per call.
2. full pool: `--tiny-calls` tiny /generate calls (unique 8-token prompts) from `--clients` clients,
   on a server with a `--pool-tokens` prefix pool, first empty (flushed), then after filling it
   with twice its size in unique 3-token prompts (many 2-token leaves, each call then evicts):
   the server's CPU seconds per call in each, and the ratio.

`--base-checkout DIR` runs the same server from another checkout (e.g. main) in the same run, so
every figure has its baseline beside it. Other processes may share the cores (`other_cores`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks import harness
from po_backend import Engine, ScoreRequest
from po_backend.serving.loop import EngineLoop

LABELS = [10539, 5230]  # "Yes", "No" in the embedded model's vocabulary


def score_calls(n: int, query_tokens: int, item_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(k)]

    return [
        {"query": ids(query_tokens), "items": [ids(item_tokens) for _ in range(rng.randint(1, 10))]}
        for _ in range(n)
    ]


def engine_items_per_s(model: str, calls: list[dict[str, Any]], dtype: str) -> float:
    """The same calls through the serving loop in process (fcfs, as the server is run here): all
    submitted at once, each call's items together; what the server's HTTP work is measured against."""
    engine = Engine.from_pretrained(model, dtype=dtype)
    per_call = [
        [
            ScoreRequest(tuple(c["query"] + it), tuple(LABELS), cache_prefix_len=len(c["query"]))
            for it in c["items"]
        ]
        for c in calls
    ]
    engine.run(per_call[0])  # warm-up
    engine.flush_cache()
    with EngineLoop(engine, policy="fcfs") as loop:
        t0 = time.perf_counter()
        futures = [f for reqs in per_call for f in loop.submit_many(reqs)]
        for f in futures:
            f.result(600)
        return len(futures) / (time.perf_counter() - t0)


def server_cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


async def closed_loop(url: str, path: str, bodies: list[dict[str, Any]], clients: int) -> list[int]:
    """`clients` clients, each sending its share of `bodies` one after another; the statuses."""
    statuses: list[int] = []
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                statuses.append((await client.post(path, json=body)).status_code)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return statuses


def measure(url: str, pid: int, path: str, bodies: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    share = harness.CpuShare(pid)
    with share:
        cpu0, t0 = server_cpu(pid), time.perf_counter()
        statuses = asyncio.run(closed_loop(url, path, bodies, clients))
        wall, cpu = time.perf_counter() - t0, server_cpu(pid) - cpu0
    bad = [s for s in statuses if s != 200]
    assert not bad, f"{len(bad)} calls failed: {bad[:5]}"
    return {"calls": len(bodies), "wall_s": wall, "server_cpu_s": cpu, "cpu_ms_per_call": 1e3 * cpu / len(bodies),
            "other_cores": round(share.other_cores, 2)}  # fmt: skip


def tiny(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "input_ids": [rng.randrange(100, 40_000) for _ in range(8)],
            "sampling_params": {"max_new_tokens": 0},
        }
        for _ in range(n)
    ]


def run_server(args: argparse.Namespace, checkout: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": checkout}
    flags = [
        "--dtype",
        args.dtype,
        "--prefix-pool-tokens",
        str(args.pool_tokens),
        "--schedule-policy",
        "fcfs",
    ]
    server = harness.our_server(flags, model_path=args.model, cwd=checkout, env=env)
    out: dict[str, Any] = {"checkout": checkout}
    with harness.servers_up([server]):
        assert server.proc is not None
        pid, url = server.proc.pid, server.url
        asyncio.run(closed_loop(url, "/v1/score", [{**calls[0], "label_token_ids": LABELS}], 1))  # warm-up
        httpx.post(url + "/flush_cache", timeout=60)
        bodies = [{**c, "label_token_ids": LABELS, "apply_softmax": True} for c in calls]
        r = measure(url, pid, "/v1/score", bodies, args.clients)
        r["items_per_s"] = sum(len(c["items"]) for c in calls) / r["wall_s"]
        out["score"] = r
        httpx.post(url + "/flush_cache", timeout=60)
        out["tiny_empty"] = measure(url, pid, "/generate", tiny(args.tiny_calls, 1), args.clients)
        # Twice the pool in 3-token prompts (2 tokens stored each: many small leaves), sent as
        # batches of 256 prompts a call.
        rng = random.Random(2)
        prompts = [[rng.randrange(100, 40_000) for _ in range(3)] for _ in range(args.pool_tokens)]
        fill = [
            {"input_ids": prompts[a : a + 256], "sampling_params": {"max_new_tokens": 0}}
            for a in range(0, len(prompts), 256)
        ]
        asyncio.run(closed_loop(url, "/generate", fill, 4))
        out["pool"] = (
            httpx.get(url + "/server_info", timeout=60).json().get("internal_states", [{}])[0].get("cache")
        )
        out["tiny_full"] = measure(url, pid, "/generate", tiny(args.tiny_calls, 3), args.clients)
        out["full_over_empty_cpu"] = (
            out["tiny_full"]["cpu_ms_per_call"] / out["tiny_empty"]["cpu_ms_per_call"]
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--calls-per-client", type=int, default=2)
    ap.add_argument("--query-tokens", type=int, default=250)
    ap.add_argument("--item-tokens", type=int, default=50)
    ap.add_argument("--tiny-calls", type=int, default=1000)
    ap.add_argument("--pool-tokens", type=int, default=8000)
    ap.add_argument("--base-checkout", default=None, help="also run the server from this checkout")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "small_calls.json")
    args = ap.parse_args()
    calls = score_calls(args.clients * args.calls_per_client, args.query_tokens, args.item_tokens, 0)
    doc: dict[str, Any] = {
        "machine": harness.machine_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    doc["engine_items_per_s"] = engine_items_per_s(args.model, calls, args.dtype)
    here = str(Path(__file__).resolve().parent.parent)
    runs = [here] + ([args.base_checkout] if args.base_checkout else [])
    doc["servers"] = [run_server(args, checkout, calls) for checkout in runs]
    for s in doc["servers"]:
        s["server_over_engine_items"] = s["score"]["items_per_s"] / doc["engine_items_per_s"]
        print(
            f"{s['checkout']}: server {s['score']['items_per_s']:.1f} items/s = "
            f"{s['server_over_engine_items']:.2f}x the engine's {doc['engine_items_per_s']:.1f}; "
            f"{s['score']['cpu_ms_per_call']:.0f} ms server CPU per score call; tiny calls "
            f"{s['tiny_empty']['cpu_ms_per_call']:.1f} ms CPU (empty pool) vs "
            f"{s['tiny_full']['cpu_ms_per_call']:.1f} ms (full): {s['full_over_empty_cpu']:.2f}x; "
            f"tiny calls/s {s['tiny_empty']['calls'] / s['tiny_empty']['wall_s']:.1f} / "
            f"{s['tiny_full']['calls'] / s['tiny_full']['wall_s']:.1f}"
        )
    harness.save(args.out, doc)


if __name__ == "__main__":
    main()
