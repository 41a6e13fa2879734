"""Shared fixtures: tiny random-weight models written to a temp dir, the embedded engine; the
session's JCT profile directory; `embedded` tests count as `slow` (the fast tier: -m "not slow")."""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. With spinning, a test
# process whose cores are shared (test servers, a CI neighbour) ran some tests 10x slower, its
# threads spinning at barriers while their partners waited for a core. Servers inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# An xdist worker (scripts/dev.sh runs one more than the cores) gets its share of the cores as torch
# threads, not every core: with a process per core and more, a second thread per process only
# adds synchronisation, the tiny models' ops being too small to split. It also makes the workers'
# in-process engines the same as the test servers (one thread each): the memory and JCT profiles,
# keyed by the thread count, are then measured once for both.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // max(1, _workers)))

import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx._transports.default  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from po_backend import Engine  # noqa: E402
from po_backend.engine.memory import MEMORY_CACHE_ENV  # noqa: E402
from po_backend.engine.models.loader import INT8_CACHE_ENV  # noqa: E402
from po_backend.serving.jct_store import JCT_CACHE_ENV  # noqa: E402

# httpx builds an SSL context (loading the CA bundle: tens of milliseconds of CPU) for every client,
# and httpx.get / httpx.post make a client per call: the tests' hundreds of loopback calls and
# polls spent more CPU there than on the answers. A test process's clients share one context per
# set of options (an SSL context is made to be shared; nothing here changes one). The function is
# httpx's private helper: where a release renames it, the tests only pay that CPU again.
_create_ssl_context = getattr(httpx._transports.default, "create_ssl_context", None)
if _create_ssl_context is not None:
    httpx._transports.default.create_ssl_context = functools.cache(_create_ssl_context)

# The session's profile directory, named in the environment by whichever pytest process made it
# (xdist's controller, or the only process of a serial run): xdist's workers inherit it from the
# controller, so every worker and every server of the run shares it.
_PROFILE_DIR_ENV = "PO_TEST_PROFILE_DIR"
_OWN_DIR: str | None = None  # the directory this process made, and removes at the end


def pytest_configure(config: pytest.Config) -> None:
    """JCT and memory profiles and int8 weights of throwaway tiny models go to one directory per
    session, shared by the in-process loops, every xdist worker and every test server (they inherit
    os.environ): a model (a shape, for memory profiles) is profiled once per run, and the user's
    cache gets none.
    Measuring takes an OS file lock, so workers asking at once measure once. The rest of the cache
    root (the embedded model's GGUF conversion, the kernel build) stays the user's, converted and
    built once."""
    global _OWN_DIR
    shared = os.environ.get(_PROFILE_DIR_ENV)
    if shared is None or not hasattr(config, "workerinput"):
        shared = _OWN_DIR = tempfile.mkdtemp(prefix="po-test-jct-")
        os.environ[_PROFILE_DIR_ENV] = shared
    os.environ[JCT_CACHE_ENV] = shared
    os.environ[MEMORY_CACHE_ENV] = os.path.join(shared, "memory")
    os.environ[INT8_CACHE_ENV] = os.path.join(shared, "int8")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_DIR is not None:
        shutil.rmtree(_OWN_DIR, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported now, with torch, transformers and the rest: hundreds of
    thousands of objects that live until the end. Frozen out of the collector, they are no longer
    walked by each full collection: the engine's memory profile collects garbage before it measures
    (in a test process that walk was most of a tiny model's start-up), and so does Python itself
    now and then. Garbage made later, by the tests, is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sums each file's setup, call and teardown times (in the controller, xdist forwards every
    worker's reports) for PO_WRITE_TEST_DURATIONS."""
    _file_seconds[_file_of(report.nodeid)] = _file_seconds.get(_file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("PO_WRITE_TEST_DURATIONS") == "1" and not hasattr(session.config, "workerinput"):
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        known.update({f: round(t, 1) for f, t in _file_seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


# Seconds each test file took in a whole-suite run. Files go to the test processes longest first
# (scripts/dev.sh runs xdist with --dist loadfile --no-loadscope-reorder, which hands files out in
# collection order): xdist's own order (most tests first) left a one-test file that runs for minutes
# (a Ray cluster) to the end, one process busy while the others idled. Only the order depends on it;
# a stale or missing figure costs balance, never a result. Refresh: PO_WRITE_TEST_DURATIONS=1 with
# the whole suite.
DURATIONS = Path(__file__).with_name("durations.json")
_file_seconds: dict[str, float] = {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    # Stable: a file's tests keep their order; a file not timed yet goes first (it may be long).
    items.sort(key=lambda item: -known.get(_file_of(item.nodeid), math.inf))
    no_cuda = pytest.mark.skip(reason="needs CUDA")  # a machine without a GPU, not a missing package
    for item in items:
        if item.get_closest_marker("embedded") is not None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)


TINY_BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

TINY_CONFIGS: dict[str, tuple[type, dict]] = {
    "llama": (transformers.LlamaConfig, {"rope_theta": 10000.0}),
    "llama3-scaled": (
        transformers.LlamaConfig,
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        },
    ),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24}),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF's init (std 0.02, zero biases, unit norms) gives near-uniform outputs that hide bugs;
    larger random weights, biases and norm scales make every parameter matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.15 * noise)


def build_tiny(kind: str, root: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    cls, extra = TINY_CONFIGS[kind]
    cfg = cls(**{**TINY_BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    path = root / kind
    model.save_pretrained(path)
    return path, model.eval()


# The memory tests' mid-size Llama: big enough that activations, not weights, decide the peak.
MID_LLAMA = dict(vocab_size=4000, hidden_size=256, intermediate_size=768, num_hidden_layers=2)
MID_LLAMA.update(num_attention_heads=8, num_key_value_heads=2)


def save_llama(root: Path, **config: int) -> str:
    """A Llama of the given sizes with HF's default init, saved under `root` (memory tests, where
    the weights' values do not matter, only the shapes)."""
    cfg = transformers.LlamaConfig(**config)
    path = root / "llama"
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            built[kind] = build_tiny(kind, root)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def embedded_fp32() -> Engine:
    return Engine.from_pretrained("embedded", dtype="fp32")


def hf_next_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' next-token log-probs after `ids` (the reference for every numeric test)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


def hf_all_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[n, vocab] log-probs of the next token at every position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


@pytest.fixture(scope="session")
def tokenized_llama(
    tiny_model: Callable[[str], tuple[Path, torch.nn.Module]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama with a trained tokenizer (tests/tiny_tokenizer.py): text end to end."""
    from tests.tiny_tokenizer import tokenized_copy

    return tokenized_copy(tiny_model("llama")[0], tmp_path_factory.mktemp("tokenized"))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray on 2 CPUs for a test file: starting Ray costs seconds, and every Ray test only
    needs a running cluster, not a fresh one. The Ray tests share one file (tests/server/test_ray.py), so
    this is one Ray per run, and it stops when that file is done instead of idling beside the rest."""
    from tests.deps import require

    ray = require("ray", "pip install 'ray[data]'")
    # Ray starts its workers at nice 15: beside any busy process of normal priority (a CI
    # neighbour) they get almost no CPU and a Ray test crawls for many minutes.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray kills a worker idle for a second once more are alive than CPUs (the actors' engine
    # loads leave the task workers idle that long), then starts a fresh one, importing Ray and
    # the project again, for the next stage's tasks: keep them for the file's few minutes.
    os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", str(10 * 60 * 1000))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()
