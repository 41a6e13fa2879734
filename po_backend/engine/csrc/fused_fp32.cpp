// Fused fp32 elementwise steps of a decoder layer, one pass over the data each: RMSNorm (with the
// residual add before it), the per-head q/k RMSNorm with RoPE, and SwiGLU's silu(gate) * up.
// Built on first use by po_backend/engine/fused_cpu.py, for fp32 CPU forwards only (bf16 keeps torch's ops,
// whose cast points transformers' bf16 rules are written in).
//
// Why: torch computes an RMSNorm as pow, mean, rsqrt, mul, mul (five passes and five parallel
// regions over a [tokens, hidden] tensor) and RoPE as six half-size passes; at hidden 1,024 these
// memory-bound passes cost a tenth of a CPU prefill, and every parallel region is a barrier where
// threads wait for each other when the machine is shared.
//
// Rounding rules:
//  - RoPE matches transformers' fp32 bits exactly: x1' = x1 c - x2 s, x2' = x2 c + x1 s, each
//    product rounded, then the sum (the file is built with -ffp-contract=off: no fused multiply-add).
//  - RMSNorm: y = w * (x * (1 / sqrt(sum(x^2) / d + eps))) as transformers' Llama rule in fp32; the
//    sum's order differs from torch's reduction (last-bit differences), but it is a fixed order
//    (8 lanes, then the lanes in turn, then the tail) that depends only on d: a row's result never
//    depends on its address, its batch or the thread that computes it.
//  - SwiGLU: silu(g) = g / (1 + exp(-g)) as torch's, with its own exp (`exp_cephes`): within a few
//    ulps of torch's, and elementwise, so an element's bits depend only on its inputs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 8;

// sum(x^2) over d floats, in the fixed order described above.
inline float sum_squares(const float* x, int64_t d) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[j + l] * x[j + l];
  }
  float s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; j < d; ++j) s += x[j] * x[j];
  return s;
}

// out = w * (x * r) for one row, r = 1 / sqrt(mean(x^2) + eps); out may be x.
inline void norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  const float var = sum_squares(x, d) / static_cast<float>(d);
  const float r = 1.0f / std::sqrt(var + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = w[j] * (x[j] * r);
}

// Rotate-half RoPE over the first 2 * half dims of one head row, in place.
inline void rope_row(float* x, const float* c, const float* s, int64_t half) {
  float* x1 = x;
  float* x2 = x + half;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x1[j], b = x2[j];
    const float p = a * c[j], q = b * s[j];
    const float u = b * c[j], v = a * s[j];
    x1[j] = p - q;
    x2[j] = u + v;
  }
}

// exp(x) in fp32, Cephes' expf: x = n ln2 + r (ln2 in two parts), e^r by a degree-6 polynomial,
// 2^n from exponent bits; the polynomial's input clamped to [-88.38, 88.38], and above ln(FLT_MAX)
// the result is +inf (as a true exp: silu(g) of a very negative g must be -0). The AVX2 form and the
// scalar one (tails, CPUs without AVX2) run the same IEEE operations in the same order, so an
// element's bits never depend on its position (within about 2 ulps of the exact value).
constexpr float kExpHi = 88.3762626647949f, kExpLo = -88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kExpInf = 88.72283935546875f;  // e^x rounds to +inf above this
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_cephes(float x) {
  const float x0 = x;
  x = kExpHi < x ? kExpHi : x;  // min/max in the vector form's operand order: NaN passes through
  x = kExpLo > x ? kExpLo : x;
  const float fx = std::floor(x * kLog2e + 0.5f);
  x = x - fx * kLn2Hi;
  x = x - fx * kLn2Lo;
  const float z = x * x;
  float y = kExpP[0];
  for (int i = 1; i < 6; ++i) y = y * x + kExpP[i];
  y = y * z + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float pow2n;
  std::memcpy(&pow2n, &bits, sizeof(pow2n));
  return x0 > kExpInf ? HUGE_VALF : y * pow2n;
}

// silu(g) * u, torch's silu formula g / (1 + e^-g).
inline float silu_times(float g, float u) { return g / (1.0f + exp_cephes(-g)) * u; }

#if defined(__AVX2__)
inline __m256 exp_cephes8(__m256 x) {
  const __m256 inf = _mm256_cmp_ps(x, _mm256_set1_ps(kExpInf), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(kExpHi), x);
  x = _mm256_max_ps(_mm256_set1_ps(kExpLo), x);
  const __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(kLn2Hi)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(kLn2Lo)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(kExpP[i]));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), _mm256_set1_ps(HUGE_VALF), inf);
}
#endif

// o[j] = silu(g[j]) * u[j] for j < n.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 e = exp_cephes8(_mm256_sub_ps(zero, gv));
    _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
  }
#endif
  for (; j < n; ++j) o[j] = silu_times(g[j], u[j]);
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be an fp32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, name, " must be 2-D or 3-D");
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dim must be contiguous");
}

// Row r of a 2-D [n, d] or 3-D [n, h, d] strided tensor.
inline float* row_ptr(float* base, const at::Tensor& t, int64_t r) {
  if (t.dim() == 2) return base + r * t.stride(0);
  const int64_t h = t.size(1);
  return base + (r / h) * t.stride(0) + (r % h) * t.stride(1);
}

int64_t rows_of(const at::Tensor& t) { return t.dim() == 2 ? t.size(0) : t.size(0) * t.size(1); }

// Rows per task: about 64 KiB of data, so small tensors take one thread.
int64_t grain(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

void rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.sizes() == out.sizes(), "x and out must have one shape");
  const int64_t d = x.size(-1);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == d, "w must be [d] fp32");
  float* xb = x.data_ptr<float>();
  float* ob = out.data_ptr<float>();
  const float* wb = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows_of(x), grain(d), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) norm_row(row_ptr(xb, x, r), wb, row_ptr(ob, out, r), d, e);
  });
}

// h += delta, then out = rms_norm(h): one pass over h instead of an add and a norm.
void add_rms_norm(
    const at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps, const at::Tensor& out) {
  check_rows(h, "h");
  check_rows(delta, "delta");
  check_rows(out, "out");
  TORCH_CHECK(h.dim() == 2 && h.sizes() == delta.sizes() && h.sizes() == out.sizes(), "h, delta, out: one 2-D shape");
  const int64_t d = h.size(1);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == d, "w must be [d] fp32");
  float* hb = h.data_ptr<float>();
  const float* db = delta.data_ptr<float>();
  float* ob = out.data_ptr<float>();
  const float* wb = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, h.size(0), grain(d), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float* hr = hb + r * h.stride(0);
      const float* dr = db + r * delta.stride(0);
      for (int64_t j = 0; j < d; ++j) hr[j] += dr[j];
      norm_row(hr, wb, ob + r * out.stride(0), d, e);
    }
  });
}

// x [n, heads, d] in place: heads [0, nq) normed by wq and the rest by wk (when given, i.e. wq
// is not empty), then every head rotated by cos/sin [n, 1, half] (the first 2 * half dims).
void norm_rope(
    const at::Tensor& x,
    const at::Tensor& cos,
    const at::Tensor& sin,
    const at::Tensor& wq,
    const at::Tensor& wk,
    int64_t nq,
    double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [n, heads, d]");
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes(), "cos/sin: one contiguous shape");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos/sin must be fp32");
  const int64_t half = cos.size(-1);
  TORCH_CHECK(cos.numel() == n * half && 2 * half <= d, "cos/sin must be [n, 1, half] with 2 * half <= d");
  const bool norm = wq.numel() > 0;
  if (norm) {
    TORCH_CHECK(wq.is_contiguous() && wk.is_contiguous() && wq.numel() == d && wk.numel() == d, "wq/wk must be [d]");
    TORCH_CHECK(wq.scalar_type() == at::kFloat && wk.scalar_type() == at::kFloat, "wq/wk must be fp32");
    TORCH_CHECK(0 <= nq && nq <= heads, "nq must be within the heads");
  }
  float* xb = x.data_ptr<float>();
  const float* cb = cos.data_ptr<float>();
  const float* sb = sin.data_ptr<float>();
  const float* wqb = norm ? wq.data_ptr<float>() : nullptr;
  const float* wkb = norm ? wk.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n * heads, grain(d), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t t = r / heads, hd = r % heads;
      float* xr = xb + t * x.stride(0) + hd * x.stride(1);
      if (norm) norm_row(xr, hd < nq ? wqb : wkb, xr, d, e);
      rope_row(xr, cb + t * half, sb + t * half, half);
    }
  });
}

// SwiGLU on a fused [n, 2 * inter] gate|up buffer: out [n, inter] = silu(gate) * up, one pass
// instead of torch's two (silu in place, then the multiply) over the largest activation.
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2, "gate_up and out must be 2-D");
  const int64_t inter = out.size(1);
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * inter, "gate_up must be [n, 2 * out's width]");
  const float* gb = gate_up.data_ptr<float>();
  float* ob = out.data_ptr<float>();
  at::parallel_for(0, out.size(0), grain(inter), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = gb + r * gate_up.stride(0);
      const float* u = g + inter;
      float* o = ob + r * out.stride(0);
      silu_mul_row(g, u, o, inter);
    }
  });
}

}  // namespace

TORCH_LIBRARY(po_fused, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("norm_rope(Tensor(a!) x, Tensor cos, Tensor sin, Tensor wq, Tensor wk, int nq, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(po_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("norm_rope", &norm_rope);
  m.impl("silu_mul", &silu_mul);
}
