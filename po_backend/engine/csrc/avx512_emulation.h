// Portable stand-ins for the AVX512 / AVX512-BF16 intrinsics attention_bf16.cpp uses, so the same
// kernel source builds and runs on any x86 CPU (-DPO_EMULATE_AVX512). Used only by the test suite:
// it runs the kernel's tiling, masking, online softmax and item logic on CPUs without avx512_bf16.
// Lane-for-lane semantics of Intel's definitions; speed is not a goal.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace po_emu {

struct i32x16;
struct bf16x32;

struct f32x16 {
  float v[16];
};
struct i32x16 {
  int32_t v[16];
  i32x16() = default;
  explicit i32x16(const bf16x32& b);
};
struct bf16x32 {
  uint16_t v[32];
  bf16x32() = default;
  explicit bf16x32(const i32x16& i) { std::memcpy(v, i.v, 64); }
};
inline i32x16::i32x16(const bf16x32& b) { std::memcpy(v, b.v, 64); }
struct bf16x16 {
  uint16_t v[16];
};
struct i8x32 {
  uint16_t v[16];
  i8x32() = default;
  explicit i8x32(const bf16x16& b) { std::memcpy(v, b.v, 32); }
};
using mask16 = uint16_t;

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as vcvtneps2bf16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

#define PO_EMU_MAP(expr)        \
  f32x16 r;                     \
  for (int i = 0; i < 16; ++i) { \
    r.v[i] = (expr);            \
  }                             \
  return r

inline f32x16 set1_ps(float x) { PO_EMU_MAP(x); }
inline f32x16 setzero_ps() { PO_EMU_MAP(0.0f); }
inline f32x16 add_ps(f32x16 a, f32x16 b) { PO_EMU_MAP(a.v[i] + b.v[i]); }
inline f32x16 sub_ps(f32x16 a, f32x16 b) { PO_EMU_MAP(a.v[i] - b.v[i]); }
inline f32x16 mul_ps(f32x16 a, f32x16 b) { PO_EMU_MAP(a.v[i] * b.v[i]); }
inline f32x16 max_ps(f32x16 a, f32x16 b) { PO_EMU_MAP(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline f32x16 fmadd_ps(f32x16 a, f32x16 b, f32x16 c) { PO_EMU_MAP(std::fma(a.v[i], b.v[i], c.v[i])); }
inline f32x16 fmsub_ps(f32x16 a, f32x16 b, f32x16 c) { PO_EMU_MAP(std::fma(a.v[i], b.v[i], -c.v[i])); }
inline f32x16 scalef_ps(f32x16 a, f32x16 b) { PO_EMU_MAP(std::ldexp(a.v[i], static_cast<int>(std::floor(b.v[i])))); }
inline f32x16 roundscale_ps(f32x16 a, int) { PO_EMU_MAP(std::nearbyint(a.v[i])); }
inline f32x16 loadu_ps(const void* p) {
  f32x16 r;
  std::memcpy(r.v, p, 64);
  return r;
}
inline void storeu_ps(void* p, f32x16 a) { std::memcpy(p, a.v, 64); }
inline float cvtss_f32(f32x16 a) { return a.v[0]; }
inline f32x16 maskz_mov_ps(mask16 k, f32x16 a) { PO_EMU_MAP((k >> i) & 1 ? a.v[i] : 0.0f); }
inline f32x16 mask_blend_ps(mask16 k, f32x16 a, f32x16 b) { PO_EMU_MAP((k >> i) & 1 ? b.v[i] : a.v[i]); }
inline f32x16 shuffle_f32x4(f32x16 a, f32x16 b, int imm) {
  f32x16 r;
  for (int lane = 0; lane < 4; ++lane) {
    const f32x16& src = lane < 2 ? a : b;
    const int sel = (imm >> (2 * lane)) & 3;
    for (int j = 0; j < 4; ++j) r.v[4 * lane + j] = src.v[4 * sel + j];
  }
  return r;
}
inline f32x16 permute_ps(f32x16 a, int imm) {
  f32x16 r;
  for (int lane = 0; lane < 4; ++lane)
    for (int j = 0; j < 4; ++j) r.v[4 * lane + j] = a.v[4 * lane + ((imm >> (2 * j)) & 3)];
  return r;
}
// vdpbf16ps: each fp32 lane += the two bf16 products of its pair.
inline f32x16 dpbf16_ps(f32x16 acc, bf16x32 a, bf16x32 b) {
  PO_EMU_MAP(acc.v[i] + bf16_to_f32(a.v[2 * i]) * bf16_to_f32(b.v[2 * i]) +
             bf16_to_f32(a.v[2 * i + 1]) * bf16_to_f32(b.v[2 * i + 1]));
}
#undef PO_EMU_MAP

inline i32x16 set1_epi32(int32_t x) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline i32x16 setr_epi32(int32_t a0, int32_t a1, int32_t a2, int32_t a3, int32_t a4, int32_t a5, int32_t a6,
                         int32_t a7, int32_t a8, int32_t a9, int32_t a10, int32_t a11, int32_t a12, int32_t a13,
                         int32_t a14, int32_t a15) {
  i32x16 r;
  const int32_t v[16] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15};
  std::memcpy(r.v, v, 64);
  return r;
}
inline i32x16 add_epi32(i32x16 a, i32x16 b) {
  i32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline i32x16 loadu_si512(const void* p) {
  i32x16 r;
  std::memcpy(r.v, p, 64);
  return r;
}
inline void store_si512(void* p, i32x16 a) { std::memcpy(p, a.v, 64); }
enum { CMPINT_LE = 2, CMPINT_NLT = 5 };
inline mask16 cmp_epi32_mask(i32x16 a, i32x16 b, int op) {
  mask16 k = 0;
  for (int i = 0; i < 16; ++i) {
    const bool hit = op == CMPINT_LE ? a.v[i] <= b.v[i] : a.v[i] >= b.v[i];
    k |= static_cast<mask16>(hit) << i;
  }
  return k;
}
// vcvtne2ps2bf16: the low 16 bf16 from b, the high 16 from a.
inline bf16x32 cvtne2ps_pbh(f32x16 a, f32x16 b) {
  bf16x32 r;
  for (int i = 0; i < 16; ++i) {
    r.v[i] = f32_to_bf16(b.v[i]);
    r.v[16 + i] = f32_to_bf16(a.v[i]);
  }
  return r;
}
inline bf16x16 cvtneps_pbh(f32x16 a) {
  bf16x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = f32_to_bf16(a.v[i]);
  return r;
}
inline void storeu_si256(void* p, i8x32 a) { std::memcpy(p, a.v, 32); }

}  // namespace po_emu

// The kernel's names, after the ATen headers (which may have included the real ones).
#define __m512 po_emu::f32x16
#define __m512i po_emu::i32x16
#define __m512bh po_emu::bf16x32
#define __m256i po_emu::i8x32
#define __mmask16 po_emu::mask16
#define _MM_FROUND_TO_NEAREST_INT 0
#define _MM_FROUND_NO_EXC 0
#define _MM_CMPINT_LE po_emu::CMPINT_LE
#define _MM_CMPINT_NLT po_emu::CMPINT_NLT
#define _mm512_set1_ps po_emu::set1_ps
#define _mm512_setzero_ps po_emu::setzero_ps
#define _mm512_add_ps po_emu::add_ps
#define _mm512_sub_ps po_emu::sub_ps
#define _mm512_mul_ps po_emu::mul_ps
#define _mm512_max_ps po_emu::max_ps
#define _mm512_fmadd_ps po_emu::fmadd_ps
#define _mm512_fmsub_ps po_emu::fmsub_ps
#define _mm512_scalef_ps po_emu::scalef_ps
#define _mm512_roundscale_ps po_emu::roundscale_ps
#define _mm512_loadu_ps po_emu::loadu_ps
#define _mm512_load_ps po_emu::loadu_ps
#define _mm512_storeu_ps po_emu::storeu_ps
#define _mm512_store_ps po_emu::storeu_ps
#define _mm512_cvtss_f32 po_emu::cvtss_f32
#define _mm512_maskz_mov_ps po_emu::maskz_mov_ps
#define _mm512_mask_blend_ps po_emu::mask_blend_ps
#define _mm512_shuffle_f32x4 po_emu::shuffle_f32x4
#define _mm512_permute_ps po_emu::permute_ps
#define _mm512_dpbf16_ps po_emu::dpbf16_ps
#define _mm512_set1_epi32 po_emu::set1_epi32
#define _mm512_setr_epi32 po_emu::setr_epi32
#define _mm512_add_epi32 po_emu::add_epi32
#define _mm512_loadu_si512 po_emu::loadu_si512
#define _mm512_store_si512 po_emu::store_si512
#define _mm512_cmp_epi32_mask po_emu::cmp_epi32_mask
#define _mm512_cvtne2ps_pbh po_emu::cvtne2ps_pbh
#define _mm512_cvtneps_pbh po_emu::cvtneps_pbh
#define _mm256_storeu_si256 po_emu::storeu_si256
