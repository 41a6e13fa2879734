"""W8A8 int8 against the float dtypes on this machine, in one run:

- `gemm`: one GEMM per library at 2048^3 and at the model's real projection shapes (a 512-token
  chunk): our fp32 / bf16 matmul, `torch._int_mm` (oneDNN) with and without the per-token
  activation quantization around it (what `Int8Linear` runs), torch.ao's dynamically quantized
  linear (fbgemm, per-tensor activations) and torchao's int8 dynamic config when it is importable.
- `forward`: cold `--tokens` forwards of a Qwen2.5-1.5B-shaped model (random weights, real shape;
  `--layers` of its 28 decoder layers) and of the embedded model, fp32 (the auto dtype on an
  AVX2-only CPU) and `--quantization w8a8_int8` loaded side by side and timed in turns, with the
  weights' bytes of each.
- `--memory`: where each int8 mode's bytes go (int8 values, block scales, float outlier channels,
  the rest of the model in its dtype), the projections' and the whole model's, against the same
  model in bf16 (2 bytes a parameter); the 1.5B shape's per-layer bytes are measured on a
  `--layers` cut and the whole model's computed for its 28 layers.

    python -m benchmarks.bench_int8 --out /tmp/int8.json
    python -m benchmarks.bench_int8 --memory --layers 2 --out /tmp/int8_memory.json
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _model_paths(layers: int) -> Iterator[dict[str, str]]:
    """The models the forward and memory rows load: the Qwen2.5-1.5B shape cut to `layers`
    (random weights, written to a temp dir) and the embedded model."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        cfg = transformers.Qwen2Config(**{**QWEN25_15B, "num_hidden_layers": layers})
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp)
        del model
        yield {"Qwen2.5-1.5B shape": tmp, "embedded (SmolLM2-135M)": "embedded"}


def forward_rows(
    tokens: int, layers: int, repeats: int, models: list[str], modes: tuple[str, ...]
) -> list[dict[str, Any]]:
    """fp32 and each int8 mode's engine of each model loaded side by side and timed in turns
    (A B A B), so a change of load on a shared machine hits all alike; best-of and median ratios."""
    import statistics

    from po_backend import Engine

    rows = []
    with _model_paths(layers) as paths:
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


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def memory_row(model: Any, full_layers: int) -> dict[str, Any]:
    """One loaded model's bytes by kind; with `full_layers`, its decoder layers' bytes (all alike)
    scaled to that many layers."""
    from po_backend.engine.models.int8 import QUANTIZED_PROJECTIONS

    layers = list(model.decoder_layers)
    kinds = dict.fromkeys(
        ("int8 values", "block scales", "outlier weights", "outlier index", "float projections"), 0
    )
    params = 0  # the projections' parameter count (what bf16 holds at 2 bytes each)
    for layer in layers:
        for name in QUANTIZED_PROJECTIONS:
            w = getattr(layer, name)
            if isinstance(w, Int8Linear):
                params += w.in_features * w.out_features
                b = w.blocks
                values, scales = (
                    (b.data, _bytes(b.scales) + _bytes(b.comp)) if b else (w.qweight, _bytes(w.scale))
                )
                kinds["int8 values"] += _bytes(values)
                kinds["block scales"] += scales
                kinds["outlier weights"] += _bytes(w.outlier_w)
                kinds["outlier index"] += _bytes(w.outlier_idx)
            else:
                params += w.numel()
                kinds["float projections"] += _bytes(w)
    per = full_layers / len(layers) if full_layers else 1.0
    proj = sum(kinds.values())
    in_layers = sum(weight_bytes(layer) for layer in layers)
    layer_rest = in_layers - proj  # norms, biases
    rest = weight_bytes(model) - in_layers  # embeddings, final norm, head
    row: dict[str, Any] = {k: v * per for k, v in kinds.items()}
    row.update(
        projections=proj * per,
        projections_bf16=2 * params * per,
        layer_rest=layer_rest * per,
        embeddings_and_head=rest,
        whole=(proj + layer_rest) * per + rest,
    )
    return row


def _with_recipe(spec: str) -> str:
    """ "MODE:field=value:..." -> MODE, its recipe changed for the loads that follow (bench_rank_auc's
    `recipe_with` options); a plain mode gets its own recipe back."""
    from benchmarks.bench_rank_auc import recipe_with
    from po_backend.engine.models import int8

    mode, *options = spec.split(":")
    attr = {int8.W8A8_INT8: "DEFAULT_RECIPE", int8.W8A8X2_INT8: "TWO_PASS_RECIPE"}[mode]
    base = _SHIPPED.setdefault(attr, getattr(int8, attr))
    setattr(int8, attr, recipe_with(base, options))
    return mode


_SHIPPED: dict[str, Any] = {}


def memory_rows(layers: int, models: list[str], modes: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each model in each int8 mode (fp32 the rest), one at a time; bf16's bytes are 2 per
    parameter of the float model."""

    from po_backend import Engine

    rows = []
    with _model_paths(layers) as paths:
        for label in models:
            full = int(QWEN25_15B["num_hidden_layers"]) if label.startswith("Qwen") else 0
            m = Engine.from_pretrained(paths[label], dtype="fp32", max_input_len=256).model
            layer_params = sum(p.numel() for layer in m.decoder_layers for p in layer.parameters())
            other = sum(p.numel() for p in m.parameters()) - layer_params
            per = full / len(list(m.decoder_layers)) if full else 1.0
            bf16_whole = 2 * (other + layer_params * per)
            del m
            for spec in modes:
                mode = _with_recipe(spec)
                eng = Engine.from_pretrained(paths[label], dtype="fp32", quantization=mode, max_input_len=256)
                row = {"model": label, "mode": spec, **memory_row(eng.model, full), "bf16_whole": bf16_whole}
                # The same int8 projections in a bf16 model: outliers, norms and embeddings at 2 bytes.
                floats = row["outlier weights"] + row["float projections"] + row["layer_rest"]
                as_bf16 = row["whole"] - (floats + row["embeddings_and_head"]) / 2
                row.update(
                    x_smaller_projections=row["projections_bf16"] / row["projections"],
                    x_smaller_projections_rest_bf16=row["projections_bf16"]
                    / (row["projections"] - (row["outlier weights"] + row["float projections"]) / 2),
                    x_smaller_whole=bf16_whole / row["whole"],
                    x_smaller_whole_rest_bf16=bf16_whole / as_bf16,
                )
                rows.append(row)
                print(row, flush=True)
                del eng
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, None, "one repeat")
    flags(ap, tokens=(2048, "forward length"), layers=(8, "decoder layers of the 1.5B shape (it has 28)"))
    flags(ap, repeats=(3, "pairs of forwards"), skip_gemm=(False, "forwards only"))
    flags(ap, memory=(False, "the weights' bytes by kind only (no timing)"))
    ap.add_argument("--models", nargs="+", default=["Qwen2.5-1.5B shape", "embedded (SmolLM2-135M)"])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(QUANTIZATIONS),
        help="int8 modes (--memory: MODE:field=value:... too)",
    )
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required")
    repeats = 1 if args.quick else args.repeats
    doc: dict[str, Any] = {"cpu_class": cpu_class(), "torch": torch.__version__}
    if args.memory:
        doc["memory"] = memory_rows(args.layers, args.models, tuple(args.modes))
        harness.save(args.out, {"machine": harness.machine_info(), **doc})
        return 0
    doc["gemm"] = [] if args.skip_gemm else gemm_rows(repeats)
    doc["forward"] = forward_rows(args.tokens, args.layers, repeats, args.models, tuple(args.modes))
    harness.save(args.out, {"machine": harness.machine_info(), **doc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
