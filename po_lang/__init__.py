"""po_lang: a small DSL for discriminative prompts ("pick one of these labels") on PrefillOnly.

    import po_lang as po

    @po.classify(labels=["Yes", "No"])
    def will_engage(profile: str, post: str) -> str:
        return po.shared(f"User profile:\\n{profile}\\n") + f"Post: {post}\\nWill the user engage? Answer:"

    will_engage(profile, post)                      # Classification(label="Yes", probs=..., ...)
    will_engage.map(rows, progress=True)            # batched, order kept, Failed in place of errors
    po.rank(will_engage, posts, label="Yes", top_k=10, profile=profile)

Importing po_lang never imports torch: `Local` loads the engine on first use, `Remote` talks HTTP.
"""

from __future__ import annotations

from po_lang.api import Classifier, classify
from po_lang.backends import Backend, LabelRequest, ScoreOutcome
from po_lang.calibration import CalibrationReport
from po_lang.context import get_backend, set_backend, using
from po_lang.errors import BackendError, BackendUnavailable, LabelError, PoLangError, PromptError
from po_lang.fake import Fake
from po_lang.ir import Prompt, Segment, shared
from po_lang.local import Local
from po_lang.rank import rank
from po_lang.remote import Remote
from po_lang.results import Classification, Failed, Ranked

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "CalibrationReport",
    "Classification",
    "Classifier",
    "Failed",
    "Fake",
    "LabelError",
    "LabelRequest",
    "Local",
    "PoLangError",
    "Prompt",
    "PromptError",
    "Ranked",
    "Remote",
    "ScoreOutcome",
    "Segment",
    "classify",
    "get_backend",
    "rank",
    "set_backend",
    "shared",
    "using",
]
