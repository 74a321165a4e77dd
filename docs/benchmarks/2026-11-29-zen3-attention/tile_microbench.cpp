#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <stdint.h>
constexpr int D = 64, W = 8, BS = 256;
double now() { struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static inline __m256 hsum8(const __m256* t) {
  __m256 a0 = _mm256_hadd_ps(t[0], t[1]), a1 = _mm256_hadd_ps(t[2], t[3]), a2 = _mm256_hadd_ps(t[4], t[5]), a3 = _mm256_hadd_ps(t[6], t[7]);
  __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
template <typename K> static inline __m256 ld(const K* p);
template <> inline __m256 ld(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
template <> inline __m256 ld(const float* p) { return _mm256_loadu_ps(p); }
template <int MODE, typename K>
__attribute__((always_inline)) inline void tile(const float* q, const K* k, float* s) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int c = 0; c < D / W; ++c) {
    __m256 k0 = ld(k + c * W), k1 = ld(k + D + c * W);
    for (int r = 0; r < 4; ++r) {
      __m256 qv = _mm256_loadu_ps(q + r * D + c * W);
      acc[2 * r] = _mm256_fmadd_ps(qv, k0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(qv, k1, acc[2 * r + 1]);
    }
  }
  if (MODE == 0) {
    alignas(32) float out[8];
    _mm256_store_ps(out, hsum8(acc));
    for (int r = 0; r < 4; ++r) s[r * BS] = out[2 * r], s[r * BS + 1] = out[2 * r + 1];
  } else {  // no hsum: just store acc sum
    __m256 t = acc[0];
    for (int i = 1; i < 8; ++i) t = _mm256_add_ps(t, acc[i]);
    _mm256_storeu_ps(s, t);
  }
}
template <int MODE, typename K>
void run(const char* name, const float* q, const K* k, float* s, int nb) {
  long reps = 3000; double t0 = now();
  for (long it = 0; it < reps; ++it)
    for (int b = 0; b < nb; ++b)
      for (int r0 = 0; r0 < 16; r0 += 4)
        for (int j = 0; j < BS; j += 2) tile<MODE>(q + r0 * D, k + ((long)b * BS + j) * D, s + r0 * BS + j);
  printf("%-20s %.1f GFLOP/s\n", name, 2.0 * 16 * BS * D * nb * reps / (now() - t0) / 1e9);
}
int main(int argc, char** argv) {
  int nb = argc > 1 ? atoi(argv[1]) : 1;
  float* q = (float*)aligned_alloc(64, 16 * D * 4); float* s = (float*)aligned_alloc(64, 16 * BS * 4);
  uint16_t* kh = (uint16_t*)aligned_alloc(64, (size_t)nb * BS * D * 2); float* kf = (float*)aligned_alloc(64, (size_t)nb * BS * D * 4);
  for (int i = 0; i < 16 * D; ++i) q[i] = (rand() % 100) / 100.f;
  for (long i = 0; i < (long)nb * BS * D; ++i) { kf[i] = (rand() % 100) / 100.f; kh[i] = _cvtss_sh(kf[i], 0); }
  run<0>("fp16 hsum", q, kh, s, nb); run<1>("fp16 nohsum", q, kh, s, nb);
  run<0>("fp32 hsum", q, kf, s, nb); run<1>("fp32 nohsum", q, kf, s, nb);
}
