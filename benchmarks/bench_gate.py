"""What launch_cluster's public port (the key-checking gate in front of the router) adds to a call:

    python -m benchmarks.bench_gate [--model-path embedded] [--calls 300]

One 1-worker cluster with a data key; tiny /generate calls (3 token ids, no new token) sent one at
a time, alternately through the public port (gate -> router -> worker) and straight to the router's
private port (router -> worker), so both sides see the same load: their latencies (median, mean,
P99), the ratio of the medians, and the gate's CPU per call. Other processes may share the cores.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks import harness
from po_backend.entrypoints import launch_cluster, spawn

RESULTS = Path(__file__).resolve().parent / "results"
BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}}
DATA_KEY = "bench-gate-data-key"


def router_port(router: psutil.Process) -> int:
    """The port the router answers /liveness on (its metrics port answers every path with metrics)."""
    ports = [c.laddr.port for c in router.net_connections("tcp") if c.status == "LISTEN"]
    return next(p for p in ports if httpx.get(f"http://127.0.0.1:{p}/liveness", timeout=10).text == "OK")


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * s for s in seconds)
    return {
        "median_ms": statistics.median(ms),
        "mean_ms": statistics.mean(ms),
        "p99_ms": ms[int(0.99 * len(ms))],
    }


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, RESULTS / "gate.json")
    harness.flags(ap, model_path="embedded", calls=(300, "calls on each side"), warmup=20)
    harness.flags(ap, worker_args=("--dtype fp32", "the worker's flags"))
    args = ap.parse_args(argv)
    port = spawn.free_port()
    cmd = [sys.executable, "-m", "po_backend.entrypoints.launch_cluster", "--model-path", args.model_path,
           "--port", str(port), "--workers", "1", *args.worker_args.split()]  # fmt: skip
    env = {**os.environ, launch_cluster.API_KEY_ENV: DATA_KEY}
    cluster = spawn.ServerProcess(cmd, f"http://127.0.0.1:{port}", env=env, health_path="/get_model_info")
    cluster.start()
    assert cluster.proc is not None
    try:
        cluster.wait_ready(600, headers={"Authorization": f"Bearer {DATA_KEY}"})
        children = psutil.Process(cluster.proc.pid).children(recursive=True)
        gate = next(c for c in children if launch_cluster.RUN_GATE in " ".join(c.cmdline()))
        worker = next(c for c in children if "launch_server" in " ".join(c.cmdline()))
        router = next(c for c in children if c not in (gate, worker))
        worker_key = launch_cluster.key_path(port, "worker").read_text().strip()
        sides = {
            "gate": httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {DATA_KEY}"}),
            "router": httpx.Client(
                base_url=f"http://127.0.0.1:{router_port(router)}",
                headers={"Authorization": f"Bearer {worker_key}"},
            ),
        }
        for client in sides.values():
            for _ in range(args.warmup):
                client.post("/generate", json=BODY).raise_for_status()
        took: dict[str, list[float]] = {side: [] for side in sides}
        cpu0 = gate.cpu_times()
        for _ in range(args.calls):
            for side, client in sides.items():
                t0 = time.perf_counter()
                client.post("/generate", json=BODY).raise_for_status()
                took[side].append(time.perf_counter() - t0)
        cpu1 = gate.cpu_times()
    finally:
        cluster.stop()
    stats: dict[str, Any] = {side: summary(s) for side, s in took.items()}
    stats["median_ratio"] = stats["gate"]["median_ms"] / stats["router"]["median_ms"]
    stats["gate_cpu_ms_per_call"] = 1e3 * (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / args.calls
    md = "\n".join([
        "| path | median ms | mean ms | P99 ms |", "|---|---:|---:|---:|",
        *(f"| {side} | {stats[side]['median_ms']:.2f} | {stats[side]['mean_ms']:.2f} | {stats[side]['p99_ms']:.2f} |"
          for side in took),
        "", f"gate / router median: {stats['median_ratio']:.2f}x; gate CPU per call: "
        f"{stats['gate_cpu_ms_per_call']:.2f} ms ({args.calls} calls each, {harness.machine_info().get('cpu', '')})",
    ])  # fmt: skip
    harness.save(args.out, {"machine": harness.machine_info(), "args": vars(args), **stats}, md)


if __name__ == "__main__":
    main()
