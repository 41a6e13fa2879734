"""An unmodified SGLang frontend program (`sgl.function` + `sgl.select` + `sgl.gen(max_tokens=1)`)
run against our server through `sgl.RuntimeEndpoint`.

    python examples/sglang_select.py                              # starts our server, runs, stops it
    python examples/sglang_select.py --url http://127.0.0.1:30000 # a server you started:
    python -m po_backend.entrypoints.launch_server --model-path embedded --backend prefillonly --port 30000

`sgl.select` sends what SGLang sends to its own server: the prompt once with max_new_tokens 0, then
prompt + each choice with `return_logprob` and picks the best token-length-normalised log-prob;
`sgl.gen(max_tokens=1)` is one next-token step. SGLang is installed with `--no-deps` (it pins a
CUDA torch), so its frontend is imported through `po_lang.sglang_shim`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from po_backend.entrypoints.spawn import ServerProcess, free_port
from po_lang.sglang_shim import import_sglang_frontend

REVIEWS = (
    ("A wonderful film with a moving story and great acting.", "positive"),
    ("The food was cold and the staff were rude.", "negative"),
    ("Fast delivery and the shoes fit perfectly.", "positive"),
    ("The app crashes constantly and loses my data.", "negative"),
    ("Lovely hike with stunning views at the top.", "positive"),
    ("The coffee here is bitter and overpriced.", "negative"),
)
CHOICES = (" positive", " negative")  # after "Sentiment:" the label word carries its space


@dataclass(frozen=True)
class Answer:
    review: str
    gold: str
    choice: str  # what sgl.select picked (without the leading space)
    normalized_logprobs: tuple[float, ...]  # per choice, SGLang's token-length-normalised score
    next_word: str  # what sgl.gen(max_tokens=1) produced after the choice


@contextlib.contextmanager
def local_server(model: str = "embedded", timeout: float = 300.0) -> Iterator[str]:
    """Our server on a free loopback port in a subprocess; yields its URL once /health answers,
    stops it on exit. A server that exits or stays unhealthy is a RuntimeError with its output."""
    # The OS picks a free port; another process could take it before the server binds it, in
    # which case the server fails to start and we say so (no silent wrong server).
    port = free_port()
    cmd = [sys.executable, "-m", "po_backend.entrypoints.launch_server", "--model-path", model]
    cmd += ["--backend", "prefillonly", "--host", "127.0.0.1", "--port", str(port)]
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}").start()
    try:
        yield server.wait_ready(timeout).url
    finally:
        server.stop()


def run_program(sgl: Any, url: str, reviews: Sequence[tuple[str, str]]) -> list[Answer]:
    """The SGLang program, exactly as one would write it for SGLang's own server."""

    @sgl.function
    def sentiment(s: Any, review: str) -> None:
        s += "Classify the sentiment of this review as positive or negative.\n"
        s += "Review: " + review + "\nSentiment:"
        s += sgl.select("sentiment", choices=list(CHOICES))
        s += "\nOne word that sums up the review:"
        s += sgl.gen("word", max_tokens=1)

    backend = sgl.RuntimeEndpoint(url)
    states = sentiment.run_batch([{"review": r} for r, _ in reviews], backend=backend, num_threads=1)
    out = []
    for (review, gold), state in zip(reviews, states, strict=True):
        meta = state.get_meta_info("sentiment")
        out.append(
            Answer(
                review=review,
                gold=gold,
                choice=state["sentiment"].strip(),
                normalized_logprobs=tuple(meta["normalized_prompt_logprobs"]),
                next_word=state["word"],
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one on the embedded model)")
    args = ap.parse_args(argv)
    try:
        sgl = import_sglang_frontend()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with contextlib.ExitStack() as stack:
            url = args.url
            if url is None:
                print("starting our server on the embedded model ...", flush=True)
                url = stack.enter_context(local_server())
            t0 = time.perf_counter()
            answers = run_program(sgl, url, REVIEWS)
            elapsed = time.perf_counter() - t0
    except Exception as e:  # the server failed to start or cannot be reached, a request failed
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for a in answers:
        mark = "ok " if a.choice == a.gold else "BAD"
        scores = " ".join(
            f"{c.strip()}={x:+.2f}" for c, x in zip(CHOICES, a.normalized_logprobs, strict=True)
        )
        print(f"{mark} {a.choice:<8s} [{scores}] next={a.next_word!r:<10s} {a.review}")
    hits = sum(a.choice == a.gold for a in answers)
    print(f"\nsgl.select accuracy {hits}/{len(answers)}; {elapsed:.1f}s for {len(answers)} programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
