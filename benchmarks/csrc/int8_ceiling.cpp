// The CPU's multiply-add ceilings per instruction sequence, in registers (no memory traffic):
// loops of independent accumulators written in inline assembly (the compiler cannot hoist or
// fuse anything), timed by the caller. benchmarks/bench_int8_ceiling.py builds and drives it.
//
// Each kernel runs `iters` iterations of its loop; `threads` copies run at once (one per thread).
// Each thread's own CPU time is what counts: on a shared machine a thread that the scheduler
// takes off its core for a while does not read slow.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <time.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

// 12 independent vfmadd231ps ymm: 12 x 8 multiply-adds per iteration.
__attribute__((target("avx2,fma"))) void fma_ps(int64_t iters) {
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n vxorps %%ymm1, %%ymm1, %%ymm1\n vxorps %%ymm2, %%ymm2, %%ymm2\n"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n vxorps %%ymm4, %%ymm4, %%ymm4\n vxorps %%ymm5, %%ymm5, %%ymm5\n"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n vxorps %%ymm7, %%ymm7, %%ymm7\n vxorps %%ymm8, %%ymm8, %%ymm8\n"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n vxorps %%ymm10, %%ymm10, %%ymm10\n vxorps %%ymm11, %%ymm11, %%ymm11\n"
      "vxorps %%ymm12, %%ymm12, %%ymm12\n vxorps %%ymm13, %%ymm13, %%ymm13\n"
      "1:\n"
      "vfmadd231ps %%ymm12, %%ymm13, %%ymm0\n vfmadd231ps %%ymm12, %%ymm13, %%ymm1\n"
      "vfmadd231ps %%ymm12, %%ymm13, %%ymm2\n vfmadd231ps %%ymm12, %%ymm13, %%ymm3\n"
      "vfmadd231ps %%ymm12, %%ymm13, %%ymm4\n vfmadd231ps %%ymm12, %%ymm13, %%ymm5\n"
      "vfmadd231ps %%ymm12, %%ymm13, %%ymm6\n vfmadd231ps %%ymm12, %%ymm13, %%ymm7\n"
      "vfmadd231ps %%ymm12, %%ymm13, %%ymm8\n vfmadd231ps %%ymm12, %%ymm13, %%ymm9\n"
      "vfmadd231ps %%ymm12, %%ymm13, %%ymm10\n vfmadd231ps %%ymm12, %%ymm13, %%ymm11\n"
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
}

// AVX2 int8 as our tile and llama.cpp do it: w carrying x's sign (vpsignb), |x| u8 x that s8
// (vpmaddubsw, 32 products summed in pairs to int16), pairs to int32 (vpmaddwd by ones), vpaddd.
// 6 independent chains: 6 x 32 multiply-adds per iteration.
#define PO_SIGN_UNIT(acc, t)                  \
  "vpsignb %%ymm14, %%ymm13, %%ymm" t "\n"    \
  "vpmaddubsw %%ymm" t ", %%ymm12, %%ymm" t "\n" \
  "vpmaddwd %%ymm15, %%ymm" t ", %%ymm" t "\n" \
  "vpaddd %%ymm" t ", %%ymm" acc ", %%ymm" acc "\n"
#define PO_NOSIGN_UNIT(acc, t)                 \
  "vpmaddubsw %%ymm13, %%ymm12, %%ymm" t "\n"  \
  "vpmaddwd %%ymm15, %%ymm" t ", %%ymm" t "\n" \
  "vpaddd %%ymm" t ", %%ymm" acc ", %%ymm" acc "\n"
#define PO_INT16_UNIT(acc, t)                  \
  "vpmaddwd %%ymm13, %%ymm12, %%ymm" t "\n"    \
  "vpaddd %%ymm" t ", %%ymm" acc ", %%ymm" acc "\n"

#define PO_INT_SETUP                                                                                   \
  "vpxor %%ymm0, %%ymm0, %%ymm0\n vpxor %%ymm1, %%ymm1, %%ymm1\n vpxor %%ymm2, %%ymm2, %%ymm2\n"       \
  "vpxor %%ymm3, %%ymm3, %%ymm3\n vpxor %%ymm4, %%ymm4, %%ymm4\n vpxor %%ymm5, %%ymm5, %%ymm5\n"       \
  "vpcmpeqw %%ymm15, %%ymm15, %%ymm15\n vpsrlw $15, %%ymm15, %%ymm15\n" /* int16 ones */               \
  "vpcmpeqb %%ymm12, %%ymm12, %%ymm12\n vpabsb %%ymm12, %%ymm12\n"      /* operands: 1s */             \
  "vmovdqa %%ymm12, %%ymm13\n vmovdqa %%ymm12, %%ymm14\n"
#define PO_INT_CLOBBERS                                                                                 \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", \
      "xmm13", "xmm14", "xmm15", "cc"

__attribute__((target("avx2,fma"))) void int8_sign(int64_t iters) {
  asm volatile(PO_INT_SETUP "1:\n" PO_SIGN_UNIT("0", "6") PO_SIGN_UNIT("1", "7") PO_SIGN_UNIT("2", "8")
                   PO_SIGN_UNIT("3", "9") PO_SIGN_UNIT("4", "10") PO_SIGN_UNIT("5", "11") "dec %0\n jnz 1b\n"
               : "+r"(iters)
               :
               : PO_INT_CLOBBERS);
}

__attribute__((target("avx2,fma"))) void int8_nosign(int64_t iters) {
  asm volatile(PO_INT_SETUP "1:\n" PO_NOSIGN_UNIT("0", "6") PO_NOSIGN_UNIT("1", "7") PO_NOSIGN_UNIT("2", "8")
                   PO_NOSIGN_UNIT("3", "9") PO_NOSIGN_UNIT("4", "10") PO_NOSIGN_UNIT("5", "11") "dec %0\n jnz 1b\n"
               : "+r"(iters)
               :
               : PO_INT_CLOBBERS);
}

// vpmaddwd on int16 operands (16 products summed in pairs to int32) + vpaddd: 6 x 16 per iteration.
__attribute__((target("avx2,fma"))) void int16_madd(int64_t iters) {
  asm volatile(PO_INT_SETUP "1:\n" PO_INT16_UNIT("0", "6") PO_INT16_UNIT("1", "7") PO_INT16_UNIT("2", "8")
                   PO_INT16_UNIT("3", "9") PO_INT16_UNIT("4", "10") PO_INT16_UNIT("5", "11") "dec %0\n jnz 1b\n"
               : "+r"(iters)
               :
               : PO_INT_CLOBBERS);
}

// One dependent chain of 1-cycle vpaddd (16 per iteration): iterations x 16 / seconds is the clock.
__attribute__((target("avx2,fma"))) void add_chain(int64_t iters) {
  asm volatile(
      "vpxor %%ymm0, %%ymm0, %%ymm0\n vpxor %%ymm1, %%ymm1, %%ymm1\n"
      "1:\n"
      "vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n"
      "vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n"
      "vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n"
      "vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n"
      "vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm1, %%ymm0, %%ymm0\n"
      "vpaddd %%ymm1, %%ymm0, %%ymm0\n"
      "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "cc");
}

struct Kernel {
  void (*fn)(int64_t);
  int64_t per_iter;  // multiply-adds (add_chain: cycles) per iteration
};

Kernel kernel(int64_t which) {
  switch (which) {
    case 0: return {fma_ps, 12 * 8};
    case 1: return {int8_sign, 6 * 32};
    case 2: return {int8_nosign, 6 * 32};
    case 3: return {int16_madd, 6 * 16};
    case 4: return {add_chain, 16};
    default: TORCH_CHECK(false, "unknown kernel ", which);
  }
}

double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double wall_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Returns [CPU seconds of the slowest thread, wall seconds of the whole run, work per thread
// (multiply-adds or cycles)]. Wall time near CPU time: the threads ran at once, unpreempted.
std::vector<double> run(int64_t which, int64_t iters, int64_t threads) {
  TORCH_CHECK(iters > 0 && threads > 0 && threads <= 256, "bad iters or threads");
  const Kernel k = kernel(which);
  std::vector<double> secs(static_cast<size_t>(threads));
  auto body = [&](int64_t t) {
    const double start = thread_seconds();
    k.fn(iters);
    secs[static_cast<size_t>(t)] = thread_seconds() - start;
  };
  const double start = wall_seconds();
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
  const double wall = wall_seconds() - start;
  double worst = 0;
  for (double s : secs) worst = std::max(worst, s);
  return {worst, wall, static_cast<double>(iters * k.per_iter)};
}

}  // namespace

TORCH_LIBRARY(po_int8_ceiling, m) { m.def("run(int which, int iters, int threads) -> float[]", &run); }
