"""Launch the HTTP server, with `python -m sglang.launch_server`-style flags:

    python -m po_backend.entrypoints.launch_server --model-path embedded --backend prefillonly \\
        --host 127.0.0.1 --port 30000 [--schedule-policy po] [--api-key KEY]

`--backend hf` serves the same API from plain transformers (FCFS, no prefix cache): the baseline
for side-by-side benchmarks. Also installed as the console scripts `prefillonly serve MODEL` and
`po-launch-server`. The flags SGLang users paste are accepted under SGLang's names and mapped onto
ours in `server_args` (the one place flags meet the config); what a prefill-only engine cannot do
(`--tp-size 2`, `--dp-size 2`, ...) is a clear usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from po_backend.core.errors import DrainingError
from po_backend.engine.config import PREFILL_MODES
from po_backend.sched.scheduler import (
    DEFAULT_FAIRNESS_LAMBDA,
    DEFAULT_MIN_SHARED_PREFIX,
    POLICIES,
    SchedulerConfig,
)
from po_backend.server import EngineOptions, LoopBackend, ServerArgs, create_app

log = logging.getLogger("po_backend.entrypoints.launch_server")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512M', '1.5g' -> bytes (binary units: a memory budget, not disk)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2147483648, 2GiB, 512M)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="po-launch-server", description=__doc__.splitlines()[0] if __doc__ else None
    )
    ap.add_argument("--model-path", required=True, help="HF folder, .gguf file, or 'embedded' (SmolLM2-135M)")
    ap.add_argument("--backend", choices=("prefillonly", "hf"), default="prefillonly")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument(
        "--max-input-len",
        "--context-length",
        dest="max_input_len",
        type=int,
        default=None,
        help="longest prompt in tokens (default: the model's context)",
    )
    ap.add_argument(
        "--max-batch-tokens",
        "--max-prefill-tokens",
        dest="max_batch_tokens",
        type=int,
        default=None,
        help="new tokens per forward (default: max(max-input-len, 2048))",
    )
    ap.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="SGLang's: share of the memory available at start for activations + prefix cache "
        "(instead of --memory-budget)",
    )
    ap.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=None,
        help="bytes beyond the weights for activations + prefix cache (e.g. 4GiB)",
    )
    ap.add_argument(
        "--schedule-policy",
        choices=(*POLICIES, *SGLANG_POLICIES),
        default=None,
        help="po (default): prefix-aware SRJF with JCT calibration (the paper's); fcfs: strict "
        "arrival order (the only one of --backend hf); srjf: JCT at arrival; lpm: longest cached "
        "prefix first. SGLang's lof (every answer is one token: arrival order) maps to fcfs and "
        "dfs-weight (prefix-tree order) to lpm, with a warning; random is refused",
    )
    ap.add_argument(
        "--fairness-lambda",
        type=float,
        default=None,
        help=f"po's starvation bound: score = jct - lambda * t_queue (seconds; default {DEFAULT_FAIRNESS_LAMBDA:g})",
    )
    ap.add_argument(
        "--min-shared-prefix",
        type=int,
        default=None,
        help="waiting requests that share at least this many leading tokens (declared or not) run "
        f"in one step, the shared part computed once (default {DEFAULT_MIN_SHARED_PREFIX})",
    )
    ap.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    ap.add_argument(
        "--chunk-size",
        "--chunked-prefill-size",
        dest="chunk_size",
        type=int,
        default=512,
        help="tokens per chunk of the non-attention work (hybrid prefilling)",
    )
    ap.add_argument(
        "--prefill-mode",
        choices=PREFILL_MODES,
        default="hybrid",
        help="hybrid: the paper's hybrid prefilling; chunked: Sarathi-style chunked prefill (baseline)",
    )
    ap.add_argument(
        "--max-queue",
        "--max-queued-requests",
        dest="max_queue",
        type=int,
        default=4096,
        help="queued prompts before requests get 503 'overloaded'",
    )
    ap.add_argument(
        "--max-top-logprobs",
        type=int,
        default=20,
        help="top log-probs per position (like vLLM's max_logprobs)",
    )
    ap.add_argument(
        "--max-items-per-request", type=int, default=1024, help="prompts or documents in one call"
    )
    ap.add_argument("--max-labels", type=int, default=64, help="labels in one classify call")
    # SGLang flags that change nothing here, accepted so pasted command lines run.
    ap.add_argument("--enable-metrics", action="store_true", help="accepted: /metrics is always on")
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted: no model code is ever loaded from the model folder",
    )
    ap.add_argument(
        "--random-seed", type=int, default=None, help="accepted: answers are greedy (deterministic)"
    )
    ap.add_argument(
        "--tokenizer-path",
        default=None,
        help="must be the model's own folder (the tokenizer is read from there)",
    )
    ap.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=int,
        default=1,
        help="1 only (one device per worker)",
    )
    ap.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="1 only: run N workers behind the SGLang router instead",
    )
    ap.add_argument(
        "--max-body-bytes", type=parse_bytes, default=64 << 20, help="larger request bodies get 413"
    )
    ap.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV}, which keeps the key out of `ps`)",
    )
    ap.add_argument(
        "--served-model-name", default=None, help="model name in API responses (default: the model path)"
    )
    ap.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=65.0,
        help="seconds an idle keep-alive connection stays open",
    )
    ap.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds to finish queued work; what is still queued then gets 503 + Retry-After",
    )
    ap.add_argument(
        "--timeout-request-read",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers and body before it is cut off",
    )
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    ap.add_argument(
        "--rerank-template",
        default="",
        help="rerank prompt (text or a file) with {query} before {doc}, optional {instruct}; default: Qwen3-Reranker's format in the chat template",
    )
    ap.add_argument(
        "--classify-labels",
        default="",
        help="labels of SGLang/vLLM-style /v1/classify {model, input}, comma-separated (e.g. yes,no)",
    )
    ap.add_argument(
        "--classify-template",
        default="{input}",
        help="prompt of /v1/classify around {input} (text or a file)",
    )
    return ap  # fmt: skip


API_KEY_ENV = "PREFILLONLY_API_KEY"

# SGLang's scheduling policies we do not implement, and ours that give the same order here.
SGLANG_POLICIES = ("lof", "dfs-weight", "random")
_POLICY_MAP = {"lof": "fcfs", "dfs-weight": "lpm"}


def _sglang_flags(a: argparse.Namespace) -> str | None:
    """SGLang's flags mapped onto ours, in place; the policy SGLang's name maps to. Raises
    ValueError for what a prefill-only worker cannot do."""
    if a.tp_size != 1:
        raise ValueError(
            f"--tp-size {a.tp_size}: tensor parallelism is not supported (one device per worker)"
        )
    if a.dp_size != 1:
        raise ValueError(
            f"--dp-size {a.dp_size}: run N workers behind the SGLang router instead (see README, Scaling out)"
        )
    if a.tokenizer_path and os.path.realpath(a.tokenizer_path) != os.path.realpath(a.model_path):
        raise ValueError("--tokenizer-path must be the model's own folder: the tokenizer is read from there")
    if a.trust_remote_code:
        log.warning("--trust-remote-code: ignored, our model code is our own (Llama, Qwen2, Qwen3)")
    if a.mem_fraction_static is not None:
        if a.memory_budget is not None:
            raise ValueError("give --memory-budget or --mem-fraction-static, not both")
        if not 0 < a.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {a.mem_fraction_static}")
    policy = a.schedule_policy
    if policy == "random":
        raise ValueError("--schedule-policy random is not supported (use po, fcfs, srjf or lpm)")
    if policy in _POLICY_MAP:
        log.warning("--schedule-policy %s: runs as %s on a prefill-only server", policy, _POLICY_MAP[policy])
        policy = _POLICY_MAP[policy]
    return policy


def server_args(a: argparse.Namespace) -> ServerArgs:
    """The command line as `ServerArgs`: the one place flags meet the config. Raises ValueError
    for values or combinations that cannot run."""
    policy = _sglang_flags(a)
    if a.backend == "hf":
        # The transformers baseline is FCFS only (one prompt per forward, no prefix cache).
        if policy not in (None, "fcfs"):
            raise ValueError(f"--backend hf runs FCFS only, got --schedule-policy {policy}")
        policy = "fcfs"
    scheduler = SchedulerConfig(
        policy=policy or "po",
        fairness_lambda=DEFAULT_FAIRNESS_LAMBDA if a.fairness_lambda is None else a.fairness_lambda,
        min_shared_prefix=DEFAULT_MIN_SHARED_PREFIX if a.min_shared_prefix is None else a.min_shared_prefix,
    )
    engine = EngineOptions(
        model_path=a.model_path,
        backend=a.backend,
        dtype=a.dtype,
        device=a.device,
        max_input_len=a.max_input_len,
        max_batch_tokens=a.max_batch_tokens,
        memory_budget=a.memory_budget,
        memory_fraction=a.mem_fraction_static,
        chunk_size=a.chunk_size,
        prefill_mode=a.prefill_mode,
        enable_cache=not a.disable_radix_cache,
    )
    return ServerArgs(
        engine=engine,
        scheduler=scheduler,
        max_queue=a.max_queue,
        served_model_name=a.served_model_name or "",
        host=a.host,
        port=a.port,
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        max_top_logprobs=a.max_top_logprobs,
        max_items_per_request=a.max_items_per_request,
        max_labels=a.max_labels,
        max_body_bytes=a.max_body_bytes,
        timeout_keep_alive=a.timeout_keep_alive,
        shutdown_timeout=a.shutdown_timeout,
        timeout_request_read=a.timeout_request_read,
        log_level=a.log_level,
        rerank_template=_text_or_file(a.rerank_template),
        classify_labels=tuple(x.strip() for x in a.classify_labels.split(",")) if a.classify_labels else (),
        classify_template=_text_or_file(a.classify_template),
    )


def _text_or_file(value: str) -> str:
    """A template flag: the text itself, or the contents of the file it names."""
    return Path(value).read_text() if value and os.path.isfile(value) else value


def build_backend(args: ServerArgs) -> LoopBackend:
    """The scorer for `args.engine.backend` and the scheduling loop that owns it."""
    opts, sched = args.engine, args.scheduler
    if opts.backend == "hf":
        from po_backend.engine.hf_scorer import HFScorer
        from po_backend.serving.loop import EngineLoop

        scorer = HFScorer.from_pretrained(
            opts.model_path,
            dtype=opts.overrides().get("dtype"),
            device=opts.device,
            max_input_len=opts.max_input_len,
        )
        loop = EngineLoop(scorer, policy="fcfs", max_queue=args.max_queue)
        settings = {
            "dtype": str(next(scorer.model.parameters()).dtype),
            "max_input_len": scorer.max_input_len,
            "schedule_policy": "fcfs",
            "radix_cache": False,
        }
        return LoopBackend(scorer, loop, scorer.max_input_len, settings)
    from po_backend.engine.engine import Engine
    from po_backend.serving.loop import EngineLoop

    overrides = opts.overrides()
    if opts.memory_fraction is not None:  # SGLang's --mem-fraction-static, resolved now
        import torch

        from po_backend.engine.config import default_device
        from po_backend.engine.memory import available_bytes

        device = torch.device(opts.device) if opts.device else default_device()
        overrides["memory_budget"] = int(opts.memory_fraction * available_bytes(device))
    engine = Engine.from_pretrained(opts.model_path, **overrides)
    loop = EngineLoop(
        engine,
        policy=sched.policy,
        fairness_lambda=sched.fairness_lambda,
        min_shared_prefix=sched.min_shared_prefix,
        max_queue=args.max_queue,
    )
    cfg = engine.config
    settings = {
        "dtype": str(cfg.dtype),
        "device": str(cfg.device),
        "chunk_size": cfg.chunk_size,
        "prefill_mode": cfg.prefill_mode,
        "max_input_len": cfg.max_input_len,
        "max_batch_tokens": cfg.max_batch_tokens,
        "schedule_policy": loop.config.policy,
        "fairness_lambda": loop.config.fairness_lambda,
        "min_shared_prefix": loop.config.min_shared_prefix,
        "radix_cache": cfg.enable_cache,
        "memory_budget": cfg.memory_budget,
    }
    return LoopBackend(engine, loop, cfg.max_input_len, settings)


class ReadDeadlineH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a read deadline: a client gets `read_timeout` seconds from
    connecting (or from the first byte of its next request) to deliver the whole request, headers
    and body; a slow or stalled sender is then disconnected instead of holding a connection for
    minutes. Idle keep-alive connections stay under uvicorn's own keep-alive timeout, and a
    request that arrived whole waits as long as its answer takes."""

    read_timeout = 30.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            log.info("closing a connection that sent no whole request in %.0f s", self.read_timeout)
            self.transport.close()


def uvicorn_config(app: Any, args: ServerArgs) -> uvicorn.Config:
    """How uvicorn serves `app`: every HTTP setting of `args` reaches it here."""
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]  # seconds; a float works
        # Above the default so a burst of ~1000 connects is queued by the kernel, not refused.
        backlog=4096,
        # Past our own deadline (DrainingServer answers what is still queued with 503s): only
        # then would uvicorn cut connections.
        timeout_graceful_shutdown=int(args.shutdown_timeout) + SHUTDOWN_MARGIN_S,
        h11_max_incomplete_event_size=64 * 1024,  # headers larger than this are refused
        http=type("H11Protocol", (ReadDeadlineH11,), {"read_timeout": args.timeout_request_read}),
    )


SHUTDOWN_MARGIN_S = 10  # the step running at the deadline finishes and its answers go out


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain that never drops a request: on SIGTERM it stops accepting
    (uvicorn closes the listening socket), new calls on open connections get 503 + Retry-After,
    queued work runs until `--shutdown-timeout`, and whatever is still queued then is answered
    503 + Retry-After before uvicorn's own (later) graceful timeout could cut a connection."""

    def __init__(self, config: uvicorn.Config, runtime: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.runtime.draining:
            self.runtime.draining = True
            log.info("draining: %.0f s to finish queued work", self.shutdown_timeout)
            timer = threading.Timer(self.shutdown_timeout, self._deadline)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)

    def _deadline(self) -> None:
        n = self.runtime.backend.abandon_waiting(DrainingError("the server is shutting down"))
        if n:
            log.warning("shutdown deadline: %d queued requests answered 503 (Retry-After)", n)


def main(argv: Sequence[str] | None = None) -> None:
    t0 = time.monotonic()
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        args = server_args(a)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    backend = build_backend(args)
    app = create_app(backend, args)
    log.info(
        "ready in %.1f s: serving %s (%s backend) on http://%s:%d",
        time.monotonic() - t0,
        args.model_path,
        args.backend,
        args.host,
        args.port,
    )
    DrainingServer(uvicorn_config(app, args), app.state.runtime, args.shutdown_timeout).run()


if __name__ == "__main__":
    main()
