#include <stdio.h>
#include <time.h>
double cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define R12(op) op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm1,%%ymm1\n" op " %%ymm12,%%ymm2,%%ymm2\n" op " %%ymm12,%%ymm3,%%ymm3\n" \
  op " %%ymm12,%%ymm4,%%ymm4\n" op " %%ymm12,%%ymm5,%%ymm5\n" op " %%ymm12,%%ymm6,%%ymm6\n" op " %%ymm12,%%ymm7,%%ymm7\n" \
  op " %%ymm12,%%ymm8,%%ymm8\n" op " %%ymm12,%%ymm9,%%ymm9\n" op " %%ymm12,%%ymm10,%%ymm10\n" op " %%ymm12,%%ymm11,%%ymm11\n"
#define DEP12(op) op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" \
  op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" \
  op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n" op " %%ymm12,%%ymm0,%%ymm0\n"
#define LOOP(body) { long n = 50000000; double t = cpu(); \
  __asm__ volatile("1:\n" body "dec %0\njnz 1b\n" : "+r"(n) : : "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","cc"); \
  dt = cpu() - t; }
int main() {
  double dt;
  for (int r = 0; r < 2; ++r) {
    LOOP(DEP12("vpaddd")) double ghz = 50e6 * 12 / dt / 1e9;  // dependent: 1 cycle each
    printf("clock from a dependent vpaddd chain: %.2f GHz\n", ghz);
    const char* names[] = {"vpaddd", "vpaddw", "vpmaddubsw", "vpmaddwd", "vfmadd231ps", "vpand", "vpmaddubsw+vpmaddwd", "maddubs,addw,maddwd,addd"};
    for (int k = 0; k < 8; ++k) {
      switch (k) {
        case 0: LOOP(R12("vpaddd")) break;
        case 1: LOOP(R12("vpaddw")) break;
        case 2: LOOP(R12("vpmaddubsw")) break;
        case 3: LOOP(R12("vpmaddwd")) break;
        case 4: LOOP(R12("vfmadd231ps")) break;
        case 5: LOOP(R12("vpand")) break;
        case 6: LOOP("vpmaddubsw %%ymm12,%%ymm0,%%ymm0\nvpmaddwd %%ymm12,%%ymm1,%%ymm1\nvpmaddubsw %%ymm12,%%ymm2,%%ymm2\nvpmaddwd %%ymm12,%%ymm3,%%ymm3\n"
                     "vpmaddubsw %%ymm12,%%ymm4,%%ymm4\nvpmaddwd %%ymm12,%%ymm5,%%ymm5\nvpmaddubsw %%ymm12,%%ymm6,%%ymm6\nvpmaddwd %%ymm12,%%ymm7,%%ymm7\n"
                     "vpmaddubsw %%ymm12,%%ymm8,%%ymm8\nvpmaddwd %%ymm12,%%ymm9,%%ymm9\nvpmaddubsw %%ymm12,%%ymm10,%%ymm10\nvpmaddwd %%ymm12,%%ymm11,%%ymm11\n") break;
        case 7: LOOP("vpmaddubsw %%ymm12,%%ymm0,%%ymm0\nvpaddw %%ymm12,%%ymm1,%%ymm1\nvpmaddwd %%ymm12,%%ymm2,%%ymm2\nvpaddd %%ymm12,%%ymm3,%%ymm3\n"
                     "vpmaddubsw %%ymm12,%%ymm4,%%ymm4\nvpaddw %%ymm12,%%ymm5,%%ymm5\nvpmaddwd %%ymm12,%%ymm6,%%ymm6\nvpaddd %%ymm12,%%ymm7,%%ymm7\n"
                     "vpmaddubsw %%ymm12,%%ymm8,%%ymm8\nvpaddw %%ymm12,%%ymm9,%%ymm9\nvpmaddwd %%ymm12,%%ymm10,%%ymm10\nvpaddd %%ymm12,%%ymm11,%%ymm11\n") break;
      }
      printf("  %-26s %.2f per cycle\n", names[k], 50e6 * 12 / dt / 1e9 / ghz);
    }
  }
}
