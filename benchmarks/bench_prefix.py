"""WL1-style offline job (users x candidate posts, Yes/No) on the embedded model: items/s and peak
memory for the transformers loop, ours without cache, ours with the prefix cache one item at a
time, and ours with cache + multi-item batches. Each configuration runs in a fresh subprocess.

    python benchmarks/bench_prefix.py            # 8 users x 20 items, profiles 2k-4k tokens
    python benchmarks/bench_prefix.py --quick    # 2 users x 6 items, profiles ~1k tokens

The two slow baselines (transformers, ours without cache) take many seconds per item here, so they
run on the first `--baseline-items` items only; items/s is comparable because every item costs
the same there (no reuse). Ratios are against the transformers loop of the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MiB,
    PeakRSS,
    emit_result,
    machine_info,
    markdown_table,
    run_child,
    text_table,
)
from workloads import Item, label_ids, wl1  # noqa: E402

CONFIGS = {
    "hf": "transformers loop (logits_to_keep=1)",
    "nocache": "ours, no prefix cache",
    "cache": "ours, prefix cache, one item at a time",
    "multi": "ours, prefix cache + multi-item batches",
}
RESULTS = Path(__file__).resolve().parent / "results"


def _workload(args: argparse.Namespace, tok) -> list[Item]:
    if args.quick:
        return wl1(tok, users=2, items=6, profile_mean=1000, profile_std=100, profile_range=(800, 1200))
    return wl1(tok, users=args.users, items=args.items)


def child(args: argparse.Namespace) -> None:
    import torch

    from po_backend import Engine, ScoreRequest

    engine = Engine.from_pretrained(
        "embedded", dtype=args.dtype, enable_cache=args.config in ("cache", "multi")
    )
    tok = engine.tokenizer
    items = _workload(args, tok)
    if args.config in ("hf", "nocache"):
        items = items[: args.baseline_items]
    labels = label_ids(tok)
    warm = ScoreRequest(tuple(range(1000, 1064)), labels)

    if args.config == "hf":
        import transformers

        from po_backend.models.loader import resolve_model_dir

        model = transformers.AutoModelForCausalLM.from_pretrained(
            resolve_model_dir("embedded"), dtype=engine.config.dtype
        ).eval()
        del engine

        def score_all() -> list[float]:
            out = []
            for it in items:
                with torch.inference_mode():
                    logits = model(torch.tensor([it.ids]), logits_to_keep=1, use_cache=False).logits[0, -1]
                lp = torch.log_softmax(logits.float(), -1)[list(labels)]
                out.append(lp.tolist())
            return out

        with torch.inference_mode():
            model(torch.tensor([warm.input_ids]), logits_to_keep=1)
    else:
        engine.run([warm])
        engine.flush_cache()
        reqs = [ScoreRequest(it.ids, labels, cache_prefix_len=len(it.prefix)) for it in items]

        def score_all() -> list[float]:
            if args.config == "multi":
                return [r.logprobs for r in engine.run(reqs)]
            return [engine.run([r])[0].logprobs for r in reqs]

    t0 = time.perf_counter()
    with PeakRSS() as peak:
        logprobs = score_all()
    seconds = time.perf_counter() - t0
    p_yes = [1 / (1 + math.exp(b - a)) for a, b in logprobs]
    result = {
        "config": args.config,
        "items": len(items),
        "tokens": sum(len(it.ids) for it in items),
        "seconds": seconds,
        "items_per_s": len(items) / seconds,
        "peak_mib": peak.peak_bytes / MiB,
        "p_yes": p_yes,
    }
    if args.config in ("cache", "multi"):
        st = engine.stats()
        result.update(cached_tokens=st.cached_tokens, prompt_tokens=st.prompt_tokens, forwards=st.forwards)
    emit_result(result)


def parent(args: argparse.Namespace) -> None:
    info = machine_info()
    print(f"machine: {info.get('cpu')} | dtype {args.dtype} | quick={args.quick}")
    outcomes = {}
    for name in args.configs.split(","):
        cmd = [__file__, "--child", name, "--dtype", args.dtype, "--baseline-items", str(args.baseline_items)]
        cmd += ["--users", str(args.users), "--items", str(args.items)] + (["--quick"] if args.quick else [])
        out = run_child(cmd, timeout=args.timeout)
        outcomes[name] = out
        r = out.result
        print(
            f"  {name:8s} {out.status}: "
            + (f"{r['items']} items in {r['seconds']:.1f}s" if r else out.detail)
        )
    base = outcomes.get("hf")
    base_ips = base.result["items_per_s"] if base and base.result else None
    multi = outcomes.get("multi")
    ref = multi.result["p_yes"] if multi and multi.result else None
    rows = []
    for name, out in outcomes.items():
        r = out.result
        if not r:
            rows.append([name, CONFIGS[name], out.status, "", "", "", "", ""])
            continue
        agree = ""
        if ref is not None:
            n = min(len(ref), len(r["p_yes"]))
            agree = f"{max(abs(a - b) for a, b in zip(ref[:n], r['p_yes'][:n], strict=True)):.1e}"
        hits = f"{r['cached_tokens'] / r['prompt_tokens']:.0%}" if "cached_tokens" in r else "-"
        rows.append(
            [
                name,
                CONFIGS[name],
                r["items"],
                f"{r['items_per_s']:.3f}",
                f"{r['items_per_s'] / base_ips:.1f}x" if base_ips else "n/a",
                f"{r['peak_mib']:.0f}",
                hits,
                agree,
            ]
        )
    header = [
        "config",
        "what",
        "items",
        "items/s",
        "vs hf",
        "peak MiB",
        "cache hits",
        "max |dP(Yes)| vs multi",
    ]
    print(text_table(header, rows))
    summary = {}
    res = {k: v.result for k, v in outcomes.items() if v.result}
    if "hf" in res and "cache" in res:
        summary["cache_vs_hf"] = res["cache"]["items_per_s"] / res["hf"]["items_per_s"]
    if "hf" in res and "multi" in res:
        summary["multi_vs_hf"] = res["multi"]["items_per_s"] / res["hf"]["items_per_s"]
    if "cache" in res and "multi" in res:
        summary["multi_vs_cache"] = res["multi"]["items_per_s"] / res["cache"]["items_per_s"]
    for k, v in summary.items():
        print(f"  {k}: {v:.2f}x")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "prefix.json").write_text(
            json.dumps({"machine": info, "dtype": args.dtype, "results": res, "summary": summary}, indent=1)
        )
        (RESULTS / "prefix.md").write_text(
            f"# bench_prefix (WL1-style, {args.users} users x {args.items} items, dtype {args.dtype})\n\n"
            f"Machine: {info.get('cpu')}\n\n"
            + markdown_table(header, rows)
            + "\n\n"
            + "\n".join(f"- {k}: {v:.2f}x" for k, v in summary.items())
            + "\n"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="hf,nocache,cache,multi")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--baseline-items", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--child", choices=sorted(CONFIGS))
    args = ap.parse_args()
    if args.child:
        args.config = args.child
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
