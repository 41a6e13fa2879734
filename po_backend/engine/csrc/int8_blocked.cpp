// Blocked int8 GEMM on x86 CPUs (Q8_0-style): activations and weights in int8, quantized in blocks
// of `block` (a multiple of 32) along k with one fp32 scale per block and row.
//
//   out[m, n] = sum over blocks b, in increasing order, of (xs[m, b] * ws[n, b]) * dot_b(m, n)
//
// where dot_b is the exact int32 dot product of the block's int8 values, converted to fp32 (exact:
// |dot| <= 512 * 128 * 127 < 2^24), and the sum is fp32 without FMA. torch's reference
// (po_backend/engine/int8_kernel.py) does the same arithmetic, so the two agree bit for bit, and a
// row's result never depends on the other rows (a prefix-cache hit equals the cold run).
//
// The int8 products: AVX2 has no signed x signed byte multiply-add; vpmaddubsw takes u8 x s8. |w|
// (u8, vpabsb once per tile step, shared by its rows) is multiplied by x carrying w's sign
// (vpsignb), vpmaddwd widens the int16 pair sums to int32; a call whose x holds -128 (which
// vpsignb cannot negate; quantize never gives it) takes llama.cpp's order instead, |x| times w
// carrying x's sign. With AVX-VNNI, vpdpbusd does the multiply and the int32 sum in one
// instruction; with AVX512-VNNI, one vpdpbusd on 512 bits per 64 multiply-adds
// (int8_blocked_zmm.h: x + 128 with the weights' sums subtracted, no sign step). Each variant is
// compiled under its own `#pragma GCC target` and chosen at run time by the caller, so the library builds and loads on any x86 CPU. With
// -DPO_EMULATE_VNNI the VNNI variants use portable stand-ins (tests on CPUs without VNNI).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include <immintrin.h>

namespace {

#ifndef PO_MR
#define PO_MR 4
#endif
constexpr int MR = PO_MR;  // rows per register tile
#ifndef PO_MC
#define PO_MC 96
#endif
constexpr int64_t MC = PO_MC;  // rows per L2-resident group
#ifndef PO_KC
#define PO_KC 1024
#endif
constexpr int64_t KC = PO_KC;  // k per cache chunk: a 16-column panel's chunk is 16 KiB

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// The AVX2 tile's step for 4 rows, 16 columns and 4 k, in assembly: GCC's own allocation of the
// same intrinsics spills accumulators to the stack. 14 registers: the 8 int32 accumulators, |w|
// (2), one broadcast of x, two products, the int16 ones; w is read from memory by vpsignb.
static inline void step4(__m256i (&acc)[4][2], const int8_t* w, const int8_t* x0, const int8_t* x1,
                         const int8_t* x2, const int8_t* x3, __m256i ones) {
  __m256i a0, a1, xb, t0, t1;
#define PO_ROW(xr, c0, c1)                 \
  "vpbroadcastd (%" xr "), %[xb]\n"        \
  "vpsignb (%[w]), %[xb], %[t0]\n"         \
  "vpsignb 32(%[w]), %[xb], %[t1]\n"       \
  "vpmaddubsw %[t0], %[a0], %[t0]\n"       \
  "vpmaddubsw %[t1], %[a1], %[t1]\n"       \
  "vpmaddwd %[ones], %[t0], %[t0]\n"       \
  "vpmaddwd %[ones], %[t1], %[t1]\n"       \
  "vpaddd %[t0], %[" c0 "], %[" c0 "]\n"   \
  "vpaddd %[t1], %[" c1 "], %[" c1 "]\n"
  asm("vpabsb (%[w]), %[a0]\n"
      "vpabsb 32(%[w]), %[a1]\n"
      PO_ROW("[x0]", "c00", "c01") PO_ROW("[x1]", "c10", "c11") PO_ROW("[x2]", "c20", "c21")
      PO_ROW("[x3]", "c30", "c31")
      : [c00] "+x"(acc[0][0]), [c01] "+x"(acc[0][1]), [c10] "+x"(acc[1][0]), [c11] "+x"(acc[1][1]),
        [c20] "+x"(acc[2][0]), [c21] "+x"(acc[2][1]), [c30] "+x"(acc[3][0]), [c31] "+x"(acc[3][1]),
        [a0] "=&x"(a0), [a1] "=&x"(a1), [xb] "=&x"(xb), [t0] "=&x"(t0), [t1] "=&x"(t1)
      : [w] "r"(w), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3), [ones] "x"(ones)
      : "memory");
#undef PO_ROW
}

#define PO_NS avx2
#define PO_DOT(acc, ab, sw) \
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, sw), ones))
#define PO_STEP4(acc, w, x0, x1, x2, x3) step4(acc, w, x0, x1, x2, x3, ones)
#include "int8_blocked_tile.h"
#undef PO_STEP4
#undef PO_DOT
#undef PO_NS

// Whether any of x is -128 (the one value the SIGN_X tile cannot negate).
static bool has_min(const int8_t* x, int64_t count) {
  const __m256i lo = _mm256_set1_epi8(static_cast<char>(-128));
  __m256i any = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= count; i += 32)
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), lo));
  bool found = !_mm256_testz_si256(any, any);
  for (; i < count; ++i) found |= x[i] == -128;
  return found;
}

// |x| as u8 (|-128| = 128), the unsigned operand of the byte multiply-adds.
static void absolute(const int8_t* x, uint8_t* ax, int64_t count) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ax + i), _mm256_abs_epi8(v));
  }
  for (; i < count; ++i) ax[i] = static_cast<uint8_t>(x[i] < 0 ? -static_cast<int>(x[i]) : x[i]);
}

// One row: per block, d = absmax / 127, q = round-half-even(x / d) (division, as torch's
// reference), d == 0 gives zeros. With `keep` (1 or 0 per column) x is read as x * keep: the
// columns kept out of the int8 GEMM (outlier channels) neither set d nor get a nonzero q, and x
// needs no zeroed copy.
template <bool MASK>
static void quantize_row(const float* x, const float* keep, int8_t* q, float* d, int64_t k, int block) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto load = [&](int64_t i) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if constexpr (MASK) return _mm256_mul_ps(v, _mm256_loadu_ps(keep + i));
    return v;
  };
  for (int64_t b = 0; b < k / block; ++b) {
    const int64_t kb = b * block;
    int8_t* qb = q + kb;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load(kb + i)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float amax = lanes[0];
    for (int i = 1; i < 8; ++i) amax = std::max(amax, lanes[i]);
    const float s = amax / 127.0f;
    d[b] = s;
    if (s == 0.0f) {
      std::memset(qb, 0, block);
      continue;
    }
    const __m256 sv = _mm256_set1_ps(s);
    for (int i = 0; i < block; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j)
        v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(load(kb + i + 8 * j), sv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // packs work per 128-bit lane: the permute puts the 32 bytes back in order.
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), _mm256_permutevar8x32_epi32(p, order));
    }
  }
}

#pragma GCC pop_options

// x + 128 as u8 (x ^ 0x80), the unsigned operand of the 512-bit vpdpbusd tile.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
static void offset(const int8_t* x, uint8_t* xu, int64_t count) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xu + i), _mm256_xor_si256(v, flip));
  }
  for (; i < count; ++i) xu[i] = static_cast<uint8_t>(x[i] ^ 0x80);
}
#pragma GCC pop_options

#ifdef PO_EMULATE_VNNI
// vpdpbusd, lane for lane (u8 x s8, 4 products summed into each int32, no saturation).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
static inline __m256i dpbusd_portable(__m256i acc, __m256i a, __m256i b) {
  alignas(32) uint8_t ua[32];
  alignas(32) int8_t sb[32];
  alignas(32) int32_t c[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ua), a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(sb), b);
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), acc);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) c[i] += static_cast<int32_t>(ua[4 * i + j]) * static_cast<int32_t>(sb[4 * i + j]);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(c));
}
#define PO_VNNI_DOT 1
#define PO_NS avxvnni
#define PO_DOT(acc, ab, sw) acc = dpbusd_portable(acc, ab, sw)
#include "int8_blocked_tile.h"
#undef PO_DOT
#undef PO_NS
#undef PO_VNNI_DOT
#include "int8_blocked_zmm.h"
#pragma GCC pop_options
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vnni")
#include "int8_blocked_zmm.h"
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#define PO_VNNI_DOT 1
#define PO_NS avxvnni
#define PO_DOT(acc, ab, sw) acc = _mm256_dpbusd_avx_epi32(acc, ab, sw)
#include "int8_blocked_tile.h"
#undef PO_DOT
#undef PO_NS
#undef PO_VNNI_DOT
#pragma GCC pop_options
#endif

void check_cpu(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(), name,
              " must be a contiguous CPU tensor of ", dtype);
}

// skip: int64 column indices read as zero (empty: none).
void quantize(const at::Tensor& x, int64_t block, const at::Tensor& skip, at::Tensor& q, at::Tensor& scales) {
  check_cpu(x, at::kFloat, "x");
  check_cpu(skip, at::kLong, "skip");
  check_cpu(q, at::kChar, "q");
  check_cpu(scales, at::kFloat, "scales");
  TORCH_CHECK(x.dim() == 2 && block > 0 && block % 32 == 0 && x.size(1) % block == 0, "bad block");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(q.sizes() == x.sizes() && scales.size(0) == m && scales.size(1) == k / block, "bad outputs");
  std::unique_ptr<float[]> keep;
  if (skip.numel()) {
    keep.reset(new float[static_cast<size_t>(k)]);
    std::fill_n(keep.get(), k, 1.0f);
    const int64_t* sk = skip.data_ptr<int64_t>();
    for (int64_t i = 0; i < skip.numel(); ++i) {
      TORCH_CHECK(sk[i] >= 0 && sk[i] < k, "skip index out of range");
      keep[sk[i]] = 0.0f;
    }
  }
  const float* xp = x.data_ptr<float>();
  const float* kp = keep.get();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = scales.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (kp != nullptr)
        quantize_row<true>(xp + r * k, kp, qp + r * k, dp + r * (k / block), k, block);
      else
        quantize_row<false>(xp + r * k, kp, qp + r * k, dp + r * (k / block), k, block);
    }
  });
}

// isa: 0 AVX2, 1 AVX512-VNNI (512-bit), 2 AVX-VNNI. wp: [ceil(n / 16), k / 4, 16, 4] int8;
// wsp: [ceil(n / 16), k / block / span, 16] fp32, one scale per `span` blocks (span: from its size;
// k / block: one per output channel); comp (isa 1 only): -128 * the blocks' weight sums,
// int32 in wsp's layout; out: [m, n] fp32, overwritten.
void matmul(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wp, const at::Tensor& wsp,
            const at::Tensor& comp, int64_t n, int64_t block, int64_t isa, at::Tensor& out) {
  check_cpu(xq, at::kChar, "xq");
  check_cpu(xs, at::kFloat, "xs");
  check_cpu(wp, at::kChar, "packed weights");
  check_cpu(wsp, at::kFloat, "packed scales");
  check_cpu(out, at::kFloat, "out");
  TORCH_CHECK(block > 0 && block % 32 == 0 && block <= 512, "bad block");
  TORCH_CHECK(isa >= 0 && isa <= 2, "bad isa");
  const int64_t m = xq.size(0), k = xq.size(1), nb = k / block, panels = (n + 15) / 16;
  TORCH_CHECK(k % block == 0 && xs.size(0) == m && xs.size(1) == nb, "bad activations");
  const int64_t nbs = wsp.numel() / std::max<int64_t>(1, panels * 16);  // weight scales per column
  TORCH_CHECK(wp.numel() == panels * k * 16 && wsp.numel() == panels * nbs * 16 && (nb == 0 || (nbs > 0 && nb % nbs == 0)),
              "bad packed weights");
  const int64_t span = nbs > 0 ? nb / nbs : 1;
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "bad out");
  if (isa == 1) {
    check_cpu(comp, at::kInt, "comp");
    TORCH_CHECK(comp.numel() == panels * nb * 16, "bad comp");
  }
  if (m == 0 || n == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }
  const int8_t* x = xq.data_ptr<int8_t>();
  // The 256-bit tiles take x as it is, unless some x is -128: then |x| goes in a copy (rare:
  // quantize never gives -128). The 512-bit tile takes x + 128. Copies are left uninitialized
  // and filled in parallel.
  bool copy = isa == 1;
  if (!copy) {
    std::atomic<bool> found{false};
    at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
      if (has_min(x + r0 * k, (r1 - r0) * k)) found = true;
    });
    copy = found;
  }
  std::unique_ptr<uint8_t[]> ax(copy ? new uint8_t[static_cast<size_t>(m * k)] : nullptr);
  if (copy)
    at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
      if (isa == 1)
        offset(x + r0 * k, ax.get() + r0 * k, (r1 - r0) * k);
      else
        absolute(x + r0 * k, ax.get() + r0 * k, (r1 - r0) * k);
    });
  const float* xsp = xs.data_ptr<float>();
  const int8_t* w = wp.data_ptr<int8_t>();
  const float* ws = wsp.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int bl = static_cast<int>(block);
  // Runs of panels handed out one at a time (at least 4 per thread), not one fixed share per
  // thread: on a shared machine a thread that loses its core for a while leaves its runs to the
  // others instead of making them wait at the end.
  const int64_t threads = at::get_num_threads();
  // (One thread: a single run, so a row group's activations serve every panel from L2.)
  const int64_t run = threads == 1 ? panels : std::clamp<int64_t>(panels / (4 * threads), 1, 16);
  const int64_t runs = (panels + run - 1) / run;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, runs), 1, [&](int64_t, int64_t) {
    for (int64_t r = next++; r < runs; r = next++) {
      const int64_t p0 = r * run, p1 = std::min(panels, p0 + run);
      if (isa == 1)
        zmm::panels(ax.get(), xsp, m, k, nb, w, ws, span, comp.data_ptr<int32_t>(), bl, o, n, p0, p1);
      else if (isa == 2)
        avxvnni::panels(x, ax.get(), xsp, m, k, nb, w, ws, span, bl, o, n, p0, p1);
      else
        avx2::panels(x, ax.get(), xsp, m, k, nb, w, ws, span, bl, o, n, p0, p1);
    }
  });
}

}  // namespace

TORCH_LIBRARY(po_int8, m) {
  m.def("quantize(Tensor x, int block, Tensor skip, Tensor(a!) q, Tensor(b!) scales) -> ()");
  m.def("matmul(Tensor xq, Tensor xs, Tensor wp, Tensor wsp, Tensor comp, int n, int block, int isa, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(po_int8, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("matmul", &matmul);
}
