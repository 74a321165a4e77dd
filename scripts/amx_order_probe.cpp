// A probe, not part of the package (docs/performance.md, "Verification attention with AMX"): does TDPBF16PS on this
// CPU compute what vdpbf16ps or a plain fp32 order computes? Random bf16 keys and queries, 16 keys x 16 rows x 64 d
// (two tile ops of 32 d), each score against scalar emulations; counts of scores that differ in any bit.
//
//     g++ -O2 -march=native -mamx-tile -mamx-bf16 -ffp-contract=off -o /tmp/amx_order scripts/amx_order_probe.cpp
//     /tmp/amx_order
// Which accumulation order does TDPBF16PS follow on this CPU? AMX scores (16 keys x 16 rows, D = 64 as two ops of
// 32 d) against scalar emulations: (a) vdpbf16ps-like, pair by pair with fp32 rounding; (b) each op's 32 products
// summed exactly (double) and added to C with one fp32 rounding; (c) odd element then even, each rounded.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
struct TileCfg { uint8_t palette_id = 1, start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static inline uint16_t bf16(float x) { uint32_t u; memcpy(&u, &x, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static inline float fl(uint16_t h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; }
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1;
  TileCfg c; for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; } _tile_loadconfig(&c);
  alignas(64) uint16_t K[16 * 64], QP[32 * 32]; alignas(64) float S[16 * 16];
  uint32_t seed = 7; auto rnd = [&]() { seed = seed * 1664525u + 1013904223u; return ((seed >> 8) / 16777216.f) * 2.f - 1.f; };
  long bad[7] = {0, 0, 0, 0, 0, 0, 0}, total = 0;
  for (int trial = 0; trial < 200; ++trial) {
    for (auto& x : K) x = bf16(rnd() * 3.f);
    for (auto& x : QP) x = bf16(rnd());
    _tile_zero(0); _tile_loadd(1, K, 128); _tile_loadd(4, K + 32, 128); _tile_loadd(2, QP, 64); _tile_loadd(3, QP + 512, 64);
    _tile_dpbf16ps(0, 1, 2); _tile_dpbf16ps(0, 4, 3); _tile_stored(0, S, 64);
    for (int m = 0; m < 16; ++m) for (int n = 0; n < 16; ++n) {
      float a = 0.f, cc = 0.f, dd = 0.f; double acc_b = 0;
      float b = 0.f;
      for (int op = 0; op < 2; ++op) {
        double sum = 0;
        for (int p = 0; p < 16; ++p) {
          const int d0 = op * 32 + 2 * p;
          const float k0 = fl(K[m * 64 + d0]), k1 = fl(K[m * 64 + d0 + 1]);
          const float q0 = fl(QP[(op * 16 + p) * 32 + n * 2]), q1 = fl(QP[(op * 16 + p) * 32 + n * 2 + 1]);
          a = a + k0 * q0; a = a + k1 * q1;            // even then odd, each rounded
          cc = cc + k1 * q1; cc = cc + k0 * q0;        // odd then even
          dd = (float)((double)dd + (double)k0 * q0 + (double)k1 * q1);  // a pair summed exactly, one rounding
          sum += (double)k0 * q0 + (double)k1 * q1;
        }
        b = (float)((double)b + sum);                  // an op's 32 products exactly, one rounding
        (void)acc_b;
      }
      // tree hypotheses over one op's products, in fp32: (e) 32 products pairwise tree; (f) pair sums rounded, 16 of them tree
      float e = 0.f, f = 0.f, g = 0.f;
      for (int op = 0; op < 2; ++op) {
        float pr[32], ps[16];
        for (int p = 0; p < 16; ++p) {
          const int d0 = op * 32 + 2 * p;
          pr[2 * p] = fl(K[m * 64 + d0]) * fl(QP[(op * 16 + p) * 32 + n * 2]);
          pr[2 * p + 1] = fl(K[m * 64 + d0 + 1]) * fl(QP[(op * 16 + p) * 32 + n * 2 + 1]);
          ps[p] = pr[2 * p] + pr[2 * p + 1];
        }
        float t[32]; memcpy(t, pr, sizeof t);
        for (int w = 16; w >= 1; w /= 2) for (int i = 0; i < w; ++i) t[i] = t[2 * i] + t[2 * i + 1];
        e = e + t[0];
        float u[16]; memcpy(u, ps, sizeof u);
        for (int w = 8; w >= 1; w /= 2) for (int i = 0; i < w; ++i) u[i] = u[2 * i] + u[2 * i + 1];
        f = f + u[0];
        float seq = 0.f; for (int p = 0; p < 16; ++p) seq = seq + ps[p];   // (g) pair sums rounded, in order, then + C
        g = g + seq;
      }
      const float got = S[m * 16 + n];
      bad[4] += got != e; bad[5] += got != f; bad[6] += got != g;
      bad[0] += got != a; bad[1] += got != cc; bad[2] += got != dd; bad[3] += got != b; ++total;
    }
  }
  printf("of %ld scores, differing from: even-then-odd %ld, odd-then-even %ld, pair exact %ld, op exact %ld, "
         "32-tree %ld, pair-sums tree %ld, pair sums in order then +C %ld\n", total, bad[0], bad[1], bad[2], bad[3], bad[4], bad[5], bad[6]);
  _tile_release();
}
