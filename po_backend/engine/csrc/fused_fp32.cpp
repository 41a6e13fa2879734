// Fused fp32 elementwise steps of a decoder layer, one pass over the data each: RMSNorm (with the
// residual add before it), and the per-head q/k RMSNorm with RoPE. Built on first use by
// po_backend/engine/models/fused_cpu.py, for fp32 CPU forwards only (bf16 keeps torch's ops,
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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

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

}  // namespace

TORCH_LIBRARY(po_fused, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) h, Tensor delta, Tensor w, float eps, Tensor(b!) out) -> ()");
  m.def("norm_rope(Tensor(a!) x, Tensor cos, Tensor sin, Tensor wq, Tensor wk, int nq, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(po_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("norm_rope", &norm_rope);
}
