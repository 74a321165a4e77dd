// A feasibility benchmark, not part of the package (docs/performance.md, "Verification attention with AMX"):
// a 5-token verification's attention (16 query rows per KV head: 15 padded to a tile) over 30 layers x 3 KV heads
// of bf16 K/V (head dim 64), on AMX tiles, checked against exact attention over the same bf16 K/V. Needs a CPU with
// AMX-BF16 (Intel Sapphire Rapids and later) and Linux >= 5.16.
//
//     g++ -O3 -march=native -mamx-tile -mamx-bf16 -fopenmp -o /tmp/amx_attention scripts/amx_attention_bench.cpp
//     OMP_NUM_THREADS=2 /tmp/amx_attention 32768        # V interleaved into key pairs per block, as it is stored
//     OMP_NUM_THREADS=2 /tmp/amx_attention 32768 16     # V stored in key pairs already (the tiles' layout), and a
//                                                       # 3-row decode on vdpbf16ps compared with the tiles bit for bit
// (the second argument: bits that skip parts for a time breakdown, see SKIP; PF_AHEAD=N prefetches N blocks ahead)
//
// 16 query rows per KV head (a 5-token verification's 15, padded) over bf16 K/V,
// flash-style blocks of 256 keys: scores S^T = K Q^T on AMX (keys x rows), softmax per row in fp32, P rounded
// to bf16 and transposed to rows x keys, V interleaved in key pairs (VNNI), O += P V on AMX.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
constexpr int D = 64, BS = 256, R = 16;
struct TileCfg { uint8_t palette_id = 1, start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static void amx_config() {
  TileCfg c;
  for (int t = 0; t < 8; ++t) { c.colsb[t] = 64; c.rows[t] = 16; }
  _tile_loadconfig(&c);
}
static inline uint16_t bf16(float x) { uint32_t u; memcpy(&u, &x, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static inline float fl(uint16_t h) { uint32_t u = (uint32_t)h << 16; float x; memcpy(&x, &u, 4); return x; }

// exp for x <= 0 (Cephes-style: 2^n * p(r)), flushing below -87 to 0
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16x16 fp32 transpose (rows in[i * ld], out rows of 16)
static inline void transpose16(const float* in, int ld, float* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ld);
  for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44); r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44); r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee); }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) { t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88); t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd); }
  for (int k = 0; k < 8; ++k) { r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88); r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd); }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * 16, r[i]);
}

// One (head, block): q pairs qp [32 pairs][16 rows][2] bf16; k, v [n=BS][D] bf16. Writes o_b [R][D], m_b, l_b.
static long PF_AHEAD = 1;  // prefetch the block this many ahead (env PF_AHEAD)
static int SKIP = 0;  // timing breakdown: 1 no V interleave, 2 no softmax, 4 no transpose, 8 no PV;
                      // 16: V stored in key pairs already (the tiles' layout), no interleave needed
static void block_amx(const uint16_t* qp, const uint16_t* k, const uint16_t* v, float* o_b, float* m_b, float* l_b,
                      const char* next_k, const char* next_v) {
  alignas(64) float st[BS * 16];          // keys x rows
  alignas(64) float pt[16 * BS];          // rows x keys (fp32, transposed)
  alignas(64) uint16_t pa[16 * BS];       // rows x keys, bf16
  alignas(64) uint16_t vb[BS / 32][4][16 * 32];  // per 32-key step, per 16-d slice: 16 key pairs x 16 d x 2
  _tile_loadd(2, qp, 64);
  _tile_loadd(3, qp + 16 * 32, 64);
  for (int j = 0; j < BS; j += 16) {
    if (next_k) for (int c = 0; c < 32; ++c) _mm_prefetch(next_k + j * D * 2 + c * 64, _MM_HINT_T1);
    _tile_zero(0);
    _tile_loadd(1, k + j * D, D * 2);
    _tile_loadd(4, k + j * D + 32, D * 2);
    _tile_dpbf16ps(0, 1, 2);
    _tile_dpbf16ps(0, 4, 3);
    _tile_stored(0, st + j * 16, 64);
  }
  // V in key pairs while the scores' softmax is computed
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  if (SKIP & 16 && next_v)
    for (int c = 0; c < BS * D * 2 / 64; ++c) _mm_prefetch(next_v + c * 64, _MM_HINT_T1);
  for (int kp = 0; kp < (SKIP & 17 ? 0 : BS / 2); ++kp) {
    if (next_v) for (int c = 0; c < 4; ++c) _mm_prefetch(next_v + kp * 256 + c * 64, _MM_HINT_T1);
    const uint16_t* r0 = v + (2 * kp) * D;
    const uint16_t* r1 = r0 + D;
    for (int h = 0; h < 2; ++h) {  // d 0..31, 32..63
      const __m512i a = _mm512_loadu_si512(r0 + 32 * h), b = _mm512_loadu_si512(r1 + 32 * h);
      _mm512_store_si512(&vb[kp / 16][2 * h][(kp % 16) * 32], _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(&vb[kp / 16][2 * h + 1][(kp % 16) * 32], _mm512_permutex2var_epi16(a, hi, b));
    }
  }
  // softmax per row (lane): max, exp, sum
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < (SKIP & 2 ? 0 : BS); ++j) mv = _mm512_max_ps(mv, _mm512_load_ps(st + j * 16));
  __m512 lv = _mm512_setzero_ps();
  for (int j0 = 0; j0 < (SKIP & 2 ? 0 : BS); j0 += 16) {  // l: per 16 keys an adjacent-pair tree, groups in order
    __m512 t[16];
    for (int i = 0; i < 16; ++i) {
      t[i] = exp512(_mm512_sub_ps(_mm512_load_ps(st + (j0 + i) * 16), mv));
      _mm512_store_ps(st + (j0 + i) * 16, t[i]);
    }
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) t[i] = _mm512_add_ps(t[2 * i], t[2 * i + 1]);
    lv = _mm512_add_ps(lv, t[0]);
  }
  _mm512_storeu_ps(m_b, mv);
  _mm512_storeu_ps(l_b, lv);
  for (int j = 0; j < (SKIP & 4 ? 0 : BS); j += 16) {
    alignas(64) float t[256];
    transpose16(st + j * 16, 16, t);
    for (int r = 0; r < 16; ++r) memcpy(pt + r * BS + j, t + r * 16, 64);
  }
  for (int r = 0; r < 16; ++r)
    for (int j = 0; j < BS; j += 32) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(pt + r * BS + j + 16), _mm512_loadu_ps(pt + r * BS + j));
      _mm512_store_si512(pa + r * BS + j, (__m512i)b);
    }
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int s = 0; s < (SKIP & 8 ? 0 : BS / 32); ++s) {
    _tile_loadd(4, pa + s * 32, BS * 2);
    const uint16_t* b0 = SKIP & 16 ? v + s * 4 * 512 : vb[s][0];  // 16: the block's V already in [s][slice][16 x 32]
    _tile_loadd(5, b0, 64); _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b0 + 512, 64); _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b0 + 1024, 64); _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b0 + 1536, 64); _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, o_b, D * 4); _tile_stored(1, o_b + 16, D * 4); _tile_stored(2, o_b + 32, D * 4); _tile_stored(3, o_b + 48, D * 4);
}

// The same numbers for the first R3 rows by AVX512-BF16 dot products, keys in lanes (a decode step's shape):
// K^T pairs by two 16x16 dword transposes per 16 keys; per (row, key) the 32 pairs accumulated in order; softmax as
// above; l by the same tree; P V per (row, 16 d) over the key pairs in order. v: the block's V in key pairs.
template <int R3>
static void block_dp(const uint16_t* qp, const uint16_t* k, const uint16_t* v, float* o_b, float* m_b, float* l_b) {
  alignas(64) float s[R3][BS];
  alignas(64) float kt[32 * 16];  // per 16 keys: [pair][key] dwords (as floats: only moved)
  uint32_t qd[R3][32];
  for (int r = 0; r < R3; ++r)
    for (int p = 0; p < 32; ++p) qd[r][p] = (uint32_t)qp[p * 32 + r * 2] | ((uint32_t)qp[p * 32 + r * 2 + 1] << 16);
  for (int j = 0; j < BS; j += 16) {
    transpose16((const float*)(k + j * D), D / 2, kt);            // dwords 0..15 of 16 keys -> [pair 0..15][key]
    transpose16((const float*)(k + j * D) + 16, D / 2, kt + 256);  // dwords 16..31
    for (int r = 0; r < R3; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int p = 0; p < 32; ++p)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(_mm512_load_ps(kt + p * 16)),
                               (__m512bh)_mm512_set1_epi32((int)qd[r][p]));
      _mm512_store_ps(s[r] + j, acc);
    }
  }
  alignas(64) uint16_t pb[R3][BS];
  for (int r = 0; r < R3; ++r) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < BS; j += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(s[r] + j));
    const float m = _mm512_reduce_max_ps(mv);
    float l = 0.f;
    for (int j = 0; j < BS; j += 16) {
      const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(s[r] + j), _mm512_set1_ps(m)));
      alignas(64) float t[16];
      _mm512_store_ps(t, p);
      _mm512_store_ps(s[r] + j, p);
      for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) t[i] = t[2 * i] + t[2 * i + 1];
      l += t[0];
    }
    m_b[r] = m;
    l_b[r] = l;
    for (int j = 0; j < BS; j += 32)
      _mm512_store_si512(pb[r] + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(s[r] + j + 16), _mm512_load_ps(s[r] + j)));
  }
  const uint32_t* pd[R3];
  for (int r = 0; r < R3; ++r) pd[r] = (const uint32_t*)pb[r];
  __m512 acc[R3][4];
  for (int r = 0; r < R3; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int kp = 0; kp < BS / 2; ++kp) {
    const uint16_t* vb = v + ((kp / 16) * 4) * 512 + (kp % 16) * 32;  // [step][slice][pair][16 d x 2]
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + c * 512);
    for (int r = 0; r < R3; ++r) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pd[r][kp]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);
    }
  }
  for (int r = 0; r < R3; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o_b + r * D + c * 16, acc[r][c]);
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); return 1; }
  SKIP = argc > 2 ? atoi(argv[2]) : 0;
  if (getenv("PF_AHEAD")) PF_AHEAD = atol(getenv("PF_AHEAD"));
  const long S = argc > 1 ? atol(argv[1]) : 32768, L = 30, H = 3, nb = S / BS;
  std::vector<uint16_t> K(L * H * S * D), V(L * H * S * D);
  uint32_t seed = 1;
  auto rnd = [&]() { seed = seed * 1664525u + 1013904223u; return ((seed >> 8) / 16777216.f) * 2.f - 1.f; };
  for (auto& x : K) x = bf16(rnd() * 2.f);
  for (auto& x : V) x = bf16(rnd());
  std::vector<uint16_t> Vp;  // V in key pairs (SKIP & 16)
  if (SKIP & 16) {  // V in key pairs per block: [32-key step][16-d slice][16 pairs x 16 d x 2]
    std::vector<uint16_t> P(V.size());
    for (long w = 0; w < L * H * nb; ++w)
      for (int st = 0; st < BS / 32; ++st)
        for (int sl = 0; sl < 4; ++sl)
          for (int p = 0; p < 16; ++p)
            for (int d = 0; d < 16; ++d)
              for (int e = 0; e < 2; ++e)
                P[w * BS * D + (st * 4 + sl) * 512 + p * 32 + d * 2 + e] = V[w * BS * D + (st * 32 + 2 * p + e) * D + sl * 16 + d];
    Vp.swap(P);
  }
  std::vector<float> Q(R * D);
  for (auto& x : Q) x = rnd() * 0.125f * 2.f;   // scaled queries
  alignas(64) static uint16_t qp[32 * 32];
  for (int p = 0; p < 32; ++p) for (int r = 0; r < 16; ++r) for (int e = 0; e < 2; ++e) qp[p * 32 + r * 2 + e] = bf16(Q[r * D + 2 * p + e]);
  std::vector<float> parts(L * H * nb * R * (D + 2));
  auto run = [&]() {
#pragma omp parallel
    {
      amx_config();
#pragma omp for schedule(static)
      for (long w = 0; w < L * H * nb; ++w) {
        float* ob = parts.data() + w * R * (D + 2);
        const long ahead = PF_AHEAD;
        const bool last = w + ahead >= L * H * nb;
        const uint16_t* vs = (SKIP & 16 ? Vp.data() : V.data());
        block_amx(qp, K.data() + w * BS * D, vs + w * BS * D, ob, ob + R * D, ob + R * D + R,
                  last ? nullptr : (const char*)(K.data() + (w + ahead) * BS * D), last ? nullptr : (const char*)(vs + (w + ahead) * BS * D));
      }
      _tile_release();
    }
  };
  // check head 0 of layer 0: merge blocks, against double-precision attention over the bf16 K/V and fp32 q
  run();
  double maxerr = 0, maxo = 0;
  for (int r = 0; r < R; ++r) {
    std::vector<double> s(S), o(D, 0.0);
    double m = -1e300, l = 0;
    for (long j = 0; j < S; ++j) { double a = 0; for (int d = 0; d < D; ++d) a += (double)Q[r * D + d] * fl(K[j * D + d]); s[j] = a; m = std::max(m, a); }
    for (long j = 0; j < S; ++j) { double p = std::exp(s[j] - m); l += p; for (int d = 0; d < D; ++d) o[d] += p * fl(V[j * D + d]); }
    float M = -INFINITY;
    for (long b = 0; b < nb; ++b) M = std::max(M, parts[b * R * (D + 2) + R * D + r]);
    double L2 = 0; std::vector<double> O(D, 0.0);
    for (long b = 0; b < nb; ++b) {
      const float* ob = parts.data() + b * R * (D + 2);
      const double wt = std::exp((double)ob[R * D + r] - M);
      L2 += wt * ob[R * D + R + r];
      for (int d = 0; d < D; ++d) O[d] += wt * ob[r * D + d];
    }
    for (int d = 0; d < D; ++d) { maxerr = std::max(maxerr, std::fabs(O[d] / L2 - o[d] / l)); maxo = std::max(maxo, std::fabs(o[d] / l)); }
  }
  printf("check (layer 0, head 0, %d rows): max |amx - exact| %.3g, max |out| %.3g\n", R, maxerr, maxo);
  auto median_seconds = [](auto&& fn) {  // of 7 runs after 2 untimed ones
    std::vector<double> ts;
    for (int rep = 0; rep < 9; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      fn();
      ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin() + 2, ts.end());
    return ts[2 + (ts.size() - 2) / 2];
  };
  const double t = median_seconds(run);
  printf("S %ld: %.1f ms for 30 layers x 3 KV heads x 16 rows (K+V %.0f MB bf16: %.1f GB/s; %.0f GFLOP/s)\n", S, t * 1e3,
         2.0 * L * H * S * D * 2 / 1e6, 2.0 * L * H * S * D * 2 / t / 1e9, 4.0 * L * H * S * D * R / t / 1e9);
  if (SKIP & 16) {
    std::vector<float> dparts(L * H * nb * 3 * (D + 2));
    auto run_dp = [&]() {
#pragma omp parallel for schedule(static)
      for (long w = 0; w < L * H * nb; ++w) {
        float* ob = dparts.data() + w * 3 * (D + 2);
        block_dp<3>(qp, K.data() + w * BS * D, Vp.data() + w * BS * D, ob, ob + 3 * D, ob + 3 * D + 3);
      }
    };
    run();
    run_dp();
    long dm = 0, dl = 0, dox = 0;  // rows whose m / l differ in any bit, output values that do
    for (long w = 0; w < L * H * nb; ++w) {
      const float* a = parts.data() + w * R * (D + 2);
      const float* b = dparts.data() + w * 3 * (D + 2);
      for (int r = 0; r < 3; ++r) {
        dm += memcmp(a + R * D + r, b + 3 * D + r, 4) != 0;
        dl += memcmp(a + R * D + R + r, b + 3 * D + 3 + r, 4) != 0;
        for (int d = 0; d < D; ++d) dox += memcmp(a + r * D + d, b + r * D + d, 4) != 0;
      }
      if (w == 0) printf("block 0 row 0: m %.9g vs %.9g, l %.9g vs %.9g, o0 %.9g vs %.9g\n", a[R * D], b[3 * D], a[R * D + R], b[3 * D + 3], a[0], b[0]);
    }
    printf("differ: m %ld, l %ld, o %ld\n", dm, dl, dox);
    printf("decode on vdpbf16ps (3 rows) vs the AMX tiles' first 3 rows: %ld of %ld values differ in any bit\n",
           dm + dl + dox, L * H * nb * 3 * (D + 2));
    const double tdm = median_seconds(run_dp);
    printf("decode (3 rows) on vdpbf16ps: %.1f ms (%.1f GB/s of K+V)\n", tdm * 1e3, 2.0 * L * H * S * D * 2 / tdm / 1e9);
  }
  return 0;
}
