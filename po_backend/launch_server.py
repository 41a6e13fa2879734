"""Launch the HTTP server, with `python -m sglang.launch_server`-style flags:

    python -m po_backend.launch_server --model-path embedded --backend prefillonly \\
        --host 127.0.0.1 --port 30000 [--schedule-policy po] [--api-key KEY]

`--backend hf` serves the same API from plain transformers (FCFS, no prefix cache): the baseline
for side-by-side benchmarks. Also installed as the console script `po-launch-server`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

from po_backend.config import PREFILL_MODES
from po_backend.scheduler import DEFAULT_FAIRNESS_LAMBDA, POLICIES
from po_backend.server import LoopBackend, ServerArgs, create_app

log = logging.getLogger("po_backend.launch_server")

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
        type=int,
        default=None,
        help="longest prompt in tokens (default: the model's context)",
    )
    ap.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="new tokens per forward (default: max(max-input-len, 2048))",
    )
    ap.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=None,
        help="bytes beyond the weights for activations + prefix cache (e.g. 4GiB)",
    )
    ap.add_argument(
        "--schedule-policy",
        choices=POLICIES,
        default="po",
        help="po: prefix-aware SRJF with JCT calibration (the paper's); fcfs: strict arrival order; "
        "srjf: JCT at arrival; lpm: longest cached prefix first",
    )
    ap.add_argument(
        "--fairness-lambda",
        type=float,
        default=None,
        help=f"po's starvation bound: score = jct - lambda * t_queue (seconds; default {DEFAULT_FAIRNESS_LAMBDA:g})",
    )
    ap.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    ap.add_argument(
        "--chunk-size",
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
        "--max-queue", type=int, default=4096, help="queued prompts before requests get 503 'overloaded'"
    )
    ap.add_argument(
        "--max-body-bytes", type=parse_bytes, default=64 << 20, help="larger request bodies get 413"
    )
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    ap.add_argument(
        "--served-model-name", default=None, help="model name in API responses (default: the model path)"
    )
    ap.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=65.0,
        help="seconds an idle keep-alive connection stays open",
    )
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    return ap  # fmt: skip


def build_backend(a: argparse.Namespace) -> tuple[LoopBackend, dict[str, Any]]:
    """The scorer and its scheduling loop for `--backend`, and what /server_info reports."""
    dtype = None if a.dtype == "auto" else a.dtype
    if a.backend == "hf":
        from po_backend.hf_backend import FCFSLoop, HFScorer

        scorer = HFScorer.from_pretrained(
            a.model_path, dtype=dtype, device=a.device, max_input_len=a.max_input_len
        )
        loop = FCFSLoop(scorer, max_queue=a.max_queue)
        info = {
            "dtype": str(next(scorer.model.parameters()).dtype),
            "schedule_policy": "fcfs",
            "radix_cache": False,
        }
        return LoopBackend(scorer, loop, scorer.max_input_len), info
    from po_backend.engine import Engine
    from po_backend.loop import EngineLoop

    engine = Engine.from_pretrained(
        a.model_path,
        dtype=dtype,
        device=a.device,
        chunk_size=a.chunk_size,
        max_input_len=a.max_input_len,
        max_batch_tokens=a.max_batch_tokens,
        enable_cache=not a.disable_radix_cache,
        memory_budget=a.memory_budget,
        prefill_mode=a.prefill_mode,
    )
    loop_kw: dict[str, Any] = {"policy": a.schedule_policy, "max_queue": a.max_queue}
    if a.fairness_lambda is not None:
        loop_kw["fairness_lambda"] = a.fairness_lambda
    loop = EngineLoop(engine, **loop_kw)
    cfg = engine.config
    info = {
        "dtype": str(cfg.dtype),
        "device": str(cfg.device),
        "chunk_size": cfg.chunk_size,
        "prefill_mode": cfg.prefill_mode,
        "max_batch_tokens": cfg.max_batch_tokens,
        "schedule_policy": a.schedule_policy,
        "fairness_lambda": loop.config.fairness_lambda,
        "radix_cache": cfg.enable_cache,
        "memory_budget": cfg.memory_budget,
    }
    return LoopBackend(engine, loop, cfg.max_input_len), info


def main(argv: Sequence[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    import uvicorn

    backend, info = build_backend(a)
    model_cfg = getattr(backend.scorer, "model_config", None)
    hf_cfg = getattr(getattr(backend.scorer, "model", None), "config", None)
    args = ServerArgs(
        model_path=a.model_path,
        served_model_name=a.served_model_name or "",
        backend=a.backend,
        host=a.host,
        port=a.port,
        api_key=a.api_key,
        max_body_bytes=a.max_body_bytes,
        model_type=getattr(model_cfg, "model_type", None) or getattr(hf_cfg, "model_type", "") or "",
        architectures=tuple(getattr(hf_cfg, "architectures", None) or ()),
        engine_args={"max_queue": a.max_queue, **info},
    )
    app = create_app(backend, args)
    log.info("serving %s (%s backend) on http://%s:%d", a.model_path, a.backend, a.host, a.port)
    # Backlog above the default so a burst of ~1000 connects is queued by the kernel, not refused.
    uvicorn.run(
        app, host=a.host, port=a.port, log_level=a.log_level, backlog=4096, timeout_graceful_shutdown=30
    )


if __name__ == "__main__":
    main()
