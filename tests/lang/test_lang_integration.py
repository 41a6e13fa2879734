"""po_lang on the real engine: a tiny random-weight Llama with a tiny trained BPE tokenizer."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import po_lang as po
from po_backend import Engine
from po_backend.core.request import ScoreRequest
from po_backend.serving.loop import LoopClosedError
from tests.conftest import hf_next_logprobs
from tests.tiny_tokenizer import CHATML, PATTERN, build_tokenizer  # noqa: F401  (re-exported)


@pytest.fixture(scope="module")
def engine(tokenized_llama: Path) -> Engine:
    eng = Engine.from_pretrained(tokenized_llama, dtype="fp32", max_input_len=128)
    assert eng.tokenizer is not None and len(eng.tokenizer) <= eng.vocab_size
    return eng


@pytest.fixture(scope="module")
def backend(engine: Engine) -> po.Local:
    return po.Local.from_engine(engine)


def engage(backend: po.Backend, **kw: object) -> po.Classifier:
    @po.classify(labels=["Yes", "No"], backend=backend, **kw)
    def will_engage(profile: str, post: str) -> po.Prompt:
        return po.shared(f"User profile:\n{profile}\n") + f"Post: {post}\nWill the user engage? Answer:"

    return will_engage


def test_classify_equals_engine_score(engine: Engine, backend: po.Local, tiny_model) -> None:
    tok = engine.tokenizer
    f = engage(backend)
    r = f("likes cats", "a cat video")
    shared = tok.encode("User profile:\nlikes cats\n")  # BOS + shared text
    ids = shared + tok.encode("Post: a cat video\nWill the user engage? Answer:", add_special_tokens=False)
    labels = [tok.encode(" Yes", add_special_tokens=False), tok.encode(" No", add_special_tokens=False)]
    assert all(len(x) == 1 for x in labels) and labels[0] != tok.encode("Yes", add_special_tokens=False)
    prog = f.compile("likes cats", "a cat video")
    assert list(prog.prompt.ids) == ids and prog.prompt.cache_prefix_len == len(shared)
    (ref,) = engine.score([ids], [x[0] for x in labels])
    assert list(r.logprobs.values()) == pytest.approx(ref.logprobs, abs=1e-5)
    _, hf = tiny_model("llama")
    want = hf_next_logprobs(hf, ids)[[x[0] for x in labels]].tolist()
    assert list(r.logprobs.values()) == pytest.approx(want, abs=1e-4)
    assert r.prompt_tokens == len(ids) and sum(r.probs.values()) == pytest.approx(1.0)


def test_chat_classify_equals_engine_score(engine: Engine, backend: po.Local) -> None:
    tok = engine.tokenizer
    f = engage(backend, chat=True, system="Be brief.")
    r = f("likes cats", "a cat video")
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": "User profile:\nlikes cats\nPost: a cat video\nWill the user engage? Answer:",
        },
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    prog = f.compile("likes cats", "a cat video")
    assert list(prog.prompt.ids) == ids
    head = tok.encode(text[: text.index("User profile")], add_special_tokens=False)
    assert prog.prompt.cache_prefix_len == len(head) + len(
        tok.encode("User profile:\nlikes cats\n", add_special_tokens=False)
    )
    yes, no = (tok.encode(x, add_special_tokens=False) for x in ("Yes", "No"))  # no leading space
    (ref,) = engine.score([ids], [yes[0], no[0]])
    assert list(r.logprobs.values()) == pytest.approx(ref.logprobs, abs=1e-5)


def test_map_equals_repeated_calls(backend: po.Local) -> None:
    f = engage(backend, batch_size=3)
    rows = [("likes cats", f"post {i}") for i in range(4)] + [{"profile": "hates dogs", "post": "a dog"}]
    rows.insert(2, ("likes cats", "long " * 200))  # over max_input_len=128: fails alone
    results = f.map(rows)
    assert isinstance(results[2], po.Failed) and "PromptTooLongError" in str(results[2].error)
    for row, r in zip(rows, results, strict=True):
        if isinstance(r, po.Failed):
            continue
        single = f(**row) if isinstance(row, dict) else f(*row)
        assert r.logprobs == pytest.approx(single.logprobs, abs=1e-5)
        assert r.label == single.label


def test_rank_orders_by_label_probability(backend: po.Local) -> None:
    f = engage(backend, chat=True)
    posts = ["a cat video", "a dog", "tax news", "cats and dogs", "a movie"]
    ranked = po.rank(f, posts, label="Yes", profile="likes cats")
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    for r in ranked:
        assert r.score == pytest.approx(f("likes cats", r.item).probs["Yes"], abs=1e-6)


@pytest.mark.parametrize("method", ["sum", "mean"])
def test_multi_token_matches_manual_sum(engine: Engine, backend: po.Local, method: str) -> None:
    labels = ["very good", "bad", "so so"]

    @po.classify(labels=labels, multi_token=True, choices_method=method, backend=backend)
    def rate(review: str) -> po.Prompt:
        return po.shared("Review:") + f" {review}\nSentiment:"

    r = rate("the movie was great.")
    prog = rate.compile("the movie was great.")
    prompt = list(prog.prompt.ids)
    assert any(len(c) > 1 for c in prog.label_ids)
    for label, cont in zip(labels, prog.label_ids, strict=True):
        # Independent path: one next-token score per continuation prefix.
        steps = [engine.score([prompt + list(cont[:k])], [cont[k]])[0].logprobs[0] for k in range(len(cont))]
        want = sum(steps) / (len(cont) if method == "mean" else 1)
        assert r.logprobs[label] == pytest.approx(want, abs=1e-4)


def test_content_free_calibration_on_the_engine(backend: po.Local) -> None:
    f = engage(backend, calibrate="content-free")
    assert f("likes cats", "N/A").probs["Yes"] == pytest.approx(0.5, abs=1e-6)
    r, raw = f("likes cats", "a cat video"), engage(backend)("likes cats", "a cat video")
    assert r.logprobs == pytest.approx(raw.logprobs, abs=1e-6)


@pytest.mark.embedded
def test_embedded_sentiment_smoke() -> None:
    backend = po.Local("embedded")

    @po.classify(labels=["positive", "negative"], chat=True, backend=backend)
    def sentiment(review: str) -> str:
        return f"Classify the sentiment of this review as positive or negative.\nReview: {review}"

    prog = sentiment.compile("Great film.")
    assert prog.label_ids == ((16185,), (17728,))  # no leading space after "assistant\n"
    plain = po.classify(labels=["positive", "negative"], backend=backend)(
        lambda r: f"Review: {r}\nSentiment:"
    )
    assert plain.compile("x").label_ids == ((2731,), (3524,))  # " positive", " negative"
    results = sentiment.map([("A wonderful, moving film.",), ("Dull and far too long.",), ("I loved it.",)])
    for r in results:
        assert isinstance(r, po.Classification) and sum(r.probs.values()) == pytest.approx(1.0)
    assert results[0].probs["positive"] > results[1].probs["positive"]


# ---- the local path goes through the scheduler ---------------------------------------------------

LONG_PROFILE = "likes cats and dogs, " * 6  # family A: long shared prefix, submitted first
SHORT_PROFILE = "hates dogs"  # family B: short shared prefix, submitted second
POSTS = ["a cat video", "a dog", "cats and dogs", "a movie"]


def _families(f: po.Classifier) -> dict[int, str]:
    """Prompt length -> family, to read the family of each item of a step log."""
    lengths = {
        fam: {len(f.compile(profile, post).prompt.ids) for post in POSTS}
        for fam, profile in (("A", LONG_PROFILE), ("B", SHORT_PROFILE))
    }
    assert not lengths["A"] & lengths["B"], "the test needs the families' lengths apart"
    return {n: fam for fam, ns in lengths.items() for n in ns}


def _scheduled_map(engine: Engine, policy: str) -> tuple[list[list[str]], list[po.Classification]]:
    """Map interleaved rows (A, B, A, B, ...) on a cold cache; the family of every item of every
    step, in the order the loop ran them, and the results."""
    engine.flush_cache()
    with po.Local.from_engine(engine, policy=policy) as local:
        f = engage(local)
        rows = [(profile, post) for post in POSTS for profile in (LONG_PROFILE, SHORT_PROFILE)]
        results = f.map(rows)
        family = _families(f)
        steps = [[family[n] for n, _ in s.items] for s in local.loop.step_log()]
    assert all(isinstance(r, po.Classification) for r in results)
    return steps, results  # type: ignore[return-value]


def test_local_map_is_ordered_by_the_scheduler(engine: Engine) -> None:
    po_steps, po_results = _scheduled_map(engine, "po")
    # Prefix-aware SRJF: family B's shorter requests first although A's were submitted first;
    # one forward per family: its first request computes the prefix, the rest read it from it.
    assert po_steps == [["B"] * 4, ["A"] * 4]
    fcfs_steps, fcfs_results = _scheduled_map(engine, "fcfs")
    assert fcfs_steps[0][0] == "A", "fcfs starts with the first submitted request"
    assert fcfs_steps != po_steps
    # The order changes nothing in the answers: they equal the engine run directly.
    engine.flush_cache()
    with po.Local.from_engine(engine) as local:
        progs = [
            engage(local).compile(profile, post)
            for post in POSTS
            for profile in (LONG_PROFILE, SHORT_PROFILE)
        ]
    reqs = [
        ScoreRequest(tuple(r.input_ids), tuple(r.label_token_ids), cache_prefix_len=r.cache_prefix_len)
        for p in progs
        for r in p.requests
    ]
    direct = engine.run(reqs)
    for res_po, res_fcfs, ref in zip(po_results, fcfs_results, direct, strict=True):
        assert list(res_po.logprobs.values()) == pytest.approx(ref.logprobs, abs=1e-5)
        assert list(res_fcfs.logprobs.values()) == pytest.approx(ref.logprobs, abs=1e-5)
    assert any(r.cached_tokens > 0 for r in po_results), "sharers read the prefix from the cache"


def test_local_loop_stops_on_close_and_collection(engine: Engine) -> None:
    def loop_threads() -> int:
        return sum(t.name == "po-engine-loop" and t.is_alive() for t in threading.enumerate())

    before = loop_threads()
    with po.Local.from_engine(engine) as local:
        engage(local)("likes cats", "a cat video")
        loop = local.loop
        assert loop_threads() == before + 1
    assert loop_threads() == before
    with pytest.raises(LoopClosedError):
        loop.submit(ScoreRequest((1, 2, 3), (4,)))
    assert engage(local)("likes cats", "a dog").prompt_tokens > 0, "a closed Local starts a new loop"
    assert loop_threads() == before + 1
    del local
    gc.collect()
    assert loop_threads() == before, "the finalizer stops the loop of a collected Local"


@pytest.mark.slow
def test_local_exits_cleanly_without_close(engine: Engine) -> None:
    """A Local left open at interpreter exit must not hang it (the finalizer stops the loop)."""
    code = (
        "import po_lang as po\n"
        f"local = po.Local({str(engine.model_path)!r}, dtype='fp32', max_input_len=128)\n"
        "f = po.classify(labels=['Yes', 'No'], backend=local)(lambda p: f'Post: {p}\\nAnswer:')\n"
        "print(len(f.map([('a',), ('b',)])))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
