"""po_lang compiler and API tests on the deterministic Fake backend (no model, no torch needed)."""

from __future__ import annotations

import inspect
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import po_lang as po
from po_lang import context
from po_lang.calibration import (
    accuracy,
    content_free_offsets,
    fit_offsets,
    log_softmax,
    mean_nll,
    softmax,
)
from po_lang.compiler import ClassifySpec, label_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake() -> po.Fake:
    return po.Fake(seed=1)


def engage(backend: po.Backend, **kw: object) -> po.Classifier:
    @po.classify(labels=["Yes", "No"], backend=backend, **kw)
    def will_engage(profile: str, post: str) -> po.Prompt:
        """Will this user engage with this post?"""
        return po.shared(f"User profile:\n{profile}\n") + f"Post: {post}\nWill the user engage? Answer:"

    return will_engage


# ---- import hygiene ---------------------------------------------------------------------------


def test_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import po_lang as po\n"
        "f = po.classify(labels=['Yes', 'No'], backend=po.Fake())(lambda x: po.shared('Q: ') + x + ' A:')\n"
        "print(f('hi').label in ('Yes', 'No'))\n"
        "po.Local('embedded'); po.Remote('http://127.0.0.1:1')\n"
        # po_lang may use torch-free po_backend modules (labels, request), never the engine.
        "assert 'po_backend.engine.engine' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


# ---- IR ---------------------------------------------------------------------------------------


def test_prompt_ir_building() -> None:
    p = po.shared("A") + "b" + "c"
    assert p.segments == (po.Segment("A", shared=True), po.Segment("bc"))
    assert p.text == "Abc" and p.shared_text == "A" and str(p) == "Abc"
    assert ("" + po.shared("A")).segments == (po.Segment("A", True),)
    nested = po.shared("I") + po.shared("P") + "x"
    assert [s.shared for s in nested.segments] == [True, True, False]
    assert po.shared(po.shared("a") + "b").shared_text == "ab"
    with pytest.raises(po.PromptError, match="must lead the prompt"):
        _ = "intro " + po.shared("profile")
    with pytest.raises(po.PromptError, match="must lead"):
        _ = po.shared("a") + "b" + po.shared("c")
    with pytest.raises(po.PromptError, match="f-string"):
        _ = f"{po.shared('a')} b"
    with pytest.raises(TypeError):
        po.shared(3)  # type: ignore[arg-type]


def test_function_must_return_prompt(fake: po.Fake) -> None:
    f = po.classify(labels=["Yes", "No"], backend=fake)(lambda: 3)
    with pytest.raises(TypeError, match="must return a str"):
        f()


# ---- prefix boundary --------------------------------------------------------------------------


def test_cache_prefix_is_the_shared_tokens(fake: po.Fake) -> None:
    f = engage(fake)
    prog = f.compile("likes cats", "a cat video")
    shared_ids = fake.tokenize("User profile:\nlikes cats\n")  # with BOS, as the prompt starts
    assert prog.prompt.cache_prefix_len == len(shared_ids)
    assert prog.prompt.ids[: len(shared_ids)] == tuple(shared_ids)
    (req,) = prog.requests
    assert req.cache_prefix_len == len(shared_ids) and req.input_ids == prog.prompt.ids
    bos = fake.token_id("<s>")
    assert prog.prompt.ids.count(bos) == 1 and prog.prompt.ids[0] == bos  # BOS only at the start
    # Nothing shared: no cache hint.
    plain = po.classify(labels=["Yes", "No"], backend=fake)(lambda x: f"Q: {x} A:")
    assert plain.compile("hi").prompt.cache_prefix_len is None


def test_prefix_survives_merges_across_the_boundary(fake: po.Fake) -> None:
    """Tokenised whole, 'profile' + 's are' would become one word; segments never merge."""

    @po.classify(labels=["Yes", "No"], backend=fake)
    def f(rest: str) -> po.Prompt:
        return po.shared("the profile") + rest

    a, b = f.compile("s are long. Answer:"), f.compile(" is long. Answer:")
    n = a.prompt.cache_prefix_len
    assert n == b.prompt.cache_prefix_len == len(fake.tokenize("the profile"))
    assert a.prompt.ids[:n] == b.prompt.ids[:n]
    assert fake.tokenize("the profiles are") != fake.tokenize("the profile") + fake.tokenize(
        "s are", add_special_tokens=False
    )


@settings(max_examples=60, deadline=None)
@given(shared=st.text(min_size=1, max_size=30), rest=st.text(max_size=30))
def test_shared_ids_are_a_prefix_property(shared: str, rest: str) -> None:
    fake = po.Fake(vocab_size=100_000)
    f = po.classify(labels=["Yes", "No"], backend=fake)(lambda r: po.shared(shared) + r + " Answer:")
    prog = f.compile(rest)
    ref = fake.tokenize(shared)
    assert prog.prompt.cache_prefix_len == len(ref)
    assert prog.prompt.ids[: len(ref)] == tuple(ref)


def test_nested_shared_segments_are_stable(fake: po.Fake) -> None:
    @po.classify(labels=["Yes", "No"], backend=fake)
    def f(profile: str, post: str) -> po.Prompt:
        return po.shared("Rules: be fair.") + po.shared(profile) + f"\n{post} Answer:"

    a, b = f.compile("alice", "p1"), f.compile("bob", "p2")
    rules = fake.tokenize("Rules: be fair.")
    assert a.prompt.ids[: len(rules)] == b.prompt.ids[: len(rules)] == tuple(rules)


# ---- labels -----------------------------------------------------------------------------------


def test_label_leading_space_rules(fake: po.Fake) -> None:
    def ids(text: str) -> tuple[int, ...]:
        return tuple(fake.tokenize(text, add_special_tokens=False))

    after_colon = engage(fake).compile("p", "q")
    assert after_colon.label_ids == (ids(" Yes"), ids(" No"))
    newline = po.classify(labels=["Yes", "No"], backend=fake)(lambda x: x + "\nAnswer:\n")
    assert newline.compile("q").label_ids == (ids("Yes"), ids("No"))
    forced = po.classify(labels=["Yes", "No"], backend=fake, leading_space=False)(lambda x: x + " A:")
    assert forced.compile("q").label_ids == (ids("Yes"), ids("No"))
    assert label_text(" Yes", "A:", None) == " Yes"  # an explicit space is kept as is
    assert label_text("Yes", "", None) == "Yes"
    assert ids(" Yes") != ids("Yes")  # the rule matters on this tokenizer


def test_label_that_merges_with_the_prompt_end(fake: po.Fake) -> None:
    f = po.classify(labels=["Yes", "No"], backend=fake, leading_space=False)(lambda x: x + " Answer")
    with pytest.raises(po.LabelError, match="merges with the end of the prompt"):
        f.compile("q")


def test_ambiguous_and_multi_token_labels_error(fake: po.Fake) -> None:
    shared_first = po.classify(labels=["very good", "very bad"], backend=fake)(lambda x: x + " A:")
    with pytest.raises(po.LabelError, match="multi_token=True"):
        shared_first.compile("q")
    long_label = po.classify(labels=["good day", "bad"], backend=fake)(lambda x: x + " A:")
    with pytest.raises(po.LabelError, match=r"'good day' is 2 tokens.*multi_token=True"):
        long_label("q")
    # Two different strings that are the same first token (a space variant) are ambiguous too.
    same = po.classify(labels=["Yes", " Yes"], backend=fake)(lambda x: x + " A:")
    with pytest.raises(po.LabelError, match="both start with token"):
        same.compile("q")


def test_spec_validation() -> None:
    with pytest.raises(po.LabelError):
        ClassifySpec(labels=("Yes",))
    with pytest.raises(po.LabelError):
        ClassifySpec(labels=("Yes", "Yes"))
    with pytest.raises(po.LabelError):
        ClassifySpec(labels="YN")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multi_token"):
        ClassifySpec(labels=("a", "b"), choices_method="mean")
    with pytest.raises(ValueError, match="chat=True"):
        ClassifySpec(labels=("a", "b"), system="hi")
    with pytest.raises(ValueError, match="calibrate"):
        po.classify(labels=["a", "b"], calibrate="platt")(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["sum", "mean"])
def test_multi_token_scoring(fake: po.Fake, method: str) -> None:
    labels = ["very good", "very bad", "ok"]

    @po.classify(labels=labels, backend=fake, multi_token=True, choices_method=method)
    def rate(review: str) -> po.Prompt:
        return po.shared("Rate the review.\n") + f"Review: {review}\nRating:"

    prog = rate.compile("great stuff")
    p = prog.prompt.ids
    for req, cont in zip(prog.requests, prog.label_ids, strict=True):
        assert req.input_ids == p + cont
        assert req.logprob_start_len == len(p) - 1 and req.cache_prefix_len == len(p) - 1
        assert req.label_token_ids == ()
    r = rate("great stuff")
    for label, cont in zip(labels, prog.label_ids, strict=True):
        full = p + cont
        want = sum(fake.logprobs(full[:i])[full[i]] for i in range(len(p), len(full)))
        if method == "mean":
            want /= len(cont)
        assert r.logprobs[label] == pytest.approx(want, abs=1e-12)
    assert r.probs == pytest.approx(dict(zip(labels, softmax(list(r.logprobs.values())), strict=True)))
    assert r.prompt_tokens == len(p)
    # The variants after the first reuse the cached prompt but its last token, which scores
    # their first label token (as on the engine, whose match stops before it).
    assert r.cached_tokens == len(p) - 1


def test_single_token_result_matches_backend(fake: po.Fake) -> None:
    f = engage(fake)
    prog = f.compile("likes cats", "a cat video")
    r = f("likes cats", "a cat video")
    lp = fake.logprobs(prog.prompt.ids)
    want = [lp[c[0]] for c in prog.label_ids]
    assert list(r.logprobs.values()) == pytest.approx(want, abs=1e-12)
    assert sum(r.probs.values()) == pytest.approx(1.0)
    assert r.label == max(r.probs, key=r.probs.__getitem__) and r[r.label] == r.probs[r.label]
    assert r.prompt_tokens == len(prog.prompt.ids)
    with pytest.raises(AttributeError):
        r.label = "No"  # type: ignore[misc]


# ---- chat templates ---------------------------------------------------------------------------


def test_chat_template_keeps_the_shared_prefix(fake: po.Fake) -> None:
    f = engage(fake, chat=True, system="Be brief.")
    prog = f.compile("likes cats", "a cat video")
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": "User profile:\nlikes cats\nPost: a cat video\nWill the user engage? Answer:",
        },
    ]
    text = fake.chat_template(messages)
    assert prog.prompt.text == text
    assert prog.prompt.ids == tuple(fake.tokenize(text, add_special_tokens=False))
    head = text[: text.index("User profile")]
    shared_ids = fake.tokenize(head, add_special_tokens=False) + fake.tokenize(
        "User profile:\nlikes cats\n", add_special_tokens=False
    )
    assert prog.prompt.cache_prefix_len == len(shared_ids)
    assert prog.prompt.ids[: len(shared_ids)] == tuple(shared_ids)
    # After "assistant\n" the labels carry no leading space.
    assert prog.label_ids == (tuple(fake.tokenize("Yes", add_special_tokens=False)),) + (
        tuple(fake.tokenize("No", add_special_tokens=False)),
    )
    # Without po.shared the template head (system message) is still a shared prefix.
    plain = po.classify(labels=["Yes", "No"], backend=fake, chat=True, system="Be brief.")(lambda x: x)
    assert plain.compile("hello").prompt.cache_prefix_len == len(
        fake.tokenize(head, add_special_tokens=False)
    )


def test_chat_template_that_rewrites_content(fake: po.Fake) -> None:
    upper = po.Fake(chat_template="{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}")
    f = po.classify(labels=["Yes", "No"], backend=upper, chat=True)(lambda x: x)
    with pytest.raises(po.PromptError, match="verbatim"):
        f("hi")


# ---- map --------------------------------------------------------------------------------------


def test_map_keeps_order_and_matches_calls(fake: po.Fake) -> None:
    f = engage(fake, batch_size=3)
    rows = [{"profile": f"user{i % 2}", "post": f"post {i}"} for i in range(7)] + [("user1", "last")]
    results = f.map(rows)
    assert len(results) == len(rows)
    for row, r in zip(rows, results, strict=True):
        single = f(**row) if isinstance(row, dict) else f(*row)
        assert isinstance(r, po.Classification)
        assert r.probs == pytest.approx(single.probs) and r.logprobs == pytest.approx(single.logprobs)


def test_map_groups_requests_by_shared_prefix(fake: po.Fake) -> None:
    f = engage(fake, batch_size=100)
    rows = [(f"user{i % 3}", f"post {i}") for i in range(9)]
    f.map(rows)
    (batch,) = fake.batches
    prefixes = [r.input_ids[: r.cache_prefix_len] for r in batch]
    runs = [k for k, _ in itertools.groupby(prefixes)]
    assert len(runs) == 3  # each prefix contiguous
    fake.batches.clear()
    engage(fake, batch_size=2).map(rows)
    assert [len(b) for b in fake.batches] == [2, 2, 2, 2, 1]


def test_map_reports_errors_per_item() -> None:
    fake = po.Fake(seed=2, max_input_len=25)

    @po.classify(labels=["Yes", "No"], backend=fake)
    def f(x: str) -> po.Prompt:
        if x == "boom":
            raise RuntimeError("bad row")
        return po.shared("Q:") + f" {x} A:"

    rows = [("a",), ("boom",), ("long " * 40,), 7, {"y": 1}, ("b",)]
    results = f.map(rows)  # type: ignore[arg-type]
    assert [type(r).__name__ for r in results] == [
        "Classification",
        "Failed",
        "Failed",
        "Failed",
        "Failed",
        "Classification",
    ]
    assert [r.index for r in results if isinstance(r, po.Failed)] == [1, 2, 3, 4]
    assert isinstance(results[1].error, RuntimeError)
    assert isinstance(results[2].error, po.BackendError) and "max_input_len" in str(results[2].error)
    assert isinstance(results[3].error, TypeError) and isinstance(results[4].error, TypeError)
    assert results[0].probs == pytest.approx(f("a").probs)
    with pytest.raises(po.BackendError, match="max_input_len"):
        f("long " * 40)


def test_map_progress_bar(fake: po.Fake, capsys: pytest.CaptureFixture[str]) -> None:
    engage(fake).map([("u", f"p{i}") for i in range(3)], progress=True)
    assert "3/3" in capsys.readouterr().err


# ---- rank -------------------------------------------------------------------------------------


def test_rank_orders_by_label_probability(fake: po.Fake) -> None:
    f = engage(fake)
    posts = [f"post number {i}" for i in range(8)]
    ranked = po.rank(f, posts, label="Yes", profile="likes cats")
    assert sorted(r.item for r in ranked) == sorted(posts)
    scores = [r.score for r in ranked]
    assert scores == sorted(scores, reverse=True)
    for r in ranked:
        assert r.score == pytest.approx(f("likes cats", r.item).probs["Yes"])
    top = po.rank(f, posts, label="No", top_k=3, profile="likes cats")
    assert len(top) == 3 and [r.item for r in top] == [r.item for r in reversed(ranked)][:3]


def test_rank_item_binding(fake: po.Fake) -> None:
    f = engage(fake)
    by_dict = po.rank(f, [{"post": "a"}, {"post": "b"}], label="Yes", profile="me")
    by_value = po.rank(f, ["a", "b"], label="Yes", profile="me")
    assert [r.score for r in by_dict] == [r.score for r in by_value]
    full = po.rank(f, [{"post": "a", "profile": "me"}], label="Yes")
    assert full[0].score == by_value[[r.item for r in by_value].index("a")].score
    with pytest.raises(TypeError, match="both give"):
        po.rank(f, [{"post": "a", "profile": "x"}], label="Yes", profile="me")
    with pytest.raises(TypeError, match="cannot tell"):
        po.rank(f, ["a"], label="Yes")
    with pytest.raises(ValueError, match="not one of"):
        po.rank(f, ["a"], label="Maybe", profile="me")

    @po.classify(labels=["Yes", "No"], backend=fake)
    def with_default(post: str, tone: str = "neutral") -> str:
        return f"{tone} {post} A:"

    assert po.rank(with_default, ["x"], label="Yes")[0].result.prompt_tokens > 0  # type: ignore[union-attr]


def test_rank_puts_failures_last() -> None:
    fake = po.Fake(seed=3, max_input_len=30)
    f = engage(fake)
    ranked = po.rank(f, ["ok", "too long " * 20, "fine"], label="Yes", profile="me")
    assert ranked[-1].item.startswith("too long") and ranked[-1].score == -math.inf
    assert isinstance(ranked[-1].result, po.Failed)


# ---- calibration ------------------------------------------------------------------------------


def test_calibration_math() -> None:
    assert sum(softmax([1.0, 2.0, 3.0])) == pytest.approx(1.0)
    assert log_softmax([0.0, 0.0]) == pytest.approx([math.log(0.5)] * 2)
    cf = [-1.0, -3.0, -0.5]
    off = content_free_offsets(cf)
    assert softmax([a + b for a, b in zip(cf, off, strict=True)]) == pytest.approx([1 / 3] * 3)
    scores = [[0.0, 1.0], [2.0, 0.0]]
    assert accuracy(scores, [1, 0], [0.0, 0.0]) == 1.0
    assert accuracy(scores, [0, 0], [0.0, 0.0]) == 0.5


def test_fit_offsets_matches_a_grid_search() -> None:
    scores = [[0.3 * i, 0.0] for i in range(-5, 6)]
    gold = [0 if i > -2 else 1 for i in range(-5, 6)]  # the model's threshold is off by ~0.5
    b = fit_offsets(scores, gold, l2=0.0)
    delta = b[0] - b[1]

    def nll(d: float) -> float:
        return mean_nll(scores, gold, [d, 0.0])

    grid = min((x / 1000 for x in range(-5000, 5000)), key=nll)
    assert delta == pytest.approx(grid, abs=2e-3)
    assert accuracy(scores, gold, b) >= accuracy(scores, gold, [0.0, 0.0])
    # One-class data: the L2 term keeps the offsets finite.
    b1 = fit_offsets([[0.0, 0.0]] * 4, [0] * 4)
    assert all(math.isfinite(x) and abs(x) < 20 for x in b1) and b1[0] > b1[1]


def test_content_free_calibration() -> None:
    fake = po.Fake(seed=4, bias={" Yes": 3.0})
    raw = engage(fake)
    cal = engage(fake, calibrate="content-free")
    rows = [("likes cats", f"post {i}") for i in range(5)]
    fake.batches.clear()
    results = cal.map(rows)
    # One probe for the one shared prefix (profile kept, post -> "N/A"), plus the five calls.
    assert sum(len(b) for b in fake.batches) == 6
    cf = raw("likes cats", "N/A")
    offsets = content_free_offsets(list(cf.logprobs.values()))
    for row, r in zip(rows, results, strict=True):
        base = raw(*row)
        assert r.logprobs == pytest.approx(base.logprobs)  # raw scores are not calibrated
        want = softmax([x + o for x, o in zip(base.logprobs.values(), offsets, strict=True)])
        assert list(r.probs.values()) == pytest.approx(want)
    assert cal("likes cats", "N/A").probs["Yes"] == pytest.approx(0.5)
    fake.batches.clear()
    cal("likes cats", "one more")  # the probe is cached per prefix
    assert sum(len(b) for b in fake.batches) == 1
    explicit = engage(fake, calibrate="content-free", content_free_args=["post"])
    assert explicit("likes cats", "post 1").probs == pytest.approx(results[1].probs)
    nothing = po.classify(labels=["Yes", "No"], backend=fake, calibrate="content-free")(
        lambda: po.shared("Q:") + " A:"
    )
    with pytest.raises(po.PromptError, match="content_free_args"):
        nothing()
    with pytest.raises(ValueError, match="no parameter"):
        engage(fake, calibrate="content-free", content_free_args=["nope"])


def test_fitted_calibration_recovers_a_biased_model() -> None:
    truth = po.Fake(seed=5, bias={" Yes": 0.0})
    biased = po.Fake(seed=5, bias={" Yes": 4.0})  # same ids and logits, plus a Yes bias
    posts = [f"post {i} about item {i * 7 % 11}" for i in range(24)]
    gold = [engage(truth)("me", p).label for p in posts]
    assert 0 < gold.count("Yes") < len(gold)
    f = engage(biased)
    report = f.calibrate([(("me", p), g) for p, g in zip(posts, gold, strict=True)])
    assert report.n == 24 and report.failed == 0
    # The fit maximises likelihood, not accuracy, so it need not find the exact threshold.
    assert report.accuracy_after >= 0.9 > report.accuracy_before + 0.2
    assert report.nll_after < report.nll_before
    assert report.offsets["Yes"] - report.offsets["No"] < -2.0
    assert f.offsets == report.offsets
    after = [f("me", p).label for p in posts]  # applied to later calls
    assert sum(a == g for a, g in zip(after, gold, strict=True)) / len(gold) == report.accuracy_after
    f.reset_calibration()
    assert f.offsets is None
    with pytest.raises(ValueError, match="gold label"):
        f.calibrate([(("me", "x"), "Maybe")])


# ---- decorator and backends -------------------------------------------------------------------


def test_signature_and_docstring_preserved(fake: po.Fake) -> None:
    f = engage(fake)
    assert f.__name__ == "will_engage"
    assert f.__doc__ == "Will this user engage with this post?"
    assert list(inspect.signature(f).parameters) == ["profile", "post"]
    assert f.labels == ("Yes", "No")
    with pytest.raises(TypeError, match="missing a required argument"):
        f("only one")
    assert "will_engage" in repr(f)


def test_current_backend_holder(fake: po.Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(context, "_current", None)
    default = po.get_backend()
    assert isinstance(default, po.Local) and default.model == "embedded" and default._engine is None
    po.set_backend(fake)
    other = po.Fake(seed=9)
    f = po.classify(labels=["Yes", "No"])(lambda x: po.shared("Q:") + f" {x} A:")
    with po.using(other) as b:
        assert b is other and po.get_backend() is other
        f("hi")
    assert po.get_backend() is fake
    assert other.batches and not fake.batches
    with pytest.raises(TypeError, match="not a backend"):
        po.set_backend(object())  # type: ignore[arg-type]


# ---- Remote over a mock transport -------------------------------------------------------------


class MockServer:
    """Our server's HTTP contract, backed by a Fake. A batch with a bad item is rejected whole."""

    def __init__(self, fake: po.Fake, *, sglang_logprob_convention: bool = True) -> None:
        self.fake = fake
        self.inclusive = sglang_logprob_convention
        self.generate_sizes: list[int] = []
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        body = json.loads(request.content)
        path = request.url.path
        if path == "/tokenize":
            tokens = self.fake.tokenize(body["text"], add_special_tokens=body["add_special_tokens"])
            return httpx.Response(200, json={"tokens": tokens})
        if path == "/apply_chat_template":
            text = self.fake.chat_template(
                body["messages"], add_generation_prompt=body["add_generation_prompt"]
            )
            return httpx.Response(200, json={"text": text})
        assert path == "/generate"
        assert body["sampling_params"] == {"max_new_tokens": 0} and body["return_logprob"] is True
        n = len(body["input_ids"])
        self.generate_sizes.append(n)
        reqs = [
            po.LabelRequest(tuple(ids), tuple(lab), cpl, start)
            for ids, lab, cpl, start in zip(
                body["input_ids"],
                body["token_ids_logprob"],
                body["cache_prefix_len"],
                body["logprob_start_len"],
                strict=True,
            )
        ]
        outs = self.fake.score(reqs)
        bad = [o for o in outs if isinstance(o, Exception)]
        if bad:
            return httpx.Response(400, json={"error": {"message": str(bad[0])}})
        return httpx.Response(200, json=[self._item(r, o) for r, o in zip(reqs, outs, strict=True)])

    def _item(self, r: po.LabelRequest, o: po.ScoreOutcome) -> dict:
        meta: dict = {"prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens}
        meta["output_token_ids_logprobs"] = [
            [[lp, t, None] for lp, t in zip(o.label_logprobs, r.label_token_ids, strict=True)]
        ]
        if r.logprob_start_len >= 0:
            ids = r.input_ids
            first = r.logprob_start_len if self.inclusive else r.logprob_start_len + 1
            meta["input_token_logprobs"] = [
                [None if i == 0 else self.fake.logprobs(ids[:i])[ids[i]], ids[i], None]
                for i in range(first, len(ids))
            ]
        return {"text": "", "output_ids": [], "meta_info": meta}


@pytest.mark.parametrize("inclusive", [True, False])
def test_remote_matches_the_backend_it_fronts(inclusive: bool) -> None:
    server = MockServer(po.Fake(seed=6), sglang_logprob_convention=inclusive)
    remote = po.Remote("http://po.test", api_key="k", transport=httpx.MockTransport(server))
    direct = po.Fake(seed=6)
    for kw in ({}, {"chat": True, "system": "Be brief."}):
        a, b = engage(remote, **kw)("likes cats", "a cat"), engage(direct, **kw)("likes cats", "a cat")
        assert a.probs == pytest.approx(b.probs) and a.prompt_tokens == b.prompt_tokens
    labels = ["very good", "very bad"]
    fn = po.classify(labels=labels, multi_token=True, backend=remote)(
        lambda x: po.shared("R:") + f" {x}\nRating:"
    )
    ref = po.classify(labels=labels, multi_token=True, backend=direct)(
        lambda x: po.shared("R:") + f" {x}\nRating:"
    )
    assert fn("nice").logprobs == pytest.approx(ref("nice").logprobs)
    assert server.headers[0]["authorization"] == "Bearer k"


def test_remote_isolates_a_bad_item_in_a_batch() -> None:
    server = MockServer(po.Fake(seed=7, max_input_len=30))
    remote = po.Remote("http://po.test", transport=httpx.MockTransport(server))
    f = engage(remote)
    rows = [("me", "short"), ("me", "long " * 30), ("me", "also short")]
    results = f.map(rows)
    assert isinstance(results[0], po.Classification) and isinstance(results[2], po.Classification)
    assert isinstance(results[1], po.Failed) and "max_input_len" in str(results[1].error)
    assert server.generate_sizes == [3, 1, 1, 1]  # rejected whole, then resent one by one


def test_remote_http_failures_are_backend_errors() -> None:
    server = MockServer(po.Fake())

    def down(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        return server(request)

    f = engage(po.Remote("http://po.test", transport=httpx.MockTransport(down)))
    results = f.map([("me", "a"), ("me", "b")])
    assert all(isinstance(r, po.Failed) and "503: overloaded" in str(r.error) for r in results)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with pytest.raises(po.BackendError, match="failed"):
        engage(po.Remote("http://po.test", transport=httpx.MockTransport(refuse)))("me", "a")
