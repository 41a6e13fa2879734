"""Import hygiene: what must work without torch, and which way imports may point."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_request_scheduler_jct_import_without_torch() -> None:
    # A router, a client or the simulator must not need torch.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import po_backend, po_backend.request, po_backend.scheduler, po_backend.jct, po_backend.simulator\n"
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


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_po_backend_never_imports_po_lang_and_nothing_imports_the_server() -> None:
    for path in (ROOT / "po_backend").rglob("*.py"):
        mods = _imports(path)
        assert not any(m == "po_lang" or m.startswith("po_lang.") for m in mods), path
        if "server" not in path.parts and path.name != "launch_server.py":
            assert not any(m.startswith("po_backend.server") for m in mods), path
