#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static int buf[64] __attribute__((aligned(64)));
double run(int which) {
  __m512i a0 = _mm512_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i x = _mm512_set1_epi8(3), t0v, t1v;
  struct timespec t0, t1; long N = 50000000;
  const int* p = buf;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < N; ++i) {
    if (which == 0) {  // register broadcast then vpdpbusd
      asm volatile(
        "vpbroadcastd (%8), %%zmm20\n\t vpdpbusd %%zmm20, %9, %0\n\t"
        "vpbroadcastd 4(%8), %%zmm21\n\t vpdpbusd %%zmm21, %9, %1\n\t"
        "vpbroadcastd 8(%8), %%zmm22\n\t vpdpbusd %%zmm22, %9, %2\n\t"
        "vpbroadcastd 12(%8), %%zmm23\n\t vpdpbusd %%zmm23, %9, %3\n\t"
        "vpbroadcastd 16(%8), %%zmm24\n\t vpdpbusd %%zmm24, %9, %4\n\t"
        "vpbroadcastd 20(%8), %%zmm25\n\t vpdpbusd %%zmm25, %9, %5\n\t"
        "vpbroadcastd 24(%8), %%zmm26\n\t vpdpbusd %%zmm26, %9, %6\n\t"
        "vpbroadcastd 28(%8), %%zmm27\n\t vpdpbusd %%zmm27, %9, %7\n\t"
        : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7) : "r"(p), "v"(x)
        : "zmm20", "zmm21", "zmm22", "zmm23", "zmm24", "zmm25", "zmm26", "zmm27");
    } else {  // embedded broadcast
      asm volatile(
        "vpdpbusd (%8)%{1to16%}, %9, %0\n\t vpdpbusd 4(%8)%{1to16%}, %9, %1\n\t"
        "vpdpbusd 8(%8)%{1to16%}, %9, %2\n\t vpdpbusd 12(%8)%{1to16%}, %9, %3\n\t"
        "vpdpbusd 16(%8)%{1to16%}, %9, %4\n\t vpdpbusd 20(%8)%{1to16%}, %9, %5\n\t"
        "vpdpbusd 24(%8)%{1to16%}, %9, %6\n\t vpdpbusd 28(%8)%{1to16%}, %9, %7\n\t"
        : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7) : "r"(p), "v"(x));
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  volatile int keep = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a7));
  return s / (N * 8.0) * 1e9;
}
int main() {
  printf("broadcast + vpdpbusd: %.3f ns per vpdpbusd\n", run(0));
  printf("embedded broadcast:   %.3f ns per vpdpbusd\n", run(1));
}
