"""The one source of an engine's settings: every entry point (the server's command line,
`compat.sglang.Engine(**kwargs)`, the SGLang frontend backend, `po.Local(**options)`, the Ray
actors, `launch_cluster`'s worker flags) turns what the user gave into a `Settings` through
`resolve`, so the same arguments give the same settings, the same defaults and the same error
text whichever door they came in by.

Each field of `Settings` is declared once, with its default, its help text and its check; the
command-line flags are generated from the fields (`add_arguments`). `ALIASES` maps SGLang's (and
vLLM's) argument names onto the fields, with the value mapping each one needs; names that change
nothing on a one-device prefill-only engine are accepted and ignored, and what it cannot do
(`tp_size=2`, `schedule_policy="random"`) is a ValueError. An unknown name is a TypeError, as
SGLang's `ServerArgs(**kwargs)` raises.

Torch-free: the settings stay the strings and numbers a user typed; the engine resolves "auto"
and None against the model and the machine (`serving.engine_runtime.EngineRuntime.resolved` reports those).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from po_backend.core.choices import (
    BACKENDS,
    CACHE_POLICIES,
    PREFILL_MODES,
    QUANTIZATIONS,
    RESIDUAL_DTYPES,
    check_choice,
)
from po_backend.core.choices import SCHEDULE_POLICIES as POLICIES
from po_backend.core.task import POOLINGS, TASKS

log = logging.getLogger(__name__)

# score = jct seconds - lambda * queueing seconds: 0 starves long prompts, much more than 1 gives up
# the cache hits po's latency comes from. A request is overtaken only by requests arriving within
# (its price - theirs) / lambda seconds after it: at 0.5 an early cold profile lost to every group
# of posts of the next 1.6 s, several long steps above saturation (the held-out sweep in REPORT).
DEFAULT_FAIRNESS_LAMBDA = 1.0
# Waiting requests join the head's step when they share at least this many leading tokens with
# it (declared or not): enough to be a profile or a document, more than a chat template's few
# tokens ("User: "), which would pull every user's requests into one step.
DEFAULT_MIN_SHARED_PREFIX = 32
# With priority scheduling on, the classes behind the most urgent one still get at least this share
# of the step time while more urgent work keeps the engine busy (their starvation credit): a
# labeling job slows to a crawl under an online burst, it never stops.
DEFAULT_BATCH_MIN_SHARE = 0.05
# A batch step is sized so that an online call arriving during it still meets the online latency
# target: the target minus what recent online calls took without batch work in their way
# (`sched.backfill`). Before any online call is measured it may take this share of the target.
BACKFILL_SLO_SHARE = 0.5
# The bounds of that share: batch steps stay long enough to be worth their fixed per-step cost
# when online calls alone come near the target, and a step's prediction error keeps some room
# even when they are far below it.
BACKFILL_SHARE_BOUNDS = (0.25, 0.8)
# Online calls the estimate looks back over: enough for a tail, recent enough to follow the load.
BACKFILL_WINDOW = 64
# A call waits at most one step of less urgent work, so steps may take at most this share of what
# the most urgent calls measurably take on their own: their P99 then stays within 1.5x of it.
BACKFILL_ALONE_SHARE = 0.5
# With priority scheduling on and no online target, a step takes at most this many predicted seconds
# (less once the most urgent calls are measured to be fast: `BACKFILL_ALONE_SHARE` of their time).
DEFAULT_PRIORITY_STEP_S = 0.25
# A request that names no priority has this one (SGLang's default).
DEFAULT_PRIORITY = 0

DEFAULT_CHUNK_SIZE = 512
# Hybrid prefilling on a CPU: its GEMMs reach the square-GEMM rate only from about 2k rows, and
# each chunk's norms, RoPE and activation are one more round of threaded elementwise calls. The
# MLP scratch of 2k rows stays small beside the weights (147 MiB at Qwen2.5-1.5B's width in fp32).
CPU_HYBRID_CHUNK_SIZE = 2048
# On a GPU a small model is bound by kernel launches, one set per chunk: longer chunks cost a
# little activation memory, which a GPU has, and save most of the launches.
CUDA_CHUNK_SIZE = 8192
DEFAULT_MAX_QUEUE = 4096

# vLLM's task names (--task, --runner, --convert) onto ours: its score and reward tasks are a
# classifier head; none leaves the choice to the checkpoint.
_VLLM_TASKS = {"embedding": "embed", "score": "classify", "reward": "classify", "none": "auto"}

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'1073741824', '1GiB', '512M', '1.5g' -> bytes (binary units: a memory budget, not disk)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 2147483648, 2GiB, 512M)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def arg_bytes(text: str) -> int:
    """`parse_bytes` as an argparse type."""
    try:
        return parse_bytes(text)
    except ValueError as e:  # argparse reports ArgumentTypeError's text as is
        raise argparse.ArgumentTypeError(str(e)) from None


def flag(
    help: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] = (),
    nargs: str | None = None,
    engine: bool = False,
    scheduler: str | None = None,
) -> Any:
    """A dataclass field's command-line declaration (its `metadata`): help text, the type that
    parses the flag's text, the choices, how many values it takes (argparse's nargs; None: one).
    `add_fields` generates the flag from it and the field's default. engine: the engine's
    `EngineConfig` has a field of the same name that it sets; scheduler: the
    `sched.config.SchedulerConfig` field it sets."""
    return {
        "help": help,
        "type": type,
        "choices": choices,
        "nargs": nargs,
        "engine": engine,
        "scheduler": scheduler,
    }


def lora_entries(value: Any) -> tuple[str, ...]:
    """LoRA adapters to load at start, as SGLang's `--lora-paths` (`name=path`, or a bare path
    named by itself), vLLM's `--lora-modules` (`name=path`, or JSON `{"name", "path"}`), or in
    process a {name: path} mapping or a list of those -> ("name=path", ...); ValueError naming a
    malformed entry or a name given twice."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items: list[Any] = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, str):
        items = [value]
    else:
        items = list(value)
    out: dict[str, str] = {}
    for item in items:
        name, path = _lora_entry(item)
        if name in out and out[name] != path:
            raise ValueError(f"LoRA adapter {name!r} given twice ({out[name]} and {path})")
        out[name] = path
    return tuple(f"{k}={v}" for k, v in out.items())


def _lora_entry(item: Any) -> tuple[str, str]:
    if isinstance(item, Mapping):
        data: Any = item
    elif isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            data = json.loads(item)
        except ValueError:
            raise ValueError(f"LoRA module {item!r} is not valid JSON") from None
    elif isinstance(item, str) and item:
        name, sep, path = item.partition("=")
        name, path = (name, path) if sep else (item, item)
        if not name or not path:
            raise ValueError(f"LoRA adapter {item!r}: give name=path")
        return name, path
    else:
        raise ValueError(f"LoRA adapter {item!r}: give name=path")
    if not isinstance(data, Mapping) or not data.get("name") or not data.get("path"):
        raise ValueError(f"LoRA module {item!r}: a JSON object needs 'name' and 'path'")
    return str(data["name"]), str(data["path"])


@dataclass(frozen=True)
class Settings:
    """What runs: the engine (or the transformers baseline) and the scheduling loop in front of
    it. None means the engine's or the model's default, resolved when the engine loads."""

    model_path: str = field(metadata=flag("HF folder, .gguf file, or 'embedded' (SmolLM2-135M)"))
    backend: str = field(
        default="prefillonly",
        metadata=flag(
            "prefillonly (ours) | hf (the transformers baseline: FCFS, no prefix cache)", choices=BACKENDS
        ),
    )
    dtype: str = field(default="auto", metadata=flag("auto | bf16 | fp16 | fp32", engine=True))
    device: str | None = field(
        default=None, metadata=flag("cpu | cuda (default: cuda when available)", engine=True)
    )
    max_input_len: int | None = field(
        default=None,
        metadata=flag("longest prompt in tokens (default: the model's context)", type=int, engine=True),
    )
    max_batch_tokens: int | None = field(
        default=None,
        metadata=flag("new tokens per forward (default: max(max-input-len, 2048))", type=int, engine=True),
    )
    memory_budget: int | None = field(
        default=None,
        metadata=flag(
            "bytes beyond the weights for activations + prefix cache (e.g. 4GiB; default: a quarter of the "
            "RAM on a CPU, or what is free if less; 0.85 of the free memory on CUDA)",
            type=arg_bytes,
            engine=True,
        ),
    )
    mem_fraction_static: float | None = field(
        default=None,
        metadata=flag(
            "share of the memory available at start for activations + prefix cache (instead of --memory-budget)",
            type=float,
            engine=True,
        ),
    )
    chunk_size: int | None = field(
        default=None,
        metadata=flag(
            f"tokens per chunk of the non-attention work (hybrid prefilling); 0 = no chunking "
            f"(default: {CPU_HYBRID_CHUNK_SIZE} on a CPU, {DEFAULT_CHUNK_SIZE} for --prefill-mode chunked there, {CUDA_CHUNK_SIZE} on CUDA)",
            type=int,
            engine=True,
        ),
    )
    prefill_mode: str = field(
        default="hybrid",
        metadata=flag(
            "hybrid: the paper's hybrid prefilling; chunked: Sarathi-style chunked prefill (baseline)",
            choices=PREFILL_MODES,
            engine=True,
        ),
    )
    residual_dtype: str = field(
        default="fp32",
        metadata=flag(
            "with bf16/fp16 weights: fp32 keeps the residual stream and norms in fp32 (rankings as "
            "fp32's; matmuls stay bf16); model rounds them to the weights' dtype (transformers' way)",
            choices=RESIDUAL_DTYPES,
            engine=True,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=flag(
            "w8a8_int8: projections and MLP in int8 (weights and each token's activations in "
            "blocks of 32 inputs, llama.cpp's Q8_0 format; int32 sums per block); attention, norms, "
            "embeddings and the LM head stay in --dtype. w8a8x2_int8: int8 weights per output "
            "channel (one fp32 scale a row), each activation block as two int8 parts (about 15 "
            "bits, two int8 GEMMs): ranks like fp32. "
            "Default: none (see docs/quantization.md)",
            choices=QUANTIZATIONS,
            engine=True,
        ),
    )
    enable_cache: bool = field(default=True, metadata=flag("the prefix (radix) cache", engine=True))
    cache_policy: str | None = field(
        default=None,
        metadata=flag(
            "which leading tokens of a request that declares none are cached (default: all-but-last-k)",
            choices=CACHE_POLICIES,
            engine=True,
        ),
    )
    prefix_pool_tokens: int | None = field(
        default=None,
        metadata=flag(
            "tokens the prefix-KV pool holds at most (default: what the memory budget leaves)",
            type=int,
            engine=True,
        ),
    )
    schedule_policy: str = field(
        default="po",
        metadata=flag(
            "po: prefix-aware SRJF with JCT calibration (the paper's); fcfs: arrival order (the only "
            "one of --backend hf); srjf: JCT at arrival; lpm: longest cached prefix first. SGLang's "
            "lof maps to fcfs and dfs-weight to lpm, with a warning; random is refused",
            choices=(*POLICIES, "lof", "dfs-weight", "random"),
            scheduler="policy",
        ),
    )
    fairness_lambda: float = field(
        default=DEFAULT_FAIRNESS_LAMBDA,
        metadata=flag(
            "po's starvation bound: score = jct - lambda * t_queue (seconds)",
            type=float,
            scheduler="fairness_lambda",
        ),
    )
    min_shared_prefix: int = field(
        default=DEFAULT_MIN_SHARED_PREFIX,
        metadata=flag(
            "waiting requests sharing at least this many leading tokens run in one step, the shared part computed once",
            type=int,
            scheduler="min_shared_prefix",
        ),
    )
    enable_priority_scheduling: bool = field(
        default=False,
        metadata=flag(
            "order by each request's `priority` first (strict between values), the policy within one; "
            "off: priorities are ignored",
            scheduler="enable_priority",
        ),
    )
    schedule_low_priority_values_first: bool = field(
        default=False,
        metadata=flag(
            "with priority scheduling: lower `priority` values run first (vLLM's order); "
            "default: higher values first (SGLang's)",
            scheduler="low_priority_first",
        ),
    )
    online_slo_ms: float | None = field(
        default=None,
        metadata=flag(
            "with priority scheduling: the P99 latency target of the most urgent calls. Every step is "
            "sized to at most the target minus what those calls take alone (half the target until they "
            "are measured), so one arriving during a step waits little; default: steps take at most half "
            "of what those calls take alone (0.25 s until measured)",
            type=float,
        ),
    )
    batch_min_share: float = field(
        default=DEFAULT_BATCH_MIN_SHARE,
        metadata=flag(
            "with priority scheduling: the share of step time less urgent classes get while more "
            "urgent work keeps the engine busy (their starvation credit; 0 = strict priority)",
            type=float,
            scheduler="batch_min_share",
        ),
    )
    max_queue: int = field(
        default=DEFAULT_MAX_QUEUE,
        metadata=flag("queued prompts before requests get 503 'overloaded'", type=int),
    )
    task: str = field(
        default="auto",
        metadata=flag(
            "what the model is served for: generate (label scoring through the LM head), classify "
            "(a *ForSequenceClassification head), embed (pooled hidden states), pooling (classify when "
            "the checkpoint has a score head, else embed); auto reads it from config.json / modules.json",
            choices=(*TASKS, *_VLLM_TASKS),
            engine=True,
        ),
    )
    pooling: str | None = field(
        default=None,
        metadata=flag(
            "an embedder's pooling (default: its sentence-transformers config, else last)",
            choices=POOLINGS,
            engine=True,
        ),
    )
    enable_lora: bool = field(
        default=False,
        metadata=flag(
            "serve LoRA adapters (on with --lora-paths; adapters load at run time too)", engine=True
        ),
    )
    lora_paths: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "PEFT LoRA adapter folders to load at start: name=path ... (a bare path is named by itself)",
            nargs="+",
        ),
    )
    max_loras: int = field(
        default=4,
        metadata=flag(
            "LoRA adapters loaded at once (their memory is set aside at start)", type=int, engine=True
        ),
    )
    max_lora_rank: int = field(
        default=16,
        metadata=flag(
            "the largest LoRA rank an adapter may have (sizes what is set aside)", type=int, engine=True
        ),
    )

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required (a HF folder, a .gguf file, or 'embedded')")
        check_choice("backend", self.backend, BACKENDS)
        for name in ("max_input_len", "max_batch_tokens", "memory_budget", "prefix_pool_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.chunk_size is not None and self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0 = no chunking), got {self.chunk_size}")
        check_choice("prefill_mode", self.prefill_mode, PREFILL_MODES)
        check_choice("residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        if self.cache_policy is not None:
            check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.backend == "hf" and self.quantization is not None:
            raise ValueError(
                "backend hf runs transformers in --dtype; quantization needs backend prefillonly"
            )
        if self.mem_fraction_static is not None:
            if self.memory_budget is not None:
                raise ValueError("give memory_budget or mem_fraction_static, not both")
            if not 0 < self.mem_fraction_static <= 1:
                raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        check_scheduler(self.schedule_policy, self.fairness_lambda, self.min_shared_prefix)
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.backend == "hf" and self.task not in ("auto", "generate"):
            raise ValueError(f"backend hf scores label tokens only (task generate), got task {self.task!r}")
        check_priority(self.online_slo_ms, self.batch_min_share)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.backend == "hf" and (self.enable_lora or self.lora_paths):
            raise ValueError("backend hf serves no LoRA adapters (use the prefillonly backend)")
        if self.backend == "hf" and self.schedule_policy != "fcfs":
            raise ValueError(f"backend hf runs FCFS only, got schedule_policy {self.schedule_policy!r}")

    def overrides(self) -> dict[str, Any]:
        """`Engine.from_pretrained` keyword arguments (EngineConfig field names); unset ones are
        left out so the engine picks its defaults (mem_fraction_static becomes a memory budget
        when the engine resolves its device)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("engine")}
        if self.enable_lora or self.lora_paths:  # --lora-paths turns LoRA on, as SGLang's does
            out["enable_lora"] = True
        else:  # no adapters to size for: the engine's own defaults, unmentioned
            for name in ("enable_lora", "max_loras", "max_lora_rank"):
                out.pop(name)
        return {k: v for k, v in out.items() if v not in (None, "auto")}

    def loras(self) -> list[tuple[str, str]]:
        """The adapters to load at start, (name, path) each."""
        return [_lora_entry(e) for e in self.lora_paths]

    def public(self) -> dict[str, Any]:
        """The settings as asked for, as one flat JSON object (lists for tuples, as JSON reads back)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


FIELDS: Mapping[str, Any] = {f.name: f for f in fields(Settings)}
# Setting name -> the `sched.config.SchedulerConfig` field it sets, as each setting declares it.
SCHEDULER_FIELDS: Mapping[str, str] = {
    n: f.metadata["scheduler"] for n, f in FIELDS.items() if f.metadata.get("scheduler")
}


@dataclass(frozen=True)
class Alias:
    """An argument name from SGLang or vLLM: the field it sets (None: accepted, changes nothing
    here), how its value maps onto ours, or the one value we can honour."""

    field: str | None
    help: str
    convert: Callable[[Any], Any] | None = None
    type: Callable[[str], Any] | None = None  # command-line type; None and no fixed value: a switch
    fixed: Any = None  # the one value accepted (see FIXED)
    nargs: str | None = None  # argparse's nargs (None: one value)


def _no_chunking(value: int) -> int:
    # SGLang's -1 (and 0) mean "do not chunk prefills"; our chunk_size 0 means the same.
    return 0 if value is not None and value <= 0 else value


def _vllm_task(value: str) -> str:
    return _VLLM_TASKS.get(value, value)


def _is_embedding(value: bool) -> str | None:
    # SGLang serves classifier checkpoints with --is-embedding too; False leaves it to the model.
    return "pooling" if value else None


_IGNORED = "accepted; changes nothing on a one-device prefill-only engine"
ALIASES: Mapping[str, Alias] = {
    # SGLang ServerArgs
    "context_length": Alias("max_input_len", "SGLang's name of --max-input-len", type=int),
    "chunked_prefill_size": Alias(
        "chunk_size", "SGLang's name of --chunk-size; -1 (no chunking) is chunk size 0", _no_chunking, int
    ),
    "max_prefill_tokens": Alias("max_batch_tokens", "SGLang's name of --max-batch-tokens", type=int),
    "max_queued_requests": Alias("max_queue", "SGLang's name of --max-queue", type=int),
    "disable_radix_cache": Alias("enable_cache", "no prefix cache", lambda v: not v),
    "tp_size": Alias(None, "1 only (one device per worker)", type=int, fixed=1),
    "dp_size": Alias(None, "1 only: run N workers behind the SGLang router instead", type=int, fixed=1),
    "pp_size": Alias(None, "1 only", type=int, fixed=1),
    "tokenizer_path": Alias(
        None, "must be the model's own folder (the tokenizer is read from there)", type=str
    ),
    "trust_remote_code": Alias(None, "accepted: no model code is ever loaded from the model folder"),
    "random_seed": Alias(None, "accepted: answers are greedy (deterministic)", type=int),
    "enable_metrics": Alias(None, "accepted: /metrics is always on"),
    "skip_tokenizer_init": Alias(None, "False only: text in, text out needs the tokenizer", fixed=False),
    "is_embedding": Alias(
        "task", "SGLang: serve an embedding or classifier model (--task pooling)", _is_embedding
    ),
    # vLLM engine arguments
    "max_model_len": Alias("max_input_len", "vLLM's name of --max-input-len", type=int),
    "max_num_batched_tokens": Alias("max_batch_tokens", "vLLM's name of --max-batch-tokens", type=int),
    "gpu_memory_utilization": Alias(
        "mem_fraction_static", "vLLM's name of --mem-fraction-static", type=float
    ),
    "enable_prefix_caching": Alias("enable_cache", "vLLM's name of --enable-cache"),
    "runner": Alias("task", "vLLM: generate | pooling (--task); auto reads the checkpoint", _vllm_task, str),
    "convert": Alias("task", "vLLM: embed | classify | reward (--task embed / classify)", _vllm_task, str),
    "pooling_type": Alias("pooling", "vLLM's pooler type: LAST | MEAN | CLS (--pooling)", str.lower, str),
    "tensor_parallel_size": Alias(None, "vLLM's --tp-size: 1 only", type=int, fixed=1),
    "data_parallel_size": Alias(None, "vLLM's --dp-size: 1 only", type=int, fixed=1),
    "pipeline_parallel_size": Alias(None, "vLLM's --pp-size: 1 only", type=int, fixed=1),
    "lora_modules": Alias(
        "lora_paths",
        "vLLM's name of --lora-paths (name=path, or JSON {name, path})",
        lora_entries,
        str,
        nargs="+",
    ),
    "max_loras_per_batch": Alias("max_loras", "SGLang's name of --max-loras", type=int),
}
# SGLang ServerArgs that change nothing about the answers of a one-device, prefill-only engine
# (logging, GPU memory and kernel knobs), accepted in process so SGLang code runs. On the command
# line log_level and served_model_name are the HTTP server's own flags.
IGNORED: frozenset[str] = frozenset(
    {
        "log_level", "log_level_http", "served_model_name", "disable_cuda_graph", "cuda_graph_max_bs",
        "attention_backend", "sampling_backend", "grammar_backend", "skip_server_warmup",
        "show_time_cost", "watchdog_timeout", "max_running_requests", "stream_output",
        "enable_cache_report", "kv_cache_dtype", "revision", "download_dir", "load_format",
        "enable_mixed_chunk", "disable_overlap_schedule", "enable_torch_compile",
    }
)  # fmt: skip
# Aliases whose one accepted value is `Alias.fixed` (None is that value too).
FIXED = frozenset(
    {"tp_size", "dp_size", "pp_size", "skip_tokenizer_init", "tensor_parallel_size",
     "data_parallel_size", "pipeline_parallel_size"}
)  # fmt: skip
_FIXED_TEXT = {
    "tp_size": "tensor parallelism is not supported (one device per worker)",
    "tensor_parallel_size": "tensor parallelism is not supported (one device per worker)",
    "dp_size": "run N workers behind the SGLang router instead (see README, Scaling out)",
    "data_parallel_size": "run N workers behind the SGLang router instead (see README, Scaling out)",
}
_POLICY_MAP = {"lof": "fcfs", "dfs-weight": "lpm"}


def _policy(value: str) -> str:
    """SGLang's scheduling policy names onto ours: every answer is one token, so lof (longest
    output first) is arrival order, and dfs-weight (prefix-tree order) is longest prefix first."""
    if value == "random":
        raise ValueError("schedule_policy 'random' is not supported (use po, fcfs, srjf or lpm)")
    if value in _POLICY_MAP:
        log.warning("schedule_policy %s: runs as %s on a prefill-only engine", value, _POLICY_MAP[value])
        return _POLICY_MAP[value]
    return value


def resolve(model_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> Settings:
    """Our field names, SGLang's and vLLM's names (`ALIASES`, `IGNORED`) -> `Settings`. None
    means "the default". Raises TypeError for an unknown name, ValueError for a value or a
    combination that cannot run (the same text at every entry point)."""
    if model_path is not None:
        if kwargs.get("model_path") not in (None, model_path):
            raise ValueError("model_path given twice with different values")
        kwargs["model_path"] = os.fspath(model_path)
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in kwargs.items():
        if key in FIELDS:
            target = key
        elif key in ALIASES:
            alias = ALIASES[key]
            if key in FIXED:
                if value not in (None, alias.fixed):
                    why = _FIXED_TEXT.get(key, f"only {alias.fixed!r} is supported")
                    raise ValueError(f"{key}={value!r}: {why}")
                continue
            if alias.field is None:
                if key == "trust_remote_code" and value:
                    log.warning("trust_remote_code: ignored, our model code is our own (Llama, Qwen2, Qwen3)")
                continue
            target = alias.field
            if value is not None and alias.convert is not None:
                value = alias.convert(value)
        elif key in IGNORED:
            log.debug("ignoring %s=%r (no effect on a prefill-only engine)", key, value)
            continue
        else:
            raise TypeError(f"got an unexpected keyword argument {key!r}")
        if value is None:
            continue
        if target in values and values[target] != value:
            raise ValueError(f"{given_as[target]} and {key} both set {target}: give one")
        values[target], given_as[target] = value, key
    tokenizer_path = kwargs.get("tokenizer_path")
    if tokenizer_path and os.path.realpath(tokenizer_path) != os.path.realpath(
        str(values.get("model_path", ""))
    ):
        raise ValueError("tokenizer_path must be the model's own folder: the tokenizer is read from there")
    if "task" in values:
        values["task"] = _vllm_task(values["task"])
    if "lora_paths" in values:
        values["lora_paths"] = lora_entries(values["lora_paths"])
    if "schedule_policy" in values:
        values["schedule_policy"] = _policy(values["schedule_policy"])
    elif values.get("backend") == "hf":
        values["schedule_policy"] = "fcfs"  # the transformers baseline runs FCFS only
    if "model_path" not in values:
        raise ValueError("model_path is required (a HF folder, a .gguf file, or 'embedded')")
    return Settings(**values)


# What SGLang's /server_info calls our resolved settings (its ServerArgs names), and how its values
# read ours: SGLang's "no chunking" is -1 where ours is 0.
SGLANG_REPORTED: Mapping[str, tuple[str, Callable[[Any], Any]]] = {
    "context_length": ("max_input_len", lambda v: v),
    "chunked_prefill_size": ("chunk_size", lambda v: -1 if v == 0 else v),
    "max_prefill_tokens": ("max_batch_tokens", lambda v: v),
    "max_queued_requests": ("max_queue", lambda v: v),
    "disable_radix_cache": ("enable_cache", lambda v: not v),
    "is_embedding": ("task", lambda v: v != "generate"),
}


def sglang_names(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """`resolved` (settings by our field names) also under SGLang's names, as SGLang reports them;
    a setting the scorer does not have (None) stays None."""
    out = dict(resolved)
    for name, (ours, convert) in SGLANG_REPORTED.items():
        value = resolved.get(ours)
        out[name] = None if value is None else convert(value)
    out.update(tp_size=1, dp_size=1, pp_size=1)
    return out


def jsonable(value: Any) -> Any:
    """Settings and stats (dicts, dataclasses, non-finite floats) as plain JSON values: what
    /server_info sends and `get_server_info()` returns, the same for both."""
    if hasattr(value, "__dataclass_fields__"):
        value = asdict(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


def check_scheduler(policy: str, fairness_lambda: float, min_shared_prefix: int) -> None:
    """The scheduler settings' checks (SchedulerConfig runs them too: one text everywhere)."""
    if policy not in POLICIES:
        raise ValueError(f"schedule policy must be one of {POLICIES}, got {policy!r}")
    if not (fairness_lambda >= 0 and math.isfinite(fairness_lambda)):
        raise ValueError(f"fairness_lambda must be a finite number >= 0, got {fairness_lambda}")
    if min_shared_prefix < 1:
        raise ValueError(f"min_shared_prefix must be >= 1, got {min_shared_prefix}")


def check_priority(online_slo_ms: float | None, batch_min_share: float) -> None:
    """The priority settings' checks (SchedulerConfig runs them too)."""
    if online_slo_ms is not None and not (online_slo_ms > 0 and math.isfinite(online_slo_ms)):
        raise ValueError(f"online_slo_ms must be a finite number > 0, got {online_slo_ms}")
    if not 0 <= batch_min_share < 1:
        raise ValueError(f"batch_min_share must be in [0, 1), got {batch_min_share}")
