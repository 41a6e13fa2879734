// fp32 CPU attention (causal after an optional prefix, or over all keys), with the log-sum-exp the
// items path merges by. Built into the fused fp32 library by po_backend/engine/fused_cpu.py.
//
// Why: torch's CPU flash kernel runs one query head per work item with 256 query rows against
// 512-key blocks, and on a causal diagonal it computes the whole 512-key block: products the
// causal half does not need, a large part of the work at a few thousand tokens. Here one work item is a KV head's
// group of query heads over a block of positions, stacked as the rows of one product (a K/V block
// is read once for the group), and the diagonal block stops at the block's last position. The
// softmax is online over key blocks, in base 2 (scale * log2(e) folded into the copied queries),
// fused into one max pass and one exp-and-sum pass per row; the products are MKL's sgemm (torch's
// own BLAS, found in the process), one thread each. Work items are taken from a shared counter,
// largest first, so a thread slowed by another process takes fewer of them.
//
// Rounding: a row's result depends on its position, the keys and the block sizes (constants), not
// on which thread computes it; the products are MKL's (the last bits may depend on how many rows a
// block holds, as in torch's kernel).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// Query rows (positions x the group's heads) per work item and keys per block: one block of
// scores (256 x 512 fp32, 512 KiB) stays within a core's L2.
constexpr int64_t kRows = 256;
constexpr int64_t kKeys = 512;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                          const float*, const int*, const float*, const int*, const float*, float*,
                          const int*);

// BLAS's sgemm from the library that holds ATen (torch's MKL, or its OpenBLAS), not whichever
// `sgemm_` another extension put first in the process.
sgemm_fn find_sgemm() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) == 0 || info.dli_fname == nullptr) return nullptr;
  void* lib = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;
  return reinterpret_cast<sgemm_fn>(dlsym(lib, "sgemm_"));
}

sgemm_fn sgemm_ptr() {
  static const sgemm_fn fn = find_sgemm();
  return fn;
}

// Column-major C = alpha op(A) op(B) + beta C, as BLAS.
inline void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float beta, float* c, int64_t ldc) {
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm_ptr()(&ta, &tb, &mi, &ni, &ki, &one, a, &la, b, &lb, &beta, c, &lc);
}

// 2^x in fp32 for x <= 0 (inputs below -126 give 2^-126's neighbourhood, whose weight is nil
// against the row's maximum, 2^0): x = i + f, 2^f by a degree-6 polynomial on [0, 1).
constexpr float kExp2P[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                             5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

inline float exp2_neg(float x) {
  x = std::max(x, -126.0f);
  const float fl = std::floor(x);
  const float f = x - fl;
  float p = kExp2P[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2P[i];
  return std::ldexp(p, static_cast<int>(fl));
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp2_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 fl = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, fl);
  __m256 p = _mm256_set1_ps(kExp2P[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2P[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fl), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}
#endif

inline float row_max(const float* s, int64_t len) {
  int64_t x = 0;
  float m = kNegInf;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vm = _mm256_set1_ps(kNegInf);
  for (; x + 8 <= len; x += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + x));
  m = hmax8(vm);
#endif
  for (; x < len; ++x) m = std::max(m, s[x]);
  return m;
}

// s[x] = 2^(s[x] - m) for x < len; their sum.
inline float exp2_sum(float* s, int64_t len, float m) {
  int64_t x = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; x + 8 <= len; x += 8) {
    const __m256 e = exp2_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + x), mv));
    _mm256_storeu_ps(s + x, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; x < len; ++x) {
    s[x] = exp2_neg(s[x] - m);
    sum += s[x];
  }
  return sum;
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be fp32 on the CPU");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              name, " must be [tokens, heads, head dim] with each token's heads contiguous");
}

// q [n, heads, d]; k, v [m, kv_heads, d]; out [n, heads, d] (each token's heads contiguous; rows
// may be strided). offset >= 0: query i sees keys j <= i + offset (causal after `offset` prefix
// keys); offset < 0: every key. lse: [n, heads] (ln of the softmax's denominator over the scaled
// scores, as torch's flash kernel), or empty.
void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
               const at::Tensor& lse, double scale, int64_t offset) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  check_rows(out, "out");
  TORCH_CHECK(sgemm_ptr() != nullptr, "torch's BLAS has no sgemm_");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), m = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == d && out.sizes() == q.sizes(), "q/k/v/out shapes disagree");
  TORCH_CHECK(m > 0, "attention needs at least one key");
  TORCH_CHECK(offset < 0 || m >= n + offset, "a causal call needs the prefix and every query's own key");
  const bool want_lse = lse.numel() > 0;
  if (want_lse) {
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == n && lse.size(1) == heads &&
                    lse.stride(1) == 1,
                "lse must be fp32 [n, heads] with each row contiguous");
  }
  if (n == 0) return;
  const int64_t g = heads / kv_heads;
  const int64_t pos = std::max<int64_t>(1, kRows / g);  // positions per work item
  const int64_t blocks = (n + pos - 1) / pos, items = blocks * kv_heads;
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);
  const int64_t sl = want_lse ? lse.stride(0) : 0;
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  float* od = out.data_ptr<float>();
  float* ld = want_lse ? lse.data_ptr<float>() : nullptr;
  const bool causal = offset >= 0;
  const float qscale = static_cast<float>(scale) * kLog2e;
  const int64_t rows_max = pos * g, keys_max = std::min(kKeys, m);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qb(rows_max * d), sb(rows_max * keys_max), ob(rows_max * d), mx(rows_max), sum(rows_max);
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      const int64_t blk = blocks - 1 - it / kv_heads, j = it % kv_heads;  // the longest rows first
      const int64_t a = blk * pos, r = std::min(pos, n - a), rows = r * g;
      // Row t * g + h: position a + t, query head j * g + h, pre-scaled.
      for (int64_t t = 0; t < r; ++t) {
        for (int64_t h = 0; h < g; ++h) {
          const float* src = qd + (a + t) * sq + (j * g + h) * d;
          float* dst = qb.data() + (t * g + h) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * qscale;
        }
      }
      std::fill(mx.begin(), mx.begin() + rows, kNegInf);
      std::fill(sum.begin(), sum.begin() + rows, 0.0f);
      const int64_t end = causal ? std::min(m, a + r + offset) : m;
      for (int64_t c = 0; c < end; c += kKeys) {
        const int64_t kb = std::min(kKeys, end - c);
        // scores [rows, kb] (row-major, row stride keys_max) = Q K^T
        sgemm('T', 'N', kb, rows, d, kd + c * sk + j * d, sk, qb.data(), d, 0.0f, sb.data(), keys_max);
        for (int64_t row = 0; row < rows; ++row) {
          float* s = sb.data() + row * keys_max;
          int64_t seen = kb;
          if (causal) {
            seen = std::clamp<int64_t>(a + row / g + offset - c + 1, 0, kb);
            std::fill(s + seen, s + kb, 0.0f);  // hidden keys weigh nothing in P V
            if (seen == 0) continue;
          }
          const float top = std::max(mx[row], row_max(s, seen));
          const float part = exp2_sum(s, seen, top);
          if (c > 0 && top != mx[row]) {  // earlier blocks' weights, relative to the new maximum
            const float alpha = exp2_neg(mx[row] - top);
            sum[row] *= alpha;
            float* o = ob.data() + row * d;
            for (int64_t x = 0; x < d; ++x) o[x] *= alpha;
          }
          sum[row] += part;
          mx[row] = top;
        }
        // out [rows, d] (+)= P V
        sgemm('N', 'N', d, rows, kb, vd + c * sv + j * d, sv, sb.data(), keys_max, c > 0 ? 1.0f : 0.0f, ob.data(), d);
      }
      for (int64_t t = 0; t < r; ++t) {
        for (int64_t h = 0; h < g; ++h) {
          const int64_t row = t * g + h;
          const float inv = 1.0f / sum[row];
          const float* o = ob.data() + row * d;
          float* dst = od + (a + t) * so + (j * g + h) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = o[x] * inv;
          if (ld != nullptr) ld[(a + t) * sl + j * g + h] = (mx[row] + std::log2(sum[row])) / kLog2e;
        }
      }
    }
  });
}

bool has_blas() { return sgemm_ptr() != nullptr; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(po_fused, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, float scale, int offset) -> ()");
  m.def("attention_has_blas() -> bool", &has_blas);
}

TORCH_LIBRARY_IMPL(po_fused, CPU, m) { m.impl("attention", &attention); }
