// Flash-attention style CPU attention whose FLOPs run on AVX512-BF16 dot-product units
// (vdpbf16ps: 32 bf16 multiply-adds into 16 fp32 lanes per instruction).
//
// Why: torch's CPU SDPA reaches AMX through oneDNN but on AVX512-BF16 CPUs without AMX (AMD EPYC)
// its bf16 path runs at fp32 speed. Built on first use by po_backend/attention_cpu.py; only ever
// loaded on a CPU whose /proc/cpuinfo lists avx512_bf16 (the kernel functions are compiled for
// that target; the registration code is not).
//
// One op, po_attn::fwd, covers every shape the engine needs. Keys live in one index space made
// of two segments:
//   A (ka/va, p keys): seen by every query (a cached prefix, or all keys of a non-causal call);
//   B (kb/vb, n keys, the queries' own tokens): query token t sees own key c iff
//     starts[t] <= c <= t (causal; starts = the first token of t's item, 0 without items).
// Outputs the normalised attention (bf16 or fp32) and optionally the natural log-sum-exp of each
// (token, head), which is what merging partial attentions needs.
//
// Layout per work item (one KV head, a block of query tokens): the query heads sharing that KV
// head are rows of one tile (row = token * g + head), so every packed K/V block is read once for
// all of them. Per key block of KB = 128 keys and per strip of up to 6 rows:
//   S = Q K^T in sub-strips of 3 rows x 8 zmm accumulators (K packed as [block][d/2][128][2],
//   Q pairs broadcast), fp32 online softmax in base 2 (exp2 by a degree-4 minimax polynomial,
//   relative error 2.6e-6, far below bf16's 2^-9 rounding of P), P rounded to bf16,
//   O (fp32, in L1) rescaled and += P V with V packed as [key pair][d][2], P pairs broadcast.
// Key blocks no row of a strip can see are skipped (causal block skipping; items skip the other
// items' blocks); masking is applied only on blocks a row sees partly.
// Threads (at::parallel_for) pull work items from an atomic counter, most expensive first, so the
// causal triangle's uneven items balance across cores.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#ifdef PO_EMULATE_AVX512
#include "avx512_emulation.h"  // the test suite's build for CPUs without avx512_bf16
#else
#include <immintrin.h>
#endif

namespace {

constexpr int KB = 128;      // keys per block
constexpr int MAX_RS = 6;    // rows per register strip
constexpr int ROWS_TARGET = 72;  // rows (tokens x heads of a group) per work item

struct Job {
  int64_t kvh;
  int64_t t0, t1;  // query tokens [t0, t1)
  int64_t cost;
};

#ifndef PO_EMULATE_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#endif

// 2^x for finite x <= 0 (softmax arguments; -inf gives NaN, which callers mask to 0). n = round(x),
// f = x - n in [-0.5, 0.5], 2^f by a degree-4 minimax polynomial (relative error 2.6e-6 over the
// interval, 1500x below the bf16 rounding P gets next); scalef gives exactly 0 for n below the
// fp32 range.
static inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.570068679749966e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917806923389435e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443318367e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931218504905701e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512i bcast32(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The running max starts at this instead of -inf, so that exp2(m_old - m_new) never sees
// -inf - -inf; a row whose keys were all masked so far gets weight exactly 0 once it sees one.
constexpr float M_INIT = -1e30f;
constexpr int NC = KB / 16;  // score vectors per row and key block
constexpr int QR = 3;        // rows per QK sub-strip (QR * NC accumulators)

// Per-row state of a work item.
struct alignas(64) Row {
  float l[16];        // running sum of exp2, per lane (summed at the end)
  const uint16_t* q;  // the row's query vector (bf16)
  int64_t tok;        // query token index
  int64_t start;      // first own key it may see (item start)
  float m;            // running max of scaled scores (base 2)
};

// Visible block-local key range [lo, hi] of a row for the block starting at global key c0.
struct Range {
  int lo, hi;
};

// S = Q K^T for QN rows x KB keys, online softmax; P (bf16) into pbuf rows, rescale factors into alpha.
template <int QN>
static inline void qk_softmax(Row* rows, const Range* rng, bool need_mask, const uint16_t* kblk, int64_t d,
                              float c2, uint16_t (*pbuf)[KB], float* alpha) {
  __m512 s[QN][NC];
#pragma GCC unroll 8
  for (int r = 0; r < QN; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) s[r][j] = _mm512_setzero_ps();
  const int64_t half = d / 2;
  for (int64_t t = 0; t < half; ++t) {
    // Each K vector is loaded once and used by every row (QN broadcasts + NC loads per step).
    const uint16_t* kt = kblk + t * (KB * 2);
    __m512bh qb[QN];
#pragma GCC unroll 8
    for (int r = 0; r < QN; ++r) qb[r] = (__m512bh)bcast32(rows[r].q + 2 * t);
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + 32 * j);
#pragma GCC unroll 8
      for (int r = 0; r < QN; ++r) s[r][j] = _mm512_dpbf16_ps(s[r][j], qb[r], kv);
    }
  }
  const __m512 vc = _mm512_set1_ps(c2);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 8
  for (int r = 0; r < QN; ++r) {
    __mmask16 vis[NC];
    if (need_mask) {
#pragma GCC unroll 8
      for (int j = 0; j < NC; ++j) {
        const __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * j));
        vis[j] = _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(rng[r].lo), _MM_CMPINT_NLT) &
                 _mm512_cmp_epi32_mask(idx, _mm512_set1_epi32(rng[r].hi), _MM_CMPINT_LE);
        s[r][j] = _mm512_mask_blend_ps(vis[j], ninf, s[r][j]);
      }
    }
    __m512 mx = s[r][0];
#pragma GCC unroll 8
    for (int j = 1; j < NC; ++j) mx = _mm512_max_ps(mx, s[r][j]);
    // Max across lanes by shuffles: every lane ends with the row max (no scalar round trip).
    mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0x4E));
    mx = _mm512_max_ps(mx, _mm512_shuffle_f32x4(mx, mx, 0xB1));
    mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0x4E));
    mx = _mm512_max_ps(mx, _mm512_permute_ps(mx, 0xB1));
    const __m512 m_old = _mm512_set1_ps(rows[r].m);
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(mx, vc));
    const __m512 a = exp2_ps(_mm512_sub_ps(m_old, m_new));
    __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < NC; ++j) {
      s[r][j] = exp2_ps(_mm512_fmsub_ps(s[r][j], vc, m_new));
      if (need_mask) s[r][j] = _mm512_maskz_mov_ps(vis[j], s[r][j]);  // exp2(-inf) is NaN here
      sum = _mm512_add_ps(sum, s[r][j]);
    }
    _mm512_store_ps(rows[r].l, _mm512_fmadd_ps(_mm512_load_ps(rows[r].l), a, sum));
    rows[r].m = _mm512_cvtss_f32(m_new);
    alpha[r] = _mm512_cvtss_f32(a);
#pragma GCC unroll 8
    for (int j = 0; j < NC; j += 2)
      _mm512_store_si512(&pbuf[r][16 * j], (__m512i)_mm512_cvtne2ps_pbh(s[r][j + 1], s[r][j]));
  }
}

// One strip of RS rows against one key block: QK + softmax in sub-strips of QR rows, then
// O = alpha * O + P V over all RS rows (64 output dims = 4 accumulators per row at a time).
template <int RS>
static inline void strip(Row* rows, const Range* rng, bool need_mask, const uint16_t* kblk,
                         const uint16_t* vblk, float* o, int64_t d, float c2) {
  alignas(64) uint16_t pbuf[RS][KB];
  float alpha[RS];
  qk_softmax<(RS < QR ? RS : QR)>(rows, rng, need_mask, kblk, d, c2, pbuf, alpha);
  if constexpr (RS > QR) {
    constexpr int R2 = RS - QR;
    qk_softmax<R2>(rows + QR, rng + QR, need_mask, kblk, d, c2, pbuf + QR, alpha + QR);
  }
  for (int64_t e0 = 0; e0 < d; e0 += 64) {
    __m512 acc[RS][4];
#pragma GCC unroll 8
    for (int r = 0; r < RS; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + e0 + 16 * j));
    }
    for (int sp = 0; sp < KB / 2; ++sp) {
      const uint16_t* vp = vblk + (sp * d + e0) * 2;
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + 32);
      const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vp + 64);
      const __m512bh v3 = (__m512bh)_mm512_loadu_si512(vp + 96);
#pragma GCC unroll 8
      for (int r = 0; r < RS; ++r) {
        const __m512bh pb = (__m512bh)bcast32(&pbuf[r][2 * sp]);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pb, v2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pb, v3);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RS; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + r * d + e0 + 16 * j, acc[r][j]);
  }
}

using StripFn = void (*)(Row*, const Range*, bool, const uint16_t*, const uint16_t*, float*, int64_t, float);
static const StripFn STRIPS[MAX_RS + 1] = {nullptr, strip<1>, strip<2>, strip<3>, strip<4>, strip<5>, strip<6>};

// Packs keys [0, len) of src ([len, kv_heads, d] bf16, any row/head strides) into the block layouts
// at key offset `off` of the packed buffers of every KV head:
//   kp: [kvh][block][d/2][KB][2], vp: [kvh][key pair][d][2]. Keys past len are left as zeros.
static void pack(const at::Tensor& k, const at::Tensor& v, uint16_t* kp, uint16_t* vp, int64_t off,
                 int64_t total, int64_t d) {
  const int64_t len = k.size(0), kvh = k.size(1);
  const auto* kb = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vb = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t nblk = (len + KB - 1) / KB;
  at::parallel_for(0, kvh * nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t w = b0; w < b1; ++w) {
      const int64_t h = w / nblk, blk = w % nblk;
      uint16_t* kh = kp + h * total * d;
      uint16_t* vh = vp + h * total * d;
      const int64_t c_end = std::min(len, (blk + 1) * KB);
      for (int64_t c = blk * KB; c < c_end; ++c) {
        const int64_t g = off + c;  // global key index (off is a multiple of KB)
        const uint16_t* kr = kb + c * ks0 + h * ks1;
        const uint16_t* vr = vb + c * vs0 + h * vs1;
        uint16_t* kdst = kh + (g / KB) * KB * d + (g % KB) * 2;
        uint16_t* vdst = vh + (g / 2) * d * 2 + (g % 2);
        for (int64_t t = 0; t < d / 2; ++t) {
          kdst[t * KB * 2] = kr[2 * t];
          kdst[t * KB * 2 + 1] = kr[2 * t + 1];
        }
        for (int64_t e = 0; e < d; ++e) vdst[e * 2] = vr[e];
      }
    }
  });
}

template <typename OutT>
static void write_row(OutT* dst, const float* o, float inv_l, int64_t d);

template <>
void write_row<float>(float* dst, const float* o, float inv_l, int64_t d) {
  const __m512 s = _mm512_set1_ps(inv_l);
  for (int64_t e = 0; e < d; e += 16) _mm512_storeu_ps(dst + e, _mm512_mul_ps(_mm512_loadu_ps(o + e), s));
}

template <>
void write_row<uint16_t>(uint16_t* dst, const float* o, float inv_l, int64_t d) {
  const __m512 s = _mm512_set1_ps(inv_l);
  for (int64_t e = 0; e < d; e += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + e), s)));
}

template <typename OutT>
static void run(const at::Tensor& q, int64_t kv_heads, const uint16_t* kp, const uint16_t* vp, int64_t p,
                int64_t pa, bool own, int64_t total, const int32_t* starts, const at::Tensor& out,
                const at::Tensor& lse, bool has_lse, double scale) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t g = heads / kv_heads;
  const auto* qb = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  auto* ob = reinterpret_cast<OutT*>(out.data_ptr());
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  float* lb = has_lse ? lse.data_ptr<float>() : nullptr;
  const int64_t ls0 = has_lse ? lse.stride(0) : 0, ls1 = has_lse ? lse.stride(1) : 0;
  auto start_of = [&](int64_t t) -> int64_t { return starts ? starts[t] : 0; };

  const int64_t bt = std::max<int64_t>(1, ROWS_TARGET / g);  // query tokens per job
  std::vector<Job> jobs;
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t t0 = 0; t0 < n; t0 += bt) {
      const int64_t t1 = std::min(n, t0 + bt);
      int64_t cost = pa;
      if (own) {
        int64_t lo = t1;
        for (int64_t t = t0; t < t1; ++t) lo = std::min(lo, start_of(t));
        cost += t1 - lo;
      }
      jobs.push_back({h, t0, t1, cost});
    }
  // Longest first: with a dynamic queue that bounds the imbalance by the cheapest jobs.
  std::stable_sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.cost > b.cost; });
  const float c2 = static_cast<float>(scale * M_LOG2E);
  const int64_t max_rows = bt * g;
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (int64_t)jobs.size()));

  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::vector<float> obuf(max_rows * d);
    std::vector<Row> rows(max_rows);
    std::vector<Range> rng(max_rows);
    for (int64_t ji; (ji = next.fetch_add(1)) < (int64_t)jobs.size();) {
      const Job& job = jobs[ji];
      const int64_t R = (job.t1 - job.t0) * g;
      int64_t min_start = job.t1;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t tok = job.t0 + r / g, head = job.kvh * g + r % g;
        rows[r].q = qb + tok * qs0 + head * qs1;
        rows[r].tok = tok;
        rows[r].start = own ? start_of(tok) : 0;
        rows[r].m = M_INIT;
        std::fill(rows[r].l, rows[r].l + 16, 0.f);
        min_start = std::min(min_start, rows[r].start);
      }
      std::fill(obuf.begin(), obuf.begin() + R * d, 0.f);
      const uint16_t* kh = kp + job.kvh * total * d;
      const uint16_t* vh = vp + job.kvh * total * d;
      // Prefix segment: every row sees keys [0, p); the last block may be partly padding.
      for (int64_t c0 = 0; c0 < pa; c0 += KB) {
        const int hi = static_cast<int>(std::min<int64_t>(KB, p - c0)) - 1;
        for (int64_t r0 = 0; r0 < R; r0 += MAX_RS) {
          const int rs = static_cast<int>(std::min<int64_t>(MAX_RS, R - r0));
          for (int r = 0; r < rs; ++r) rng[r0 + r] = {0, hi};
          STRIPS[rs](&rows[r0], &rng[r0], hi < KB - 1, kh + c0 * d, vh + c0 * d, &obuf[r0 * d], d, c2);
        }
      }
      // Own segment: row sees own keys [start, tok]; blocks nobody in a strip sees are skipped.
      if (own) {
        for (int64_t cb = (min_start / KB) * KB; cb < job.t1; cb += KB) {
          const int64_t gk = pa + cb;
          for (int64_t r0 = 0; r0 < R; r0 += MAX_RS) {
            const int rs = static_cast<int>(std::min<int64_t>(MAX_RS, R - r0));
            bool any = false, mask = false;
            for (int r = 0; r < rs; ++r) {
              const Row& row = rows[r0 + r];
              const int64_t lo = std::max<int64_t>(row.start - cb, 0);
              const int64_t hi = std::min<int64_t>(row.tok - cb, KB - 1);
              rng[r0 + r] = {static_cast<int>(std::min<int64_t>(lo, KB)), static_cast<int>(std::max<int64_t>(hi, -1))};
              any |= lo <= hi;
              mask |= lo > 0 || hi < KB - 1;
            }
            if (!any) continue;
            STRIPS[rs](&rows[r0], &rng[r0], mask, kh + gk * d, vh + gk * d, &obuf[r0 * d], d, c2);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        const Row& row = rows[r];
        const float l = std::accumulate(row.l, row.l + 16, 0.f);
        const int64_t head = job.kvh * g + r % g;
        // A row that saw no key (only possible for an empty prefix): zeros and lse = -inf.
        const float inv_l = l > 0.f ? 1.f / l : 0.f;
        write_row<OutT>(ob + row.tok * os0 + head * os1, &obuf[r * d], inv_l, d);
        if (lb)
          lb[row.tok * ls0 + head * ls1] =
              l > 0.f ? row.m * static_cast<float>(M_LN2) + std::log(l)
                          : -std::numeric_limits<float>::infinity();
      }
    }
  });
}

#ifndef PO_EMULATE_AVX512
#pragma GCC pop_options
#endif

void check_kv(const at::Tensor& k, const at::Tensor& v, int64_t d, const char* what) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), what, ": K and V must be [keys, kv_heads, d] alike");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, what, ": bf16 only");
  TORCH_CHECK(k.size(2) == d && k.stride(2) == 1 && v.stride(2) == 1, what, ": head dim must match q, contiguous");
}

void fwd(const at::Tensor& q, const at::Tensor& ka, const at::Tensor& va, const at::Tensor& kb,
         const at::Tensor& vb, const at::Tensor& starts, const at::Tensor& out, const at::Tensor& lse,
         double scale, bool has_lse) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q: [n, heads, d] bf16");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 64 == 0, "head dim must be a multiple of 64, got ", d);
  check_kv(ka, va, d, "prefix");
  check_kv(kb, vb, d, "own");
  const int64_t p = ka.size(0), nb = kb.size(0);
  const bool own = nb > 0;
  TORCH_CHECK(!own || nb == n, "own keys must be as many as queries");
  TORCH_CHECK(p > 0 || own, "no keys");
  const int64_t kv_heads = own ? kb.size(1) : ka.size(1);
  TORCH_CHECK(!own || p == 0 || ka.size(1) == kv_heads, "prefix and own K/V differ in heads");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads not a multiple of KV heads");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == n && out.size(1) == heads && out.size(2) == d && out.stride(2) == 1,
              "out: [n, heads, d], last dim contiguous");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, "out: bf16 or fp32");
  if (has_lse)
    TORCH_CHECK(lse.dim() == 2 && lse.size(0) == n && lse.size(1) == heads && lse.scalar_type() == at::kFloat,
                "lse: [n, heads] fp32");
  const int32_t* st = nullptr;
  if (starts.numel()) {
    TORCH_CHECK(own && starts.numel() == n && starts.scalar_type() == at::kInt && starts.is_contiguous(),
                "starts: [n] int32, with own keys");
    st = starts.data_ptr<int32_t>();
  }
  const int64_t pa = (p + KB - 1) / KB * KB;
  const int64_t total = pa + (nb + KB - 1) / KB * KB;
  at::Tensor kp = at::empty({kv_heads, total * d}, q.options());
  at::Tensor vp = at::empty({kv_heads, total * d}, q.options());
  // Padding keys must be zero in V (P is exactly 0 there, and 0 * NaN garbage would be NaN): the
  // last block of each segment is cleared before packing (V pairs of a block lie within it).
  for (int64_t seg_end : {pa, total})
    if (seg_end > 0) {
      kp.narrow(1, (seg_end - KB) * d, KB * d).zero_();
      vp.narrow(1, (seg_end - KB) * d, KB * d).zero_();
    }
  auto* kpp = reinterpret_cast<uint16_t*>(kp.data_ptr());
  auto* vpp = reinterpret_cast<uint16_t*>(vp.data_ptr());
  if (p) pack(ka, va, kpp, vpp, 0, total, d);
  if (own) pack(kb, vb, kpp, vpp, pa, total, d);
  if (out.scalar_type() == at::kBFloat16)
    run<uint16_t>(q, kv_heads, kpp, vpp, p, pa, own, total, st, out, lse, has_lse, scale);
  else
    run<float>(q, kv_heads, kpp, vpp, p, pa, own, total, st, out, lse, has_lse, scale);
}

}  // namespace

TORCH_LIBRARY(po_attn, m) {
  m.def(
      "fwd(Tensor q, Tensor ka, Tensor va, Tensor kb, Tensor vb, Tensor starts, Tensor(a!) out, "
      "Tensor(b!) lse, float scale, bool has_lse) -> ()");
}

TORCH_LIBRARY_IMPL(po_attn, CPU, m) { m.impl("fwd", &fwd); }
