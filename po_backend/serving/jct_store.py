"""The JCT profiles kept on disk: where a profile for an engine and machine lives, reading and
writing it (atomically, under an OS file lock shared by the processes of one machine), and saving
a model refined online (`Persister`). `jct_profile` measures and chooses; this only stores."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from po_backend.core.fs import file_lock, private_cache_dir, write_atomic
from po_backend.sched.jct import CalibratedJCT, JCTModel, JCTSample

# The profiles' log is jct_profile's, whichever module writes it.
log = logging.getLogger("po_backend.serving.jct_profile")

# Where profiles live: `$PREFILLONLY_JCT_CACHE`, else `jct/` under the cache root. Its own setting
# so that test runs keep their throwaway profiles apart while sharing the root's GGUF conversion
# and kernel build.
JCT_CACHE_ENV = "PREFILLONLY_JCT_CACHE"


def profile_dir() -> Path:
    return private_cache_dir("jct", what="JCT profiles", env=JCT_CACHE_ENV)


def profile_path(key: dict[str, Any], root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or profile_dir()) / f"{digest}.json"


def save_model(model: JCTModel, path: Path, samples: Sequence[JCTSample] = ()) -> None:
    """Written atomically: a concurrent start reads the old file or the new one."""
    write_atomic(path, json.dumps(model.to_json(samples), indent=1))


def load_jct_model(path: Path) -> JCTModel:
    return JCTModel.from_json(json.loads(path.read_text()))


def load_samples(path: Path) -> list[JCTSample]:
    return JCTModel.samples_from_json(json.loads(path.read_text()))


def profile_lock(path: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive across the processes of this machine while `path` is measured and written."""
    return file_lock(
        path.with_suffix(".lock"), f"another process is measuring the JCT profile {path.name}: waiting"
    )


def try_load(path: Path, key: dict[str, Any]) -> JCTModel | None:
    if not path.is_file():
        return None
    try:
        model = load_jct_model(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable JCT profile %s: %s", path, e)
        return None
    if model.key != key:
        return None
    q = model.quality
    log.info(
        "JCT profile (%s) loaded from %s (r=%.3f, median error %.0f%%)",
        model.source,
        path,
        q.pearson_r if q else math.nan,
        100 * q.median_rel_error if q else math.nan,
    )
    return model


def save_quietly(model: JCTModel, path: Path, samples: Sequence[JCTSample]) -> None:
    try:
        save_model(model, path, samples)
    except OSError as e:  # a read-only home must not stop the server
        log.warning("could not save the JCT profile to %s: %s", path, e)
    else:
        log.info("JCT profile (%s) saved to %s", model.source, path)


PERSIST_AT = (64, 256, 1024)  # observed steps at which a refined model is saved, then every 1024


class Persister:
    """Saves a refined model at PERSIST_AT observations, on a thread of its own: the refit runs
    on the engine loop's thread, and the file lock may be held by a process measuring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._next = 0
        self._busy = threading.Lock()

    def due(self, observations: int) -> bool:
        marks = list(PERSIST_AT)
        while marks[-1] <= observations:
            marks.append(marks[-1] + 1024)
        return sum(m <= observations for m in marks) > self._next

    def __call__(self, cal: CalibratedJCT) -> None:
        if not self.due(cal.observations) or not self._busy.acquire(blocking=False):
            return
        self._next += 1
        model, samples = cal.model, cal.samples()

        def write() -> None:
            try:
                with profile_lock(self.path):
                    save_quietly(model, self.path, samples)
            finally:
                self._busy.release()

        threading.Thread(target=write, name="po-jct-persist", daemon=True).start()
