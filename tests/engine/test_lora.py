"""LoRA adapters against transformers + PEFT on tiny random models and random adapters (fp32): a
causal LM's label log-probs, a classifier head's logits and an embedder's vectors; cache hits
under an adapter equal the cold run, adapters never read each other's (or the base's) prefixes;
bad adapters are refused at load with the reason."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from po_backend import Engine
from po_backend.core.errors import CapacityError, LoRAError
from po_backend.core.request import ScoreRequest
from po_backend.engine.models import lora
from tests.conftest import hf_next_logprobs

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    auto: type,
    root: Path,
    name: str,
    seed: int,
    task_type: str = "CAUSAL_LM",
    attn: str | None = None,
    **config: object,
) -> tuple[Path, torch.nn.Module]:
    """A PEFT LoRA on a fresh copy of `base`, every weight random (B too, so it changes answers),
    saved as PEFT saves it; and the PEFT model, the reference."""
    extra = {"attn_implementation": attn} if attn else {}
    model = auto.from_pretrained(base, dtype=torch.float32, **extra)
    torch.manual_seed(seed)
    opts = {"r": 4, "lora_alpha": 8, "target_modules": ALL, **config}
    pm = peft.get_peft_model(model, peft.LoraConfig(task_type=task_type, init_lora_weights=False, **opts))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n or "modules_to_save" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    path = root / name
    pm.save_pretrained(path)
    return path, pm.eval()


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 300) for _ in range(length)] for _ in range(n)]


def _delta(a: list[float], b: torch.Tensor | list[float]) -> float:
    return float((torch.tensor(a) - torch.as_tensor(b)).abs().max())


LABELS = (3, 17, 101, 250)


@pytest.fixture(scope="module")
def causal(tiny_model, tmp_path_factory) -> dict[str, object]:
    base, hf = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora")
    a, pa = make_adapter(base, transformers.AutoModelForCausalLM, root, "a", seed=1)
    b, pb = make_adapter(
        base, transformers.AutoModelForCausalLM, root, "b", seed=2, r=8, lora_alpha=4, use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )  # fmt: skip
    return {"base": base, "hf": hf, "a": a, "pa": pa, "b": b, "pb": pb}


def _engine(path: Path, **kw: object) -> Engine:
    return Engine.from_pretrained(path, **{"dtype": "fp32", "chunk_size": 16, "enable_lora": True, **kw})


def _label_lp(model: torch.nn.Module, ids: list[int]) -> list[float]:
    lp = hf_next_logprobs(model, ids)
    return [float(lp[t]) for t in LABELS]


def test_causal_lm_adapters_match_peft_cold_cached_and_apart(causal) -> None:
    engine = _engine(causal["base"])
    assert engine.loras is not None
    engine.loras.load("a", causal["a"])
    engine.loras.load("b", causal["b"])
    assert engine.loras.get("b").scaling == pytest.approx(4 / 8**0.5)  # rslora
    prompts = _prompts(2, 30, seed=5)
    refs = {"a": causal["pa"], "b": causal["pb"], None: causal["hf"]}
    for name, ref in refs.items():
        res = engine.run([ScoreRequest(tuple(p), LABELS, lora=name) for p in prompts])
        for p, r in zip(prompts, res, strict=True):
            assert _delta(r.logprobs, _label_lp(ref, p)) <= 1e-4, name
    # The adapters change the answers (else the comparison above proves nothing).
    p = prompts[0]
    assert _delta(_label_lp(causal["pa"], p), _label_lp(causal["hf"], p)) > 1e-2
    assert _delta(_label_lp(causal["pb"], p), _label_lp(causal["pa"], p)) > 1e-2

    # A shared prefix under adapter a: computed once, then read from the cache by a's requests
    # only; the same tokens under b and the base model are computed cold.
    prefix = _prompts(1, 40, seed=6)[0]
    items = [prefix + t for t in _prompts(3, 8, seed=7)]
    first = engine.run(
        [ScoreRequest(tuple(x), LABELS, cache_prefix_len=len(prefix), lora="a") for x in items]
    )
    again = engine.run([ScoreRequest(tuple(items[1]), LABELS, cache_prefix_len=len(prefix), lora="a")])
    assert again[0].cached_tokens == len(prefix)
    assert _delta(again[0].logprobs, first[1].logprobs) <= 1e-5
    for name in ("b", None):
        other = engine.run([ScoreRequest(tuple(items[1]), LABELS, cache_prefix_len=len(prefix), lora=name)])
        assert other[0].cached_tokens == 0, name
        assert _delta(other[0].logprobs, _label_lp(refs[name], items[1])) <= 1e-4
    for x, r in zip(items, first, strict=True):
        assert _delta(r.logprobs, _label_lp(causal["pa"], x)) <= 1e-4
    assert engine.cache is not None
    engine.cache.check_integrity()


def test_a_step_of_several_adapters_runs_one_forward_each(causal) -> None:
    engine = _engine(causal["base"])
    assert engine.loras is not None
    engine.loras.load("a", causal["a"])
    engine.loras.load("b", causal["b"])
    prefix = _prompts(1, 30, seed=8)[0]
    ids = [prefix + t for t in _prompts(4, 6, seed=9)]
    names = ["a", "b", None, "a"]
    reqs = [
        ScoreRequest(tuple(x), LABELS, cache_prefix_len=len(prefix), lora=n)
        for x, n in zip(ids, names, strict=True)
    ]
    # The scheduler's batches hold one adapter: the first's.
    assert [i for i, _ in engine.batchable(reqs)] == [0, 3]
    forwards = engine.stats().forwards
    res = engine.step(reqs)
    assert engine.stats().forwards == forwards + 3
    refs = {"a": causal["pa"], "b": causal["pb"], None: causal["hf"]}
    for x, n, r in zip(ids, names, res, strict=True):
        assert _delta(r.logprobs, _label_lp(refs[n], x)) <= 1e-4


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3", "chunked"])
def test_other_architectures_and_the_chunked_runner(kind: str, causal, tmp_path) -> None:
    """Gemma's own layer code (norms after the projections) and Phi-3's fused qkv_proj /
    gate_up_proj targets; the chunked baseline runner applies adapters too."""
    from tests.engine.test_architectures import build

    if kind == "chunked":
        base, path, ref, mode = causal["base"], causal["a"], causal["pa"], "chunked"
    else:
        base, _ = build(kind, tmp_path)
        targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if kind == "phi3" else ALL
        auto = transformers.AutoModelForCausalLM
        path, ref = make_adapter(base, auto, tmp_path, "ad", seed=6, attn="eager", target_modules=targets)
        mode = "hybrid"
    engine = _engine(base, prefill_mode=mode)
    assert engine.loras is not None
    engine.loras.load("x", path)
    prefix = _prompts(1, 30, seed=15)[0]
    items = [prefix + t for t in _prompts(2, 6, seed=16)]
    reqs = [ScoreRequest(tuple(x), LABELS, cache_prefix_len=len(prefix), lora="x") for x in items]
    res = engine.run(reqs) + engine.run(reqs[:1])
    assert res[-1].cached_tokens == len(prefix)
    for x, r in zip([*items, items[0]], res, strict=True):
        assert _delta(r.logprobs, _label_lp(ref, x)) <= 1e-4


def test_bf16_cache_hit_under_an_adapter_equals_its_cold_run(causal) -> None:
    """In bf16 the adapter's updates round like the base projections: a multi-item hit over a
    cached prefix gives each item the bits of its cold run."""
    engine = _engine(causal["base"], dtype="bf16")
    assert engine.loras is not None
    engine.loras.load("a", causal["a"])
    prefix = _prompts(1, 40, seed=19)[0]
    items = [prefix + t for t in _prompts(3, 8, seed=20)]
    reqs = [ScoreRequest(tuple(x), LABELS, cache_prefix_len=len(prefix), lora="a") for x in items]
    cold, hit = engine.run(reqs), engine.run(reqs)
    assert [h.cached_tokens for h in hit] == [len(prefix)] * 3
    assert [c.logprobs for c in cold] == [h.logprobs for h in hit]
    assert _delta(cold[0].logprobs, _label_lp(causal["pa"], items[0])) <= 0.5  # bf16 of the same answer


def test_unloaded_adapter_is_refused_and_its_name_reloads_without_its_cache(causal) -> None:
    engine = _engine(causal["base"])
    assert engine.loras is not None
    engine.loras.load("a", causal["a"])
    x = tuple(_prompts(1, 30, seed=10)[0])
    engine.run([ScoreRequest(x, LABELS, cache_prefix_len=20, lora="a")])
    engine.loras.unload("a")
    with pytest.raises(LoRAError, match="'a' is not loaded"):
        engine.run([ScoreRequest(x, LABELS, lora="a")])
    engine.loras.load("a", causal["b"])  # the same name, other weights: nothing cached under it
    res = engine.run([ScoreRequest(x, LABELS, cache_prefix_len=20, lora="a")])
    assert res[0].cached_tokens == 0
    assert _delta(res[0].logprobs, _label_lp(causal["pb"], list(x))) <= 1e-4


def test_classifier_adapter_with_its_own_head_matches_peft(tmp_path) -> None:
    from tests.engine.test_heads import build_classifier, hf_logits

    base, hf = build_classifier("qwen2", tmp_path)
    path, pm = make_adapter(
        base, transformers.AutoModelForSequenceClassification, tmp_path, "cls", seed=3, task_type="SEQ_CLS"
    )
    engine = _engine(base)
    assert engine.loras is not None
    adapter = engine.loras.load("cls", path)
    assert adapter.score is not None
    prefix = _prompts(1, 30, seed=11)[0]
    items = [prefix + t for t in _prompts(3, 7, seed=12)]
    reqs = [ScoreRequest(tuple(x), pool=True, cache_prefix_len=len(prefix), lora="cls") for x in items]
    res = engine.run(reqs) + engine.run(reqs[:1])
    assert res[-1].cached_tokens == len(prefix)
    for x, r in zip([*items, items[0]], res, strict=True):
        assert _delta(r.outputs, hf_logits(pm, x)) <= 1e-4
    base_res = engine.run([ScoreRequest(tuple(items[0]), pool=True)])
    assert _delta(base_res[0].outputs, hf_logits(hf, items[0])) <= 1e-4  # the base head is back
    assert _delta(base_res[0].outputs, res[0].outputs) > 1e-2


def test_embedder_adapter_matches_peft(tmp_path) -> None:
    from tests.engine.test_embeddings import build_embedder, hf_embedding

    base, hf = build_embedder("qwen3", tmp_path, "lasttoken", True)
    path, pm = make_adapter(
        base, transformers.AutoModel, tmp_path, "emb", seed=4, task_type="FEATURE_EXTRACTION"
    )
    engine = _engine(base)
    assert engine.loras is not None and engine.task.kind == "embed"
    engine.loras.load("emb", path)
    prompts = _prompts(3, 25, seed=13)
    res = engine.run([ScoreRequest(tuple(p), pool=True, lora="emb") for p in prompts])
    for p, r in zip(prompts, res, strict=True):
        assert _delta(r.outputs, hf_embedding(pm, p, "lasttoken", True)) <= 1e-4
        assert _delta(r.outputs, hf_embedding(hf, p, "lasttoken", True)) > 1e-3


def _copy(src: Path, dst: Path, edit: Callable[[dict], None] | None = None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / lora.CONFIG_FILE).read_text())
        edit(cfg)
        (dst / lora.CONFIG_FILE).write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_at_load_naming_the_problem(causal, tmp_path, tiny_model) -> None:
    engine = _engine(causal["base"], max_loras=2, max_lora_rank=8)
    assert engine.loras is not None
    good = causal["a"]
    cases: list[tuple[Path, str]] = [
        (tmp_path / "nowhere", "does not exist"),
        (_copy(good, tmp_path / "rank", lambda c: c.update(r=6)), r"config's rank r is 6"),
        (_copy(good, tmp_path / "dora", lambda c: c.update(use_dora=True)), "DoRA"),
        (_copy(good, tmp_path / "head", lambda c: c.update(target_modules=["q_proj", "lm_head"])), "lm_head"),
        (
            _copy(good, tmp_path / "save", lambda c: c.update(modules_to_save=["embed_tokens"])),
            "modules_to_save",
        ),
        (_copy(good, tmp_path / "big", lambda c: c.update(r=16)), "--max-lora-rank"),
    ]
    no_weights = _copy(good, tmp_path / "noweights")
    (no_weights / lora.WEIGHTS_FILE).unlink()
    cases.append((no_weights, lora.WEIGHTS_FILE))
    no_config = _copy(good, tmp_path / "noconfig")
    (no_config / lora.CONFIG_FILE).unlink()
    cases.append((no_config, lora.CONFIG_FILE))
    # An adapter made for another base model (Qwen3's head_dim 24: other q/k/v sizes).
    other, _ = make_adapter(
        tiny_model("qwen3")[0], transformers.AutoModelForCausalLM, tmp_path, "other", seed=5
    )
    cases.append((other, r"maps 64 inputs to \d+ outputs"))
    for path, why in cases:
        with pytest.raises(LoRAError, match=why):
            engine.loras.load("x", path)
        assert engine.loras.names() == []  # nothing half-loaded
    with pytest.raises(LoRAError, match="not loaded"):
        engine.validate(ScoreRequest((1, 2, 3), lora="x"))
    engine.loras.load("a", good)
    with pytest.raises(LoRAError, match="already loaded"):
        engine.loras.load("a", good)
    engine.loras.load("b", causal["b"])
    with pytest.raises(LoRAError, match="--max-loras"):
        engine.loras.load("c", good)
    plain = Engine.from_pretrained(causal["base"], dtype="fp32")
    with pytest.raises(LoRAError, match="--enable-lora"):
        plain.validate(ScoreRequest((1, 2, 3), lora="a"))
    from po_backend.engine.hf_scorer import HFScorer

    with pytest.raises(LoRAError, match="backend hf"):  # never the base model in its place
        HFScorer.from_pretrained(causal["base"], dtype="fp32").validate(ScoreRequest((1, 2, 3), lora="a"))


def test_adapter_memory_is_set_aside_from_the_budget(causal) -> None:
    budget = 64 << 20
    plain = Engine.from_pretrained(causal["base"], dtype="fp32", memory_budget=budget)
    with_lora = _engine(causal["base"], memory_budget=budget, chunk_size=None, max_loras=3, max_lora_rank=8)
    task = plain.task
    want = lora.reserve_bytes(plain.model_config, task, torch.float32, 3, 8, plain.config.chunk_size)
    assert with_lora.activation_budget - plain.activation_budget == want
    assert plain.cache is not None and with_lora.cache is not None
    assert with_lora.cache.pool.num_total < plain.cache.pool.num_total
    # What any adapter within the limits takes fits what was set aside for one.
    assert with_lora.loras is not None
    b = with_lora.loras.load("b", causal["b"])
    assert b.nbytes * 3 <= want
    with pytest.raises(CapacityError):
        _engine(causal["base"], memory_budget=budget, max_loras=10_000, max_lora_rank=64)


def _engage(**kw: object):  # noqa: ANN202
    import po_lang as po

    @po.classify(labels=["Yes", "No"], **kw)
    def engage(profile: str, post: str) -> po.Prompt:
        return po.shared(f"User profile:\n{profile}\n") + f"Post: {post}\nWill the user engage? Answer:"

    return engage


def _dsl_reference(causal, tokenized_llama: Path, engage) -> dict[str | None, list[float]]:  # noqa: ANN001
    """PEFT's (and transformers') label log-probs of the compiled program, per adapter."""
    program = engage.compile("likes cats", "a cat video")
    (req,) = program.requests
    refs = {"a": causal["pa"], "b": causal["pb"], None: causal["hf"]}
    lp = {name: hf_next_logprobs(m, list(req.input_ids)) for name, m in refs.items()}
    return {name: [float(v[t]) for t in req.label_token_ids] for name, v in lp.items()}


def test_dsl_local_and_classify_choose_the_adapter(causal, tokenized_llama) -> None:
    import po_lang as po
    from po_lang.errors import BackendError

    loras = {"a": str(causal["a"]), "b": str(causal["b"])}
    with po.Local(tokenized_llama, dtype="fp32", lora_paths=loras, max_lora_rank=8, lora="a") as local:
        want = _dsl_reference(causal, tokenized_llama, _engage(backend=local))
        for kw, name in (({}, "a"), ({"lora": "b"}, "b")):
            got = _engage(backend=local, **kw)("likes cats", "a cat video")
            assert _delta(list(got.logprobs.values()), want[name]) <= 1e-4, name
        assert _delta(want["a"], want[None]) > 1e-2
        bad = _engage(backend=local, lora="nope")
        with pytest.raises(BackendError, match="'nope' is not loaded"):
            bad("likes cats", "a cat video")


def test_sglang_engine_in_process(causal, tokenized_llama) -> None:
    """SGLang's Python Engine: lora_paths at creation, lora_path per score call, load / unload."""
    from po_backend.compat.sglang import Engine as SGLangEngine

    query, item = _prompts(1, 30, seed=17)[0], _prompts(1, 6, seed=18)[0]
    with SGLangEngine(model_path=str(tokenized_llama), dtype="fp32", lora_paths=[f"a={causal['a']}"]) as eng:
        for name, ref in (("a", causal["pa"]), (None, causal["hf"])):
            out = eng.score(query=query, items=[item], label_token_ids=list(LABELS), lora_path=name)
            assert _delta([math.log(p) for p in out[0]], _label_lp(ref, query + item)) <= 1e-4
        eng.load_lora_adapter("b", str(causal["b"]))
        out = eng.score(query=query, items=[item], label_token_ids=list(LABELS), lora_path="b")
        assert _delta([math.log(p) for p in out[0]], _label_lp(causal["pb"], query + item)) <= 1e-4
        eng.unload_lora_adapter("b")
        with pytest.raises(LoRAError, match="'b' is not loaded"):
            eng.score(query=query, items=[item], label_token_ids=list(LABELS), lora_path="b")


# ---- over HTTP: start-up adapters, load / unload routes, the adapter chosen per request ---------


@pytest.mark.slow
def test_server_routes_and_per_request_adapter(causal, tokenized_llama, tmp_path) -> None:
    import httpx

    from tests.server_utils import ServerProcess, error_message

    flags = ["--model-path", str(tokenized_llama), "--dtype", "fp32", "--max-input-len", "256"]
    flags += ["--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    flags += ["--lora-modules", f"a={causal['a']}"]  # vLLM's name of --lora-paths
    ids = _prompts(1, 40, seed=14)[0]

    def generate(url: str, **extra: object) -> dict:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        body |= {"token_ids_logprob": list(LABELS), "cache_prefix_len": 30, **extra}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    def labels(meta: dict) -> list[float]:
        return [e[0] for e in meta["output_token_ids_logprobs"][0]]

    def completion(url: str, model: str) -> list[float]:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "logprobs": 3, "echo": False}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["token_logprobs"]  # the greedy token's

    def top1(model: torch.nn.Module) -> list[float]:
        return [float(hf_next_logprobs(model, ids).max())]

    with ServerProcess(flags) as proc:
        url = proc.url
        cards = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        assert cards["a"]["parent"] == "tiny" and cards["a"]["root"] == str(causal["a"])
        assert httpx.get(url + "/v1/models/a", timeout=10).json()["parent"] == "tiny"

        # SGLang's lora_path (by name or by path) and the base model; a cache hit only under a.
        cold = generate(url, lora_path="a")
        assert cold["cached_tokens"] == 0
        assert _delta(labels(cold), _label_lp(causal["pa"], ids)) <= 1e-4
        hit = generate(url, lora_path=str(causal["a"]))
        assert hit["cached_tokens"] == 30 and _delta(labels(hit), labels(cold)) <= 1e-5
        base = generate(url)
        assert base["cached_tokens"] == 0
        assert _delta(labels(base), _label_lp(causal["hf"], ids)) <= 1e-4

        # vLLM's load route, then the adapter's name as `model` (OpenAI's client shape).
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(causal["b"])})
        assert r.status_code == 200 and "b" in r.text
        b_meta = generate(url, lora_path="b")
        assert b_meta["cached_tokens"] == 0  # what a cached is not b's
        assert _delta(labels(b_meta), _label_lp(causal["pb"], ids)) <= 1e-4
        assert _delta(completion(url, "b"), top1(causal["pb"])) <= 1e-4
        assert _delta(completion(url, "a"), top1(causal["pa"])) <= 1e-4
        assert _delta(completion(url, "tiny"), top1(causal["hf"])) <= 1e-4

        # Refusals: the limit, a bad folder, an unknown adapter, several adapters in one call.
        bad_dir = _copy(causal["a"], tmp_path / "bad", lambda c: c.update(use_dora=True))
        for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            r = httpx.post(url + route, json={"lora_name": "c", "lora_path": str(bad_dir)})
            assert r.status_code == 400 and "max-loras" in error_message(r)
        assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": str(bad_dir)})
        assert r.status_code == 400 and "DoRA" in error_message(r)
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 400 and "not loaded" in error_message(r)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "lora_path": "b"}
        r = httpx.post(url + "/generate", json=body)
        assert r.status_code == 400 and "'b' is not loaded" in error_message(r)
        r = httpx.post(url + "/generate", json={**body, "input_ids": [ids, ids], "lora_path": ["a", None]})
        assert r.status_code == 400 and "one adapter per call" in error_message(r)
        assert [c["id"] for c in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny", "a"]

        # po.Remote passes the adapter as lora_path: its own default, or the classifier's.
        import po_lang as po

        remote = po.Remote(url, lora="a")
        want = _dsl_reference(causal, tokenized_llama, _engage(backend=remote))
        got = _engage(backend=remote)("likes cats", "a cat video")
        assert _delta(list(got.logprobs.values()), want["a"]) <= 1e-4
        base = _engage(backend=po.Remote(url))("likes cats", "a cat video")
        assert _delta(list(base.logprobs.values()), want[None]) <= 1e-4


@pytest.mark.slow
def test_server_refuses_to_start_with_a_bad_adapter(causal, tmp_path) -> None:
    import subprocess
    import sys

    from tests.server_utils import REPO_ROOT

    bad_dir = _copy(causal["a"], tmp_path / "bad", lambda c: c.update(r=6))
    command = [
        sys.executable,
        "-m",
        "po_backend.entrypoints.launch_server",
        "--model-path",
        str(causal["base"]),
    ]
    command += ["--dtype", "fp32", "--max-input-len", "128", "--lora-paths", f"bad={bad_dir}", "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "config's rank r is 6" in done.stderr and "Traceback" not in done.stderr
