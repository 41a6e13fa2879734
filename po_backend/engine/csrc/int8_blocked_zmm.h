// The AVX512-VNNI tile of int8_blocked.cpp (512 bits): one vpdpbusd per 64 multiply-adds.
// vpdpbusd takes u8 x s8 and sums 4 products into int32 without saturation, so the activations
// enter as x + 128 (u8) and each block's accumulator starts at -128 * sum(w) over the block
// (`comp`, computed when the weights are packed): the int32 dot is exact, as on the other paths.
// The panel layout is the same: 16 columns x 4 k = 64 bytes = one register. With
// PO_EMULATE_VNNI the few 512-bit operations used are portable stand-ins (tests on CPUs without
// AVX-512).

namespace zmm {

#ifdef PO_EMULATE_VNNI
struct vi {
  int32_t v[16];
};
struct vf {
  float v[16];
};
static inline vi load_i(const void* p) {
  vi r;
  std::memcpy(r.v, p, 64);
  return r;
}
static inline vi bcast_i(int32_t x) {
  vi r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
static inline vi dpbusd(vi acc, vi a, vi b) {
  uint8_t ua[64];
  int8_t sb[64];
  std::memcpy(ua, a.v, 64);
  std::memcpy(sb, b.v, 64);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 4; ++j) acc.v[i] += static_cast<int32_t>(ua[4 * i + j]) * static_cast<int32_t>(sb[4 * i + j]);
  return acc;
}
static inline vf load_f(const float* p) {
  vf r;
  std::memcpy(r.v, p, 64);
  return r;
}
static inline void store_f(float* p, vf a) { std::memcpy(p, a.v, 64); }
static inline vf bcast_f(float x) {
  vf r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
static inline vf zero_f() { return bcast_f(0.0f); }
static inline vf cvt(vi a) {
  vf r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}
static inline vf mul(vf a, vf b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
static inline vf add(vf a, vf b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
#else
using vi = __m512i;
using vf = __m512;
static inline vi load_i(const void* p) { return _mm512_loadu_si512(p); }
static inline vi bcast_i(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi dpbusd(vi acc, vi a, vi b) { return _mm512_dpbusd_epi32(acc, a, b); }
static inline vf load_f(const float* p) { return _mm512_loadu_ps(p); }
static inline void store_f(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf bcast_f(float x) { return _mm512_set1_ps(x); }
static inline vf zero_f() { return _mm512_setzero_ps(); }
static inline vf cvt(vi a) { return _mm512_cvtepi32_ps(a); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
#endif

constexpr int ZR = 8;  // rows per register tile (8 int32 + 8 fp32 accumulators of 32 registers)

template <int R>
static void tile(const uint8_t* xu, int64_t ldx, const float* xs, int64_t nb, const int8_t* wp, const float* wsp,
                 int64_t span, const int32_t* comp, int64_t b0, int64_t b1, int block, float* out, int64_t ldo, int ncols) {
  vf o[R];
  for (int r = 0; r < R; ++r) {
    if (b0 == 0) {
      o[r] = zero_f();
    } else {
      alignas(64) float buf[16] = {};
      std::memcpy(buf, out + r * ldo, sizeof(float) * ncols);
      o[r] = load_f(buf);
    }
  }
  const float* sp = wsp + (b0 / span) * 16;  // one weight scale per `span` blocks
  int64_t sr = b0 % span;
  for (int64_t b = b0; b < b1; ++b) {
    const vi start = load_i(comp + b * 16);
    vi acc[R];
    for (int r = 0; r < R; ++r) acc[r] = start;
    const int64_t kb = b * block;
    const int8_t* w = wp + kb * 16;
    for (int g = 0; g < block / 4; ++g) {
      const vi wv = load_i(w + g * 64);
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, xu + r * ldx + kb + 4 * g, 4);
        acc[r] = dpbusd(acc[r], bcast_i(xv), wv);
      }
    }
    const vf s = load_f(sp);
    if (++sr == span) {
      sr = 0;
      sp += 16;
    }
    for (int r = 0; r < R; ++r) o[r] = add(o[r], mul(mul(bcast_f(xs[r * nb + b]), s), cvt(acc[r])));
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float buf[16];
    store_f(buf, o[r]);
    std::memcpy(out + r * ldo, buf, sizeof(float) * ncols);
  }
}

static void panels(const uint8_t* xu, const float* xs, int64_t m, int64_t k, int64_t nb, const int8_t* w,
                   const float* ws, int64_t span, const int32_t* comp, int block, float* out, int64_t n, int64_t p0, int64_t p1) {
  const int64_t chunk = std::max<int64_t>(1, KC / block);
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t b1 = std::min(nb, b0 + chunk);
    for (int64_t g0 = 0; g0 < m; g0 += MC) {
      const int64_t g1 = std::min(m, g0 + MC);
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* wp = w + p * k * 16;
        const float* wsp = ws + p * (nb / span) * 16;
        const int32_t* cp = comp + p * nb * 16;
        const int64_t col0 = p * 16;
        const int ncols = static_cast<int>(std::min<int64_t>(16, n - col0));
        int64_t r = g0;
        for (; r + ZR <= g1; r += ZR)
          tile<ZR>(xu + r * k, k, xs + r * nb, nb, wp, wsp, span, cp, b0, b1, block, out + r * n + col0, n, ncols);
        for (; r < g1; ++r)  // the same arithmetic per element, one row at a time
          tile<1>(xu + r * k, k, xs + r * nb, nb, wp, wsp, span, cp, b0, b1, block, out + r * n + col0, n, ncols);
      }
    }
  }
}

}  // namespace zmm
