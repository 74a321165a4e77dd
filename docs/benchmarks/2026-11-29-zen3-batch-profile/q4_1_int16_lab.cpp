// Lab: Q4_1 packed group tile on AVX2, two ways to the same exact int32 block sums.
// A (the kernel's): x as two int8 planes (xq, xr), vpmaddubsw + vpmaddwd(1) per plane.
// B: X = 256 xq + xr as int16, codes as int16 pairs, one vpmaddwd per pair of codes.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define AI __attribute__((always_inline)) inline
typedef __m256i IV;
constexpr int P = 16, W = 8, HEAD = 4, WORDS = 4, BYTES = HEAD + 4 * WORDS;  // Q4_1 per row and block: 20
double cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
AI IV bcast4(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
AI IV dot_us2(IV acc, IV u, IV s, IV u2, IV s2) {
  const IV p = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(u2, s2));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
struct X { int8_t *q, *r; int16_t* pairs; float* scale; float* fsum; };
template <int TB>
AI void tileA(const uint8_t* g, int nb, int lane0, const X* x, float* const* y) {
  constexpr int GB = P * BYTES;
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * GB;
    const uint8_t* codes = blk + P * HEAD + 4 * lane0;
    IV hi[TB], lo[TB];
    for (int t = 0; t < TB; ++t) hi[t] = lo[t] = _mm256_setzero_si256();
    for (int j = 0; j < WORDS; ++j) {
      const IV v = _mm256_loadu_si256((const IV*)(codes + 4 * P * j));
      IV a = _mm256_and_si256(v, _mm256_set1_epi8(15)), c = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
      for (int t = 0; t < TB; ++t) {
        const int8_t* xq = x[t].q + 32 * b + 4 * j; const int8_t* xr = x[t].r + 32 * b + 4 * j;
        hi[t] = dot_us2(hi[t], a, bcast4(xq), c, bcast4(xq + 16));
        lo[t] = dot_us2(lo[t], a, bcast4(xr), c, bcast4(xr + 16));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 2 * lane0)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 2 * P + 2 * lane0)));
    for (int t = 0; t < TB; ++t) {
      IV s = _mm256_add_epi32(_mm256_slli_epi32(hi[t], 8), lo[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x[t].scale[b])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[t].fsum[b]), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) _mm256_storeu_ps(y[t] + lane0, acc[t]);
}
template <int TB>
AI void tileB(const uint8_t* g, int nb, int lane0, const X* x, float* const* y) {
  constexpr int GB = P * BYTES;
  const IV mask = _mm256_set1_epi32(0x000F000F);
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * GB;
    const uint8_t* codes = blk + P * HEAD + 4 * lane0;
    IV s[TB];
    for (int t = 0; t < TB; ++t) s[t] = _mm256_setzero_si256();
    for (int j = 0; j < WORDS; ++j) {
      const IV v = _mm256_loadu_si256((const IV*)(codes + 4 * P * j));
      const IV e = _mm256_and_si256(v, mask), o = _mm256_and_si256(_mm256_srli_epi32(v, 8), mask);
      const IV e2 = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask), o2 = _mm256_and_si256(_mm256_srli_epi32(v, 12), mask);
      for (int t = 0; t < TB; ++t) {
        const int16_t* xp = x[t].pairs + 32 * b + 8 * j;  // (X4j, X4j+2), (X4j+1, X4j+3), (X16+4j, ..), (X17+4j, ..)
        const IV p0 = _mm256_add_epi32(_mm256_madd_epi16(e, bcast4(xp)), _mm256_madd_epi16(o, bcast4(xp + 2)));
        const IV p1 = _mm256_add_epi32(_mm256_madd_epi16(e2, bcast4(xp + 4)), _mm256_madd_epi16(o2, bcast4(xp + 6)));
        s[t] = _mm256_add_epi32(s[t], _mm256_add_epi32(p0, p1));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 2 * lane0)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 2 * P + 2 * lane0)));
    for (int t = 0; t < TB; ++t) {
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_mul_ps(d, _mm256_set1_ps(x[t].scale[b])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[t].fsum[b]), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) _mm256_storeu_ps(y[t] + lane0, acc[t]);
}
template <bool B, int TB> void pass(const uint8_t* w, int ng, int nb, const X* x, float** y) {
  for (int g = 0; g < ng; ++g) {
    float* out[TB];
    for (int t = 0; t < TB; ++t) out[t] = y[t] + g * P;
    for (int lane0 = 0; lane0 < P; lane0 += W) {
      if (B) tileB<TB>(w + (size_t)g * nb * P * BYTES, nb, lane0, x, out);
      else tileA<TB>(w + (size_t)g * nb * P * BYTES, nb, lane0, x, out);
    }
  }
}
template <bool B, int TB> void rows(const uint8_t* w, int ng, int nb, const X* x, int M, float** y) {
  for (int m0 = 0; m0 < M; m0 += TB) pass<B, TB>(w, ng, nb, x + m0, y + m0);  // (M a multiple of TB here)
}
int main(int argc, char** argv) {
  const int N = argc > 1 ? atoi(argv[1]) : 1536, K = argc > 2 ? atoi(argv[2]) : 576, M = 12;
  const int ng = N / P, nb = K / 32;
  uint8_t* w = (uint8_t*)aligned_alloc(64, (size_t)ng * nb * P * BYTES);
  srand(1);
  for (size_t i = 0; i < (size_t)ng * nb * P * BYTES; ++i) w[i] = rand();
  for (int g = 0; g < ng; ++g) for (int b = 0; b < nb; ++b) for (int r = 0; r < 2 * P; ++r) {  // sane fp16 d, m
    uint16_t h = 0x2000 + (rand() & 0x3ff); memcpy(w + ((size_t)g * nb + b) * P * BYTES + 2 * r, &h, 2); }
  X x[M]; float* y[M]; float* y2[M];
  for (int t = 0; t < M; ++t) {
    x[t].q = (int8_t*)malloc(K); x[t].r = (int8_t*)malloc(K); x[t].pairs = (int16_t*)malloc(2 * K);
    x[t].scale = (float*)malloc(4 * nb); x[t].fsum = (float*)malloc(4 * nb);
    y[t] = (float*)malloc(4 * N); y2[t] = (float*)malloc(4 * N);
    for (int i = 0; i < K; ++i) { x[t].q[i] = rand() % 255 - 127; x[t].r[i] = rand() % 255 - 127; }
    for (int b = 0; b < nb; ++b) {
      x[t].scale[b] = 1e-3f * (1 + rand() % 7); x[t].fsum[b] = (rand() % 1000) * 1e-2f;
      for (int j = 0; j < 4; ++j) {
        const int idx[8] = {4 * j, 4 * j + 2, 4 * j + 1, 4 * j + 3, 16 + 4 * j, 18 + 4 * j, 17 + 4 * j, 19 + 4 * j};
        for (int k = 0; k < 8; ++k) { int i = 32 * b + idx[k]; x[t].pairs[32 * b + 8 * j + k] = (int16_t)(256 * x[t].q[i] + x[t].r[i]); }
      }
    }
  }
  rows<false, 3>(w, ng, nb, x, M, y); rows<true, 3>(w, ng, nb, x, M, y2);
  int bad = 0; for (int t = 0; t < M; ++t) for (int i = 0; i < N; ++i) bad += memcmp(&y[t][i], &y2[t][i], 4) != 0;
  printf("%d x %d, bit-identical outputs: %s (%d differ)\n", N, K, bad ? "NO" : "yes", bad);
  const double macs = (double)N * K;
  for (int rep = 0; rep < 3; ++rep) {
    for (int v = 0; v < 6; ++v) {
      const int reps = 400; double t0 = cpu();
      for (int it = 0; it < reps; ++it) {
        switch (v) {
          case 0: rows<false, 3>(w, ng, nb, x, 3, y); break;
          case 1: rows<true, 3>(w, ng, nb, x, 3, y); break;
          case 2: rows<false, 1>(w, ng, nb, x, 1, y); break;
          case 3: rows<true, 1>(w, ng, nb, x, 1, y); break;
          case 4: rows<false, 3>(w, ng, nb, x, 12, y); break;
          case 5: rows<true, 4>(w, ng, nb, x, 12, y); break;
        }
      }
      const int m = v < 2 ? 3 : v < 4 ? 1 : 12;
      const double dt = cpu() - t0;
      printf("%s %s rows %2d: %.1f GMAC/s  ", v % 2 ? "B" : "A", v == 5 ? "TB4" : "TB" , m, macs * m * reps / dt / 1e9);
      if (v % 2) printf("\n");
    }
  }
}
