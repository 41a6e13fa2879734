"""The blocked int8 GEMM (`po_backend.engine.int8_kernel`): the C++ kernel bit-equal to torch's
reference (quantization and GEMM) over odd shapes, every block size and k up to 4096; the
reference itself against exact integer math; extreme values (no int16 saturation in vpmaddubsw);
a row's output independent of its batch and of the thread count; bad input refused; the VNNI
variants run here through their emulated build (a child process) and chosen from the CPU flags;
a CPU without AVX2 falls back to the reference with one warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from po_backend.engine import int8_kernel as ik
from tests.deps import missing

AVX2 = frozenset({"avx", "avx2", "fma"})


def _kernel_or_skip() -> None:
    """Where the kernel can run (AVX2), a build failure fails the test; elsewhere it skips."""
    if ik.isa() is None:
        pytest.skip("the CPU has no AVX2/FMA: only the reference runs here")
    if ik.kernels.compiler() is None:
        missing("no C++ compiler to build the int8 kernel")
    assert ik.kernel_available(), "the int8 kernel failed to build (see the logged warning)"


@pytest.fixture
def kernel() -> None:
    _kernel_or_skip()


def _operands(m: int, n: int, k: int, block: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    w = torch.randn(n, k, generator=g) * 0.05
    xq, xs = ik.reference_quantize_blocks(x, block)
    wq, ws = ik.reference_quantize_blocks(w, block)
    return x, xq, xs, wq, ws


def _exact(
    xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: int
) -> torch.Tensor:
    """The blocked product in fp64 (integer dots exact, scales exact): the reference's target."""
    m, k = xq.shape
    nb = k // block
    dots = torch.einsum("mbk,nbk->mnb", xq.double().view(m, nb, block), wq.double().view(-1, nb, block))
    return (dots * xs.double()[:, None, :] * ws.double()[None, :, :]).sum(-1)


def test_reference_quantization_is_q8_0() -> None:
    """d = absmax / 127 per block, round half to even, an all-zero block gives d = 0 and zeros."""
    x = torch.zeros(2, 64)
    x[0, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -127.0] + [0.0] * 24)
    x[1, 32:] = 1e-3
    q, d = ik.reference_quantize_blocks(x, 32)
    assert d.tolist() == [[1.0, 0.0], [0.0, pytest.approx(1e-3 / 127)]]
    assert q[0, :8].tolist() == [127, 2, 4, -2, 0, 0, 2, -127]
    assert q[0, 32:].eq(0).all() and q[1, :32].eq(0).all() and q[1, 32:].eq(127).all()


@pytest.mark.parametrize("block", [32, 64, 128])
def test_quantize_blocks_equals_the_reference(kernel, block: int) -> None:
    for m, k in [(1, block), (7, 4 * block), (33, 4096)]:
        x, *_ = _operands(m, 1, k, block, seed=m)
        x[-1, -block:] = torch.arange(block, dtype=torch.float32) - block / 2 + 0.5
        x[0, :block] = 0.0  # a zero block
        q, d = ik.quantize_blocks(x, block)
        rq, rd = ik.reference_quantize_blocks(x, block)
        assert torch.equal(q, rq) and torch.equal(d, rd)
        assert d[0, 0] == 0 and q[0, :block].eq(0).all()


def test_quantize_ties_round_to_even(kernel) -> None:
    """x / d lands exactly on .5 when absmax is 127 (d = 1): the kernel rounds as torch.round."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] + [0.0] * 24])
    q, d = ik.quantize_blocks(x, 32)
    assert d.item() == 1.0
    assert q[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize("block", [32, 64, 128])
def test_blocked_matmul_is_bit_equal_to_the_reference(kernel, block: int) -> None:
    """Odd row and column counts (row tiles of 4 and panels of 16 with tails), k from one block to
    4096 (several cache chunks), packed and unpacked weights."""
    for m, n, k in [
        (1, 1, block),
        (3, 17, 2 * block),
        (77, 100, 4096),
        (130, 33, 1024 + block),
        (5, 16, 2048),
    ]:
        _, xq, xs, wq, ws = _operands(m, n, k, block, seed=m + n)
        ref = ik.reference_blocked_matmul(xq, xs, wq, ws, block)
        assert torch.equal(ik.blocked_matmul(xq, xs, wq, ws, block), ref), (m, n, k)
        packed = ik.pack_weights(wq, ws, block)
        assert torch.equal(ik.blocked_matmul(xq, xs, packed), ref), (m, n, k)
        assert torch.allclose(
            ref.double(), _exact(xq, xs, wq, ws, block), rtol=1e-5, atol=1e-5 * ref.abs().max().item()
        )


def test_fp16_weight_scales_read_as_their_fp32_values(kernel) -> None:
    """Packed fp16 scales (Q8_0's 2 bytes per block) stay fp16 and give the bits of the same
    scales in fp32, in the kernel and the reference."""
    _, xq, xs, wq, ws = _operands(19, 40, 256, 32)
    ws16 = ws.half()
    packed = ik.pack_weights(wq, ws16, 32)
    assert packed.scales.dtype == torch.float16 and torch.equal(packed.unpack()[1], ws16)
    ref = ik.reference_blocked_matmul(xq, xs, wq, ws16.float(), 32)
    assert torch.equal(ik.reference_blocked_matmul(xq, xs, wq, ws16, 32), ref)
    assert torch.equal(ik.blocked_matmul(xq, xs, packed), ref)
    with pytest.raises(TypeError, match="ws must be"):
        ik.pack_weights(wq, ws.double(), 32)


def test_a_weight_scale_may_span_several_blocks(kernel) -> None:
    """Weight scales [n, k // (block * span)]: each read for `span` activation blocks, the same
    bits as the repeated scales, in the kernel and the reference; kept unrepeated."""
    _, xq, xs, wq, ws = _operands(11, 37, 384, 32)
    for span in (2, 3, 4):
        w_s = ws[:, ::span].half()  # [37, 12 // span]
        packed = ik.pack_weights(wq, w_s, 32)
        assert torch.equal(packed.unpack()[1], w_s) and packed.scales.shape == (3, 12 // span, 16)
        ref = ik.reference_blocked_matmul(xq, xs, wq, w_s.float().repeat_interleave(span, 1), 32)
        assert torch.equal(ik.reference_blocked_matmul(xq, xs, wq, w_s, 32), ref)
        assert torch.equal(ik.blocked_matmul(xq, xs, packed), ref)
    with pytest.raises(ValueError, match="ws must be"):
        ik.pack_weights(wq, ws[:, :5], 32)


def test_one_weight_scale_per_output_channel(kernel) -> None:
    """fp32 scales [n, 1] (one per output channel, over every activation block): packed as one
    scale per column, read by the kernel in place (no per-call copy), bit-equal to the reference
    with the scale repeated per block; also where a span crosses the kernel's k chunks (96 blocks,
    spans of 3 and 96, chunks of 32)."""
    for m, n, k, block in [(11, 37, 384, 32), (9, 40, 3072, 32), (5, 17, 1024, 128)]:
        _, xq, xs, wq, ws = _operands(m, n, k, block, seed=k)
        nb = k // block
        for span in sorted({3 if nb % 3 == 0 else 2, nb}):
            w_s = ws[:, ::span].amax(1, keepdim=True) if span == nb else ws[:, ::span].contiguous()
            packed = ik.pack_weights(wq, w_s, block)
            assert (
                packed.scales.shape == (-(-n // 16), nb // span, 16) and packed.scales.dtype == torch.float32
            )
            assert packed.kernel_scales() is packed.scales
            ref = ik.reference_blocked_matmul(xq, xs, wq, w_s.repeat_interleave(span, 1), block)
            assert torch.equal(ik.reference_blocked_matmul(xq, xs, wq, w_s, block), ref)
            assert torch.equal(ik.blocked_matmul(xq, xs, packed), ref), (m, n, k, span)


def test_quantize_blocks_skips_columns(kernel) -> None:
    """`skip` columns read as zeros: they set no block scale and get q = 0, the bits of quantizing
    a copy with those columns zeroed, and x is left as it was."""
    x, *_ = _operands(13, 1, 576, 32, seed=5)
    skip = torch.tensor([0, 40, 41, 300, 575])
    x[:, skip] *= 1000
    before = x.clone()
    q, d = ik.quantize_blocks(x, 32, skip)
    rq, rd = ik.reference_quantize_blocks(x.index_fill(1, skip, 0), 32)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(x, before)
    assert torch.equal(ik.reference_quantize_blocks(x, 32, skip)[0], rq)
    assert torch.equal(
        ik.quantize_blocks(x, 32, torch.tensor([], dtype=torch.long))[0], ik.quantize_blocks(x, 32)[0]
    )
    with pytest.raises(ValueError, match="outside"):
        ik.quantize_blocks(x, 32, torch.tensor([576]))
    with pytest.raises(TypeError, match="int64"):
        ik.quantize_blocks(x, 32, skip.int())


def test_reference_sums_blocks_in_order_in_fp32() -> None:
    """The reference is the stated arithmetic: fp32 (xs * ws) * dot per block, added in order."""
    _, xq, xs, wq, ws = _operands(9, 5, 256, 32)
    acc = torch.zeros(9, 5)
    for b in range(8):
        dot = xq[:, 32 * b : 32 * b + 32].long() @ wq[:, 32 * b : 32 * b + 32].long().t()
        acc = acc + (xs[:, b, None] * ws[None, :, b]) * dot.float()
    assert torch.equal(ik.reference_blocked_matmul(xq, xs, wq, ws, 32), acc)


@pytest.mark.parametrize("block", [32, 128, 512])
def test_extreme_values_do_not_saturate(kernel, block: int) -> None:
    """vpmaddubsw adds two u8 x s8 products in int16 with saturation. With |w| (u8) times x carrying
    w's sign, or (where some x is -128) |x| (up to 128) times w carrying x's sign, a pair is at most
    2 * 128 * 127 = 32512 < 32767: the all-extreme cases give the exact integer sums (unit scales:
    out == the int dot)."""
    k = 2 * block
    ones = torch.ones(4, k // block)
    for xv, wv in [(127, 127), (-127, 127), (127, -127), (-127, -127), (-128, 127), (-128, -127)]:
        xq = torch.full((4, k), xv, dtype=torch.int8)
        wq = torch.full((3, k), wv, dtype=torch.int8)
        got = ik.blocked_matmul(xq, ones, wq, ones[:3], block)
        assert got.eq(k * xv * wv).all(), (xv, wv, got[0, 0].item())
    # alternating signs inside each pair: products of opposite signs cancel exactly
    xq = torch.tensor([127, -128] * (k // 2), dtype=torch.int8).repeat(2, 1)
    wq = torch.tensor([[127, 127] * (k // 2), [-127, 127] * (k // 2)], dtype=torch.int8)
    got = ik.blocked_matmul(xq, ones[:2], wq, ones[:2], block)
    assert got[0].tolist() == [-127 * k // 2, -255 * 127 * k // 2]


def test_a_row_does_not_depend_on_its_batch_or_the_threads(kernel) -> None:
    """Row i alone, in a batch of 77, beside rows 1000x larger, beside a row holding -128, and with
    1 or 2 threads: the same bits (a prefix-cache hit equals the cold run)."""
    _, xq, xs, wq, ws = _operands(77, 45, 1088, 32)
    packed = ik.pack_weights(wq, ws, 32)
    full = ik.blocked_matmul(xq, xs, packed)
    loud = ik.blocked_matmul(xq, xs * torch.tensor([1.0, 1000.0]).repeat(39)[:77, None], packed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = ik.blocked_matmul(xq, xs, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for i in (0, 1, 5, 40, 76):
        alone = ik.blocked_matmul(xq[i : i + 1], xs[i : i + 1], packed)
        assert torch.equal(alone[0], full[i])
        if i % 2 == 0:
            assert torch.equal(loud[i], full[i])
    assert torch.equal(ik.blocked_matmul(xq[3:10], xs[3:10], packed), full[3:10])
    # a -128 in the batch moves the call onto the tile that takes |x| (the usual one cannot
    # negate -128): the other rows keep their bits
    odd = xq.clone()
    odd[7, 100] = -128
    mixed = ik.blocked_matmul(odd, xs, packed)
    assert torch.equal(mixed[7], ik.reference_blocked_matmul(odd[7:8], xs[7:8], wq, ws, 32)[0])
    assert torch.equal(torch.cat([mixed[:7], mixed[8:]]), torch.cat([full[:7], full[8:]]))


def test_out_and_degenerate_shapes(kernel) -> None:
    _, xq, xs, wq, ws = _operands(6, 20, 64, 32)
    packed = ik.pack_weights(wq, ws, 32)
    out = torch.full((6, 20), float("nan"))
    assert ik.blocked_matmul(xq, xs, packed, out=out) is out
    assert torch.equal(out, ik.reference_blocked_matmul(xq, xs, wq, ws, 32))
    assert ik.blocked_matmul(xq[:0], xs[:0], packed).shape == (0, 20)
    with pytest.raises(ValueError, match="out must be"):
        ik.blocked_matmul(xq, xs, packed, out=torch.empty(6, 21))


def test_pack_round_trip_and_bad_input() -> None:
    _, xq, xs, wq, ws = _operands(2, 21, 96, 32)
    packed = ik.pack_weights(wq, ws, 32)
    assert packed.data.shape == (2, 24, 16, 4) and packed.scales.shape == (2, 3, 16)
    back_q, back_s = packed.unpack()
    assert torch.equal(back_q, wq) and torch.equal(back_s, ws)
    with pytest.raises(ValueError, match="multiple of the block"):
        ik.quantize_blocks(torch.zeros(2, 48), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        ik.quantize_blocks(torch.zeros(2, 48), 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        ik.reference_quantize_blocks(torch.zeros(2, 1024), 1024)
    with pytest.raises(TypeError, match="float32"):
        ik.quantize_blocks(torch.zeros(2, 64, dtype=torch.float64), 32)
    with pytest.raises(ValueError, match="-127, 127"):
        ik.pack_weights(torch.full((3, 32), -128, dtype=torch.int8), torch.ones(3, 1), 32)
    with pytest.raises(ValueError, match="ws must be"):
        ik.pack_weights(wq, ws[:, :2], 32)
    with pytest.raises(ValueError, match="k = 64"):
        ik.blocked_matmul(xq[:, :64], xs[:, :2], packed)
    with pytest.raises(ValueError, match="block 64 differs"):
        ik.blocked_matmul(xq, xs, packed, None, 64)
    with pytest.raises(TypeError, match="xq must be"):
        ik.blocked_matmul(xq.float(), xs, packed)


def test_isa_from_the_cpu_flags() -> None:
    assert ik.isa(AVX2) == "avx2"
    assert ik.isa(AVX2 | {"avx512f", "avx512vl", "avx512_vnni"}) == "avx512_vnni"
    assert ik.isa(AVX2 | {"avx512f", "avx512_vnni", "avx_vnni"}) == "avx512_vnni"
    assert ik.isa(AVX2 | {"avx_vnni"}) == "avx_vnni"
    assert ik.isa(frozenset({"sse4_2", "avx"})) is None
    assert ik.isa(frozenset()) is None


@pytest.fixture
def no_avx2(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ik, "cpu_flags", lambda: frozenset({"sse4_2"}))
    ik.load_kernel.cache_clear()
    yield
    ik.load_kernel.cache_clear()


def test_without_avx2_the_reference_runs_with_one_warning(no_avx2, caplog) -> None:
    _, xq, xs, wq, ws = _operands(5, 9, 64, 32)
    x = torch.randn(5, 64)
    with caplog.at_level(logging.WARNING, logger="po_backend.engine.int8_kernel"):
        assert not ik.kernel_available()
        got = ik.blocked_matmul(xq, xs, ik.pack_weights(wq, ws, 32))
        q, d = ik.quantize_blocks(x, 32)
    assert torch.equal(got, ik.reference_blocked_matmul(xq, xs, wq, ws, 32))
    rq, rd = ik.reference_quantize_blocks(x, 32)
    assert torch.equal(q, rq) and torch.equal(d, rd)
    assert sum("no AVX2" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("failure", ["no compiler", "build error"])
def test_without_a_compiler_or_a_build_the_reference_runs(
    monkeypatch, caplog, tmp_path, failure: str
) -> None:
    from torch.utils import cpp_extension

    def broken(**_: object) -> None:
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(ik, "cpu_flags", lambda: AVX2)
    monkeypatch.setattr(ik, "_registered", lambda: False)  # as in a process that never loaded it
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    if failure == "no compiler":
        monkeypatch.setattr(ik.kernels, "compiler", lambda: None)
    else:
        monkeypatch.setattr(ik.kernels, "compiler", lambda: "/usr/bin/c++")
        monkeypatch.setattr(cpp_extension, "load", broken)
    ik.load_kernel.cache_clear()
    try:
        _, xq, xs, wq, ws = _operands(5, 9, 64, 32)
        with caplog.at_level(logging.WARNING, logger="po_backend.engine.int8_kernel"):
            got = ik.blocked_matmul(xq, xs, wq, ws, 32)
            ik.quantize_blocks(torch.randn(3, 64), 32)
        assert torch.equal(got, ik.reference_blocked_matmul(xq, xs, wq, ws, 32))
        want = "no C++ compiler" if failure == "no compiler" else "simulated compiler failure"
        assert [want in r.getMessage() for r in caplog.records] == [True]
    finally:
        ik.load_kernel.cache_clear()


_EMULATED = """
import sys, torch
from po_backend.engine import int8_kernel as ik
flags = frozenset({"avx", "avx2", "fma"}) | frozenset(sys.argv[1].split(","))
ik.cpu_flags = lambda: flags
assert ik.isa() == sys.argv[2], ik.isa()
assert ik.kernel_available(), "the emulated build failed"
g = torch.Generator().manual_seed(1)
for m, n, k, block in [(1, 1, 32, 32), (77, 45, 1088, 32), (6, 33, 2048, 128), (21, 16, 256, 64)]:
    xq, xs = ik.reference_quantize_blocks(torch.randn(m, k, generator=g), block)
    wq, ws = ik.reference_quantize_blocks(torch.randn(n, k, generator=g), block)
    xq[0, :32] = -128  # |x| = 128 through vpdpbusd too
    ref = ik.reference_blocked_matmul(xq, xs, wq, ws, block)
    packed = ik.pack_weights(wq, ws, block)
    assert (packed.comp is not None) == (sys.argv[2] == "avx512_vnni")
    assert torch.equal(ik.blocked_matmul(xq, xs, packed), ref), (m, n, k, block)
    assert torch.equal(ik.blocked_matmul(xq[-1:], xs[-1:], wq, ws, block)[0], ref[-1])
    rows = ws.amax(1, keepdim=True)  # one scale per output channel, read for every block
    per_row = ik.reference_blocked_matmul(xq, xs, wq, rows.repeat_interleave(k // block, 1), block)
    assert torch.equal(ik.blocked_matmul(xq, xs, ik.pack_weights(wq, rows, block)), per_row), (m, n, k)
    full = torch.full((4, k), -128, dtype=torch.int8), torch.full((2, k), 127, dtype=torch.int8)
    ones = torch.ones(4, k // block)
    assert ik.blocked_matmul(full[0], ones, full[1], ones[:2], block).eq(-128 * 127 * k).all()
print("vnni ok")
"""


@pytest.fixture(scope="module")
def emulated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("int8-emulated") / "cache"  # one emulated build for both variants


@pytest.mark.parametrize(
    ("flags", "variant"), [("avx512f,avx512vl,avx512_vnni", "avx512_vnni"), ("avx_vnni", "avx_vnni")]
)
def test_vnni_variants_run_emulated(emulated_cache: Path, flags: str, variant: str) -> None:
    """The VNNI variants' tiles (AVX-VNNI: vpdpbusd on |x| and w carrying x's sign; AVX512-VNNI:
    on x + 128 with the weights' block sums subtracted, 8-row tiles and single-row tails) built
    with portable stand-ins (PO_KERNEL_EMULATE=1), chosen by emulated flags, bit-equal to the
    reference. In a child process: a second copy of the library's operators would abort this one."""
    if ik.isa() is None:
        pytest.skip("the CPU has no AVX2/FMA: the emulated VNNI build still needs AVX2")
    if ik.kernels.compiler() is None:
        missing("no C++ compiler to build the int8 kernel")
    env = {**os.environ, "PO_KERNEL_EMULATE": "1", "PREFILLONLY_CACHE": str(emulated_cache)}
    done = subprocess.run(
        [sys.executable, "-c", _EMULATED, flags, variant],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0 and "vnni ok" in done.stdout, done.stdout + done.stderr[-3000:]
