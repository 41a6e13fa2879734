"""The command line: SGLang's flags mapped onto ours in one place, clear errors for the rest, and
the `prefillonly serve MODEL` entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from po_backend.entrypoints.launch_server import build_parser, server_args

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return server_args(build_parser().parse_args(["--model-path", "m", *argv]))


def test_sglang_flags_map_onto_ours() -> None:
    args = parse(
        "--context-length", "4096", "--chunked-prefill-size", "256", "--max-prefill-tokens", "8192",
        "--max-queued-requests", "77", "--enable-metrics", "--trust-remote-code", "--random-seed", "1",
        "--served-model-name", "smol", "--dtype", "bfloat16", "--tp-size", "1",
    )  # fmt: skip
    assert args.engine.max_input_len == 4096
    assert args.engine.chunk_size == 256
    assert args.engine.max_batch_tokens == 8192
    assert args.max_queue == 77
    assert args.model_name == "smol" and args.engine.dtype == "bfloat16"


def test_sglang_policies() -> None:
    assert parse("--schedule-policy", "lof").scheduler.policy == "fcfs"
    assert parse("--schedule-policy", "dfs-weight").scheduler.policy == "lpm"
    assert parse("--schedule-policy", "lpm").scheduler.policy == "lpm"
    with pytest.raises(ValueError, match="random"):
        parse("--schedule-policy", "random")


def test_what_a_prefill_only_worker_cannot_do_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor parallelism"):
        parse("--tp-size", "2")
    with pytest.raises(ValueError, match="router"):
        parse("--dp-size", "2")
    with pytest.raises(ValueError, match="tokenizer"):
        parse("--tokenizer-path", "/elsewhere")
    with pytest.raises(ValueError, match="not both"):
        parse("--mem-fraction-static", "0.5", "--memory-budget", "1GiB")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        parse("--mem-fraction-static", "1.5")
    assert parse("--mem-fraction-static", "0.25").engine.mem_fraction_static == 0.25


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFILLONLY_API_KEY", "from-env")
    assert parse().api_key == "from-env"
    assert parse("--api-key", "flag").api_key == "flag"


@pytest.mark.slow
def test_prefillonly_serve_entry_point() -> None:
    code = "from po_lang.cli import main; main(['serve', '--help'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--context-length" in out.stdout
    out = subprocess.run(
        [sys.executable, "-c", "from po_lang.cli import main; main(['frobnicate'])"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "unknown command" in out.stderr


@pytest.mark.parametrize(
    ("given", "pre", "want"),
    [(None, "", "PASSIVE"), ("ACTIVE", "", "ACTIVE"), (None, "import torch; ", "None")],
    ids=["unset", "user's choice", "torch already loaded"],
)
def test_the_server_lets_idle_openmp_threads_sleep(given: str | None, pre: str, want: str) -> None:
    """`prefillonly serve` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP, unless the user
    set it; once torch is loaded the policy is fixed and the variable is left alone."""
    code = (
        f"import atexit, os; {pre}"
        "atexit.register(lambda: print('OMP=' + str(os.environ.get('OMP_WAIT_POLICY')))); "
        "from po_lang.cli import main; main(['serve', '--help'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"OMP={want}" in out.stdout.splitlines()
