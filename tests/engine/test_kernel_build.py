"""How the bf16 CPU attention kernel is built and chosen, on any CPU: the build folder keyed by
what the library depends on, an OS lock with a timeout, a cache folder other users could write
to refused, the build at start-up and never in a request, head dims and K/V dtypes it does not
take falling back. Running the kernel needs avx512_bf16 (tests/engine/test_attention_cpu.py); building
it needs only a compiler, so the real build is checked wherever one exists."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from po_backend.engine import attention, attention_cpu
from tests.conftest import save_llama

CPU = torch.device("cpu")
EPYC = frozenset({"avx2", "avx512f", "avx512_bf16"})  # AVX512-BF16, no AMX
XEON = EPYC | {"amx_bf16", "amx_tile"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private cache folder and a fresh `load_kernel`; the fake compiler records its calls."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PREFILLONLY_CACHE", str(root))
    monkeypatch.delenv("PO_CPU_ATTENTION", raising=False)
    monkeypatch.setattr(shutil, "which", lambda _: "/usr/bin/c++")
    # The fake builds register nothing, whatever an earlier test of this process loaded for real.
    monkeypatch.setattr(attention_cpu, "_registered", lambda: False)
    attention_cpu.load_kernel.cache_clear()
    yield root
    attention_cpu.load_kernel.cache_clear()


def _fake_build(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    from torch.utils import cpp_extension

    calls: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    return calls


def test_build_folder_is_keyed_by_source_flags_and_torch(cache: Path, tmp_path, monkeypatch) -> None:
    key = attention_cpu.build_key()
    assert attention_cpu._build_dir() == cache / "ext" / f"po_attention_bf16-{key}"
    other = tmp_path / "other.cpp"
    other.write_bytes(attention_cpu._SOURCE.read_bytes() + b"// another checkout\n")
    monkeypatch.setattr(attention_cpu, "_SOURCE", other)
    assert attention_cpu.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(attention_cpu, "_CFLAGS", ("-O2",))
    assert attention_cpu.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert attention_cpu.build_key() != key


def test_build_folder_is_private_and_a_stale_torch_lock_goes(cache: Path, monkeypatch) -> None:
    from torch.utils import cpp_extension

    build = attention_cpu._build_dir()
    seen_lock: list[bool] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen_lock.append((build / "lock").exists()))
    attention_cpu.load_kernel()
    for folder in (cache, cache / "ext", build):  # created by the first call: the user's only
        assert folder.stat().st_mode & 0o077 == 0, oct(folder.stat().st_mode)
    (build / "lock").touch()  # left by a build killed midway: torch would wait on it forever
    attention_cpu.load_kernel.cache_clear()
    attention_cpu.load_kernel()
    assert seen_lock == [False, False]


@pytest.mark.parametrize("unsafe", ["group-writable", "world-writable", "owner"])
def test_unsafe_cache_folder_is_refused(cache: Path, monkeypatch, caplog, unsafe: str) -> None:
    calls = _fake_build(monkeypatch)
    ext = cache / "ext"
    ext.mkdir(parents=True, mode=0o700)
    if unsafe == "owner":
        uid = os.getuid()
        monkeypatch.setattr(attention_cpu.os, "getuid", lambda: uid + 1)
        want = "not by this user"
    else:
        ext.chmod(0o770 if unsafe == "group-writable" else 0o707)
        want = "writable by other users"
    with caplog.at_level(logging.WARNING, logger="po_backend.engine.attention_cpu"):
        assert attention_cpu.load_kernel() is False
    assert calls == [], "nothing may be built or loaded from an unsafe folder"
    assert any(want in r.getMessage() and "PREFILLONLY_CACHE" in r.getMessage() for r in caplog.records)


def test_a_held_build_lock_times_out_with_a_message(cache: Path, monkeypatch, caplog) -> None:
    calls = _fake_build(monkeypatch)
    monkeypatch.setenv("PO_KERNEL_LOCK_TIMEOUT", "0.3")
    build = attention_cpu._build_dir()
    build.mkdir(mode=0o700, parents=True)
    fd = os.open(build / ".po_build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another "process" (a separate open file) builds
        with caplog.at_level(logging.WARNING, logger="po_backend.engine.attention_cpu"):
            assert attention_cpu.load_kernel() is False
    finally:
        os.close(fd)
    assert calls == []
    assert any("held the kernel build lock" in r.getMessage() for r in caplog.records)
    attention_cpu.load_kernel.cache_clear()
    attention_cpu.load_kernel()  # released: the build goes ahead
    assert len(calls) == 1


def test_decide_says_what_runs_and_why(cache: Path, monkeypatch, caplog) -> None:
    calls = _fake_build(monkeypatch)
    bf16 = torch.bfloat16
    assert attention_cpu.decide(torch.float32, CPU, 64, EPYC).attention == "sdpa"
    avx2 = attention_cpu.decide(bf16, CPU, 64, frozenset({"avx2"}))
    assert avx2.attention == "sdpa" and "no avx512_bf16" in avx2.reason
    assert "AMX" in attention_cpu.decide(bf16, CPU, 64, XEON).reason
    with caplog.at_level(logging.WARNING, logger="po_backend.engine.attention_cpu"):
        phi3 = attention_cpu.decide(bf16, CPU, 96, EPYC)  # Phi-3's head dim: a logged fallback
    assert phi3.attention == "sdpa" and "96" in phi3.reason
    assert any("head dim 96" in r.getMessage() for r in caplog.records)
    assert calls == [], "no build for a choice that cannot use the kernel"
    # The fake build registers no op: the kernel is unavailable and SDPA runs, saying why.
    built = attention_cpu.decide(bf16, CPU, 64, EPYC)
    assert built.attention == "sdpa" and "could not be built" in built.reason and len(calls) == 1


def test_the_kernel_is_built_at_start_up_never_in_a_request(
    cache: Path, tmp_path, monkeypatch, caplog
) -> None:
    from po_backend import Engine

    calls = _fake_build(monkeypatch)
    monkeypatch.setattr(attention_cpu, "cpu_flags", lambda: EPYC)
    path = save_llama(
        tmp_path,
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with caplog.at_level(logging.INFO, logger="po_backend.engine.runner"):
        engine = Engine.from_pretrained(path, dtype="bf16", max_input_len=64, max_batch_tokens=64)
    assert len(calls) == 1, "the build runs while the engine starts"
    assert any(
        "attention: torch SDPA" in r.getMessage() and "could not be built" in r.getMessage()
        for r in caplog.records
    )
    engine.score([[1, 2, 3, 4]], [0])
    assert len(calls) == 1, "a request never builds"


def test_kv_in_another_dtype_falls_back(monkeypatch) -> None:
    """K/V in fp32 under bf16 queries (e.g. a pool in another dtype): cast, not an error, and the
    kernel is not asked to read them."""
    monkeypatch.setattr(attention_cpu, "cpu_flags", lambda: EPYC)
    monkeypatch.setattr(attention_cpu, "load_kernel", lambda: True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20, 4, 64, generator=g).bfloat16()
    k, v = torch.randn(20, 2, 64, generator=g), torch.randn(20, 2, 64, generator=g)
    assert attention_cpu.supported(q, k.bfloat16(), v.bfloat16())
    assert not attention_cpu.supported(q, k, v)
    monkeypatch.setenv("PO_CPU_ATTENTION", "sdpa")  # the reference: SDPA on bf16 K/V
    out, ref = torch.empty(20, 256, dtype=torch.bfloat16), torch.empty(20, 256, dtype=torch.bfloat16)
    attention.attend(q, k, v, out, 0.125)
    attention.attend(q, k.bfloat16(), v.bfloat16(), ref, 0.125)
    assert torch.equal(out, ref)
    pk, pv = torch.randn(7, 2, 64, generator=g), torch.randn(7, 2, 64, generator=g)
    attention.attend_items(q, k, v, out, 0.125, [(0, 8), (8, 20)], pk, pv)
    attention.attend_items(
        q, k.bfloat16(), v.bfloat16(), ref, 0.125, [(0, 8), (8, 20)], pk.bfloat16(), pv.bfloat16()
    )
    assert torch.equal(out, ref)


_REAL_BUILD = """
import os, sys
from pathlib import Path
import torch
from po_backend.engine import attention_cpu
assert attention_cpu.load_kernel(), "the kernel failed to build (see the logged warning)"
assert hasattr(torch.ops.po_attn, "fwd")
assert (attention_cpu._build_dir() / "po_attention_bf16.so").is_file()
# A second build folder in the same process: its copy must not be loaded (the interpreter would
# abort on the second registration of the same operators); the loaded one serves.
os.environ["PREFILLONLY_CACHE"] = sys.argv[1]
attention_cpu.load_kernel.cache_clear()
assert attention_cpu.load_kernel()
assert not Path(sys.argv[1], "ext").exists(), "nothing built for a kernel already loaded"
print("loaded once")
"""


def test_the_real_build(tmp_path: Path) -> None:
    """Compiles and loads the kernel for real (no instruction of it runs: loading registers the
    op), in a child process: a crash there fails this test, not the test run. Skips only without
    a compiler; a build error fails."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine")
    env = {**os.environ, "PREFILLONLY_CACHE": str(tmp_path / "cache")}
    env.pop("PO_CPU_ATTENTION", None)
    done = subprocess.run(
        [sys.executable, "-c", _REAL_BUILD, str(tmp_path / "second")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0 and "loaded once" in done.stdout, done.stdout + done.stderr[-3000:]


def test_cpu_classes_decide_dtype_and_attention(monkeypatch) -> None:
    """`--dtype auto` and the attention choice per CPU class, from the flags alone."""
    from po_backend.core import cpu
    from po_backend.engine import config

    avx2 = frozenset({"avx2", "fma"})
    for flags, klass, auto, attn in (
        (avx2, "AVX2-only", torch.float32, "sdpa"),
        (EPYC, "AVX512-BF16", torch.bfloat16, "kernel"),
        (XEON, "AMX", torch.bfloat16, "sdpa"),
    ):
        assert cpu.cpu_class(flags) == klass
        monkeypatch.setattr(cpu, "cpu_flags", lambda f=flags: f)
        assert config.parse_dtype("auto", CPU) == auto
        assert attention_cpu.choose(torch.bfloat16, CPU, flags) == attn


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_kernel_logic_runs_emulated_where_the_cpu_cannot_run_it() -> None:
    """On a CPU without avx512_bf16 the real kernel never runs, so tests/engine/test_attention_cpu.py runs
    in a child process against the same source built with portable stand-ins for its intrinsics
    (PO_KERNEL_EMULATE=1): tiling, masking, items, the online softmax and the log-sum-exp are
    checked against SDPA and transformers on every CPU class. Every kernel test must run."""
    if "avx512_bf16" in attention_cpu.cpu_flags():
        pytest.skip("the real kernel runs here: tests/engine/test_attention_cpu.py checks it directly")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine")
    env = {**os.environ, "PO_KERNEL_EMULATE": "1"}
    env.pop("PO_CPU_ATTENTION", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/engine/test_attention_cpu.py",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
        ],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "skipped" not in summary, done.stdout[-3000:] + done.stderr[-2000:]


def test_every_kernel_library_runs_its_parallel_loops_on_openmp() -> None:
    """at::parallel_for's `#pragma omp parallel` is compiled in each library: one built without
    OpenMP runs every call on one thread whatever torch's thread count. The libraries this CPU
    builds must call into OpenMP's runtime (GOMP_parallel in their symbol table)."""
    from po_backend.engine import fused_cpu, int8_kernel, kernels

    if kernels.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    built = {
        "fused fp32": (
            fused_cpu.load(),
            fused_cpu._NAME,
            kernels.build_dir(fused_cpu._NAME, fused_cpu.build_key()),
        ),
        "blocked int8": (int8_kernel.load_kernel(), int8_kernel._flavour()[0], int8_kernel._build_dir()),
    }
    for what, (loaded, name, folder) in built.items():
        assert loaded, f"the {what} library failed to build (see the logged warning)"
        assert kernels.is_built(name, folder), f"the {what} library is not in {folder}"
        calls_openmp = b"GOMP_parallel" in (folder / f"{name}.so").read_bytes()
        assert calls_openmp, f"the {what} library was built without OpenMP"
