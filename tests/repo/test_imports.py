"""Import hygiene: what must work without torch, and which way imports may point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_request_scheduler_jct_import_without_torch() -> None:
    # A router, a client or the simulator must not need torch.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import po_backend, po_backend.core.request, po_backend.sched.scheduler, po_backend.sched.jct, po_backend.sim.simulator\n"
        "from po_backend import ScoreRequest, PrefillOnlyError\n"
        "print(ScoreRequest(input_ids=(1, 2)).input_ids)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1, 2)"


def test_engine_export_needs_torch_only_when_asked() -> None:
    code = "import sys; sys.modules['torch'] = None\nimport po_backend\npo_backend.Engine\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "torch" in out.stderr
