// A feasibility benchmark, not part of the package (docs/performance.md, "Verification attention with AMX"):
// the scores half of a 5-token verification's attention (16 query rows per KV head, in lanes, as the kernel's
// rows-in-lanes path lays them out) over 30 layers x 3 KV heads of bf16 keys (head dim 64), three ways:
// fp32 FMAs over keys widened a 16-key tile at a time (what kernels/attention.cpp does), AVX512-BF16 dot
// products (vdpbf16ps, queries rounded to bf16), and AMX tiles (tdpbf16ps, the same rounding). Needs a CPU
// with AMX-BF16 (Intel Sapphire Rapids and later) and Linux >= 5.16.
//
//     g++ -O3 -march=native -mamx-tile -mamx-bf16 -fopenmp -o /tmp/amx_scores scripts/amx_scores_bench.cpp
//     OMP_NUM_THREADS=2 /tmp/amx_scores 32768
#include <sys/syscall.h>
#include <unistd.h>
// Scores of 16 query rows (in lanes) against bf16 keys: fp32 FMAs over widened keys vs AVX512-BF16 dot products.
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>
constexpr int D = 64, BS = 256, JT = 16;
static float sink_val = 0;
struct TileCfg { uint8_t palette_id = 1, start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static void amx_init() {
  long r = syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  if (r) { perror("arch_prctl"); exit(1); }
}
static void amx_config() {
  TileCfg c;
  for (int t = 0; t < 5; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
}
// st [BS][16]: tile of 16 keys x 16 rows = keys-major, as the lanes path lays scores out
void scores_amx(const uint16_t* k, const uint16_t* qpb, float* st) {
  _tile_loadd(2, qpb, 64);             // d pairs 0..15: 16 rows x (16 query rows x 2)
  _tile_loadd(3, qpb + 16 * 32, 64);   // d pairs 16..31
  for (int j = 0; j < BS; j += 16) {
    _tile_zero(0);
    _tile_loadd(1, k + j * D, D * 2);        // 16 keys x d 0..31
    _tile_loadd(4, k + j * D + 32, D * 2);   // 16 keys x d 32..63
    _tile_dpbf16ps(0, 1, 2);
    _tile_dpbf16ps(0, 4, 3);
    _tile_stored(0, st + j * 16, 64);
  }
}

void scores_fma(const uint16_t* k, const float* qt, float* st) {  // qt [D][16], st [BS][16]
  alignas(64) float kt[JT * D];
  for (int j = 0; j < BS; j += JT) {
    for (int i = 0; i < JT * D; i += 16) {  // widen: bf16 -> fp32 is a 16-bit shift
      __m256i h = _mm256_loadu_si256((const __m256i*)(k + j * D + i));
      _mm512_store_ps(kt + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    __m512 acc[JT];
    for (int jj = 0; jj < JT; ++jj) acc[jj] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 qv = _mm512_loadu_ps(qt + d * 16);
      for (int jj = 0; jj < JT; ++jj) acc[jj] = _mm512_fmadd_ps(_mm512_set1_ps(kt[jj * D + d]), qv, acc[jj]);
    }
    for (int jj = 0; jj < JT; ++jj) _mm512_storeu_ps(st + (j + jj) * 16, acc[jj]);
  }
}

void scores_dp(const uint16_t* k, const __m512bh* qp, float* st) {  // qp [D/2] pairs of 16 rows, st [BS][16]
  const uint32_t* k32 = (const uint32_t*)k;
  for (int j = 0; j < BS; j += JT) {
    __m512 acc[JT];
    for (int jj = 0; jj < JT; ++jj) acc[jj] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh qv = qp[p];
      for (int jj = 0; jj < JT; ++jj)
        acc[jj] = _mm512_dpbf16_ps(acc[jj], (__m512bh)_mm512_set1_epi32(k32[(j + jj) * (D / 2) + p]), qv);
    }
    for (int jj = 0; jj < JT; ++jj) _mm512_storeu_ps(st + (j + jj) * 16, acc[jj]);
  }
}

int main(int argc, char** argv) {
  const long S = argc > 1 ? atol(argv[1]) : 32768, L = 30, H = 3;
  std::vector<uint16_t> K(L * H * S * D);
  for (size_t i = 0; i < K.size(); ++i) K[i] = (uint16_t)(0x3f80 + ((uint32_t)(i * 2654435761u) >> 25)) ^ (uint16_t)((i & 1) << 15);
  alignas(64) float qt[D * 16];
  for (int i = 0; i < D * 16; ++i) qt[i] = (i % 7) * 0.1f;
  alignas(64) uint16_t qpb[D * 16];
  for (int p = 0; p < D / 2; ++p) for (int r = 0; r < 16; ++r) for (int e = 0; e < 2; ++e) {
    float x = qt[(2 * p + e) * 16 + r]; uint32_t u; memcpy(&u, &x, 4); qpb[p * 32 + r * 2 + e] = u >> 16; }
  const long nb = S / BS;
  amx_init();
  {
    alignas(64) float a[BS * 16], b[BS * 16], c[BS * 16];
    amx_config();
    scores_amx(K.data() + 7 * BS * D, qpb, a);
    _tile_release();
    scores_fma(K.data() + 7 * BS * D, qt, b);
    scores_dp(K.data() + 7 * BS * D, (const __m512bh*)qpb, c);
    double e1 = 0, e2 = 0, mx = 0;
    for (int i = 0; i < BS * 16; ++i) { e1 = std::max(e1, (double)fabsf(a[i] - b[i])); e2 = std::max(e2, (double)fabsf(a[i] - c[i])); mx = std::max(mx, (double)fabsf(b[i])); }
    printf("check: |amx - fp32| max %.4g, |amx - dp| max %.4g, |fp32| max %.4g\n", e1, e2, mx);
  }
  for (int mode = 0; mode < 6; ++mode) {
    std::vector<double> ts;
    for (int rep = 0; rep < 7; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      float tot = 0;
#pragma omp parallel reduction(+:tot)
      {
        if (mode % 3 == 2) amx_config();
#pragma omp for schedule(static)
        for (long w = 0; w < L * H * nb; ++w) {
          alignas(64) float st[BS * 16];
          const uint16_t* kb = K.data() + w * BS * D;
          if (mode % 3 == 0) scores_fma(kb, qt, st); else if (mode % 3 == 1) scores_dp(kb, (const __m512bh*)qpb, st);
          else scores_amx(kb, qpb, st);
          tot += st[5] + st[BS * 16 - 1];
        }
        if (mode % 3 == 2) _tile_release();
      }
      sink_val += tot;
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin() + 2, ts.end());
    const double t = ts[2 + (ts.size() - 2) / 2];
    const double gflop = 2.0 * L * H * S * D * 16 / 1e9;
    printf("%s: %.1f ms (%.0f GFLOP/s of 16-row scores, K %.0f MB)\n", mode % 3 == 1 ? "bf16 dot products" : mode % 3 == 2 ? "AMX tiles" : "fp32 fma, widened",
           t * 1e3, gflop / t, L * H * S * D * 2 / 1e6);
  }
  return sink_val == 12345 ? 1 : 0;
}
