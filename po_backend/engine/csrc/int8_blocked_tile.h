// The register tile of int8_blocked.cpp, included once per instruction set with PO_NS (its
// namespace) and PO_DOT(acc, ax, sw) (acc += the 4-byte dot products of unsigned ax and signed sw,
// exact in int32) defined, under that set's `#pragma GCC target`; and optionally
// PO_STEP4(acc, w, x0, x1, x2, x3): the 4-row SIGN_X step (4 k, 16 columns) written by hand.
//
// Packed weights: panels of 16 output columns; inside a panel, for every 4 consecutive k, the 16
// columns' 4 bytes (64 bytes: two vectors of 8 columns x 4 k). Scales: per panel, per block, 16.
// One call: rows [0, R) of x from `x`, one panel, blocks [b0, b1), added into out (b == 0 starts
// from zero). The int32 dot of a block is exact; each block's product with its scale is added to
// the fp32 output in increasing block order, with no FMA (-ffp-contract=off), so every output
// element has the same arithmetic whatever the tile shape, thread or row count.

namespace PO_NS {

// BL: the block size when known at compile time (the 32 of Q8_0: the k loop unrolls), else 0.
// SIGN_X: the unsigned operand is |w| (vpabsb, shared by the tile's rows) and x carries w's sign,
// so a row needs one broadcast per 4 k and no |x| copy; it needs x != -128 (-(-128) is not an
// int8). Otherwise the unsigned operand is |x| (`ax`) and w carries x's sign.
// The fp32 sums live in `ob` (the tile's rows, in L1), not in registers: the int32 accumulators,
// the weights and the broadcasts then fit the 16 vector registers without spilling.
template <int R, int BL, bool SIGN_X>
static void tile(const int8_t* x, const uint8_t* ax, int64_t ldx, const float* xs, int64_t nb,
                 const int8_t* wp, const float* wsp, int64_t span, int64_t b0, int64_t b1, int block_, float* out,
                 int64_t ldo, int ncols) {
#ifndef PO_VNNI_DOT
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  const int block = BL > 0 ? BL : block_;
  alignas(32) float ob[R][16];
  for (int r = 0; r < R; ++r) {
    if (b0 == 0)
      std::memset(ob[r], 0, sizeof(ob[r]));
    else
      std::memcpy(ob[r], out + r * ldo, sizeof(float) * ncols);
  }
  // One weight scale per `span` blocks (1: per block; nb: per output channel), read in place.
  const float* sp = wsp + (b0 / span) * 16;
  int64_t sr = b0 % span;
  for (int64_t b = b0; b < b1; ++b) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int64_t kb = b * block;
    const int8_t* w = wp + kb * 16;
#pragma GCC unroll 8
    for (int g = 0; g < block / 4; ++g) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32));
#ifdef PO_STEP4
      if constexpr (SIGN_X && R == 4) {
        const int8_t* xg = x + kb + 4 * g;
        PO_STEP4(acc, w + g * 64, xg, xg + ldx, xg + 2 * ldx, xg + 3 * ldx);
        continue;
      }
#endif
      if constexpr (SIGN_X) {
        const __m256i a0 = _mm256_abs_epi8(w0);
        const __m256i a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; ++r) {
          int32_t xv;
          std::memcpy(&xv, x + r * ldx + kb + 4 * g, 4);
          const __m256i xb = _mm256_set1_epi32(xv);
          // |w| (u8, <= 127) times x with w's sign (|x| <= 127): pairs stay within int16.
          PO_DOT(acc[r][0], a0, _mm256_sign_epi8(xb, w0));
          PO_DOT(acc[r][1], a1, _mm256_sign_epi8(xb, w1));
        }
      } else {
        for (int r = 0; r < R; ++r) {
          int32_t xv, av;
          std::memcpy(&xv, x + r * ldx + kb + 4 * g, 4);
          std::memcpy(&av, ax + r * ldx + kb + 4 * g, 4);
          const __m256i xb = _mm256_set1_epi32(xv);
          const __m256i ab = _mm256_set1_epi32(av);
          // |x| (u8) times w with x's sign: vpmaddubsw's pair sums stay within int16 (|x| <= 128,
          // |w| <= 127: 2 * 128 * 127 = 32512 < 32767), so nothing saturates.
          PO_DOT(acc[r][0], ab, _mm256_sign_epi8(w0, xb));
          PO_DOT(acc[r][1], ab, _mm256_sign_epi8(w1, xb));
        }
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sp);
    const __m256 s1 = _mm256_loadu_ps(sp + 8);
    if (++sr == span) {
      sr = 0;
      sp += 16;
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xsr = _mm256_set1_ps(xs[r * nb + b]);
      const __m256 d0 = _mm256_mul_ps(_mm256_mul_ps(xsr, s0), _mm256_cvtepi32_ps(acc[r][0]));
      const __m256 d1 = _mm256_mul_ps(_mm256_mul_ps(xsr, s1), _mm256_cvtepi32_ps(acc[r][1]));
      _mm256_store_ps(ob[r], _mm256_add_ps(_mm256_load_ps(ob[r]), d0));
      _mm256_store_ps(ob[r] + 8, _mm256_add_ps(_mm256_load_ps(ob[r] + 8), d1));
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, ob[r], sizeof(float) * ncols);
}

template <int R>
static void tile_any(const int8_t* x, const uint8_t* ax, int64_t ldx, const float* xs, int64_t nb,
                     const int8_t* wp, const float* wsp, int64_t span, int64_t b0, int64_t b1, int block, float* out,
                     int64_t ldo, int ncols) {
  if (ax == nullptr) {
    if (block == 32)
      tile<R, 32, true>(x, ax, ldx, xs, nb, wp, wsp, span, b0, b1, block, out, ldo, ncols);
    else
      tile<R, 0, true>(x, ax, ldx, xs, nb, wp, wsp, span, b0, b1, block, out, ldo, ncols);
  } else if (block == 32) {
    tile<R, 32, false>(x, ax, ldx, xs, nb, wp, wsp, span, b0, b1, block, out, ldo, ncols);
  } else {
    tile<R, 0, false>(x, ax, ldx, xs, nb, wp, wsp, span, b0, b1, block, out, ldo, ncols);
  }
}

// Panels [p0, p1) (16 columns each), k in cache-sized chunks and rows in groups of MC: a panel's
// chunk (16 KiB) stays in L1 while a row tile passes, the group's rows stay in L2 while the
// panels pass. Per output element the blocks still run in increasing order.
static void panels(const int8_t* x, const uint8_t* ax, const float* xs, int64_t m, int64_t k, int64_t nb,
                   const int8_t* w, const float* ws, int64_t span, int block, float* out, int64_t n, int64_t p0,
                   int64_t p1) {
  const int64_t chunk = std::max<int64_t>(1, KC / block);
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t b1 = std::min(nb, b0 + chunk);
    for (int64_t g0 = 0; g0 < m; g0 += MC) {
      const int64_t g1 = std::min(m, g0 + MC);
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* wp = w + p * k * 16;
        const float* wsp = ws + p * (nb / span) * 16;
        const int64_t col0 = p * 16;
        const int ncols = static_cast<int>(std::min<int64_t>(16, n - col0));
        int64_t r = g0;
        for (; r + MR <= g1; r += MR)
          tile_any<MR>(x + r * k, ax == nullptr ? nullptr : ax + r * k, k, xs + r * nb, nb, wp, wsp, span, b0, b1, block, out + r * n + col0, n,
                       ncols);
        const int64_t left = g1 - r;
        const int8_t* xr = x + r * k;
        const uint8_t* ar = ax == nullptr ? nullptr : ax + r * k;
        const float* xsr = xs + r * nb;
        float* orow = out + r * n + col0;
        if (left == 3) tile_any<3>(xr, ar, k, xsr, nb, wp, wsp, span, b0, b1, block, orow, n, ncols);
        if (left == 2) tile_any<2>(xr, ar, k, xsr, nb, wp, wsp, span, b0, b1, block, orow, n, ncols);
        if (left == 1) tile_any<1>(xr, ar, k, xsr, nb, wp, wsp, span, b0, b1, block, orow, n, ncols);
      }
    }
  }
}

}  // namespace PO_NS
