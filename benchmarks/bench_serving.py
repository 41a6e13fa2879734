"""Serving benchmark: open-loop Poisson arrivals of WL1/WL2 scoring calls over HTTP (SGLang's
`/v1/score`, `/v1/rerank` or `/generate`) against our server per `--launch` config or any running
server (`--url`, e.g. a real SGLang): mean/P50/P99 latency (send -> response) and items/s per offered
QPS, ratios against the baseline config (`hf` when launched, else the first) of the same run.
Results: `--out` (results/serving.json), its .md and .png. bench_cluster builds its traffic here.

    python -m benchmarks.bench_serving --launch po,fcfs,hf --qps 0.5,1,2
    python -m benchmarks.bench_serving --url http://127.0.0.1:30000 --api score --qps 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks import harness, report
from benchmarks.workloads import label_ids, wl1, wl2
from po_backend.core.settings import POLICIES

# --launch names -> launch_server flags. chunked: vLLM-style FCFS + prefix cache + Sarathi chunked
# prefill; po-nogroup: po without grouping undeclared shared prefixes; base: po as built by
# another checkout (--base-checkout), so one run measures a change against what it replaces.
LAUNCH = {
    **{policy: ["--schedule-policy", policy] for policy in POLICIES},
    "po-nocache": ["--schedule-policy", "po", "--disable-radix-cache"],
    "hf": ["--backend", "hf"],
    "chunked": ["--schedule-policy", "fcfs", "--prefill-mode", "chunked"],
    "base": ["--schedule-policy", "po"],
    "po-nogroup": ["--schedule-policy", "po", "--min-shared-prefix", str(10**9)],
}
Headers = dict[str, str] | None  # an API key's Authorization header, or none


@dataclass(frozen=True)
class Call:
    """One HTTP request: items of one user sharing `prefix`, as sent (`path`, `body`)."""

    user: int
    prefix: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], ...]
    path: str = ""
    body: Any = None


@dataclass(frozen=True)
class Outcome:
    sent: float  # seconds since the run started
    latency: float
    status: int  # HTTP status, 0 for a transport error
    items: int
    error: str = ""


def make_calls(args: argparse.Namespace, tok: Any) -> list[Call]:
    """The workload's items (grouped by user) as calls of up to `--items-per-call` items each,
    shuffled (users interleave: the scheduler's order matters), each with its request for `--api`."""
    p, h = args.profile_tokens, args.history_tokens
    if args.workload == "wl1":
        span = (max(1, p // 2), p * 3 // 2)
        items = wl1(tok, args.users, args.items, p, max(1, p // 5), span, args.item_tokens, args.seed)
    else:
        items = wl2(tok, args.users, (h // 2, h), args.seed)
    calls = []
    for user, group in itertools.groupby(items, key=lambda it: it.user):
        its = list(group)
        for a in range(0, len(its), args.items_per_call):
            chunk = its[a : a + args.items_per_call]
            calls.append(Call(user, chunk[0].prefix, tuple(it.suffix for it in chunk)))
    random.Random(args.seed).shuffle(calls)
    return [Call(c.user, c.prefix, c.suffixes, *request_body(c, args, tok)) for c in calls]


def request_body(call: Call, args: argparse.Namespace, tok: Any) -> tuple[str, dict[str, Any]]:
    """`--api` score: SGLang's /v1/score (prompt = query + item; our server caches the query);
    rerank: /v1/rerank, the prefix as the query; generate: one prompt per item (a batch when
    more than one), `--generate-as` ids or text, `--prefix-hint`: our cache_prefix_len."""
    labels = label_ids(tok)
    if args.api == "score":
        body = {"query": list(call.prefix), "items": [list(s) for s in call.suffixes]}
        return "/v1/score", {**body, "label_token_ids": list(labels), "apply_softmax": True}
    if args.api == "rerank":
        docs = [tok.decode(s) for s in call.suffixes]
        return "/v1/rerank", {"query": tok.decode(call.prefix), "documents": docs, "return_documents": False}
    prompts: list[Any] = [list(call.prefix + s) for s in call.suffixes]
    if args.generate_as == "text":
        prompts = [tok.decode(p) for p in prompts]
    one = len(prompts) == 1  # a single prompt, not a batch of one: what plain SGLang clients send
    key = "input_ids" if isinstance(prompts[0], list) else "text"
    body = {
        key: prompts[0] if one else prompts,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": list(labels),
    }
    if args.prefix_hint:  # our extension; SGLang does not know it
        hint = [len(call.prefix) or None] * len(prompts)
        body["cache_prefix_len"] = hint[0] if one else hint
    return "/generate", body


async def send_open_loop(
    url: str, calls: Sequence[Call], arrivals: Sequence[float], timeout: float, headers: Headers = None
) -> tuple[list[Outcome], float]:
    """POST each call at its arrival (seconds from the start) whatever happened to the earlier
    ones, so a server that falls behind shows it as latency. Returns the outcomes and the span
    from the first send to the last response."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(c: Call, at: float) -> Outcome:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            sent = loop.time()
            try:
                r = await client.post(c.path, json=c.body)
                status, err = r.status_code, "" if r.status_code == 200 else r.text[:200]
            except httpx.HTTPError as e:
                status, err = 0, f"{type(e).__name__}: {e}"
            return Outcome(sent - t0, loop.time() - sent, status, len(c.suffixes), err)

        outcomes = await asyncio.gather(*(one(c, at) for c, at in zip(calls, arrivals, strict=True)))
    span = max(o.sent + o.latency for o in outcomes) - min(o.sent for o in outcomes)
    return list(outcomes), span


def summarize(outcomes: list[Outcome], span: float, qps: float, items_per_call: float) -> dict[str, Any]:
    good = [o for o in outcomes if o.status == 200]
    items = sum(o.items for o in good)
    return {
        "qps": qps,
        "offered_items_per_s": qps * items_per_call,
        "calls": len(outcomes),
        "ok": len(good),
        "errors": dict(Counter(str(o.status) for o in outcomes if o.status != 200)),
        "first_error": next((o.error for o in outcomes if o.status != 200), ""),
        "items": items,
        "seconds": span,
        "items_per_s": items / span if span > 0 else float("nan"),
        **harness.latency_summary([o.latency for o in good]),
    }


def scrape(url: str, headers: Headers = None) -> dict[str, float]:
    """Our server's unlabelled `po_*` metrics (an SGLang server has other names: then empty)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    return {m[1]: float(m[2]) for m in re.finditer(r"^(po_\w+) ([0-9.e+-]+)$", text, re.M)}


def warm_up(url: str, call: Call, timeout: float, headers: Headers = None) -> None:
    """One request first: one-off start-up costs (allocator, kernels) stay out of the numbers."""
    r = httpx.post(url + call.path, json=call.body, headers=headers, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"warm-up request failed: HTTP {r.status_code}: {r.text[:300]}")


def bench_one(
    name: str, url: str, calls: list[Call], args: argparse.Namespace, auth: Headers, pid: int | None
) -> list[dict[str, Any]]:
    """Every `--qps` on one server, each from a flushed cache. Without a pid (a server not
    launched here) the server's own CPU use counts as "other"."""
    rows: list[dict[str, Any]] = []
    per_call = sum(len(c.suffixes) for c in calls) / len(calls)
    for qps in args.qps:
        httpx.post(url + "/flush_cache", headers=auth, timeout=60)
        before = scrape(url, auth)
        arrivals = harness.poisson_arrivals(len(calls), random.Random(args.seed + 1), qps)
        with harness.CpuShare(pid) as load:
            outcomes, span = asyncio.run(send_open_loop(url, calls, arrivals, args.timeout, auth))
        after = scrape(url, auth)
        row = {"config": name, **summarize(outcomes, span, qps, per_call), "other_cores": load.other_cores}
        row["server_cores"] = load.pid_cores if pid is not None else None
        if after and before:
            prompt = after["po_prompt_tokens_total"] - before["po_prompt_tokens_total"]
            hits = after["po_cache_hit_tokens_total"] - before["po_cache_hit_tokens_total"]
            row["prompt_tokens"] = prompt
            row["cache_hit_rate"] = hits / prompt if prompt else 0.0
            row["prompt_tokens_per_s"] = prompt / span if span else float("nan")
            # What the pool holds at the end, and how much of it was read back (not speculation).
            if "po_cache_tokens" in after:
                row["cache_tokens"] = after["po_cache_tokens"]
                row["cache_reused_tokens"] = after.get("po_cache_reused_tokens", float("nan"))
        rows.append(row)
        print(" | ".join(report.serving_rows([row])[2][0]), row["errors"] or "", row["first_error"][:80])
    return rows


def main() -> None:
    quick = "2 users x 4 posts, 300-token profiles, qps 1"
    ap = harness.parser(__doc__, harness.RESULTS / "serving.json", quick)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--launch", help=f"launch ours per config, one at a time: any of {','.join(LAUNCH)}")
    harness.flags(ap, model_path=("embedded", "model to launch; its tokenizer is used"), api_key=None, seed=0)
    harness.flags(ap, tokenizer=(None, "tokenizer folder (default: --model-path)"))
    harness.flags(ap, server_args=("", "more flags for every launched server"))
    harness.flags(ap, base_checkout=(None, "the checkout `--launch base` runs (another commit)"))
    harness.flags(ap, api=["score", "rerank", "generate"], timeout=(600.0, "per request, seconds"))
    harness.flags(ap, generate_as=(["ids", "text"], "/generate: token ids or text"))
    ap.add_argument(
        "--no-prefix-hint", dest="prefix_hint", action="store_false", help="/generate: no cache_prefix_len"
    )
    harness.flags(ap, workload=["wl1", "wl2"], users=4, items=(10, "WL1: posts per user"))
    harness.flags(
        ap, profile_tokens=(1000, "WL1: mean profile length"), item_tokens=(150, "WL1: tokens per post")
    )
    harness.flags(
        ap, history_tokens=(3000, "WL2: longest history"), items_per_call=(1, "items per HTTP call")
    )
    harness.flags(ap, qps=(None, "offered calls/s, comma list (default 0.5,1,2; --quick: 1)"))
    args = ap.parse_args()
    if args.quick:
        args.users, args.items, args.profile_tokens, args.item_tokens = 2, 4, 300, 60
        args.history_tokens, args.qps = 600, args.qps or "1"
    args.qps = [float(x) for x in (args.qps or "0.5,1,2").split(",")]
    launch = args.launch.split(",") if args.launch else []
    if unknown := sorted(set(launch) - set(LAUNCH)):
        ap.error(f"unknown --launch config {unknown}; choose from {sorted(LAUNCH)}")
    if "base" in launch and not args.base_checkout:
        ap.error("--launch base needs --base-checkout DIR")
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model_path = args.tokenizer or args.model_path
    if args.url and not args.tokenizer:  # same machine: the served model's tokenizer, loaded here
        info = httpx.get(args.url + "/model_info", headers=auth, timeout=10).json()
        model_path = info.get("tokenizer_path") or info["model_path"]
    calls = make_calls(args, harness.tokenizer(model_path))
    n_items = sum(len(c.suffixes) for c in calls)
    tokens = sum(len(c.prefix) + len(s) for c in calls for s in c.suffixes)
    workload = {
        "name": args.workload,
        "calls": len(calls),
        "items": n_items,
        "prompt_tokens": tokens,
        "users": args.users,
    }
    machine = harness.machine_info()
    print(f"{args.workload}: {len(calls)} calls, {n_items} items, {tokens} prompt tokens | {machine['cpu']}")
    rows = bench_one("server", args.url, calls, args, auth, None) if args.url else []
    for name in launch:
        # python -m resolves po_backend from the working directory: `base` runs the other checkout's.
        cwd = args.base_checkout if name == "base" else harness.REPO_ROOT
        srv = harness.our_server([*LAUNCH[name], *args.server_args.split()], args.model_path, cwd=cwd)
        with harness.servers_up([srv]):
            warm_up(srv.url, calls[0], args.timeout, auth)
            rows += bench_one(name, srv.url, calls, args, auth, srv.proc.pid if srv.proc else None)
    doc = {
        "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "workload": workload,
        "results": rows,
    }
    harness.save(args.out, doc, report.serving_markdown(doc))
    report.plot_sweeps({f"{args.workload} via /{args.api}": {"runs": rows}}, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
