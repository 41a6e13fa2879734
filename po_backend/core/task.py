"""What a loaded model is served for: its task, read from the checkpoint's files (`config.json`'s
`architectures`, `id2label`, `problem_type`, `pad_token_id`; sentence-transformers' `modules.json`
and pooling config) or forced by the `task` setting (vLLM's `--task` / `--runner` / `--convert`,
SGLang's `--is-embedding`).

- generate: a causal LM, scored through its LM head on label tokens (every route of the server).
- classify: a `*ForSequenceClassification` checkpoint (classifiers, one-logit rerankers, reward
  models): the `score` head on the hidden state of the last token.
- embed: the decoder's final hidden states pooled (last token, mean, or first token), normalised
  when the model's config says so.

Torch-free: the server decides which routes fit the model from this alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from po_backend.core.errors import UnsupportedModelError

TASKS = ("auto", "generate", "classify", "embed", "pooling")
KINDS = ("generate", "classify", "embed")
POOLINGS = ("last", "mean", "cls")
# What each kind answers over HTTP (the 400 for a route that does not fit names these).
ROUTES: dict[str, tuple[str, ...]] = {
    "generate": (
        "/generate",
        "/v1/completions",
        "/v1/score",
        "/v1/classify (labels as tokens)",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/generative_scoring",
    ),
    "classify": ("/v1/classify", "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/pooling"),
    "embed": ("/v1/embeddings", "/pooling"),
}
_ARCH_KINDS = (
    ("ForCausalLM", "generate"),
    ("ForConditionalGeneration", "generate"),
    ("ForSequenceClassification", "classify"),
    ("Model", "embed"),  # a bare decoder (Qwen3Model, MistralModel): an embedder
)
SUPPORTED_TEXT = (
    "supported: *ForCausalLM (label scoring), *ForSequenceClassification (classifier, reranker and "
    "reward heads), bare *Model / sentence-transformers decoders (embeddings); pass --task "
    "generate|classify|embed (vLLM: --task / --runner pooling / --convert embed|classify; SGLang: "
    "--is-embedding) to choose"
)


@dataclass(frozen=True)
class ModelTask:
    """The task of a loaded model and what its head or pooling needs."""

    kind: str = "generate"
    labels: tuple[str, ...] = ()  # classify: id2label in index order (LABEL_i when unnamed)
    problem_type: str = ""  # classify: transformers' single_label / multi_label / regression
    pooling: str = "last"  # embed
    normalize: bool = False  # embed: L2-normalise the pooled vector
    pad_token_id: int | None = None  # classify: transformers scores the last non-pad token

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task kind must be one of {KINDS}, got {self.kind!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    @property
    def pooled(self) -> bool:
        """Answers are the model's pooled output, not next-token log-probs."""
        return self.kind != "generate"

    @property
    def activation(self) -> str:
        """How a classifier's logits become probabilities (vLLM's rule, after transformers' loss
        for `problem_type`): regression none, multi-label sigmoid, one logit sigmoid, else softmax."""
        if self.problem_type == "regression":
            return "none"
        if self.problem_type == "multi_label_classification" or self.num_labels == 1:
            return "sigmoid"
        return "softmax"

    @property
    def routes(self) -> tuple[str, ...]:
        return ROUTES[self.kind]

    def describe(self) -> dict[str, Any]:
        """What /v1/models and /server_info report."""
        out: dict[str, Any] = {"task": self.kind}
        if self.kind == "classify":
            out.update(
                num_labels=self.num_labels,
                labels=list(self.labels),
                problem_type=self.problem_type,
                activation=self.activation,
            )
        if self.kind == "embed":
            out.update(pooling=self.pooling, normalize=self.normalize)
        return out


def mismatch_text(kind: str, what: str) -> str:
    return f"{what}: the loaded model is served for task {kind!r}, which answers {', '.join(ROUTES[kind])}"


def arch_kind(architectures: list[str]) -> str | None:
    """The kind an `architectures` entry names; None when there is none (a bare config)."""
    for arch in architectures:
        for suffix, kind in _ARCH_KINDS:
            if arch.endswith(suffix):
                return kind
        raise UnsupportedModelError(f"architecture {arch!r} is not served; {SUPPORTED_TEXT}")
    return None


def read_pooling(model_dir: Path) -> tuple[str, bool] | None:
    """sentence-transformers' pooling mode and whether a Normalize module follows, from
    `modules.json`; None when the folder has none."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    pooling: str | None = None
    normalize = False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _pooling_mode(json.loads((model_dir / m.get("path", "") / "config.json").read_text()))
        else:
            raise UnsupportedModelError(
                f"sentence-transformers module {kind!r} is not supported (Transformer, Pooling, Normalize are)"
            )
    return (pooling or "last"), normalize


def _pooling_mode(cfg: dict[str, Any]) -> str:
    names = {"lasttoken": "last", "mean": "mean", "mean_tokens": "mean", "cls": "cls", "cls_token": "cls"}
    if cfg.get("include_prompt", True) is False:
        raise UnsupportedModelError("pooling with include_prompt=false is not supported")
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    else:
        modes = [
            k[len("pooling_mode_") :] for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True
        ]
    if len(modes) != 1 or modes[0] not in names:
        raise UnsupportedModelError(
            f"pooling mode {modes} is not supported (one of lasttoken, mean, cls); --pooling overrides it"
        )
    return names[modes[0]]


def detect_task(
    config: dict[str, Any], model_dir: Path | None, requested: str = "auto", pooling: str | None = None
) -> ModelTask:
    """The task `requested` (a `TASKS` name) on this checkpoint; "auto" reads it from the files,
    "pooling" is a classifier when the checkpoint has a score head, else an embedder."""
    if requested not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {requested!r}")
    found = arch_kind(list(config.get("architectures") or []))
    st = read_pooling(model_dir) if model_dir is not None else None
    kind = requested
    if requested == "auto":
        kind = found or "generate"
        if kind == "generate" and st is not None:
            kind = "embed"
    elif requested == "pooling":
        kind = "classify" if found == "classify" else "embed"
    if kind == "classify" and found != "classify":
        raise UnsupportedModelError(
            f"task classify needs a *ForSequenceClassification checkpoint (its score head); this one is "
            f"{config.get('architectures')}; {SUPPORTED_TEXT}"
        )
    if kind == "generate" and found in ("classify", "embed"):
        raise UnsupportedModelError(
            f"task generate needs an LM head; {config.get('architectures')} has none; {SUPPORTED_TEXT}"
        )
    pad = config.get("pad_token_id")
    if kind == "classify":
        id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
        n = len(id2label) or int(config.get("num_labels") or 2)
        labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(n))
        problem = str(config.get("problem_type") or "")
        return ModelTask("classify", labels, problem, pad_token_id=None if pad is None else int(pad))
    if kind == "embed":
        mode, normalize = st if st is not None else ("last", True)
        return ModelTask("embed", pooling=pooling or mode, normalize=normalize)
    return ModelTask("generate")


def log_probabilities(task: ModelTask, logits: list[float]) -> list[float]:
    """The log of `probabilities`, computed stably (a score of every label, as label scoring
    gives); a regression head's values as they are."""
    if task.activation == "none":
        return list(logits)
    if task.activation == "sigmoid":
        return [-math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x)) for x in logits]
    top = max(logits)
    total = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return [x - total for x in logits]


def probabilities(task: ModelTask, logits: list[float]) -> list[float]:
    """A classifier's logits through its activation (`ModelTask.activation`)."""
    if task.activation == "none":
        return list(logits)
    if task.activation == "sigmoid":
        return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x)) for x in logits]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def model_identity(scorer: Any) -> dict[str, Any]:
    """SGLang's `model_type` and `architectures` of a scorer: our engine has its own model
    config, the transformers baseline the HF one."""
    model_cfg = getattr(scorer, "model_config", None)
    hf_cfg = getattr(getattr(scorer, "model", None), "config", None)
    model_type = getattr(model_cfg, "model_type", None) or getattr(hf_cfg, "model_type", "") or ""
    return {
        "model_type": str(model_type),
        "architectures": list(getattr(hf_cfg, "architectures", None) or ()),
    }
