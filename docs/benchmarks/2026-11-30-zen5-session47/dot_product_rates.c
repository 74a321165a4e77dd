#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define OP(ins, x, y) \
  asm volatile(ins " %13, %12, %0\n\t" ins " %13, %12, %1\n\t" ins " %13, %12, %2\n\t" ins " %13, %12, %3\n\t" \
               ins " %13, %12, %4\n\t" ins " %13, %12, %5\n\t" ins " %13, %12, %6\n\t" ins " %13, %12, %7\n\t" \
               ins " %13, %12, %8\n\t" ins " %13, %12, %9\n\t" ins " %13, %12, %10\n\t" ins " %13, %12, %11\n\t" \
               : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11) : "v"(x), "v"(y))
double run(int which) {
  __m512i a0 = _mm512_set1_epi32(0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
  __m512 f0 = _mm512_set1_ps(0), f1 = f0, f2 = f0;
  struct timespec t0, t1; long N = 50000000;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < N; ++i) {
    if (which == 0) OP("vpdpbusd", x, y);
    else if (which == 1) OP("vpdpwssd", x, y);
    else if (which == 2) OP("vdpbf16ps", x, y);
    else OP("vpaddd", x, y);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  volatile int keep = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, _mm512_add_epi32(a5, a11)));
  return s / (N * 12.0) * 1e9;
}
int main() {
  const char* n[] = {"vpdpbusd", "vpdpwssd", "vdpbf16ps", "vpaddd"};
  for (int w = 0; w < 4; ++w) printf("%s zmm: %.3f ns each\n", n[w], run(w));
}
