"""Real model shapes on this CPU (random weights, real shape), in one process: per shape and prompt
length, one prefill of ours against transformers (`logits_to_keep=1`, the same dtype: the one
`--dtype auto` picks here), repeats interleaved, each against the GEMM peak of this run (the
highest of its readings before and after every length: `bench_mil.GemmPeak`; FLOPs from
`bench_mil.prefill_flops`: projections, MLP, attention's causal half, a 1-row head) with its peak
memory; llama.cpp (llama-cpp-python, the `llamacpp` extra) prompt tokens/s on F16 and Q8_0 GGUFs
of the same weights; and a WL1-style labeling job (users x posts sharing each user's profile):
ours (the profile from the prefix cache) against a batched transformers loop and llama.cpp (the
profile's KV cache kept across that user's posts), items/s.

    python -m benchmarks.bench_real_shapes                 # the full table (about an hour idle, 2 cores)
    python -m benchmarks.bench_real_shapes --rehearsal --out /tmp/rs.json   # a tiny cut, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, llamacpp
from benchmarks.bench_mil import LABEL_ID, GemmPeak, prefill_flops, timed
from benchmarks.harness import REPO_ROOT, GiB, MiB
from benchmarks.workloads import Item, label_ids, wl1
from po_backend.engine.config import ModelConfig, parse_dtype
from po_backend.engine.memory import PeakMemory
from po_backend.engine.models import shapes
from po_backend.engine.models.gguf_export import write_gguf
from po_backend.engine.models.loader import read_config, resolve_model_dir

OUT = REPO_ROOT / "benchmarks" / "results" / "real_shapes_cpu.json"
# The rehearsal's cut: every feature of the shape at a test's size; a vocabulary that holds the
# shapes' BPE tokenizer, so the labeling workload tokenizes as at full size.
TINY = "num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
TINY += "&num_key_value_heads=2&head_dim=16&vocab_size=49152"
WARMUP_TOKENS = 128
GGUF_TYPES = ("f16", "q8_0")


def _ids(cfg: ModelConfig, n: int) -> list[int]:
    return torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _measure(fn: Any) -> tuple[float, int, float]:
    """(seconds, peak bytes above entry, other processes' cores) of one call."""
    gc.collect()
    with PeakMemory("cpu") as p, harness.CpuShare() as cpu:
        seconds, _ = timed(fn)
    return seconds, p.peak_bytes, cpu.other_cores


def prefill_rows(
    model: str, lengths: list[int], repeats: int, dt: torch.dtype, peak: GemmPeak, sdpa_ab: bool = False
) -> list[dict[str, Any]]:
    """Ours and transformers at each length, `repeats` times, alternating which goes first; the
    GEMM peak read again after each length (the shares are set at the end: `set_shares`).
    sdpa_ab: also ours with PO_CPU_ATTENTION=sdpa (torch's SDPA for attention, the same engine)."""
    import transformers

    from po_backend.engine.engine import Engine

    model_dir = resolve_model_dir(model)
    cfg = read_config(model_dir)
    engine = Engine.from_pretrained(
        model,
        dtype=str(dt).removeprefix("torch."),
        enable_cache=False,  # cold prefills
        max_input_len=max(lengths),
        memory_budget=64 * GiB,  # never refuse the length being measured
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()

    def ours(ids: list[int]) -> Any:
        return lambda: engine.score([ids], [LABEL_ID])

    def theirs(ids: list[int]) -> Any:
        x = torch.tensor([ids])

        def run() -> None:
            with torch.inference_mode():
                hf(x, logits_to_keep=1, use_cache=False)

        return run

    def ours_sdpa(ids: list[int]) -> Any:
        def run() -> None:
            with _env("PO_CPU_ATTENTION", "sdpa"):
                engine.score([ids], [LABEL_ID])

        return run

    systems = {"ours": ours, "transformers": theirs}
    if sdpa_ab:
        systems["ours_sdpa"] = ours_sdpa
    for make in systems.values():  # pools, weights' first touch
        make(_ids(cfg, WARMUP_TOKENS))()
    rows = []
    shape = model.removeprefix(shapes.PREFIX).split("?")[0]
    for n in lengths:
        ids = _ids(cfg, n)
        # The reading after the previous length is this one's "before".
        before = peak.sample(f"before {shape} n={n}") if not rows else peak.samples[-1][1]
        runs: dict[str, list[tuple[float, int, float]]] = {k: [] for k in systems}
        for r in range(repeats):
            for name in list(systems)[:: 1 if r % 2 == 0 else -1]:
                runs[name].append(_measure(systems[name](ids)))
        after = peak.sample(f"after {shape} n={n}")
        flops = prefill_flops(cfg, n)
        row: dict[str, Any] = {"n": n, "gflop": flops / 1e9, "gemm_peak_around_gflops": [before, after]}
        for name, rs in runs.items():
            best = min(s for s, _, _ in rs)
            row[name] = {
                "seconds": [s for s, _, _ in rs],
                "best_s": best,
                "median_s": statistics.median(s for s, _, _ in rs),
                "tok_per_s": n / best,
                "gflops": flops / best / 1e9,
                "peak_mib": max(b for _, b, _ in rs) / MiB,
                "other_cores": max(c for _, _, c in rs),
            }
        row["ratio"] = row["transformers"]["best_s"] / row["ours"]["best_s"]
        row["median_ratio"] = row["transformers"]["median_s"] / row["ours"]["median_s"]
        if sdpa_ab:
            row["ratio_to_sdpa"] = row["ours_sdpa"]["best_s"] / row["ours"]["best_s"]
            print(f"  n={n:5d}: ours / ours with PO_CPU_ATTENTION=sdpa {row['ratio_to_sdpa']:.2f}x")
        rows.append(row)
        o, h = row["ours"], row["transformers"]
        print(
            f"  n={n:5d}: ours {o['tok_per_s']:7.1f} tok/s ({peak.share(o['gflops']):.0%} of the peak so far, "
            f"{o['peak_mib']:.0f} MiB), transformers {h['tok_per_s']:7.1f} tok/s ({peak.share(h['gflops']):.0%}, "
            f"{h['peak_mib']:.0f} MiB): {row['ratio']:.2f}x (other cores up to {max(o['other_cores'], h['other_cores']):.2f}; "
            f"GEMM peak {before:.1f} before, {after:.1f} after)"
        )
    return rows


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """`name`=`value` in this process's environment for the block (the engine reads it per call)."""
    was = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if was is None:
            del os.environ[name]
        else:
            os.environ[name] = was


def set_shares(doc: dict[str, Any], peak: GemmPeak) -> None:
    """Every prefill row's share of the run's GEMM peak (its highest reading), once all are in."""
    doc["gemm_peak_gflops"] = peak.best
    doc["gemm_peak"] = peak.record()
    for s in doc["shapes"]:
        for row in s["prefill"]:
            for name in ("ours", "transformers", "ours_sdpa"):
                if name in row:
                    row[name]["gemm_peak_frac"] = peak.share(row[name]["gflops"])


def gguf_files(model: str) -> dict[str, Path]:
    """The shape's F16 and Q8_0 GGUFs, written once beside its checkpoint."""
    folder = resolve_model_dir(model)
    out = {}
    for kind in GGUF_TYPES:
        path = folder / f"llama.{kind}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            write_gguf(model, tmp, kind)
            tmp.rename(path)
        out[kind] = path
    return out


def llama_rows(model: str, n: int, repeats: int, n_batch: int) -> list[dict[str, Any]]:
    """llama.cpp's prompt processing of `n` tokens per GGUF type: tokens/s of the best of `repeats`."""
    cfg = read_config(resolve_model_dir(model))
    ids = _ids(cfg, n)
    rows = []
    for kind, path in gguf_files(model).items():
        rs = _llama_prompts(path, ids, repeats, n_batch)
        best = min(s for s, _, _ in rs)
        rows.append(
            {
                "gguf": kind,
                "n": n,
                "n_batch": n_batch,
                "seconds": [s for s, _, _ in rs],
                "tok_per_s": n / best,
                "gflops": prefill_flops(cfg, n) / best / 1e9,
                "other_cores": max(c for _, _, c in rs),
            }
        )
        print(f"  llama.cpp {kind}: {n / best:7.1f} tok/s at n={n}")
    return rows


def _llama_prompts(path: Path, ids: list[int], repeats: int, n_batch: int) -> list[tuple[float, int, float]]:
    llm = llamacpp.load(path, n_ctx=len(ids) + 8, n_batch=n_batch)
    llamacpp.last_logprobs(llm, ids[:WARMUP_TOKENS])
    return [_measure(lambda: llamacpp.last_logprobs(llm, ids)) for _ in range(repeats)]


def labeling(model: str, args: argparse.Namespace, dt: torch.dtype) -> dict[str, Any]:
    """WL1-style: `users` x `items` posts, each user's profile shared by their posts. Items/s of
    ours (one call per user, the profile cached), transformers (each user's posts in batches of
    `hf_batch`, logits_to_keep=1: the posts of a user have one length) and llama.cpp per GGUF type
    (the profile evaluated once per user, then each post after it); each system's P(Yes) agree."""
    model_dir = resolve_model_dir(model)
    tok = harness.tokenizer(model)
    yes, no = label_ids(tok)
    span = (int(args.label_profile * 0.8), int(args.label_profile * 1.2))
    items = wl1(tok, args.label_users, args.label_items, args.label_profile, args.label_profile // 8, span)
    users = sorted({it.user for it in items})
    by_user = {u: [it for it in items if it.user == u] for u in users}
    tokens = sum(len(it.ids) for it in items)
    out: dict[str, Any] = {
        "users": len(users),
        "items": len(items),
        "profile_tokens": [len(by_user[u][0].prefix) for u in users],
        "item_tokens": len(items[0].suffix),
        "prompt_tokens": tokens,
        "systems": {},
    }
    p_yes: dict[str, list[float]] = {}

    def record(name: str, seconds: float, probs: list[float], other: float) -> None:
        out["systems"][name] = {"seconds": seconds, "items_per_s": len(items) / seconds, "other_cores": other}
        p_yes[name] = probs
        print(f"  labeling {name}: {len(items) / seconds:.3g} items/s ({seconds:.1f} s)")

    max_len = max(len(it.ids) for it in items) + 8
    jobs: dict[str, Any] = {
        "ours": lambda: _label_ours(model, dt, max_len, by_user, (yes, no)),
        "transformers": lambda: _label_hf(model_dir, dt, by_user, (yes, no), args.hf_batch),
    }
    if args.llama:
        for kind, path in gguf_files(model).items():
            jobs[f"llama.cpp {kind}"] = lambda path=path: _label_llama(
                path, max_len, by_user, (yes, no), args.n_batch
            )
    for name, job in jobs.items():
        seconds, probs, other = job()
        record(name, seconds, probs, other)
        gc.collect()
    ref = p_yes["transformers"]
    out["max_abs_p_yes_vs_transformers"] = {
        k: max(abs(a - b) for a, b in zip(v, ref, strict=True)) for k, v in p_yes.items()
    }
    return out


Job = tuple[float, list[float], float]  # seconds, P(Yes) per item, other processes' cores


def _timed_job(run: Any) -> Job:
    with harness.CpuShare() as cpu:
        seconds, probs = timed(run)
    return seconds, probs, cpu.other_cores


def _label_ours(
    model: str, dt: torch.dtype, max_len: int, by_user: dict[int, list[Item]], labels: tuple[int, int]
) -> Job:
    """One call per user, the profile (the items' shared prefix) cached by the first item."""
    from po_backend.engine.engine import Engine

    engine = Engine.from_pretrained(model, dtype=str(dt).removeprefix("torch."), max_input_len=max_len)
    first = next(iter(by_user.values()))[0]
    engine.score([list(first.suffix)], labels)  # first-call allocations, no profile cached

    def run() -> list[float]:
        probs = []
        for its in by_user.values():
            res = engine.score([list(it.ids) for it in its], labels, cache_prefix_len=len(its[0].prefix))
            probs += [float(torch.tensor(r.logprobs).softmax(0)[0]) for r in res]
        return probs

    return _timed_job(run)


def _label_hf(
    model_dir: Path, dt: torch.dtype, by_user: dict[int, list[Item]], labels: tuple[int, int], batch: int
) -> Job:
    """Each user's posts in batches (a user's prompts have one length), logits_to_keep=1."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()

    def run() -> list[float]:
        probs = []
        with torch.inference_mode():
            for its in by_user.values():
                for i in range(0, len(its), batch):
                    x = torch.tensor([list(it.ids) for it in its[i : i + batch]])
                    lp = hf(x, logits_to_keep=1, use_cache=False).logits[:, -1].float().log_softmax(-1)
                    probs += lp[:, list(labels)].softmax(-1)[:, 0].tolist()
        return probs

    return _timed_job(run)


def _label_llama(
    path: Path, max_len: int, by_user: dict[int, list[Item]], labels: tuple[int, int], n_batch: int
) -> Job:
    """The profile evaluated once per user; each post after it, the profile's KV cache kept."""
    llm = llamacpp.load(path, n_ctx=max_len, n_batch=n_batch)
    first = next(iter(by_user.values()))[0]
    llamacpp.last_logprobs(llm, list(first.suffix))  # first-call allocations

    def run() -> list[float]:
        probs = []
        for its in by_user.values():
            keep = 0
            for it in its:
                lp = llamacpp.last_logprobs(llm, list(it.ids), keep=keep)
                probs.append(float(torch.tensor(lp[list(labels)]).softmax(0)[0]))
                keep = len(it.prefix)
        return probs

    return _timed_job(run)


def markdown(doc: dict[str, Any]) -> str:
    m, g = doc["machine"], doc["gemm_peak"]
    flags = ", ".join(f for f, on in m["flags"].items() if on) or "none of the listed"
    lines = [
        f"# Real shapes on {m['cpu']} ({m['cpu_class']}, {m['cores']} cores)",
        "",
        f"**{shapes.WEIGHTS_NOTE}.** CPU flags: {flags}. dtype {doc['dtype']} (what `--dtype auto` picks "
        f"here). GEMM peak (2048^3, x @ W.t()): {doc['gemm_peak_gflops']:.1f} GFLOP/s, the highest of "
        f"{len(g['samples'])} readings in this run (before and after every length; lowest "
        f"{g['min_gflops']:.1f}, spread {g['spread']:.0%}): **every % of peak below is of that highest "
        "reading**. Best of the interleaved repeats; 'other cores' is the CPU other processes used meanwhile.",
        "",
        "| shape | tokens | ours tok/s | ours % of GEMM peak | transformers tok/s | transformers % of peak "
        "| ours / transformers | ours peak MiB | transformers peak MiB | other cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in doc["shapes"]:
        for r in s["prefill"]:
            o, h = r["ours"], r["transformers"]
            lines.append(
                f"| {s['shape']} | {r['n']} | {o['tok_per_s']:.1f} | {o['gemm_peak_frac']:.0%} | {h['tok_per_s']:.1f} "
                f"| {h['gemm_peak_frac']:.0%} | {r['ratio']:.2f}x | {o['peak_mib']:.0f} | {h['peak_mib']:.0f} "
                f"| {max(o['other_cores'], h['other_cores']):.2f} |"
            )
    ab = [(s["shape"], r) for s in doc["shapes"] for r in s["prefill"] if "ours_sdpa" in r]
    if ab:
        lines += [
            "",
            "| shape | tokens | ours % of peak | ours with PO_CPU_ATTENTION=sdpa, % of peak | ours / ours with SDPA |",
            "|---|---:|---:|---:|---:|",
        ]
        for shape, r in ab:
            lines.append(
                f"| {shape} | {r['n']} | {r['ours']['gemm_peak_frac']:.0%} | {r['ours_sdpa']['gemm_peak_frac']:.0%} "
                f"| {r['ratio_to_sdpa']:.2f}x |"
            )
    llama = [(s["shape"], r) for s in doc["shapes"] for r in s.get("llama_cpp", [])]
    if llama:
        lines += [
            "",
            "| shape | llama.cpp GGUF | tokens | tok/s | ours / llama.cpp |",
            "|---|---|---:|---:|---:|",
        ]
        for shape, r in llama:
            ours = next(
                (
                    p["ours"]["tok_per_s"]
                    for s in doc["shapes"]
                    if s["shape"] == shape
                    for p in s["prefill"]
                    if p["n"] == r["n"]
                ),
                None,
            )
            ratio = "-" if ours is None else f"{ours / r['tok_per_s']:.2f}x"
            lines.append(f"| {shape} | {r['gguf']} | {r['n']} | {r['tok_per_s']:.1f} | {ratio} |")
    job = doc.get("labeling")
    if job:
        lines += [
            "",
            f"Labeling job ({job['shape']}): {job['users']} users x {job['items'] // job['users']} posts of "
            f"{job['item_tokens']} tokens, profiles of {job['profile_tokens']} tokens.",
            "",
            "| system | items/s | vs transformers | max abs P(Yes) diff vs transformers |",
            "|---|---:|---:|---:|",
        ]
        base = job["systems"]["transformers"]["items_per_s"]
        for k, v in job["systems"].items():
            d = job["max_abs_p_yes_vs_transformers"][k]
            lines.append(f"| {k} | {v['items_per_s']:.3g} | {v['items_per_s'] / base:.2f}x | {d:.1e} |")
    if not llamacpp.available():
        lines += ["", "llama.cpp: not run (llama-cpp-python is not installed: `pip install .[llamacpp]`)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, OUT)
    harness.flags(
        ap,
        shapes=("qwen3-0.6b,qwen2.5-1.5b", "registered shapes, comma-separated ('' skips the prefill table)"),
        lengths=("512,2048,8192", "prompt lengths of the prefill table"),
        repeats=(3, "interleaved repeats per (shape, length, system)"),
        llama_tokens=(2048, "llama.cpp's prompt length"),
        n_batch=(2048, "llama.cpp n_batch = n_ubatch"),
        label_shape=("qwen3-0.6b", "the labeling job's shape ('' skips it)"),
        label_users=(2, "labeling job: users"),
        label_items=(5, "labeling job: posts per user"),
        label_profile=(512, "labeling job: mean profile tokens"),
        hf_batch=(3, "labeling job: transformers' batch"),
        no_llama=(False, "skip llama.cpp"),
        sdpa_ab=(False, "also ours with PO_CPU_ATTENTION=sdpa (torch's SDPA for fp32/bf16 CPU attention)"),
        rehearsal=(False, "a 2-layer, 64-wide cut of each shape and tiny lengths (the test suite's run)"),
    )
    args = ap.parse_args(argv)
    args.llama = not args.no_llama and llamacpp.available()
    suffix = ""
    if args.rehearsal:
        suffix = "?" + TINY
        args.lengths, args.repeats, args.llama_tokens, args.n_batch = "64,160", 2, 128, 64
        args.label_users, args.label_items, args.label_profile, args.hf_batch = 2, 3, 96, 2
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dev = torch.device("cpu")
    dt = parse_dtype("auto", dev)
    peak = GemmPeak.of(dt, dev)
    first = peak.sample("start")
    print(
        f"{harness.machine_info()['cpu']}: --dtype auto -> {dt}; GEMM peak {first:.1f} GFLOP/s at the start "
        f"(read again around every length) ({shapes.WEIGHTS_NOTE})"
    )
    lengths = [int(x) for x in args.lengths.split(",")]
    doc: dict[str, Any] = {
        "machine": harness.machine_info(),
        "weights": shapes.WEIGHTS_NOTE,
        "args": vars(args),
        "dtype": str(dt),
        "shapes": [],
    }
    t0 = time.perf_counter()
    for name in filter(None, args.shapes.split(",")):
        model = f"{shapes.PREFIX}{name}{suffix}"
        print(f"{model}:")
        entry: dict[str, Any] = {"shape": name, "model": model}
        entry["prefill"] = prefill_rows(model, lengths, args.repeats, dt, peak, args.sdpa_ab)
        if args.llama:
            entry["llama_cpp"] = llama_rows(model, args.llama_tokens, args.repeats, args.n_batch)
        doc["shapes"].append(entry)
    if args.label_shape:
        model = f"{shapes.PREFIX}{args.label_shape}{suffix}"
        print(f"labeling job on {model}:")
        doc["labeling"] = {"shape": args.label_shape, **labeling(model, args, dt)}
    peak.sample("end")
    set_shares(doc, peak)
    print(peak.summary() + ": every share of the peak in the JSON and markdown is of the highest")
    doc["wall_s"] = time.perf_counter() - t0
    harness.save(args.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
