"""Serving benchmark: Poisson arrivals of WL1/WL2 scoring requests over HTTP, against any server that
speaks SGLang's `/v1/score` or `/generate` (ours with each schedule policy, ours with
`--backend hf`, or a real SGLang server). Reports mean/P50/P99 latency and items/s per offered QPS.

    # launch our server once per configuration (one at a time) and sweep QPS on each:
    python benchmarks/bench_serving.py --launch po,fcfs,hf --qps 0.5,1,2
    # or aim at a running server:
    python benchmarks/bench_serving.py --url http://127.0.0.1:30000 --api score --qps 1,2

Open loop: request i is sent at its Poisson arrival time whatever happened to the earlier ones, so
a server that falls behind shows it as queueing latency. Latency is send -> response. items/s is
completed items over the span from the first send to the last response. Ratios are against the
baseline configuration (`hf` when launched, else the first) measured in the same run. Results:
benchmarks/results/<out>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, machine_info, markdown_table, text_table  # noqa: E402
from workloads import Item, label_ids, wl1, wl2  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# --launch names -> launch_server flags
LAUNCH = {
    "po": ["--schedule-policy", "po"],
    "fcfs": ["--schedule-policy", "fcfs"],
    "srjf": ["--schedule-policy", "srjf"],
    "lpm": ["--schedule-policy", "lpm"],
    "po-nocache": ["--schedule-policy", "po", "--disable-radix-cache"],
    # vLLM-style baseline: FCFS + prefix cache + Sarathi chunked prefill (attention chunked too).
    "chunked": ["--schedule-policy", "fcfs", "--prefill-mode", "chunked"],
    "hf": ["--backend", "hf"],
}


@dataclass(frozen=True)
class Call:
    """One HTTP request: items of one user sharing `prefix`."""

    user: int
    prefix: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Outcome:
    sent: float  # seconds since the run started
    latency: float
    status: int  # HTTP status, 0 for a transport error
    items: int
    error: str = ""


# ---- workload -----------------------------------------------------------------------------------


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from po_backend.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(path))


def make_calls(args: argparse.Namespace, tok: Any) -> list[Call]:
    if args.workload == "wl1":
        lo, hi = max(1, args.profile_tokens // 2), args.profile_tokens * 3 // 2
        items = wl1(
            tok,
            users=args.users,
            items=args.items,
            profile_mean=args.profile_tokens,
            profile_std=max(1, args.profile_tokens // 5),
            profile_range=(lo, hi),
            item_tokens=args.item_tokens,
            seed=args.seed,
        )
    else:
        items = wl2(
            tok,
            users=args.users,
            history_range=(args.history_tokens // 2, args.history_tokens),
            seed=args.seed,
        )
    by_user: dict[int, list[Item]] = {}
    for it in items:
        by_user.setdefault(it.user, []).append(it)
    calls = []
    for user, its in by_user.items():
        for a in range(0, len(its), args.items_per_call):
            chunk = its[a : a + args.items_per_call]
            calls.append(Call(user, chunk[0].prefix, tuple(it.suffix for it in chunk)))
    if args.order == "shuffled":
        random.Random(args.seed).shuffle(calls)  # users interleave: the scheduler's order matters
    return calls[: args.num_calls] if args.num_calls else calls


def request_body(call: Call, args: argparse.Namespace, labels: tuple[int, int]) -> tuple[str, dict[str, Any]]:
    if args.api == "score":
        # SGLang's /v1/score: prompt = query + item; our server caches the query's tokens.
        return "/v1/score", {
            "query": list(call.prefix),
            "items": [list(s) for s in call.suffixes],
            "label_token_ids": list(labels),
            "apply_softmax": True,
        }
    body: dict[str, Any] = {
        "input_ids": [list(call.prefix + s) for s in call.suffixes],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": list(labels),
    }
    if args.prefix_hint:  # our extension; SGLang does not know it
        body["cache_prefix_len"] = [len(call.prefix) or None] * len(call.suffixes)
    return "/generate", body


# ---- load generation ----------------------------------------------------------------------------


async def run_load(
    url: str, calls: list[Call], qps: float, args: argparse.Namespace, labels: tuple[int, int]
) -> tuple[list[Outcome], float]:
    """Send `calls` at Poisson arrival times (rate `qps` calls/s); returns outcomes and the span."""
    rng = random.Random(args.seed + 1)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(call: Call) -> Outcome:
            path, body = request_body(call, args, labels)
            sent = loop.time()
            try:
                r = await client.post(path, json=body)
                err = "" if r.status_code == 200 else r.text[:200]
                return Outcome(sent - t0, loop.time() - sent, r.status_code, len(call.suffixes), err)
            except httpx.HTTPError as e:
                return Outcome(
                    sent - t0, loop.time() - sent, 0, len(call.suffixes), f"{type(e).__name__}: {e}"
                )

        tasks = []
        at = 0.0
        for call in calls:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(call)))
            at += rng.expovariate(qps)
        outcomes = await asyncio.gather(*tasks)
        span = max(o.sent + o.latency for o in outcomes) - min(o.sent for o in outcomes)
    return list(outcomes), span


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(outcomes: list[Outcome], span: float, qps: float, items_per_call: float) -> dict[str, Any]:
    good = [o for o in outcomes if o.status == 200]
    lat = [o.latency for o in good]
    items = sum(o.items for o in good)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            errors[str(o.status)] = errors.get(str(o.status), 0) + 1
    return {
        "qps": qps,
        "offered_items_per_s": qps * items_per_call,
        "calls": len(outcomes),
        "ok": len(good),
        "errors": errors,
        "first_error": next((o.error for o in outcomes if o.status != 200), ""),
        "items": items,
        "seconds": span,
        "items_per_s": items / span if span > 0 else math.nan,
        "mean_s": sum(lat) / len(lat) if lat else math.nan,
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
    }


def scrape(url: str, api_key: str | None) -> dict[str, float]:
    """Our server's counters (an SGLang server has other names: then empty)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name in ("po_prompt_tokens_total", "po_cache_hit_tokens_total"):
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


class LoadMeter:
    """Cores used during a run by everything except this process and the server (`pid`): on a
    shared machine a run that had other work beside it is slower than the server is. Without a
    pid (a server not launched here) the server's own use counts as "other"."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid

    @staticmethod
    def _busy_seconds() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    def _server_seconds(self) -> float:
        if self.pid is None:
            return 0.0
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def __enter__(self) -> LoadMeter:
        t = os.times()
        self._start = (time.perf_counter(), self._busy_seconds(), t.user + t.system, self._server_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, busy0, own0, srv0 = self._start
        t = os.times()
        wall = max(time.perf_counter() - wall0, 1e-9)
        own = t.user + t.system - own0
        self.server_cores = (self._server_seconds() - srv0) / wall
        self.other_cores = max(0.0, (self._busy_seconds() - busy0) - own - self.server_cores * wall) / wall


# ---- servers ------------------------------------------------------------------------------------


class LaunchedServer:
    def __init__(self, name: str, args: argparse.Namespace, port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "po_backend.launch_server",
            "--model-path",
            args.model_path,
            "--port",
            str(port),
        ]
        cmd += ["--dtype", args.dtype, "--log-level", "warning", *LAUNCH[name]]
        if args.max_input_len:
            cmd += ["--max-input-len", str(args.max_input_len)]
        # The server's log goes to a temp file, named in the error if it fails to start.
        self.log = tempfile.NamedTemporaryFile(
            "w", prefix=f"bench-serving-{name}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server {self.name} exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server {self.name} not ready after {timeout:.0f}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def bench_one(
    name: str,
    url: str,
    calls: list[Call],
    args: argparse.Namespace,
    labels: tuple[int, int],
    pid: int | None = None,
) -> list[dict[str, Any]]:
    rows = []
    per_call = sum(len(c.suffixes) for c in calls) / len(calls)
    for qps in args.qps:
        httpx.post(url + "/flush_cache", headers=_auth(args), timeout=60)  # every rate starts cold
        before = scrape(url, args.api_key)
        with LoadMeter(pid) as load:
            outcomes, span = asyncio.run(run_load(url, calls, qps, args, labels))
        after = scrape(url, args.api_key)
        row = {
            "config": name,
            **summarize(outcomes, span, qps, per_call),
            "server_cores": load.server_cores if pid is not None else None,
            "other_cores": load.other_cores,
        }
        if after and before:
            prompt = after["po_prompt_tokens_total"] - before["po_prompt_tokens_total"]
            hits = after["po_cache_hit_tokens_total"] - before["po_cache_hit_tokens_total"]
            row["prompt_tokens"] = prompt
            row["cache_hit_rate"] = hits / prompt if prompt else 0.0
            row["prompt_tokens_per_s"] = prompt / span if span else math.nan
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def warm_up(url: str, call: Call, args: argparse.Namespace, labels: tuple[int, int]) -> None:
    """One request first: one-off start-up costs (allocator, kernels) stay out of the numbers."""
    path, body = request_body(call, args, labels)
    r = httpx.post(url + path, json=body, headers=_auth(args), timeout=args.timeout)
    assert r.status_code == 200, f"warm-up request failed: HTTP {r.status_code}: {r.text[:300]}"


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _load(r: dict[str, Any]) -> str:
    if r["server_cores"] is None:
        return f"busy cores besides this client, server included: {r['other_cores']:.1f}"
    return f"server {r['server_cores']:.1f} cores, others {r['other_cores']:.1f}"


def _line(r: dict[str, Any]) -> str:
    hit = f" cache {r['cache_hit_rate']:.0%}" if "cache_hit_rate" in r else ""
    err = f" errors {r['errors']} ({r['first_error'][:80]})" if r["errors"] else ""
    return (
        f"{r['config']:>10s} qps {r['qps']:<5g} {r['ok']}/{r['calls']} calls, {r['items']} items in "
        f"{r['seconds']:.1f}s: {r['items_per_s']:.2f} items/s, latency mean {r['mean_s']:.2f}s "
        f"p50 {r['p50_s']:.2f}s p99 {r['p99_s']:.2f}s{hit} ({_load(r)}){err}"
    )


# ---- report -------------------------------------------------------------------------------------


def report(
    rows: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, Any], workload: dict[str, Any]
) -> None:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    base = "hf" if "hf" in configs else configs[0]
    by = {(r["config"], r["qps"]): r for r in rows}
    table = []
    for r in rows:
        b = by.get((base, r["qps"]))
        ratio_t = f"{r['items_per_s'] / b['items_per_s']:.2f}x" if b and b["items_per_s"] else "n/a"
        ratio_l = f"{b['mean_s'] / r['mean_s']:.2f}x" if b and r["mean_s"] else "n/a"
        table.append(
            [
                r["config"],
                f"{r['qps']:g}",
                f"{r['ok']}/{r['calls']}",
                f"{r['items_per_s']:.2f}",
                f"{r['mean_s']:.2f}",
                f"{r['p50_s']:.2f}",
                f"{r['p99_s']:.2f}",
                f"{r['cache_hit_rate']:.0%}" if "cache_hit_rate" in r else "-",
                ratio_t,
                ratio_l,
                "-" if r.get("server_cores") is None else f"{r['server_cores']:.1f}",
                f"{r['other_cores']:.1f}",
            ]
        )
    header = [
        "config",
        "qps",
        "ok",
        "items/s",
        "mean s",
        "p50 s",
        "p99 s",
        "cache hits",
        f"items/s vs {base}",
        f"mean lat. {base}/this",
        "server cores",
        "other cores",
    ]
    print(text_table(header, table))
    RESULTS.mkdir(exist_ok=True)
    doc = {
        "machine": info,
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "workload": workload,
        "results": rows,
    }
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1))
    (RESULTS / f"{args.out}.md").write_text(
        f"# bench_serving: {args.workload} over /{'v1/score' if args.api == 'score' else 'generate'}\n\n"
        f"Machine: {info.get('cpu')}, {info.get('cores')} cores. Workload: {json.dumps(workload)}.\n"
        f"Open-loop Poisson arrivals; latency = send to response; ratios against `{base}` in the same run.\n"
        "`server cores` / `other cores`: CPU used during the run by the server and by everything else "
        "(other users of this shared 2-core machine; not this client). Other work slows the server, "
        "so small differences between configurations are noise.\n\n" + markdown_table(header, table) + "\n"
    )
    if not args.no_plot:
        plot(rows, configs, RESULTS / f"{args.out}.png", args)
    print(f"results: {RESULTS / args.out}.json .md" + ("" if args.no_plot else " .png"))


def plot(rows: list[dict[str, Any]], configs: list[str], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for c in configs:
        rs = sorted((r for r in rows if r["config"] == c), key=lambda r: r["qps"])
        q = [r["qps"] for r in rs]
        (line,) = a1.plot(q, [r["mean_s"] for r in rs], marker="o", label=f"{c} mean")
        a1.plot(
            q, [r["p99_s"] for r in rs], marker="x", linestyle="--", color=line.get_color(), label=f"{c} p99"
        )
        a2.plot(q, [r["items_per_s"] for r in rs], marker="o", label=c)
    a1.set_xlabel("offered calls/s (Poisson)")
    a1.set_ylabel("latency (s)")
    a1.set_yscale("log")
    a1.legend(fontsize=7)
    a2.set_xlabel("offered calls/s (Poisson)")
    a2.set_ylabel("completed items/s")
    a2.legend(fontsize=7)
    fig.suptitle(f"bench_serving {args.workload} via /{'v1/score' if args.api == 'score' else 'generate'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument(
        "--launch", help=f"launch ours once per config, one at a time: comma list of {sorted(LAUNCH)}"
    )
    ap.add_argument(
        "--model-path", default="embedded", help="model to launch; also where the tokenizer comes from"
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model-path)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-input-len", type=int, default=None)
    ap.add_argument("--port", type=int, default=30100, help="port for launched servers")
    ap.add_argument("--api", choices=("score", "generate"), default="score")
    ap.add_argument(
        "--no-prefix-hint",
        dest="prefix_hint",
        action="store_false",
        help="/generate: do not send our cache_prefix_len extension",
    )
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--workload", choices=("wl1", "wl2"), default="wl1")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--items", type=int, default=10, help="WL1: posts per user")
    ap.add_argument("--profile-tokens", type=int, default=1000, help="WL1: mean profile length")
    ap.add_argument("--item-tokens", type=int, default=150, help="WL1: tokens per post")
    ap.add_argument("--history-tokens", type=int, default=3000, help="WL2: longest history")
    ap.add_argument("--items-per-call", type=int, default=1, help="items of one user per HTTP call")
    ap.add_argument("--num-calls", type=int, default=0, help="cap on calls per rate (0: the whole workload)")
    ap.add_argument("--order", choices=("shuffled", "grouped"), default="shuffled")
    ap.add_argument("--qps", default=None, help="offered calls/s, comma list (default 0.5,1,2; --quick: 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 users x 4 items, 300-token profiles, qps 1")
    ap.add_argument("--out", default="serving", help="results file stem in benchmarks/results/")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--json", action="store_true", help="also print the result rows as JSON")
    args = ap.parse_args()  # fmt: skip
    if args.quick:
        args.users, args.items, args.profile_tokens, args.item_tokens, args.history_tokens = (
            2,
            4,
            300,
            60,
            600,
        )
        args.qps = args.qps or "1"
    args.qps = args.qps or "0.5,1,2"
    args.qps = [float(x) for x in str(args.qps).split(",")]

    model_path = args.tokenizer or args.model_path
    if args.url and not args.tokenizer:
        # Same machine: read the served model's path and load its tokenizer locally.
        info = httpx.get(args.url + "/model_info", headers=_auth(args), timeout=10).json()
        model_path = info.get("tokenizer_path") or info["model_path"]
    tok = load_tokenizer(model_path)
    calls = make_calls(args, tok)
    labels = label_ids(tok)
    n_items = sum(len(c.suffixes) for c in calls)
    tokens = sum(len(c.prefix) + len(s) for c in calls for s in c.suffixes)
    workload = {
        "name": args.workload,
        "calls": len(calls),
        "items": n_items,
        "prompt_tokens": tokens,
        "users": args.users,
    }
    machine = machine_info()
    print(f"{args.workload}: {len(calls)} calls, {n_items} items, {tokens} prompt tokens | {machine['cpu']}")

    rows: list[dict[str, Any]] = []
    if args.url:
        rows += bench_one("server", args.url, calls, args, labels)
    else:
        for i, name in enumerate(args.launch.split(",")):
            assert name in LAUNCH, f"unknown config {name!r}; choose from {sorted(LAUNCH)}"
            srv = LaunchedServer(name, args, args.port + i)
            try:
                srv.wait_ready()
                warm_up(srv.url, calls[0], args, labels)
                rows += bench_one(name, srv.url, calls, args, labels, pid=srv.proc.pid)
            finally:
                srv.stop()
    report(rows, args, machine, workload)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
