"""W8A8 int8 against the float dtypes on this machine, in one run:

- `gemm`: one GEMM per library at 2048^3 and at the model's real projection shapes (a 512-token
  chunk): our fp32 / bf16 matmul, `torch._int_mm` (oneDNN) with and without the per-token
  activation quantization around it (what `Int8Linear` runs), torch.ao's dynamically quantized
  linear (fbgemm, per-tensor activations) and torchao's int8 dynamic config when it is importable.
- `forward`: cold `--tokens` forwards of a Qwen2.5-1.5B-shaped model (random weights, real shape;
  `--layers` of its 28 decoder layers) and of the embedded model, fp32 (the auto dtype on an
  AVX2-only CPU) and `--quantization w8a8_int8` loaded side by side and timed in turns, with the
  weights' bytes of each.

    python -m benchmarks.bench_int8 --out /tmp/int8.json
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import flags
from po_backend.core.choices import QUANTIZATIONS
from po_backend.core.cpu import cpu_class
from po_backend.engine.models.int8 import Int8Linear, weight_bytes

# Qwen2.5-1.5B's config.json (the sizes that decide the work; tied embeddings as released).
QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_rows(repeats: int) -> list[dict[str, Any]]:
    h, i, q, kv = 1536, 8960, 1536, 256
    shapes = {
        "2048^3": (2048, 2048, 2048),
        "1.5B qkv": (512, h, q + 2 * kv),
        "1.5B gate_up": (512, h, 2 * i),
        "1.5B down": (512, i, h),
        "135M gate_up": (512, 576, 3072),
    }
    try:  # torchao, when installed (it is not a dependency)
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        ao: Any = (quantize_, Int8DynamicActivationInt8WeightConfig)
    except ImportError:
        ao = None
    rows = []
    for name, (m, k, n) in shapes.items():
        for op, fn in _ops(m, k, n, name == "2048^3" or cpu_class() != "AVX2-only", ao).items():
            s = best(torch.inference_mode()(fn), repeats)
            rows.append({"shape": name, "m": m, "k": k, "n": n, "op": op, "gops": 2 * m * k * n / s / 1e9})
            print(f"{name:14s} {op:42s} {rows[-1]['gops']:8.0f} GOP/s", flush=True)
    return rows


def _ops(m: int, k: int, n: int, bf16: bool, ao: Any) -> dict[str, Callable[[], Any]]:
    """The same [m, k] x [k, n] product through each library (bf16: emulated, so slow, on AVX2)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    ops: dict[str, Callable[[], Any]] = {"fp32": lambda: x @ w.t()}
    if bf16:
        xb, wb = x.bfloat16(), w.bfloat16()
        ops["bf16"] = lambda: xb @ wb.t()
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    lin = Int8Linear.from_float(w)
    ops["_int_mm"] = lambda: torch._int_mm(xq, lin.qweight)
    ops["Int8Linear (quant + _int_mm + dequant)"] = lambda: lin(x)
    dyn = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False, dtype=torch.qint8)
    wq = torch.quantize_per_channel(
        w, w.abs().amax(1) / 127, torch.zeros(n, dtype=torch.long), 0, torch.qint8
    )
    dyn.set_weight_bias(wq, None)
    ops["torch.ao dynamic (fbgemm)"] = lambda: dyn(x)
    if ao is not None:
        mod = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
        mod[0].weight.data = w.clone()
        ao[0](mod, ao[1]())
        ops["torchao Int8DynamicActivationInt8Weight"] = lambda: mod(x)
    return ops


def forward_rows(
    tokens: int, layers: int, repeats: int, models: list[str], modes: tuple[str, ...]
) -> list[dict[str, Any]]:
    """fp32 and each int8 mode's engine of each model loaded side by side and timed in turns
    (A B A B), so a change of load on a shared machine hits all alike; best-of and median ratios."""
    import statistics

    import transformers

    from po_backend import Engine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = transformers.Qwen2Config(**{**QWEN25_15B, "num_hidden_layers": layers})
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        del model
        paths = {"Qwen2.5-1.5B shape": tmp, "embedded (SmolLM2-135M)": "embedded"}
        for label in models:
            ids = torch.randint(3, 40000, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
            engines = {
                quant: Engine.from_pretrained(
                    paths[label], dtype="fp32", quantization=quant, max_input_len=tokens, enable_cache=False
                )
                for quant in (None, *modes)
            }
            times: dict[str | None, list[float]] = {q: [] for q in engines}
            for eng in engines.values():  # warm-up
                eng.score([ids[:128]], [0])
            for _ in range(repeats):
                for quant, eng in engines.items():
                    t = time.perf_counter()
                    eng.score([ids], [0])
                    times[quant].append(time.perf_counter() - t)
            f = times[None]
            row = {
                "model": label,
                "layers": engines[None].model_config.num_layers,
                "tokens": tokens,
                "fp32_s": f,
                "weight_bytes_fp32": weight_bytes(engines[None].model.layers),
            }
            for mode in modes:
                q = times[mode]
                row[mode] = {
                    "s": q,
                    "speedup_best": min(f) / min(q),
                    "speedup_median": statistics.median(f) / statistics.median(q),
                    "speedup_per_pair": [a / b for a, b in zip(f, q, strict=True)],
                    "weight_bytes": weight_bytes(engines[mode].model.layers),
                }
            rows.append(row)
            print(row, flush=True)
            del engines
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, None, "one repeat")
    flags(ap, tokens=(2048, "forward length"), layers=(8, "decoder layers of the 1.5B shape (it has 28)"))
    flags(ap, repeats=(3, "pairs of forwards"), skip_gemm=(False, "forwards only"))
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-1.5B shape", "embedded (SmolLM2-135M)"])
    ap.add_argument("--modes", nargs="+", default=list(QUANTIZATIONS), help="int8 modes timed against fp32")
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required")
    repeats = 1 if args.quick else args.repeats
    doc: dict[str, Any] = {"cpu_class": cpu_class(), "torch": torch.__version__}
    doc["gemm"] = [] if args.skip_gemm else gemm_rows(repeats)
    doc["forward"] = forward_rows(args.tokens, args.layers, repeats, args.models, tuple(args.modes))
    harness.save(args.out, {"machine": harness.machine_info(), **doc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
