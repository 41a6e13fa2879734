"""One forward, ours against a reference, on the embedded model. Three modes:

- default: maximum input length in a fixed activation budget (paper Table 2), and memory and speed
  of one long prefill per configuration (Fig. 10, hybrid prefilling on/off). Each (config, n) is one
  cold forward in a fresh subprocess, so allocator state and the RSS high-water mark never leak.
  Peak = RSS high-water mark (CUDA: the allocator's peak) above its level before the forward;
  TFLOP/s = useful FLOPs (`prefill_flops`) per second, against the GEMM peak (`GemmPeak`: the
  highest of its readings at the start and after every length); MIL
  = where a line through the peaks reaches `--budget-mib` ("measured" if measured lengths bracket it).
- `--compare-dtypes`: bf16 (`--residual-dtype fp32`, and `model`: everything bf16) against fp32:
  Kendall tau of P(Yes) rankings on held-out item lists, `examples/recommend.py`'s AUC, cache hit
  vs cold, and one cold `--speed-tokens` forward of the two residual modes. `--llamacpp`: also
  llama.cpp's F16 and Q8_0 on the same weights (GGUFs written by `gguf_export`), tau against fp32.
- `--heads`: classifier heads and embeddings (random weights on SmolLM2-135M's shape, cut to
  `--layers`) against transformers (batch 1) and our engine with and without the shared
  instruction (`--prefix` tokens, then `--suffix` per item) reused from the prefix cache.

    python -m benchmarks.bench_mil --quick --out /tmp/mil.json   # ~1 min (~10 min without --quick)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from benchmarks import harness
from benchmarks.harness import REPO_ROOT, GiB, MiB, flags
from benchmarks.workloads import label_ids
from po_backend.core.cpu import cpu_class
from po_backend.engine import attention_cpu
from po_backend.engine.config import ModelConfig, parse_dtype
from po_backend.engine.device import describe, resolve_device
from po_backend.engine.memory import PeakMemory
from po_backend.engine.models import shapes
from po_backend.engine.models.int8 import weight_bytes
from po_backend.engine.models.loader import read_config, resolve_model_dir

CONFIGS = {
    "hf-default": "transformers default forward (all logits + KV cache)",
    "hf-ltk1": "transformers logits_to_keep=1, use_cache=False",
    "nochunk": "ours, no chunking",
    "hybrid": "ours, hybrid prefilling",
    "chunked": "ours, chunked prefill (Sarathi-style)",
}
LABEL_ID = 10539
WARMUP_TOKENS = 128
# On a GPU one forward of a small model lasts milliseconds and its first run at a shape pays for
# kernel selection, so there the full prompt is run once untimed and the median of these is kept.
CUDA_TIMED_RUNS = 5
RESULT_MARKER = "@@RESULT "  # a child prints exactly one line starting with this, then JSON
T = TypeVar("T")


def timed(fn: Callable[[], T], device: torch.device | None = None) -> tuple[float, T]:
    """`fn()`'s wall seconds and result. On a CUDA `device` (asynchronous) its queued work is waited
    for before and after, so the time is of fn's kernels, not of their queueing."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else lambda _: None
    sync(device)
    t = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - t, result


def gemm_peak_gflops(dtype: torch.dtype, device: torch.device) -> float:
    """Best achieved GFLOP/s of a square GEMM: the roof the model's GEMMs can reach. The layout is
    nn.Linear's, x @ W.t(): on CPUs without native bf16 a plain `a @ b` in bf16 takes a ~10x slower
    path. 2048^3 is too small to fill a GPU, so the size is 8192 there."""
    size = 8192 if device.type == "cuda" else 2048
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(size, size, generator=gen).to(device, dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype, device=device)
    times: list[float] = []
    while len(times) < 3 or (sum(times[1:]) < 1.0 and len(times) < 51):  # the first: warm-up
        times.append(timed(lambda: torch.matmul(x, w.t(), out=out), device)[0])
    return 2.0 * size**3 / min(times[1:]) / 1e9


class GemmPeak:
    """The GEMM roof of one run, measured several times (`sample`, e.g. before and after each
    measurement it judges) because one reading can come out low (a busy neighbour, clocks, the
    allocator): the machine's capability is the highest reading, and every share of the peak is
    taken against it. `measure` is injectable so the bookkeeping is testable without timing."""

    def __init__(self, measure: Callable[[], float]) -> None:
        self.measure = measure
        self.samples: list[tuple[str, float]] = []

    @classmethod
    def of(cls, dtype: torch.dtype, device: torch.device) -> GemmPeak:
        return cls(lambda: gemm_peak_gflops(dtype, device))

    def sample(self, when: str) -> float:
        """Measure once more (`when` names the point of the run); the new reading."""
        gflops = float(self.measure())
        if not gflops > 0:
            raise ValueError(f"a GEMM peak reading must be positive, got {gflops}")
        self.samples.append((when, gflops))
        return gflops

    @property
    def best(self) -> float:
        """The highest reading so far: the roof every share is taken against."""
        if not self.samples:
            raise ValueError("no GEMM peak measured yet")
        return max(g for _, g in self.samples)

    @property
    def spread(self) -> float:
        """(highest - lowest) / highest: how much one reading alone could have been off."""
        lowest = min(g for _, g in self.samples) if self.samples else 0.0
        return 1.0 - lowest / self.best

    def share(self, gflops: float) -> float:
        """`gflops` as a fraction of the highest reading."""
        return gflops / self.best

    def summary(self) -> str:
        return (
            f"GEMM peak {self.best:.1f} GFLOP/s (the highest of {len(self.samples)} readings in this run; "
            f"lowest {min(g for _, g in self.samples):.1f}, spread {self.spread:.0%})"
        )

    def record(self) -> dict[str, Any]:
        return {
            "max_gflops": self.best,
            "min_gflops": min(g for _, g in self.samples),
            "spread": self.spread,
            "samples": [{"when": w, "gflops": g} for w, g in self.samples],
        }


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Useful FLOPs of one causal prefill of `n` tokens, the same for every configuration (waste such
    as hf-default's LM head over all n rows is not credited): 2 per matmul weight per token, QK^T and
    PV on the causal half of the n x n square, a 1-row LM head; elementwise ops (<1%) are not counted."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    attention = 2.0 * 2.0 * (n * n / 2.0) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2.0 * cfg.num_layers * per_layer * n + attention + 2.0 * cfg.hidden_size * cfg.vocab_size


class AttentionClock:
    """Seconds spent in the runner's attention entry points while `on` (a child measures one
    configuration, so patching the module is harmless; transformers never calls them)."""

    def __init__(self) -> None:
        from po_backend.engine import runner

        self.seconds, self.on = 0.0, False
        for name in ("attend", "attend_items"):
            setattr(runner, name, self.wrap(getattr(runner, name)))

    def wrap(self, fn: Callable[..., None]) -> Callable[..., None]:
        def clocked(q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if not self.on:
                return fn(q, *args, **kwargs)
            self.seconds += timed(lambda: fn(q, *args, **kwargs), q.device)[0]

        return clocked


def child(
    config: str,
    n: int,
    chunk_size: int | None,
    dtype: str,
    device: str,
    model: str = "embedded",
    quantization: str | None = None,
) -> dict[str, Any]:
    """One cold forward of `n` tokens in `config`, in this (fresh) process."""
    model_dir = resolve_model_dir(model)
    cfg = read_config(model_dir)
    dev = resolve_device(device)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    hf = config.startswith("hf")
    clock = AttentionClock()
    if hf:
        import transformers

        dt = parse_dtype(dtype, dev)  # the engine's choice for "auto"
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(dev).eval()
        kwargs = {} if config == "hf-default" else {"logits_to_keep": 1, "use_cache": False}

        def forward(x: torch.Tensor) -> float:
            with torch.inference_mode():
                return model(x[None], **kwargs).logits[0, -1].float().log_softmax(-1)[LABEL_ID].item()

        prompt: Any = ids.to(dev)
    else:
        from po_backend.engine.engine import Engine

        engine = Engine.from_pretrained(
            model,
            device=dev,
            dtype=dtype,
            quantization=quantization,
            chunk_size=max(n, WARMUP_TOKENS) if config == "nochunk" else chunk_size,
            prefill_mode="chunked" if config == "chunked" else "hybrid",
            # the embedded model's whole context; a long-context shape's is far beyond any n here
            max_input_len=max(n, min(cfg.max_position_embeddings, 8192)),
            enable_cache=False,  # one cold forward, no pool
            memory_budget=64 * GiB,  # never refuse the configuration being measured
        )

        def forward(x: Any) -> float:
            return engine.score([x], [LABEL_ID])[0].logprobs[0]

        prompt = ids.tolist()  # built outside the timed region
    forward(prompt if dev.type == "cuda" else prompt[:WARMUP_TOKENS])  # pools, kernels, weights
    runs = CUDA_TIMED_RUNS if dev.type == "cuda" else 1
    clock.on = runs == 1  # on a GPU the syncs per attention call would slow the timed runs
    with PeakMemory(dev) as p, harness.CpuShare() as cpu:
        by_time = sorted(timed(lambda: forward(prompt)) for _ in range(runs))
    seconds, logprob = by_time[runs // 2]  # the median run
    clocked_s = seconds  # the run whose attention calls were timed
    if not clock.on and not hf:  # one more run, timed per attention call
        clock.on = True
        clocked_s = timed(lambda: forward(prompt))[0]
    return {  # the parent's row adds config, n and dtype
        "device": str(dev),
        "chunk_size": None if hf else engine.config.chunk_size,
        "peak_bytes": p.peak_bytes,
        "peak_method": p.method,
        "time_s": seconds,
        "timed_runs": runs,
        "tok_per_s": n / seconds,
        "tflops": prefill_flops(cfg, n) / seconds / 1e12,
        # Share of the forward spent in attention calls (ours only; None for transformers).
        "attention_share": None if hf else clock.seconds / clocked_s,
        "logprob": logprob,
        "other_cores": cpu.other_cores,
    }


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """`child(**spec)` in a fresh interpreter: its result, or a row saying why there is none (a
    SIGKILL with no traceback is what the OOM killer leaves)."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "benchmarks.bench_mil", "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "detail": f"no result within {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return {"status": "ok", **json.loads(line[len(RESULT_MARKER) :])}
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    oom = proc.returncode in (-9, 137) or "MemoryError" in proc.stderr
    return {"status": "oom" if oom else "failed", "detail": f"exit {proc.returncode}: {tail}"}


def fit_mil(points: list[tuple[int, int]], budget: float) -> dict[str, Any]:
    """MIL from (n, peak bytes) points: the line's crossing of `budget`, and whether measured
    points bracket it."""
    c1, c0 = np.polyfit([n for n, _ in points], [b for _, b in points], 1)
    fits = [n for n, b in points if b <= budget]
    over = [n for n, b in points if b > budget]
    return {
        "c0_mib": c0 / MiB,
        "kib_per_token": c1 / 1024,
        "mil": int((budget - c0) / c1) if c1 > 0 else None,
        "kind": "measured" if fits and over and max(fits) < min(over) else "extrapolated",
        "largest_measured_fit": max(fits) if fits else None,
        "points": [n for n, _ in points],
    }


def speed_summary(ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, n) where both ran: ours (hybrid) against transformers logits_to_keep=1."""
    hf = {(r["dtype"], r["n"]): r for r in ok if r["config"] == "hf-ltk1"}
    pairs = [(o, hf.get((o["dtype"], o["n"]))) for o in ok if o["config"] == "hybrid"]
    return [
        {
            "dtype": o["dtype"],
            "n": o["n"],
            "ours_tok_per_s": o["tok_per_s"],
            "hf_tok_per_s": h["tok_per_s"],
            "ratio": o["tok_per_s"] / h["tok_per_s"],
            "ours_gflops": o["tflops"] * 1e3,
            "ours_gemm_peak_frac": o["gemm_peak_frac"],
            "attention_share": o["attention_share"],
        }
        for o, h in pairs
        if h is not None
    ]


def model_record(model: str) -> dict[str, Any]:
    """What a result says about its model: the path, and "random weights, real shape" for a shape."""
    return {"model": model, "weights": shapes.weights_note(model) or "real"}


def _weights_line(model: str) -> str:
    note = shapes.weights_note(model)
    return f" ({note})" if note else ""


def mil(args: argparse.Namespace) -> dict[str, Any]:
    """The default mode: each config at each length per dtype in a fresh child, then the speed
    summary and the MIL fit of the first dtype's peaks."""
    if args.quick:
        args.lengths, args.quiet_wait = "256,512", min(args.quiet_wait, 5.0)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    dev = resolve_device(args.device)
    dtypes = {name: parse_dtype(name, dev) for name in args.dtype.split(",")}
    model_cfg = read_config(resolve_model_dir(args.model))
    print(f"device: {describe(dev)}; model {args.model}" + _weights_line(args.model))
    if dev.type == "cpu":  # what --dtype auto and the attention choice are on this CPU class
        for name, dt in dtypes.items():
            c = attention_cpu.decide(dt, dev, model_cfg.head_dim)
            print(f"CPU class {cpu_class()}: --dtype {name} -> {dt}; attention {c.attention} ({c.reason})")
    # fp32 and bf16 whatever runs: the CPU decides which one the engine uses (bf16 only where it
    # is native); a GPU's fp16 default (compute capability < 8) is added when it runs.
    # Each dtype's roof is read again after every length; shares are of its highest reading.
    roofs = {str(dt): GemmPeak.of(dt, dev) for dt in {torch.float32, torch.bfloat16, *dtypes.values()}}
    first = {k: p.sample("start") for k, p in roofs.items()}
    print(
        "GEMM peak (x @ W.t()) at the start: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in first.items())
    )
    rows: list[dict[str, Any]] = []
    lengths = [int(x) for x in args.lengths.split(",")]
    for (name, dt), n, c in itertools.product(dtypes.items(), lengths, configs):
        harness.wait_for_quiet(args.quiet_wait)
        spec = {"config": c, "n": n, "chunk_size": args.chunk_size, "dtype": name, "device": str(dev)}
        spec |= {"model": args.model}
        spec["quantization"] = args.quantization or None  # ours only; transformers runs in the dtype
        row = {"config": c, "n": n, "dtype": str(dt), **run_child(spec, args.timeout)}
        rows.append(row)
        if c == configs[-1]:
            roofs[str(dt)].sample(f"after n={n}")
        if row["status"] != "ok":
            print(f"  {c:10s} n={n:6d} {dt}: {row['status']} {row['detail']}")
            continue
        share = "" if row["attention_share"] is None else f", attention {row['attention_share']:.0%}"
        print(
            f"  {c:10s} n={n:6d} {dt}: peak {row['peak_bytes'] / MiB:7.1f} MiB, "
            f"{row['tok_per_s']:6.0f} tok/s, {row['tflops']:.3f} TFLOP/s "
            f"({roofs[str(dt)].share(row['tflops'] * 1e3):.0%} of the GEMM peak so far){share}  "
            f"(other cores {row['other_cores']:.2f})"
        )
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        r["gemm_peak_frac"] = roofs[r["dtype"]].share(r["tflops"] * 1e3)
    print("; ".join(f"{k}: {p.summary()}" for k, p in roofs.items()) + ": the shares are of the highest")
    speed = speed_summary(ok)
    for s in speed:
        print(f"  {s['dtype']:>14s} n={s['n']:5d}: ours {s['ratio']:.2f}x transformers logits_to_keep=1")
    dtype = str(next(iter(dtypes.values())))  # the MIL fit's
    fits = {}
    for c in configs:
        points = [(r["n"], r["peak_bytes"]) for r in ok if (r["config"], r["dtype"]) == (c, dtype)]
        if len({n for n, _ in points}) >= 2:
            m = fits[c] = fit_mil(points, args.budget_mib * MiB)
            print(f"  MIL {c:10s}: {m['mil']} tokens ({m['kind']}), {m['kib_per_token']:.1f} KiB/token")
    return {
        "device": describe(dev),
        "args": vars(args),
        **model_record(args.model),
        "dtype": dtype,
        "gemm_peak_gflops": {k: p.best for k, p in roofs.items()},
        "gemm_peak": {k: p.record() for k, p in roofs.items()},
        "configs": {c: CONFIGS[c] for c in configs},
        "budget_mib": args.budget_mib,
        "model_context": model_cfg.max_position_embeddings,
        "rows": rows,
        "speed": speed,
        "mil": fits,
    }


# ---- --compare-dtypes: bf16 against fp32 ------------------------------------------------------------

PROFILES = (  # held out: these profiles and items appear nowhere else in the repository
    "Maria restores vintage motorcycles and races them on weekends; she follows Formula 1 and "
    "reads about engine tuning. She dislikes fashion news and has no pets.",
    "Tom teaches high-school chemistry, grows tomatoes and chillies on his allotment and watches "
    "nature documentaries. He avoids video games and does not follow any sport.",
    "Priya is a cardiologist who plays the violin in an amateur orchestra and travels to Japan "
    "every year. She never gambles and is not interested in cars.",
    "Leo is a teenage gamer who streams strategy games, builds his own PCs and collects trading "
    "cards. He finds gardening and classical music boring.",
)
ITEMS = (
    "Ten tips for a faster lap time on a wet track.",
    "Rebuilding a carburettor: a step-by-step photo guide.",
    "Grand Prix preview: who wins in Monaco this year?",
    "Spring fashion week: the looks everyone is talking about.",
    "Why your tomato leaves turn yellow, and how to fix it.",
    "A beginner's guide to growing chilli peppers indoors.",
    "New documentary follows a family of snow leopards.",
    "Mixing acids and bases: a safe classroom experiment.",
    "Understanding heart rhythm disorders: a patient's guide.",
    "The best violin concertos for a rainy afternoon.",
    "A week in Kyoto: temples, tea houses and trains.",
    "Patch notes: the new season of a popular strategy game.",
    "Building a quiet gaming PC on a budget.",
    "Rare trading card sells for a record price at auction.",
    "Online casino bonus codes for this weekend.",
    "Adopting a rescue dog: what to know first.",
)
QUESTION = "\nWould this person be interested in this item? Answer Yes or No.\nAnswer:"


def _scores(engine: Any, lists: Any, labels: tuple[int, int], cached: bool) -> np.ndarray:
    """Label log-probs per list and item, each prompt's prefix declared as a user's would be;
    `cached`: the prefix is computed once and read from the cache by the items over it, else each
    prompt runs on an empty cache."""
    out = []
    for prefix, items in lists:
        prompts = [prefix + s for s in items]
        engine.flush_cache()
        if cached:
            engine.score(prefix, labels, cache_prefix_len=len(prefix))
            res = engine.score(prompts, labels, cache_prefix_len=len(prefix))
            assert all(r.cached_tokens == len(prefix) for r in res), "the prefix was not read from the cache"
        else:
            res = []
            for p in prompts:
                engine.flush_cache()
                res += engine.score([p], labels, cache_prefix_len=len(prefix))
        out.append([r.logprobs for r in res])
    return np.array(out)


def _auc(**options: Any) -> float:
    import po_lang as po
    from examples import recommend

    with po.using(po.Local("embedded", **options)):
        aucs = [r.auc for r in recommend.recommend(recommend.USERS, 10) if r.auc is not None]
    return sum(aucs) / len(aucs)


def compare_dtypes(args: argparse.Namespace) -> dict[str, Any]:
    """--compare-dtypes; Kendall tau is per item list, of the Yes-No log-odds (the ranking `po.rank`
    makes); the forward's seconds are the best of --repeats."""
    from scipy.stats import kendalltau

    from po_backend import Engine

    n = args.speed_tokens
    kw: dict[str, Any] = {"max_input_len": max(n, 512), "max_batch_tokens": max(n, 1024)}
    e32 = Engine.from_pretrained("embedded", dtype="fp32", **kw)
    tok = e32.tokenizer
    labels = label_ids(tok)
    items = [tok.encode(f"Item: {it}{QUESTION}", add_special_tokens=False) for it in ITEMS]
    lists = [(tok.encode(f"Profile: {p}\n"), items) for p in PROFILES]
    ref = _scores(e32, lists, labels, cached=False)
    doc: dict[str, Any] = {"fp32": {"auc": _auc(dtype="fp32"), **_sentiment(e32)}}
    if args.llamacpp:
        doc.update(_llamacpp_taus(ref, lists, labels, Path(args.out).parent))
    ids = torch.randint(0, e32.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.quantization:  # the quantized model against fp32, both timed in this run
        doc["fp32"][f"forward_s_{n}"] = _best_forward(e32, ids, args.repeats)
        variants = {
            f"{args.quantization}-{args.dtype}": {"dtype": args.dtype, "quantization": args.quantization}
        }
    else:
        variants = {f"bf16-residual-{m}": {"dtype": "bf16", "residual_dtype": m} for m in ("fp32", "model")}
    del e32
    for name, options in variants.items():
        eng = Engine.from_pretrained("embedded", **options, **kw)
        cold, hit = _scores(eng, lists, labels, cached=False), _scores(eng, lists, labels, cached=True)
        odds = cold[..., 0] - cold[..., 1], ref[..., 0] - ref[..., 1]  # [list, item]
        taus = [float(kendalltau(a, b).statistic) for a, b in zip(*odds, strict=True)]
        doc[name] = {
            "kendall_tau_mean": sum(taus) / len(taus),
            "kendall_tau_min": min(taus),
            "max_abs_dlogprob_vs_fp32": float(np.abs(cold - ref).max()),
            "max_abs_dlogprob_hit_vs_cold": float(np.abs(hit - cold).max()),
            "auc": _auc(**options),
            f"forward_s_{n}": _best_forward(eng, ids, args.repeats),
        }
        if args.quantization:
            doc[name].update(_sentiment(eng), weight_bytes=weight_bytes(eng.model))
        print(name, doc[name], flush=True)
        del eng
    if args.quantization:
        (name,) = variants
        return {**doc, "speed_ratio_vs_fp32": doc["fp32"][f"forward_s_{n}"] / doc[name][f"forward_s_{n}"]}
    f, m = doc["bf16-residual-fp32"][f"forward_s_{n}"], doc["bf16-residual-model"][f"forward_s_{n}"]
    return {**doc, "speed_ratio_fp32_residual_vs_model": f / m}


def _taus(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Kendall tau per list between two [list, item] log-odds, and the largest difference."""
    from scipy.stats import kendalltau

    taus = [float(kendalltau(x, y).statistic) for x, y in zip(a, b, strict=True)]
    return {"kendall_tau_mean": sum(taus) / len(taus), "kendall_tau_min": min(taus),
            "max_abs_dlogodds": float(np.abs(a - b).max())}  # fmt: skip


def _llamacpp_taus(ref: np.ndarray, lists: Any, labels: tuple[int, int], folder: Path) -> dict[str, Any]:
    """llama.cpp (one thread) on F16 and Q8_0 GGUFs of the embedded model's weights, written to
    `folder`: the held-out lists' log-odds against ours in fp32 (`ref`), and Q8_0 against F16."""
    from benchmarks import llamacpp
    from po_backend.engine.models.gguf_export import write_gguf

    odds = {"fp32": ref[..., 0] - ref[..., 1]}
    for kind in ("f16", "q8_0"):
        path = folder / f"embedded.{kind}.gguf"
        if not path.is_file():
            write_gguf(resolve_model_dir("embedded"), path, kind)
        llm = llamacpp.load(path, n_ctx=512, n_batch=512, threads=1)
        sc = np.array(
            [
                [llamacpp.last_logprobs(llm, prefix + it)[list(labels)] for it in items]
                for prefix, items in lists
            ]
        )
        odds[kind] = sc[..., 0] - sc[..., 1]
        del llm
    return {
        "llamacpp-f16": _taus(odds["f16"], odds["fp32"]),
        "llamacpp-q8_0": {**_taus(odds["q8_0"], odds["fp32"]), "vs_f16": _taus(odds["q8_0"], odds["f16"])},
    }


def _best_forward(engine: Any, ids: list[int], repeats: int) -> float:
    """Seconds of the fastest of `repeats` cold forwards of `ids`."""
    times = []
    for _ in range(repeats):
        engine.flush_cache()
        t = time.perf_counter()
        engine.score([ids], [0])
        times.append(time.perf_counter() - t)
    return min(times)


SENTIMENT = REPO_ROOT / "tests" / "data" / "sentiment.jsonl"


def _sentiment(engine: Any) -> dict[str, float]:
    """Accuracy on the shipped sentiment set (tests/test_lang_embedded.py's prompt): raw (the more
    likely label) and with content-free calibration."""
    import po_lang as po

    rows = [json.loads(line) for line in SENTIMENT.read_text(encoding="utf-8").splitlines() if line.strip()]
    labels = ["positive", "negative"]

    @po.classify(labels=labels, chat=True, backend=po.Local.from_engine(engine), calibrate="content-free")
    def review(text: str) -> po.Prompt:
        return (
            po.shared("Classify the sentiment of this review as positive or negative.\n") + f"Review: {text}"
        )

    results = review.map([(r["text"],) for r in rows])
    raw = sum(
        max(labels, key=lambda k: res.logprobs[k]) == r["label"] for res, r in zip(results, rows, strict=True)
    )
    cf = sum(res.label == r["label"] for res, r in zip(results, rows, strict=True))
    return {"sentiment_acc_raw": raw / len(rows), "sentiment_acc_content_free": cf / len(rows)}


# ---- --heads: classifier heads and embeddings against transformers ----------------------------------

ST_MODULES = [  # sentence-transformers' modules.json of a last-token, normalised embedder
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def heads(args: argparse.Namespace) -> dict[str, Any]:
    """--heads: items/s of transformers (one forward per prompt) and ours (prompts packed into forwards),
    without and with the instruction reused from the cache; max |difference| from transformers'."""
    import random
    import tempfile

    import transformers

    from po_backend import Engine, ScoreRequest

    cfg = transformers.AutoConfig.from_pretrained(resolve_model_dir("embedded"))  # SmolLM2-135M's shape
    cfg.num_hidden_layers, cfg.num_labels, cfg.pad_token_id = args.layers, 2, 0
    rng = random.Random(0)
    shared = [rng.randrange(1, cfg.vocab_size) for _ in range(args.prefix)]
    prompts = [
        shared + [rng.randrange(1, cfg.vocab_size) for _ in range(args.suffix)] for _ in range(args.items)
    ]

    def ours(path: Path, reuse: bool) -> tuple[float, list[torch.Tensor], int]:
        engine = Engine.from_pretrained(path, dtype="fp32", enable_cache=reuse, max_input_len=1024)
        engine.run([ScoreRequest(tuple(prompts[0][args.prefix :]), pool=True)])  # first-call allocations
        prefix = args.prefix if reuse else None
        reqs = [ScoreRequest(tuple(p), pool=True, cache_prefix_len=prefix) for p in prompts]
        seconds, res = timed(lambda: engine.run(reqs))
        return seconds, [torch.tensor(r.outputs) for r in res], sum(r.cached_tokens for r in res)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-heads-") as tmp:
        torch.manual_seed(0)
        root = Path(tmp)
        cls = transformers.LlamaForSequenceClassification(cfg).eval()
        emb = transformers.LlamaModel(cfg).eval()
        cls.save_pretrained(root / "classifier")
        emb.save_pretrained(root / "embedder")
        (root / "embedder" / "modules.json").write_text(json.dumps(ST_MODULES))
        (root / "embedder" / "1_Pooling").mkdir()
        (root / "embedder" / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
        for kind, model in (("classifier", cls), ("embedder", emb)):
            t = time.perf_counter()
            with torch.inference_mode():
                outs = [model(torch.tensor([ids])) for ids in prompts]
            t_hf = time.perf_counter() - t
            if kind == "classifier":
                ref = [o.logits[0] for o in outs]
            else:
                ref = [torch.nn.functional.normalize(o.last_hidden_state[0, -1], dim=0) for o in outs]
            t_no, out_no, _ = ours(root / kind, reuse=False)
            t_re, out_re, cached = ours(root / kind, reuse=True)
            delta = max(
                float((a - b).abs().max()) for a, b in zip([*out_no, *out_re], ref + ref, strict=True)
            )
            seconds = {"transformers": t_hf, "ours-noreuse": t_no, "ours": t_re}
            rows.append(
                {
                    "model": kind,
                    "items_per_s": {k: args.items / v for k, v in seconds.items()},
                    "ours_vs_transformers": t_hf / t_re,
                    "noreuse_vs_transformers": t_hf / t_no,
                    "reuse_vs_noreuse": t_no / t_re,
                    "cached_tokens": cached,
                    "max_abs_delta_vs_transformers": delta,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    keys = ("items", "prefix", "suffix", "layers", "out")
    return {"args": {k: getattr(args, k) for k in keys}, "dtype": "fp32", "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, None, "lengths 256,512")
    flags(ap, lengths="1024,2048,4096,8192", configs=",".join(CONFIGS))
    ap.add_argument(
        "--chunk-size", type=int, help="hybrid / chunked chunk (default: the engine's on the device)"
    )
    # A comma list (e.g. bf16,fp32) runs every config at every length per dtype; the MIL fit uses the first.
    flags(ap, dtype=("auto", "auto (the engine's default here) | fp32 | bf16, or a list"))
    flags(ap, device=("cpu", "cpu | cuda | cuda:N (the same for ours and transformers)"))
    flags(ap, model=("embedded", "model path: a HF folder, a .gguf, 'embedded' or shape:NAME"))
    ap.add_argument(
        "--shape", help=f"a real model's shape, random weights: {', '.join(sorted(shapes.SHAPES))}"
    )
    flags(ap, budget_mib=256.0, timeout=900.0, quiet_wait=30.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # run_child's: child()'s arguments as JSON
    flags(ap, compare_dtypes=(False, "bf16 vs fp32: rankings, AUC, hit vs cold"))
    flags(ap, speed_tokens=(2048, "--compare-dtypes: forward length"))
    flags(ap, quantization=("", "--compare-dtypes: this quantization (w8a8_int8) in --dtype vs fp32"))
    flags(ap, repeats=(3, "--compare-dtypes: best of this many"))
    flags(ap, llamacpp=(False, "--compare-dtypes: llama.cpp's F16 and Q8_0 on the same weights too"))
    flags(ap, heads=(False, "classifier / embedding heads vs transformers"))
    flags(ap, items=(16, "--heads: prompts"), prefix=(256, "--heads: shared instruction tokens"))
    flags(ap, suffix=(32, "--heads: unique tail tokens"))
    flags(ap, layers=(30, "--heads: decoder layers (SmolLM2-135M has 30)"))
    args = ap.parse_args(argv)
    if args.shape:
        args.model = shapes.PREFIX + args.shape
    if args.child:
        print(RESULT_MARKER + json.dumps(child(**json.loads(args.child))), flush=True)
        return 0
    if args.out is None:
        ap.error("--out is required")
    mode = compare_dtypes if args.compare_dtypes else heads if args.heads else mil
    harness.save(args.out, {"machine": harness.machine_info(), **mode(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
