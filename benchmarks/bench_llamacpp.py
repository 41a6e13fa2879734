"""llama.cpp (through llama-cpp-python) next to ours on the same GGUF file and the same WL1-style
items: items/s, per-item latency and label agreement. OPTIONAL, never in CI: run_all runs it
only with `--llamacpp` and only when `llama_cpp` is importable.

Both run the items one at a time in user order, with prefix reuse on: ours through the radix
prefix cache, llama.cpp by keeping its KV state and evaluating only the tokens after the longest
common prefix with the previous prompt (its prompt-cache behaviour). llama.cpp computes on the
GGUF's quantised weights natively; ours dequantises them once to the engine dtype, so answers
differ slightly: agreement = same argmax of (Yes, No), and the largest |P(Yes) difference|.

llama-cpp-python is an sdist (~9 min of both cores to compile here); build it once into a cached
wheel (`install_hint()` prints the command with CMAKE_ARGS for this CPU: AMX off, AVX512 only where
/proc/cpuinfo has it).

    python -m benchmarks.bench_llamacpp --out benchmarks/results/report/llamacpp.json [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import load_engine, machine_info, save, tokenizer
from benchmarks.workloads import add_trace_args, build_traces, label_ids
from po_backend.core.cpu import cpu_flags

WHEELS = Path("~/.cache/prefillonly/wheels").expanduser()


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def cmake_args(flags: frozenset[str] | None = None) -> str:
    """AMX off (the default build crashed in its AMX matmul on the Xeon this was tried on); AVX512
    paths only where the CPU has them (an AVX2-only CPU would fault on them)."""
    flags = cpu_flags() if flags is None else flags
    on = "ON" if "avx512f" in flags else "OFF"
    bf16 = "ON" if "avx512_bf16" in flags else "OFF"
    vnni = "ON" if "avx512_vnni" in flags else "OFF"
    return (
        f"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512={on} -DGGML_AVX512_BF16={bf16} "
        f"-DGGML_AVX512_VNNI={vnni} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    )


def install_hint() -> str:
    return (
        f'CMAKE_ARGS="{cmake_args()}" .venv/bin/pip wheel --no-deps -w {WHEELS} llama-cpp-python '
        f"&& .venv/bin/pip install {WHEELS}/llama_cpp_python-*.whl   (compiles ~9 min once; the wheel is cached)"
    )


def p_yes(logp_yes: float, logp_no: float) -> float:
    return 1.0 / (1.0 + math.exp(min(logp_no - logp_yes, 700.0)))  # no overflow


def timed(score: Callable[[int], float], n: int) -> dict[str, Any]:
    """P(Yes) of items 0..n-1 in order, with per-item latency and items/s."""
    lat, probs = [], []
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        probs.append(score(i))
        lat.append(time.perf_counter() - t)
    return {"items_per_s": n / (time.perf_counter() - t0), "mean_s": float(np.mean(lat)), "p_yes": probs}


def run_llamacpp(
    gguf: Path, prompts: list[tuple[int, ...]], labels: tuple[int, int], n_ctx: int
) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False)
    n_vocab = llm.n_vocab()

    def score(i: int) -> float:
        ids = prompts[i]
        past = list(llm.input_ids[: llm.n_tokens])
        k = 0
        while k < min(len(past), len(ids) - 1) and past[k] == ids[k]:
            k += 1
        llm.n_tokens = k  # keep the shared prefix's KV; eval() drops the rest and computes the suffix
        llm.eval(list(ids[k:]))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        logp = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
        return p_yes(float(logp[labels[0]]), float(logp[labels[1]]))

    return timed(score, len(prompts))


def run_ours(prompts: list[tuple[int, ...]], prefixes: list[int], labels: tuple[int, int]) -> dict[str, Any]:
    engine = load_engine()

    def score(i: int) -> float:
        (res,) = engine.score([list(prompts[i])], labels, cache_prefix_len=prefixes[i])
        return p_yes(*res.logprobs)

    return timed(score, len(prompts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(ap, wl1_users=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 2, 3, 300, 40
    doc: dict[str, Any] = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}}
    if not available():
        doc.update(status="not run: llama-cpp-python not installed", install=install_hint())
        print(doc["status"] + "\n  install: " + doc["install"])
    else:
        from po_backend.engine.models.loader import embedded_model_file

        tok = tokenizer()
        items = build_traces(args, tok, ("WL1",))["WL1"]
        prompts = [it.ids for it in items]  # user order: each user's prefix is reused by its items
        labels = label_ids(tok)
        gguf = embedded_model_file()
        n_ctx = max(len(p) for p in prompts) + 16
        ours = run_ours(prompts, [len(it.prefix) for it in items], labels)
        lc = run_llamacpp(gguf, prompts, labels, n_ctx)
        agree = [(a >= 0.5) == (b >= 0.5) for a, b in zip(ours["p_yes"], lc["p_yes"], strict=True)]
        doc.update(
            status="ok",
            gguf=gguf.name,
            items=len(prompts),
            ours=ours,
            llamacpp=lc,
            agreement=sum(agree) / len(agree),
            max_abs_dp_yes=max(abs(a - b) for a, b in zip(ours["p_yes"], lc["p_yes"], strict=True)),
            ours_vs_llamacpp=ours["items_per_s"] / lc["items_per_s"],
        )
        print(
            f"ours {ours['items_per_s']:.2f} items/s vs llama.cpp {lc['items_per_s']:.2f} "
            f"({doc['ours_vs_llamacpp']:.2f}x); label agreement {doc['agreement']:.0%}"
        )
    save(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
