"""CPU attention alone, fp32, causal, on a registered shape's head layout (random inputs): torch's
flash kernel (SDPA, one grouped-query call, as `attention.attend` makes it) against the fp32
kernel (`csrc/attention_fp32.cpp`) and a plain-torch block-causal version (a KV head's query heads
stacked as the rows of batched products, whole-row softmax per block of queries, key blocks above
the diagonal skipped), interleaved, best of `--repeats`. GFLOP/s count the causal half only
(`bench_mil.prefill_flops`' attention term for one layer) and are shared against the highest
2048^3 GEMM reading of the same run (`bench_mil.GemmPeak`, read before and after every length).

    python -m benchmarks.bench_attention_cpu                      # 0.6B heads at 2k and 8k
    python -m benchmarks.bench_attention_cpu --lengths 2048 --repeats 5 --candidates flash,kernel
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.bench_mil import GemmPeak, timed
from benchmarks.harness import REPO_ROOT
from po_backend.engine import fused_cpu
from po_backend.engine.models import shapes

OUT = REPO_ROOT / "benchmarks" / "results" / "attention_cpu.json"
BLOCK_ELEMS = 1 << 22  # the torch-block candidate's scores per block (16 MiB in fp32)

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    out.copy_(o[0].transpose(0, 1))


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    torch.ops.po_fused.attention(q, k, v, out, torch.empty(0, 0), scale, 0)


def torch_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Blocks of query positions: per KV head one product of its g query heads' rows against the
    keys up to the block's end, the diagonal block masked, torch's softmax over the whole row."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    rows = max(1, min(n, BLOCK_ELEMS // (g * n)))
    hidden = torch.ones(rows, rows, dtype=torch.bool).triu_(1)[:, None, :]
    kh, vh = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [kv_heads, n, d]
    for j in range(kv_heads):
        for a in range(0, n, rows):
            b = min(a + rows, n)
            r = b - a
            qb = q[a:b, j * g : (j + 1) * g].reshape(r * g, d) * scale
            s = torch.matmul(qb, kh[j, :b].t())
            s.view(r, g, b)[:, :, a:b].masked_fill_(hidden[:r, :, :r], -torch.inf)
            p = torch.softmax(s, dim=-1)
            out[a:b, j * g : (j + 1) * g] = torch.matmul(p, vh[j, :b]).view(r, g, d)


CANDIDATES: dict[str, Attention] = {"flash": flash, "kernel": kernel, "torch_blocks": torch_blocks}


def causal_flops(n: int, heads: int, d: int) -> float:
    """QK^T and PV over the causal half of the n x n square, one layer (prefill_flops' term)."""
    return 2.0 * 2.0 * (n * n / 2.0) * heads * d


def run(args: Any) -> dict[str, Any]:
    cfg = shapes.hf_config(args.shape)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    names = [c for c in args.candidates.split(",") if c]
    unknown = set(names) - set(CANDIDATES)
    if unknown or "flash" not in names:
        raise SystemExit(f"--candidates: flash plus any of {sorted(CANDIDATES)}; got {names}")
    dev = torch.device("cpu")
    if "kernel" in names and not fused_cpu.enable(torch.float32, dev):
        raise SystemExit("the fp32 kernels did not build here: run without 'kernel' in --candidates")
    peak = GemmPeak.of(torch.float32, dev)
    peak.sample("start")
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        gen = torch.Generator().manual_seed(n)
        q = torch.randn(n, heads, d, generator=gen)
        k, v = (torch.randn(n, kv_heads, d, generator=gen) for _ in range(2))
        scale = d**-0.5
        outs = {c: torch.empty(n, heads, d) for c in names}
        for c in names:  # warm-up, and every candidate checked against flash
            CANDIDATES[c](q, k, v, outs[c], scale)
        err = {c: (outs[c] - outs["flash"]).abs().max().item() for c in names}
        before = peak.samples[-1][1]
        times: dict[str, list[float]] = {c: [] for c in names}
        with harness.CpuShare() as share:
            for r in range(args.repeats):
                for c in names[:: 1 if r % 2 == 0 else -1]:
                    args_c = (q, k, v, outs[c], scale)
                    times[c].append(timed(lambda c=c, a=args_c: CANDIDATES[c](*a))[0])
        after = peak.sample(f"after n={n}")
        flops = causal_flops(n, heads, d)
        row: dict[str, Any] = {"n": n, "gflop": flops / 1e9, "gemm_peak_around_gflops": [before, after]}
        row["other_cores"] = share.other_cores
        for c in names:
            best = min(times[c])
            row[c] = {
                "seconds": times[c],
                "best_s": best,
                "gflops": flops / best / 1e9,
                "max_abs_diff": err[c],
            }
        for c in names:
            row[c]["vs_flash"] = row["flash"]["best_s"] / row[c]["best_s"]
        rows.append(row)
        print(
            f"  n={n}: "
            + ", ".join(f"{c} {row[c]['gflops']:.1f} GFLOP/s ({row[c]['vs_flash']:.2f}x)" for c in names)
            + f"; other processes {share.other_cores:.2f} cores; GEMM peak {before:.1f} before, {after:.1f} after"
        )
    for row in rows:
        for c in names:
            row[c]["gemm_peak_frac"] = peak.share(row[c]["gflops"])
    return {
        "machine": harness.machine_info(),
        "shape": args.shape,
        "heads": [heads, kv_heads, d],
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "gemm_peak": peak.record(),
        "rows": rows,
    }


def markdown(doc: dict[str, Any]) -> str:
    h, kv, d = doc["heads"]
    names = [c for c in CANDIDATES if c in doc["rows"][0]]
    lines = [
        f"fp32 causal attention alone, {doc['shape']} heads ({h} query, {kv} KV, head dim {d}), "
        f"{doc['threads']} threads, {doc['machine']['cpu']}; best of {doc['args']['repeats']} interleaved; "
        f"GFLOP/s of the causal half, % of the run's highest GEMM peak reading "
        f"({doc['gemm_peak']['max_gflops']:.1f} GFLOP/s, {len(doc['gemm_peak']['samples'])} readings, "
        f"lowest {doc['gemm_peak']['min_gflops']:.1f}).",
        "",
        "| tokens | " + " | ".join(f"{c} GFLOP/s (% peak, x flash)" for c in names) + " | other cores |",
        "|---|" + "---|" * len(names) + "---|",
    ]
    for row in doc["rows"]:
        cells = [
            f"{row[c]['gflops']:.1f} ({row[c]['gemm_peak_frac']:.0%}, {row[c]['vs_flash']:.2f}x)"
            for c in names
        ]
        lines.append(f"| {row['n']} | " + " | ".join(cells) + f" | {row['other_cores']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, OUT)
    harness.flags(
        ap,
        shape=("qwen3-0.6b", "a registered shape (its heads, KV heads and head dim)"),
        lengths=("2048,8192", "sequence lengths, comma-separated"),
        repeats=(5, "interleaved runs per candidate and length (the best counts)"),
        candidates=(",".join(CANDIDATES), "flash plus any of: " + ", ".join(CANDIDATES)),
    )
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    doc = run(args)
    harness.save(args.out, doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
