#include <chrono>
#include <cstdio>
#include <cstdint>
#include <algorithm>
#include <ATen/core/Tensor.h>
#include "/work/main/src/triforce/kernels/simd.h"
using namespace triforce;
constexpr int tree_lane(int i) { return i; }
#ifndef UNROLL
#define UNROLL
#endif
template <int64_t D, int NJ, int NV>
ALWAYS_INLINE void lane_partials(const float* qg, int64_t RP, const float* kj, int l, Vec (&acc)[NJ][NV]) {
  UNROLL for (int jj = 0; jj < NJ; ++jj)
    UNROLL for (int v = 0; v < NV; ++v) acc[jj][v] = Vec(0.f);
  UNROLL for (int c = 0; c < D / W; ++c) {
    Vec qv[NV];
    UNROLL for (int v = 0; v < NV; ++v) qv[v] = Vec::loadu(qg + (c * W + l) * RP + v * W);
    UNROLL for (int jj = 0; jj < NJ; ++jj) {
      const Vec kb(kj[jj * D + c * W + l]);
      UNROLL for (int v = 0; v < NV; ++v) acc[jj][v] = fma(qv[v], kb, acc[jj][v]);
    }
  }
}
template <int64_t D, int NJ, int NV, int LO, int N>
ALWAYS_INLINE void exact_tile(const float* qg, int64_t RP, const float* kj, Vec (&acc)[NJ][NV], float* park) {
  if constexpr (N == 1) {
    lane_partials<D, NJ, NV>(qg, RP, kj, tree_lane(LO), acc);
  } else {
    exact_tile<D, NJ, NV, LO, N / 2>(qg, RP, kj, acc, park + NJ * NV * W);
    UNROLL for (int jj = 0; jj < NJ; ++jj)
      UNROLL for (int v = 0; v < NV; ++v) acc[jj][v].store(park + (jj * NV + v) * W);
    exact_tile<D, NJ, NV, LO + N / 2, N / 2>(qg, RP, kj, acc, park + NJ * NV * W);
    UNROLL for (int jj = 0; jj < NJ; ++jj)
      UNROLL for (int v = 0; v < NV; ++v) acc[jj][v] = Vec::loadu(park + (jj * NV + v) * W) + acc[jj][v];
  }
}
static c10::Half kh[256 * 64];
__attribute__((noinline)) void run(const float* qt, const float* k, int64_t n, float* st) {
  constexpr int D = 64, NJ = 6, NV = 2; const int64_t RP = 16;
  alignas(64) float park[4 * NJ * 2 * W];
  alignas(64) float kt[2][NJ * D];
  for (int64_t j = 0; j + NJ <= n; j += NJ) {
    Vec acc[NJ][NV];
#if MODE == 1
    for (int i = 0; i < NJ * D; i += W) load(kh + j * D + i).store(kt[0] + i);
    exact_tile<D, NJ, NV, 0, W>(qt, RP, kt[0], acc, park);
#elif MODE == 2
    if (j == 0) for (int i = 0; i < NJ * D; i += W) load(kh + j * D + i).store(kt[0] + i);
    if (j + 2 * NJ <= n) for (int i = 0; i < NJ * D; i += W) load(kh + (j + NJ) * D + i).store(kt[((j / NJ) + 1) % 2] + i);
    exact_tile<D, NJ, NV, 0, W>(qt, RP, kt[(j / NJ) % 2], acc, park);
#else
    exact_tile<D, NJ, NV, 0, W>(qt, RP, k + j * D, acc, park);
#endif
    for (int jj = 0; jj < NJ; ++jj) for (int v = 0; v < NV; ++v) acc[jj][v].store(st + (j + jj) * RP + v * W);
  }
}
__attribute__((noinline)) void peak(int64_t iters) {
  __m256 a[12]; for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.f);
  const __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.999f);
  for (int64_t it = 0; it < iters; ++it)
    for (int r = 0; r < 1000; ++r) {
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
    }
  float s = 0; for (int i = 0; i < 12; ++i) s += _mm256_cvtss_f32(a[i]); if (s == 1.2345f) printf("x");
}
int main() {
  const int64_t n = 252; static float qt[64 * 16], k[256 * 64], st[256 * 16];
  for (int i = 0; i < 64*16; ++i) qt[i] = 0.001f * i; for (int i = 0; i < 256*64; ++i) k[i] = 0.0001f * (i % 97);
  for (int w = 0; w < 1000; ++w) run(qt, k, n, st);
  const int reps = 2000; double best = 1e9, bp = 1e9;
  for (int b = 0; b < 15; ++b) {
    auto t = std::chrono::steady_clock::now();
    for (int w = 0; w < reps; ++w) run(qt, k, n, st);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    t = std::chrono::steady_clock::now();
    peak(reps * 16);
    bp = std::min(bp, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  double flops = 2.0 * n / 6 * 6 * 16 * 64 * reps;
  double pf = 2.0 * 8 * 12 * 1000.0 * reps * 16;
  printf("%.1f GFLOP/s (16 lanes x %ld keys), peak loop %.1f GFLOP/s: %.0f%%, st %f\n", flops / best / 1e9, n, pf / bp / 1e9, 100 * (flops / best) / (pf / bp), st[100]);
}
