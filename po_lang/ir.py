"""The prompt IR: a frozen sequence of text segments, the leading ones marked shared.

A decorated function returns `po.shared(head) + tail` (or a plain `str`, nothing shared). The
shared segments become the request's cached prefix, so they must lead the prompt: a prefix is
the only thing a prefix cache can reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from po_lang.errors import PromptError


@dataclass(frozen=True)
class Segment:
    text: str
    shared: bool = False


@dataclass(frozen=True)
class Prompt:
    """Segments in order; every shared segment precedes every non-shared one.

    Adjacent non-shared segments are merged (one tokenisation, no needless boundary); shared
    segments stay separate because each one is tokenised on its own, which keeps a nested prefix
    (instructions, then a profile) token-stable for the cache.
    """

    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        seen_plain: Segment | None = None
        for seg in self.segments:
            if not seg.shared:
                seen_plain = seg
            elif seen_plain is not None:
                raise PromptError(
                    f"po.shared({_preview(seg.text)}) comes after non-shared text "
                    f"{_preview(seen_plain.text)}; the shared part must lead the prompt because it "
                    "becomes the cached prefix. Wrap the leading text in po.shared(...) too, or move it "
                    "after the shared part."
                )

    @classmethod
    def of(cls, segments: tuple[Segment, ...] | list[Segment]) -> Prompt:
        """Normalise: drop empty segments, merge adjacent non-shared ones."""
        out: list[Segment] = []
        for seg in segments:
            if not seg.text:
                continue
            if out and not seg.shared and not out[-1].shared:
                out[-1] = Segment(out[-1].text + seg.text)
            else:
                out.append(seg)
        return cls(tuple(out))

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def shared_text(self) -> str:
        return "".join(s.text for s in self.segments if s.shared)

    def __add__(self, other: Prompt | str) -> Prompt:
        if isinstance(other, str):
            other = Prompt((Segment(other),))
        if not isinstance(other, Prompt):
            return NotImplemented
        return Prompt.of(self.segments + other.segments)

    def __radd__(self, other: str) -> Prompt:
        if not isinstance(other, str):
            return NotImplemented
        return Prompt.of((Segment(other), *self.segments))

    def __str__(self) -> str:
        return self.text

    def __format__(self, spec: str) -> str:
        # f"{po.shared(x)}..." would silently turn the prompt into a plain str and lose the
        # shared marking (and with it all prefix reuse), so refuse loudly.
        raise PromptError(
            "a po.shared(...) prompt was formatted into a string (f-string or format()), which drops "
            "the shared marking; build the prompt with +, e.g. po.shared(head) + f'...{x}...'"
        )


def shared(text: str | Prompt) -> Prompt:
    """Mark `text` as the part many calls share (instructions, a user profile): its tokens are the
    request's cache prefix. It must lead the prompt: `po.shared(head) + tail`."""
    if isinstance(text, Prompt):
        return Prompt.of([Segment(s.text, shared=True) for s in text.segments])
    if not isinstance(text, str):
        raise TypeError(f"po.shared() takes a str, got {type(text).__name__}")
    return Prompt.of([Segment(text, shared=True)])


def as_prompt(value: object) -> Prompt:
    """What a decorated function returned, as a Prompt (a plain str shares nothing)."""
    if isinstance(value, Prompt):
        return value
    if isinstance(value, str):
        return Prompt.of([Segment(value)])
    raise TypeError(
        f"a classify function must return a str or a prompt built with po.shared(...) + str, "
        f"got {type(value).__name__}"
    )


def _preview(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")
