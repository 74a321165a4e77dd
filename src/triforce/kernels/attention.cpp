// Decode attention on the CPU for a few query rows over a long KV cache: out = softmax(q k^T * scale) v
// in one pass over K and V. fp32 queries and arithmetic; K/V in fp32, bf16 or fp16 (widened in
// registers); head dim 64, 128 or 256. Written over simd.h's Vec: one source for AVX2 and AVX-512.
//
// Why: decoding reads the whole cache per token, so attention must stream it at memory bandwidth.
// PyTorch's CPU flash kernel parallelises over heads only (3 KV heads on 2 threads) and reached
// about 7 GB/s at 32K. Here the keys are split into blocks of BS, every (KV head, block) is one work
// item (flash-decoding): scores, a block-local softmax (max m_b, sum l_b) and the block's p v are
// computed while the block sits in L1/L2, and the blocks are merged by their log-sum-exp at the end.
// Half-precision values are widened as they are read; keys too on the per-row path, and a tile of
// keys at a time into a small fp32 scratch (L1) on the rows-in-lanes path, whose broadcasts need fp32
// scalars. Both paths read every cache byte once from memory.
//
// Rows are (group head, token) pairs as in model.py: row r belongs to token r % T. Masks: none, or
// causal over the last T keys (key S - T + u is visible to token t iff u <= t).
//
// Three ways to compute a block's scores, chosen by the number of query rows R and the path asked for:
//  * few rows (a decode step): per row, W keys' dot products reduced together (hsum_lanes); K is
//    read once per row, which is cheap for R <= a few;
//  * many rows (verifying k draft tokens, R = g * k): "rows in lanes", a small GEMM. The scores are
//    computed transposed, s[key][row], with W query rows in the W lanes of a vector: per head
//    dimension d one broadcast k[key][d] times the vector q[rows][d], for a tile of keys at once.
//    Every K element is loaded once per group of rows (not once per row) and no horizontal sums are
//    needed.
//  * many rows, the per-row path's bits (scores_exact, the model's path from a CPU-dependent row count:
//    exact_rows): the scores computed rows-in-lanes in the per-row path's order of sums, then transposed, so
//    that a verification's rows stay exactly the decode step's.
// Over bf16 K/V on AMD Zen 5 the model's path is instead the rows-in-lanes path on AVX512-BF16 dot products at every
// row count (dot_every_row; with the keys in lanes for up to 8 rows, the same bits), whose sums do not depend on the
// rows beside a row either.
// p v is one loop for both (block_pv): TILE rows x DC vectors of accumulators, each V element read
// once per tile of rows.
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace triforce {
namespace {

constexpr int64_t MAX_ROWS = 64;
constexpr int64_t DOT_MAX_ROWS = 256;  // a call's rows over bf16 K/V on dot products: MAX_ROWS at a time per block
constexpr float LOG2E = 1.4426950408889634f;
constexpr int64_t LANES_MIN_ROWS = 8;  // from this many rows on, the rows-in-lanes path (measured: equal at 6)

// The row count from which decode_attention's path 0 takes the rows-in-lanes path; dot: bf16 K/V on dot products
// (AVX512-BF16 or AMX). LANES_MIN_ROWS was measured on an Intel Xeon. On AMD Zen 4 the AVX-512 build's lanes
// path runs its broadcast FMAs at about half the rate (30 layers x 3 KV heads at 32K, fp16 K/V, per row vs lanes:
// 15 rows 41.1 vs 67.0 ms, 24 rows 62.3 vs 85.6, 48 rows 113.9 vs 106.6; the AVX2 build's lanes path there: 60.6
// at 15), so it keeps the per-row path to 40 rows, and for bf16 on vdpbf16ps lanes to 12 (9 rows 33.9 vs 41.5,
// 15 rows 45.6 vs 41.5, 48 rows 117.6 vs 59.8). On Zen 5 (family 26), with the prefetches paced (Prefetch), bf16
// on vdpbf16ps: 6 rows 20.7 per row vs 21.3 lanes, 9 rows 26.9 vs 23.0, 12 rows 31.5 vs 22.5: lanes from 8 there;
// fp16 per row still ahead at 24 rows (56.7 vs 62.2). (Zen 4 not re-measured with the paced prefetches.)
inline int amd_avx512_family() {  // 0: not an AMD CPU with this build's 16 lanes
  static const int family = [] {
    __builtin_cpu_init();
    if (W != 16 || !__builtin_cpu_is("amd")) return 0;
    unsigned a, b, c, d;
    __cpuid(1, a, b, c, d);
    return int((a >> 8) & 0xf) + int((a >> 20) & 0xff);  // base family + extended family
  }();
  return family;
}
inline int64_t lanes_min_rows(bool dot) {
  const int family = amd_avx512_family();
  if (family == 0) return LANES_MIN_ROWS;
  return dot ? (family >= 26 ? 8 : 12) : 40;
}

// Whether path 0 computes R rows' scores as scores_exact (the per-row path's bits, rows in lanes). Its cost grows
// with the row vectors (W rows each, full or not), the per-row path's with the rows, so it pays where the vectors
// are nearly full. Intel Xeon (family 6 model 207, AMX hidden), AVX-512 build, 30 layers x 3 KV heads, fp16 K/V,
// per row vs scores_exact (benchmarks/attention_time.py, path 1 vs 4; docs/benchmarks/2026-11-28-intel-exact-lanes/
// attention_paths.txt): at 32K, 9 rows 56.0 vs 61.9 ms, 12 rows 69.2 vs 65.7, 15 rows 86.1 vs 75.9, 24 rows 127.5
// vs 126.9, 30 rows 162.6 vs 142.4, 33 rows 177.0 vs 220.0; at 8K, 15 rows 21.3 vs 19.7; bf16 K/V at 32K, 15 rows
// 85.0 vs 75.6. The AVX2 build's per-row sums are cheaper (8 lanes: hadds) and its tree has 16 registers:
// scores_exact was slower (12 rows 87.1 vs 111.6, 15 rows 107.3 vs 122.9). On AMD's AVX-512 CPUs broadcast FMAs
// ran at about half the rate (lanes_min_rows): not measured there, not taken.
inline bool exact_rows(int64_t R) {
  return W == 16 && amd_avx512_family() == 0 && R >= 12 && (R % W == 0 || R % W >= 12);
}
constexpr int64_t BLOCK_FLOATS = 16384;  // keys per work item x head dim: 64 KB of fp32 K (256 keys of 64)
// Keys per work item: BLOCK_FLOATS / D whatever the K/V dtype (bf16 / fp16 blocks had half as many keys
// while the lanes path widened a whole block's keys into an L1 scratch; it widens a tile at a time now:
// 256-key blocks took 5-token verification attention at 32K from 66.0 to 62.8 ms, decode steps unchanged;
// 512 keys were slower at 8K: too few work items for the threads).
template <int64_t D, typename KV>
constexpr int64_t block_keys() {
  return BLOCK_FLOATS / D;
}
constexpr int TILE = 6;                  // query rows per register tile in p v

// f(std::integral_constant<int, n>{}) for the n = min(rows, MAX) rows of a register tile (1 <= n <= MAX <= 6): a
// tile's row count as a compile-time constant, so that its accumulators can live in registers.
template <int MAX, typename F>
ALWAYS_INLINE void with_tile_rows(int64_t rows, F&& f) {
  static_assert(MAX >= 1 && MAX <= 6, "tiles of 1 to 6 rows");
  auto at = [&](auto n) {
    if constexpr (decltype(n)::value <= MAX) f(n);
  };
  switch (std::min<int64_t>(MAX, rows)) {
    case 1: at(std::integral_constant<int, 1>{}); break;
    case 2: at(std::integral_constant<int, 2>{}); break;
    case 3: at(std::integral_constant<int, 3>{}); break;
    case 4: at(std::integral_constant<int, 4>{}); break;
    case 5: at(std::integral_constant<int, 5>{}); break;
    default: at(std::integral_constant<int, 6>{}); break;
  }
}
constexpr int DC = W == 16 ? 4 : 2;      // vectors of a value row per pass: TILE x DC + DC + 1 <= REGS
// rows-in-lanes scores: row vectors per group and keys per tile, JT x NVG + NVG + 1 <= REGS - 1
constexpr int NVG_MAX = W == 16 ? 4 : 2;
template <int NVG>
constexpr int keys_per_tile() {
  return W == 16 ? (NVG == 1 ? 16 : NVG == 2 ? 12 : NVG == 3 ? 8 : 6) : (NVG == 1 ? 12 : 5);
}

// The next block's K and V, a few cache lines at a time over the whole of this block's work item, at the pace of
// its arithmetic. The loops step it by their vector instructions (FMAs, dot products; an exp as 16), and
// the work item paces it by their total, so the lines go out at an even rate: asked for in one phase of the item,
// they queued behind each other, stalled that phase's own loads (a burst of 32 prefetches per tile of 16 keys took
// the bf16 dot-product scores from 20 to 31 cycles per key) and left the rest of the item with no reads in flight.
// Zen 5, 32K, 30 layers x 3 KV heads, bf16 K/V, 15 rows (a 5-token verification) on dot products: 26.3 -> 24 ms
// with K and V over the whole item instead of K over the scores and V over p v. The per-row path (decode) keeps
// the latter: its scores and p v are each as long, and one stream over both made fp16 decode steps 2-6% slower.
// The hint is T0 (L1 and L2), though a block's lines run 64 KB ahead of their use. Against T1 (L2 only), the
// embedded model at 32K on Zen 5, alternated in one process (benchmarks/inprocess_ab.py): the bf16 decode step
// 0.95-0.96x when the memory reads fast (72-76 GB/s), 0.99-1.00x when slow (45-48 GB/s); a 5-token verification
// 0.98-1.01x; the AVX2 build's step 0.90-0.99x (fp16 K/V) and 0.98x (bf16), its verification 0.97-1.00x. The
// linear layers' prefetches, 16 KB ahead, measured the same either way and stay T1.
struct Prefetch {
  const char* a = nullptr;  // the K lines left, then the V lines
  const char* a_end = nullptr;
  const char* b = nullptr;
  const char* b_end = nullptr;
  uint64_t rate = 0;  // lines per unit of work, 32.32 fixed point
  uint64_t owed = 0;  // lines due, 32.32
  Prefetch(const void* k, const void* v, int64_t bytes) {
    if (k != nullptr) a = static_cast<const char*>(k), a_end = a + bytes;
    if (v != nullptr) b = static_cast<const char*>(v), b_end = b + bytes;
  }
  bool pending() const { return a < a_end || b < b_end; }
  void pace(int64_t units) {
    const uint64_t lines = ((a_end - a) + (b_end - b)) / 64;
    rate = units > 0 ? (lines << 32) / static_cast<uint64_t>(units) + 1 : uint64_t(1) << 40;
  }
  ALWAYS_INLINE void step(int64_t units) {
    owed += rate * static_cast<uint64_t>(units);
    for (; owed >= (uint64_t(1) << 32); owed -= uint64_t(1) << 32) {
      if (a < a_end) {
        prefetch_l1(a);
        a += 64;
      } else if (b < b_end) {
        prefetch_l1(b);
        b += 64;
      } else {
        owed = 0;
        return;
      }
    }
  }
  void finish() {
    for (; a < a_end; a += 64) prefetch_l1(a);
    for (; b < b_end; b += 64) prefetch_l1(b);
  }
};

// One tile of NR rows (a compile-time count, so the accumulators can live in registers) and DCP vectors of the
// value rows from vector c0 on; PF: pf stepped per key.
template <int64_t D, int64_t RS, int NR, int DCP, bool PF, typename KV>
inline void pv_tile(const float* p, int64_t js, const KV* v, int64_t n, int c0, float* o, Prefetch* pf) {
  Vec acc[NR][DCP];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DCP; ++c) acc[r][c] = Vec(0.f);
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (PF) pf->step(NR * DCP);
    const KV* vj = v + j * D + c0 * W;
    const float* pj = p + j * js;
    if constexpr (NR * DCP + NR + 1 <= REGS) {  // few rows: their p held, a value vector widened at a time
      Vec pr[NR];
      for (int r = 0; r < NR; ++r) pr[r] = Vec(pj[r * RS]);
      for (int c = 0; c < DCP; ++c) {
        const Vec vv = load(vj + c * W);
        for (int r = 0; r < NR; ++r) acc[r][c] = fma(pr[r], vv, acc[r][c]);
      }
    } else {
      Vec vv[DCP];
      for (int c = 0; c < DCP; ++c) vv[c] = load(vj + c * W);
      for (int r = 0; r < NR; ++r) {
        const Vec pr(pj[r * RS]);
        for (int c = 0; c < DCP; ++c) acc[r][c] = fma(pr, vv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DCP; ++c) acc[r][c].store(o + r * D + (c0 + c) * W);
}

constexpr int pv_vectors_per_pass(int nc, int nr) {
  if (nc < DC) return nc;
  const int wide = (REGS - 1 - nr) / nr;  // NR x DCP accumulators + NR p + one value vector
  for (int d : {8, 4})
    if (d > DC && d <= wide && nc % d == 0) return d;
  return DC;
}

template <int64_t D, int64_t RS, int NR, typename KV>
inline void pv_rows(const float* p, int64_t js, const KV* v, int64_t n, float* o, Prefetch* pf) {
  constexpr int NC = D / W;
  // vectors of a value row per pass: DC, or with few rows as many as their accumulators and p leave registers
  // for (one value vector live at a time; AVX2, 3 rows: 4 vectors, two passes over the keys instead of four)
  constexpr int DCP = pv_vectors_per_pass(NC, NR);
  // (the prefetching loop is a separate instance: with its inner loop in the tile GCC kept the accumulators
  // on the stack, a load and a store around every fma)
  for (int c0 = 0; c0 < NC; c0 += DCP)
    if (pf != nullptr && pf->pending())
      pv_tile<D, RS, NR, DCP, true>(p, js, v, n, c0, o, pf);
    else
      pv_tile<D, RS, NR, DCP, false>(p, js, v, n, c0, o, nullptr);
}

// o_b [R, D] = p v for one block of n keys (v: the block's first value row), with p(r, j) =
// p[r * RS + j * js] (the per-row path keeps scores by row, RS = BS; the lanes path by key, RS = 1;
// RS is a compile-time constant: runtime strides in the inner loop cost 10-20%). pf: stepped per key and pass.
template <int64_t D, int64_t RS, typename KV>
void block_pv(const float* p, int64_t js, const KV* v, int64_t R, int64_t n, float* o_b, Prefetch* pf = nullptr) {
  for (int64_t r0 = 0; r0 < R; r0 += TILE) {
    const float* pr = p + r0 * RS;
    float* o = o_b + r0 * D;
    with_tile_rows<TILE>(R - r0, [&](auto nr) { pv_rows<D, RS, decltype(nr)::value>(pr, js, v, n, o, pf); });
  }
}

// Where a row's scores are all -inf (every key of the block masked), m is -inf: subtract 0 instead
// and zero p, so l = 0 marks the block as empty for that row.
// B2 (a bf16 cache's arithmetic, run()): m is the block's reference in base 2, an integer, and p = 2^(s log2 e - m)
// is stored rounded to bf16 (l sums the unrounded p).
template <bool B2 = false>
inline Vec softmax_numerators(float* x, int64_t n, float m, float* l_out, int64_t seen = -1) {
  // seen: one past the row's last visible key (default n). The lanes sum the keys below it rounded down to W, the
  // rest one by one, so that a row of a verification, whose block runs on past its last key (masked), sums its keys
  // exactly as the decode step does, whose block ends there
  const Vec mv(m == NEG_INF ? 0.f : m), neg(NEG_INF);
  Vec acc(0.f);
  int64_t j = 0;
  const int64_t lanes_end = (seen < 0 ? n : seen) / W * W;
  for (; j + W <= lanes_end; j += W) {
    const Vec s = Vec::loadu(x + j);
    if constexpr (B2) {
      const Vec p = select(s != neg, exp2(s * Vec(LOG2E) - mv));
      round_bf16(p).store(x + j);
      acc = acc + p;
    } else {
      const Vec p = select(s != neg, exp(s - mv));
      p.store(x + j);
      acc = acc + p;
    }
  }
  float l = reduce_add(acc);
  for (; j < n; ++j) {  // a block's last keys by the same vector code: a key's p does not depend on where it falls
    float p = 0.f;
    if (x[j] != NEG_INF) {
      alignas(64) float t[W];
      (B2 ? exp2(Vec(x[j]) * Vec(LOG2E) - mv) : exp(Vec(x[j]) - mv)).store(t);
      p = t[0];
    }
    x[j] = B2 ? round_bf16(p) : p;
    l += p;
  }
  *l_out = l;
  return acc;
}

// A block's base-2 reference for its maximum score m (natural units): ceil(m log2 e), an integer, so that blocks'
// rounded p differ by exact powers of two whatever the block boundaries (B2).
inline float base2_reference(float m) { return m == NEG_INF ? NEG_INF : std::ceil(m * LOG2E); }

// The base-2 reference of a block's maximum score m (-inf: every key masked), as a vector (base2_reference's value;
// both layouts compute it by these operations)
ALWAYS_INLINE Vec reference2(const Vec& m) {
  const Vec neg(NEG_INF);
  return select(m != neg, (m * Vec(LOG2E)).ceil()) + select(m == neg, neg);
}

// Partial dot products of RG rows (q, row stride D) with KP keys from k (row stride D): acc[r][i] holds W lanes
// whose sum is row r's score of key i. Each key vector is loaded (and widened) once for all RG rows.
template <int64_t D, int RG, int KP, typename KV>
inline void dot_parts(const float* q, const KV* k, Vec (&acc)[RG][KP]) {
  for (int r = 0; r < RG; ++r)
    for (int i = 0; i < KP; ++i) acc[r][i] = Vec(0.f);
  for (int c = 0; c < D / W; ++c)
    for (int i = 0; i < KP; ++i) {
      const Vec kv = load(k + i * D + c * W);
      for (int r = 0; r < RG; ++r) acc[r][i] = fma(Vec::loadu(q + r * D + c * W), kv, acc[r][i]);
    }
}

// hsum_lanes over KP = W / 2 vectors of a and KP of b: lanes [0, KP) to a_out, [KP, W) to b_out.
template <int KP>
inline void hsum_halves(const Vec* a, const Vec* b, float* a_out, float* b_out) {
  Vec t[W];
  for (int i = 0; i < KP; ++i) {
    t[i] = a[i];
    t[KP + i] = b[i];
  }
  float sums[W];
  hsum_lanes(t).store(sums);
  std::copy(sums, sums + KP, a_out);
  std::copy(sums + KP, sums + W, b_out);
}

// Scores of R rows q [R, D] (scaled) against n keys k [n, D] as stored (half-precision keys are widened
// as they are loaded: with a few rows that beat widening the block into a scratch copy first), into s
// [R, BS] (row stride BS). Rows go in groups of up to 3, W keys at a time in two halves of W / 2: a key
// vector is widened once per group instead of once per row (widening is what bound this loop), and each
// score is its W lanes reduced by hsum_lanes, whose tree is the same for every position: a score does not
// depend on the group it was computed in.
// Scores of a group of RG = 2 or 3 rows: W keys at a time, in two halves of KP = W / 2 keys, each half's partial
// sums of rows 0 and 1 reduced together; row 2's two halves (RG = 3) reduced together after them.
template <int64_t D, int64_t BS, int RG, typename KV>
inline void group_scores(const float* qg, const KV* k, int64_t nw, float* s0, Prefetch& pf) {
  constexpr int KP = W / 2;
  float* s1 = s0 + BS;
  for (int64_t j = 0; j < nw; j += W) {
    pf.step(RG * D);
    Vec lo[RG][KP], hi[RG][KP];
    dot_parts<D, RG, KP>(qg, k + j * D, lo);
    hsum_halves<KP>(lo[0], lo[1], s0 + j, s1 + j);
    dot_parts<D, RG, KP>(qg, k + (j + KP) * D, hi);
    hsum_halves<KP>(hi[0], hi[1], s0 + j + KP, s1 + j + KP);
    if constexpr (RG == 3) hsum_halves<KP>(lo[2], hi[2], s1 + BS + j, s1 + BS + j + KP);
  }
}

// The scores of nw keys (a multiple of W) for R rows, W keys at a time.
// Scores of RT rows (q, row stride D) against KT = W / RT keys (k, row stride D) into s (row stride BS): the W
// (row, key) partial-sum vectors, each the chain fma(q, k, acc) over the head's W-lane chunks from zero as in
// dot_parts, reduced together by one hsum_lanes (its tree is the same in every lane): the bits of the groups below.
// Per chunk it loads RT query vectors into registers (asked for: GCC otherwise folds a query load into every FMA)
// and KT key vectors for W FMAs, where a group loads a query vector per FMA. 2 rows x 4 keys on the AVX2 build: its
// 8 accumulators, 2 query and 4 key vectors fit its 16 registers; 4 x 2 took longer (AMD Zen 3, one thread, fp16
// K/V, 32K keys x 30 layers x 3 KV heads; docs/benchmarks/2026-11-29-zen3-attention/). The last 3 rows of an odd
// count (and a decode step's 3) run as a group. AVX2 only: the AVX-512 build's tiles are not measured.
constexpr int TILE_SCORE_ROWS = W == 8 ? 2 : 0;

template <int64_t D, int64_t BS, int RT, typename KV>
ALWAYS_INLINE void tile_scores(const float* q, const KV* k, float* s) {
  constexpr int KT = W / RT;
  Vec acc[W];  // (row r, key i) at r * KT + i
  for (int i = 0; i < W; ++i) acc[i] = Vec(0.f);
  for (int c = 0; c < D / W; ++c) {
    Vec kv[KT];
    for (int i = 0; i < KT; ++i) kv[i] = load(k + i * D + c * W);
    for (int r = 0; r < RT; ++r) {
      Reg qr = Vec::loadu(q + r * D + c * W);
#if defined(CPU_CAPABILITY_AVX512)
      asm volatile("" : "+v"(qr));  // in a register: one load per query vector, not one per FMA
#else
      asm volatile("" : "+x"(qr));
#endif
      const Vec qv(qr);
      for (int i = 0; i < KT; ++i) acc[r * KT + i] = fma(qv, kv[i], acc[r * KT + i]);
    }
  }
  alignas(64) float out[W];
  hsum_lanes(acc).store(out);
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < KT; ++i) s[r * BS + i] = out[r * KT + i];
}

template <int64_t D, int64_t BS, typename KV>
void scores_groups(const float* q, const KV* k, int64_t R, int64_t nw, float* s, Prefetch& pf) {
  constexpr int NC = D / W;
  int64_t r0 = 0;
  if constexpr (TILE_SCORE_ROWS > 0) {  // tiles of RT rows until 3 or fewer are left (a decode step's 1-3: the groups)
    constexpr int RT = TILE_SCORE_ROWS, KT = W / RT;
    for (; R - r0 >= RT && R - r0 != 3; r0 += RT)
      for (int64_t j = 0; j < nw; j += KT) {
        pf.step(D);
        tile_scores<D, BS, RT>(q + r0 * D, k + j * D, s + r0 * BS + j);
      }
  }
  while (R - r0 >= 2) {  // groups of 3, or of 2 where 2 or 4 rows are left
    if (R - r0 == 2 || R - r0 == 4) {
      group_scores<D, BS, 2>(q + r0 * D, k, nw, s + r0 * BS, pf);
      r0 += 2;
    } else {
      group_scores<D, BS, 3>(q + r0 * D, k, nw, s + r0 * BS, pf);
      r0 += 3;
    }
  }
  for (; r0 < R; ++r0) {  // a last single row
    const float* qr = q + r0 * D;
    float* sr = s + r0 * BS;
    for (int64_t j = 0; j < nw; j += W) {  // W keys at a time, their W partial-sum vectors reduced together
      pf.step(D);
      Vec t[W];
      for (int c = 0; c < NC; ++c) {
        const Vec qc = Vec::loadu(qr + c * W);
        for (int i = 0; i < W; ++i) t[i] = fma(qc, load(k + (j + i) * D + c * W), t[i]);
      }
      hsum_lanes(t).store(sr + j);
    }
  }
}

template <int64_t D, int64_t BS, typename KV>
void scores_rows(const float* q, const KV* k, int64_t R, int64_t n, float* s, Prefetch& pf) {
  const int64_t nw = n - n % W;
  scores_groups<D, BS>(q, k, R, nw, s, pf);
  if (nw < n) {  // the block's last n % W keys by the same code as a full group, from a zero-padded copy: a key's
    // score then does not depend on where the block ends (a verification's rows see masked keys past their own,
    // the decode step's block ends at them), so a verification's rows equal the decode step's bit for bit
    // (n < BS here, so the group's W scores fit the row's BS slots)
    KV kt[W * D];
    std::memset(static_cast<void*>(kt), 0, sizeof(kt));
    std::memcpy(static_cast<void*>(kt), static_cast<const void*>(k + nw * D), (n - nw) * D * sizeof(KV));
    Prefetch none(nullptr, nullptr, 0);
    scores_groups<D, BS>(q, kt, R, W, s + nw, none);
  }
}

// The per-row path's scores computed rows-in-lanes ("exact lanes", path 4): the same bits as scores_rows, without
// its horizontal sums. A per-row score is hsum_lanes over W lane partials, partial l being the chain fma(q, k, acc)
// over dimensions l, W + l, 2W + l, ... from zero; hsum_lanes sums the partials as the balanced binary tree over
// the lanes in the order tree_lane(0), tree_lane(1), ... (AVX-512: lanes l and l + 2 of each group of four first;
// AVX2: neighbours). Here each partial is a vector of W rows (a broadcast key element times the transposed
// queries), and the tree adds whole vectors: per key and W rows, D FMAs and W - 1 adds instead of the per-row
// path's D / W FMAs per row plus a share of the transposes that hsum_lanes is made of.
constexpr int tree_lane(int i) { return W == 16 ? (i & ~3) | ((i & 1) << 1) | ((i >> 1) & 1) : i; }

// out[jj] (W rows in lanes) = the sum over the tree's lanes LO .. LO + N - 1 (in tree_lane order) for key jj of kj
// [JN][D] (fp32), qg: the first of this row vector's lanes in qt [D][RP].
template <int64_t D, int JN, int LO, int N>
ALWAYS_INLINE void exact_tree(const float* qg, int64_t RP, const float* kj, Vec (&out)[JN]) {
  if constexpr (N == 1) {
    constexpr int l = tree_lane(LO);
    for (int jj = 0; jj < JN; ++jj) out[jj] = Vec(0.f);
    for (int c = 0; c < D / W; ++c) {
      const Vec qv = Vec::loadu(qg + (c * W + l) * RP);
      for (int jj = 0; jj < JN; ++jj) out[jj] = fma(qv, Vec(kj[jj * D + c * W + l]), out[jj]);
    }
  } else {
    Vec b[JN];
    exact_tree<D, JN, LO, N / 2>(qg, RP, kj, out);
    exact_tree<D, JN, LO + N / 2, N / 2>(qg, RP, kj, b);
    for (int jj = 0; jj < JN; ++jj) out[jj] = out[jj] + b[jj];
  }
}

// scores_rows' result, s [R, BS] for the n keys of k (as stored), from the transposed queries qt [D][RP]: JN keys
// at a time (widened into an L1 scratch) into st [n][RP] (a row vector's scores of a key together), then st
// transposed into s, W x W in registers (scalar stores of each tile's scores straight into s's rows, right after
// the tile's vector stores, cost 10-17 ms of a 5-token verification's attention at 32K). JN: the tree's live
// vectors (up to log2(W) + 1 per key) and a query vector within the registers.
template <int64_t D, int64_t BS, typename KV>
void scores_exact(const float* qt, int64_t RP, int64_t R, const KV* k, int64_t n, float* st, float* s, Prefetch& pf) {
  constexpr int JN = W == 16 ? 5 : 3;
  alignas(64) float kt[std::is_same_v<KV, float> ? 1 : JN * D];
  // keys j .. j + keys - 1 as fp32: in place, or widened into kt
  auto keys_fp32 = [&](int64_t j, int64_t keys) -> const float* {
    if constexpr (std::is_same_v<KV, float>) {
      return k + j * D;
    } else {
      for (int64_t i = 0; i < keys * D; i += W) load(k + j * D + i).store(kt + i);
      return kt;
    }
  };
  const int64_t nw = n - n % W;
  // one row vector at a time, its keys' tiles inside: with the tiles outside and the row vectors inside each, GCC
  // spilled the tree's registers (fp16 K/V, 15 rows: 110 ms against 74 for the attention of a 5-token verification
  // at 32K). NV > 1 widens each key again: 4 conversions against its 79 vector operations.
  for (int64_t g = 0; g < RP / W; ++g) {
    const float* qg = qt + g * W;
    float* sg = st + g * W;
    auto tile = [&](auto jn_const, int64_t j) {  // JNc keys' scores of this row vector into st
      constexpr int JNc = decltype(jn_const)::value;
      const float* kj = keys_fp32(j, JNc);
      pf.step(JNc * D);
      Vec acc[JNc];
      exact_tree<D, JNc, 0, W>(qg, RP, kj, acc);
      for (int jj = 0; jj < JNc; ++jj) acc[jj].store(sg + (j + jj) * RP);
    };
    int64_t j = 0;
    for (; j + JN <= n; j += JN) tile(std::integral_constant<int, JN>{}, j);
    for (; j < n; ++j) tile(std::integral_constant<int, 1>{}, j);
    const int64_t rn = std::min<int64_t>(W, R - g * W);  // then into s's rows
    for (int64_t jw = 0; jw < nw; jw += W) {
      Reg r[W];
      transpose_lanes(sg + jw * RP, RP, r);
      for (int64_t i = 0; i < rn; ++i) Vec(r[i]).store(s + (g * W + i) * BS + jw);
    }
    for (int64_t jr = nw; jr < n; ++jr)
      for (int64_t i = 0; i < rn; ++i) s[(g * W + i) * BS + jr] = sg[jr * RP + i];
  }
}

// Per row of s [R, BS] (n scores, masked ones -inf): its max m_b[r], its numerators exp(s - m) in place
// and their sum l_b[r].
template <int64_t BS, bool B2 = false>
void rows_softmax(float* s, int64_t R, int64_t n, float* m_b, float* l_b) {
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * BS;
    Vec mv(NEG_INF);
    int64_t j = 0;
    for (; j + W <= n; j += W) mv = vmax(mv, Vec::loadu(sr + j));
    float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return vmax(a, b); }, mv);
    for (; j < n; ++j) m = std::max(m, sr[j]);
    if constexpr (B2) m = base2_reference(m);
    m_b[r] = m;
    int64_t seen = n;  // one past the row's last visible key
    while (seen > 0 && sr[seen - 1] == NEG_INF) --seen;
    softmax_numerators<B2>(sr, n, m, l_b + r, seen);
  }
}

// One (head, block) work item on the per-row path. q [R, D] scaled; k: the block's keys as stored;
// s: scratch [R, BS] (BS: the row stride); mask(r, j) -> whether row r sees key j of the block (called
// for the keys from mask_from on: the ones before it are seen by every row). Writes o_b [R, D], m_b [R], l_b [R].
// Where the scores run as scores_exact (path 4), the queries come transposed instead, qt [D][RP] (RP a multiple of
// W; q is null), with st its scratch [BS][RP].
template <int64_t D, int64_t BS, bool B2, typename KV, typename Mask>
void block_rows(const float* q, const KV* k, const KV* v, int64_t R, int64_t n, int64_t mask_from, const Mask& mask,
                float* s, const char* next_k, const char* next_v, float* o_b, float* m_b, float* l_b,
                const float* qt = nullptr, int64_t RP = 0, float* st = nullptr) {
  // the next block's K paced over the scores, its V over p v (see Prefetch)
  Prefetch pk(next_k, nullptr, BS * D * sizeof(KV)), pv(nullptr, next_v, BS * D * sizeof(KV));
  pk.pace(qt != nullptr ? n * (RP / W) * D : n * R * D / W);  // the scores' FMAs
  pv.pace(n * R * D / W);  // p v's
  if (qt != nullptr)
    scores_exact<D, BS>(qt, RP, R, k, n, st, s, pk);
  else
    scores_rows<D, BS>(q, k, R, n, s, pk);
  pk.finish();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = mask_from; j < n; ++j)
      if (!mask(r, j)) s[r * BS + j] = NEG_INF;
  rows_softmax<BS, B2>(s, R, n, m_b, l_b);
  block_pv<D, BS>(s, 1, v, R, n, o_b, &pv);
  pv.finish();
}

// Rows-in-lanes scores of one block for NVG vectors of rows: st[j][row] for the n keys of k (as stored),
// qt [D][RP] the scaled, transposed queries (zero in padded lanes), st of row stride RP. Half-precision keys
// are widened a tile at a time into a small scratch that stays in L1 (the broadcasts need fp32 scalars);
// widening the whole block first into a 32 KB scratch left its loads waiting and the block out of L1.
template <int64_t D, int NVG, typename KV>
void scores_lanes(const float* qt, int64_t RP, const KV* k, int64_t n, float* st, Prefetch& pf) {
  constexpr int JT = keys_per_tile<NVG>();
  float kt[std::is_same_v<KV, float> ? 1 : JT * D];
  auto tile = [&](auto jt_const, int64_t j) {
    constexpr int JN = decltype(jt_const)::value;
    Vec acc[JN][NVG];
    const float* kj;
    if constexpr (std::is_same_v<KV, float>) {
      kj = k + j * D;
    } else {
      for (int64_t i = 0; i < JN * D; i += W) load(k + j * D + i).store(kt + i);
      kj = kt;
    }
    for (int64_t d = 0; d < D; ++d) {
      Vec qv[NVG];
      for (int g = 0; g < NVG; ++g) qv[g] = Vec::loadu(qt + d * RP + g * W);
      for (int jj = 0; jj < JN; ++jj) {
        const Vec kb(kj[jj * D + d]);
        for (int g = 0; g < NVG; ++g) acc[jj][g] = fma(kb, qv[g], acc[jj][g]);
      }
    }
    for (int jj = 0; jj < JN; ++jj)
      for (int g = 0; g < NVG; ++g) acc[jj][g].store(st + (j + jj) * RP + g * W);
  };
  int64_t j = 0;
  for (; j + JT <= n; j += JT) {
    pf.step(JT * D * NVG);
    tile(std::integral_constant<int, JT>{}, j);
  }
  for (; j < n; ++j) tile(std::integral_constant<int, 1>{}, j);
}

// ---- scores on AMX tiles (bf16 K, the bf16 arithmetic; Intel Sapphire Rapids and later) ----
// Compiled where the CPU has AMX-BF16 (kernels/__init__.py adds -mamx-tile -mamx-bf16); used where Linux
// grants the process the tile state (arch_prctl, Linux >= 5.16) and TRIFORCE_AMX is not 0.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
bool amx_usable() {
  static const bool ok = [] {
    const char* env = std::getenv("TRIFORCE_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes (the palette's largest): a thread's tile configuration is its own register
// state, so each work chunk sets it before its first tile instruction.
inline void amx_configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Scores of the first n16 keys (a multiple of 16) of one block, st[j][row] (row stride RP) for every group of
// 16 rows: per 16 keys, C (keys x rows) += K (16 keys x 16 dimension pairs) . Q (16 pairs x 16 rows x 2), D / 32
// times. qb: the rounded queries in the tiles' pair layout, [NV][D / 32][16 pairs][16 rows][2] bf16.
template <int64_t D>
void scores_amx(const uint16_t* qb, int64_t NV, int64_t RP, const c10::BFloat16* k, int64_t n16, float* st) {
  constexpr int NC = D / 32;
  const auto* kb = reinterpret_cast<const uint16_t*>(k);
  for (int64_t g = 0; g < NV; ++g) {
    const uint16_t* qg = qb + g * NC * 512;
    if constexpr (NC <= 4) {  // the queries stay in tiles 2-5
      _tile_loadd(2, qg, 64);
      if constexpr (NC > 1) _tile_loadd(3, qg + 512, 64);
      if constexpr (NC > 2) _tile_loadd(4, qg + 1024, 64);
      if constexpr (NC > 3) _tile_loadd(5, qg + 1536, 64);
    }
    for (int64_t j = 0; j < n16; j += 16) {
      const uint16_t* kj = kb + j * D;
      _tile_zero(0);
      if constexpr (NC <= 4) {
        _tile_loadd(1, kj, D * 2);
        _tile_dpbf16ps(0, 1, 2);
        if constexpr (NC > 1) {
          _tile_loadd(6, kj + 32, D * 2);
          _tile_dpbf16ps(0, 6, 3);
        }
        if constexpr (NC > 2) {
          _tile_loadd(1, kj + 64, D * 2);
          _tile_dpbf16ps(0, 1, 4);
        }
        if constexpr (NC > 3) {
          _tile_loadd(6, kj + 96, D * 2);
          _tile_dpbf16ps(0, 6, 5);
        }
      } else {
        for (int c = 0; c < NC; ++c) {
          _tile_loadd(2, qg + c * 512, 64);
          _tile_loadd(1, kj + c * 32, D * 2);
          _tile_dpbf16ps(0, 1, 2);
        }
      }
      _tile_stored(0, st + j * RP + g * 16, RP * 4);
    }
  }
}

// o_b [R, D] = p v of one block's first n32 keys (a multiple of 32) on AMX tiles, for the bf16 arithmetic: st [n][RP]
// the rounded p (keys x rows; bf16 values as fp32), v [n][D] bf16. Per 32 keys, C (16 rows x 16 dims) += P (16 rows
// x 32 keys) . V (16 key pairs x 16 dims x 2): V's rows interleaved in pairs once per block (the tiles' layout),
// P transposed to rows x keys per group of 16 rows; four 16-dim slices of C per pass over the keys.
template <int64_t D>
void pv_amx(const float* st, int64_t RP, int64_t NV, const c10::BFloat16* v, int64_t R, int64_t n32, float* o_b,
            const char* next_v) {
  constexpr int64_t NS = D / 16, BS = BLOCK_FLOATS / D;
  alignas(64) uint16_t vb[BS * D];    // [32-key step][slice][16 pairs][16 dims x 2]
  alignas(64) uint16_t pa[16 * BS];   // one group's p, rows x keys
  alignas(64) float ot[16 * D];       // one group's output
  const auto* vv = reinterpret_cast<const uint16_t*>(v);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < n32 / 2; ++kp) {
    if (next_v != nullptr)  // the next block's values into L2, two rows per pair
      for (int64_t b = 2 * kp * D * 2; b < (2 * kp + 2) * D * 2; b += 64) prefetch_l2(next_v + b);
    const uint16_t* r0 = vv + 2 * kp * D;
    for (int64_t h = 0; h < D / 32; ++h) {  // dims 32h..32h+31: slices 2h and 2h+1
      const __m512i a = _mm512_loadu_si512(r0 + 32 * h), b = _mm512_loadu_si512(r0 + D + 32 * h);
      uint16_t* dst = vb + ((kp / 16) * NS + 2 * h) * 512 + (kp % 16) * 32;
      _mm512_store_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(dst + 512, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
  for (int64_t g = 0; g < NV; ++g) {
    for (int64_t j = 0; j < n32; j += 16) {  // p (bf16 values) -> rows x keys, their upper halves
      __m512 r[16];
      transpose_lanes(st + j * RP + g * 16, RP, r);
      for (int row = 0; row < 16; ++row)
        _mm256_store_si256(reinterpret_cast<__m256i*>(pa + row * BS + j),
                           _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(r[row]), 16)));
    }
    for (int64_t c0 = 0; c0 < NS; c0 += 4) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < n32 / 32; ++s) {
        _tile_loadd(4, pa + s * 32, BS * 2);
        const uint16_t* b0 = vb + (s * NS + c0) * 512;
        _tile_loadd(5, b0, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b0 + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b0 + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b0 + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, ot + c0 * 16, D * 4);
      _tile_stored(1, ot + c0 * 16 + 16, D * 4);
      _tile_stored(2, ot + c0 * 16 + 32, D * 4);
      _tile_stored(3, ot + c0 * 16 + 48, D * 4);
    }
    const int64_t rows = std::min<int64_t>(16, R - g * 16);
    std::copy(ot, ot + rows * D, o_b + g * 16 * D);
  }
}
#else
bool amx_usable() { return false; }
inline void amx_configure() {}
template <int64_t D>
void scores_amx(const uint16_t*, int64_t, int64_t, const c10::BFloat16*, int64_t, float*) {}
template <int64_t D>
void pv_amx(const float*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t, float*, const char*) {}
#endif

// ---- a bf16 cache's rows-in-lanes path on AVX512-BF16 dot products (vdpbf16ps: AMD Zen 4 on, Intel Cooper Lake
// on) ----
// One instruction sums two bf16 x bf16 products per lane into fp32: twice an FMA's multiply-adds, at the FMA's rate
// on Zen 4 (measured 2.7 vs 2.5 G instructions/s per core; on Sapphire Rapids at half it, where AMX's tiles serve
// instead). The products are the bf16 arithmetic's (exact in fp32): only the order of the fp32 sums differs from the
// FMA paths, as between the other paths. Keys are read as stored (no widening), a dimension pair broadcast from
// memory per key; values interleaved in key pairs in registers.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool BF16_DOT = true;

// Scores of the n keys of k for NVG groups of 16 rows: st[j][row] (row stride RP). qb: the rounded queries' pairs,
// [NVG][D / 2][16 rows][2] bf16 (scores_amx's layout); steps pf per tile as scores_lanes does. (Not inlined, and the
// keys addressed from one pointer: inside block_lanes GCC kept a pointer per key of the tile, partly on the stack,
// reloaded in the inner loop. Zen 5: 33 -> 28 cycles per key, then 2% more on the whole.)
template <int64_t D, int NVG>
__attribute__((noinline)) void scores_dot(const uint16_t* qb, int64_t RP, const c10::BFloat16* k, int64_t n, float* st,
                                          Prefetch& pf, int64_t max_to, float* mx) {
  constexpr int JT = keys_per_tile<NVG>();
  __m512 m[NVG];  // the rows' maximum over keys [0, max_to) (the unmasked ones), taken as the scores are stored
  for (int g = 0; g < NVG; ++g) m[g] = _mm512_set1_ps(NEG_INF);
  const auto* kp = reinterpret_cast<const int32_t*>(k);  // [n][D / 2] dimension pairs
  auto tile = [&](auto jt_const, int64_t j) {
    constexpr int JN = decltype(jt_const)::value;
    __m512 acc[JN][NVG];
    for (int jj = 0; jj < JN; ++jj)
      for (int g = 0; g < NVG; ++g) acc[jj][g] = _mm512_setzero_ps();
    const int32_t* kd = kp + j * (D / 2);  // the tile's dimension pair d: kd[jj * (D / 2)] for key j + jj
    for (int64_t d = 0; d < D / 2; ++d, ++kd) {
      asm("" : "+r"(kd));  // (opaque to the loop optimiser: it would make a pointer per key again)
      __m512bh qv[NVG];
      for (int g = 0; g < NVG; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qb + (g * (D / 2) + d) * 32);
      for (int jj = 0; jj < JN; ++jj) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(kd[jj * (D / 2)]);
        for (int g = 0; g < NVG; ++g) acc[jj][g] = _mm512_dpbf16_ps(acc[jj][g], qv[g], kb);
      }
    }
    for (int jj = 0; jj < JN; ++jj)
      for (int g = 0; g < NVG; ++g) {
        _mm512_storeu_ps(st + (j + jj) * RP + g * 16, acc[jj][g]);
        if (j + jj < max_to) m[g] = _mm512_max_ps(m[g], acc[jj][g]);
      }
  };
  int64_t j = 0;
  for (; j + JT <= n; j += JT) {
    pf.step(JT * D / 2 * NVG);
    tile(std::integral_constant<int, JT>{}, j);
  }
  while (j < n)  // the last n % JT keys in one tile (a key at a time, each score was a chain of D / 2 dependent dot products)
    with_tile_rows<std::min(JT - 1, 6)>(n - j, [&](auto jn) {
      tile(jn, j);
      j += decltype(jn)::value;
    });
  for (int g = 0; g < NVG; ++g) _mm512_storeu_ps(mx + g * 16, m[g]);
}

// o [NR, D] = p v of NR rows over n keys: pp [(n + 1) / 2][RP] the rows' p in key pairs (bf16, the first key's in the
// low half; a last odd key paired with 0), v [n][D] bf16. Passes of 64 channels (4 vectors of accumulators per row:
// NR x 4 + 4 registers). Per key pair, the two value rows interleaved by vpunpck{l,h}wd: lane i of a vector holds
// one channel's pair, in unpack order (per 32 channels, lo: channels 0-3, 8-11, 16-19, 24-27; hi: 4-7, ...), put
// back in channel order when stored. (Interleaved once per block for every tile of a row group instead, into an L1
// scratch, the tiles' loads from it took 12% longer on Zen 5 than their own shuffles.)
template <int64_t D, int NR>
void pv_dot_tile(const int32_t* pp, int64_t RP, const c10::BFloat16* v, int64_t n, float* o, Prefetch* pf) {
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const auto* vv = reinterpret_cast<const uint16_t*>(v);
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t u = 0; 2 * u < n; ++u) {
      if (pf != nullptr) pf->step(4 * NR + 4);
      const uint16_t* a = vv + 2 * u * D + c0;
      const bool pair = 2 * u + 1 < n;
      __m512bh vp[4];
      for (int c = 0; c < 2; ++c) {
        const __m512i x = _mm512_loadu_si512(a + 32 * c);
        const __m512i y = pair ? _mm512_loadu_si512(a + D + 32 * c) : _mm512_setzero_si512();
        vp[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
        vp[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp[u * RP + r]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vp[c], pb);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 2; ++c) {
        float* oc = o + r * D + c0 + 32 * c;
        _mm512_storeu_ps(oc, _mm512_permutex2var_ps(acc[r][2 * c], first, acc[r][2 * c + 1]));
        _mm512_storeu_ps(oc + 16, _mm512_permutex2var_ps(acc[r][2 * c], second, acc[r][2 * c + 1]));
      }
  }
}

// o_b [R, D] = p v over the block's n keys from pp [(n + 1) / 2][RP], the rows' p in key pairs (softmax_pairs), in
// tiles of up to TILE rows; pf stepped per key pair and tile.
template <int64_t D>
void pv_dot(const int32_t* pp, int64_t RP, const c10::BFloat16* v, int64_t R, int64_t n, float* o_b, Prefetch* pf) {
  for (int64_t r0 = 0; r0 < R; r0 += TILE) {
    with_tile_rows<TILE>(R - r0, [&](auto nr) {
      pv_dot_tile<D, decltype(nr)::value>(pp + r0, RP, v, n, o_b + r0 * D, pf->pending() ? pf : nullptr);
    });
  }
}

// The dot products' softmax numerator p = 2^(x log2 e - m), lane by lane: x log2 e - m (never above 0) clamped at -200,
// 2^f for f = it - n in [-1/2, 1/2] (n its nearest integer) by the Taylor polynomial of e^(f ln 2) to degree 6
// (relative error about 1e-7), times 2^n by vscalefps: 2^-200 and a masked score's -inf come out 0, so no select.
// One function for both layouts (rows or keys in lanes), so that the compiler forms the same operations in each.
// (softmax_numerators' exp2 with its 8 FMAs, a select and the bit rounding cost 13 cycles a vector of 16 on Zen 5:
// a third of a 63-row prefill call.)
ALWAYS_INLINE __m512 numerator2(const Vec& x, const Vec& ms) {
  const __m512 y = _mm512_max_ps(_mm512_fmsub_ps(x, _mm512_set1_ps(LOG2E), ms), _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(0.00015403530393381606f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0013333558146428441f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009618129107628477f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055504108664821576f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// A row's sum l of its block's unrounded p on dot products: key j (from the block's start) goes to partial j % 8, each
// partial sums its keys in order from zero, and the 8 partials are added by this tree (i + 4 first, then i + 2,
// i + 1). Keys past a row's last one add exact zeros, so a verification's row, whose block runs on past its keys
// (masked), sums what the decode step's block ending there sums. Rows in lanes: 8 vectors of partials, added as
// vectors; keys in lanes: the partials in 8 lanes, each vector of 16 keys added as its two halves. T: Vec or float.
// (16 partials kept 16 vectors live beside the exp's constants: GCC spilled them, a load and a store per add.)
template <typename T>
ALWAYS_INLINE T tree8(T (&a)[8]) {
  for (int w = 4; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
}

// The softmax numerators of one vector of 16 rows (col: their scores, row stride RP) over n keys, straight into p v's
// key pairs pp [n16 / 2][RP] (n16: n rounded up to 16; this vector's 16 lanes): p = 2^(s log2 e - m) by numerator2,
// rounded to bf16, the first key's in the low half. Scores col[j] for j in
// [n, n16) are set to -inf here (p = 0: a last odd key is paired with 0). Returns l (tree8). (Stored as rounded fp32
// and paired in a second pass: 7% slower on one Zen 5 core at 32K.)
inline Vec softmax_pairs(float* col, int64_t RP, int64_t n, const Vec& ms, int32_t* pp, Prefetch& pf) {
  // vcvtne2ps2bf16 (ties to even) puts the first key's 16 bf16 in words 0-15 and the second's in 16-31; lane r's pair
  // is words r and 16 + r
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t n16 = (n + 15) / 16 * 16;
  for (int64_t j = n; j < n16; ++j) Vec(NEG_INF).store(col + j * RP);
  Vec part[8];
  for (int i = 0; i < 8; ++i) part[i] = Vec(0.f);
  for (int64_t j0 = 0; j0 < n16; j0 += 16) {
    pf.step(256);
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
      const __m512 p0 = numerator2(Vec::loadu(col + (j0 + i) * RP), ms);
      const __m512 p1 = numerator2(Vec::loadu(col + (j0 + i + 1) * RP), ms);
      part[i % 8] = part[i % 8] + Vec(p0);
      part[i % 8 + 1] = part[i % 8 + 1] + Vec(p1);
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
      _mm512_storeu_si512(pp + (j0 + i) / 2 * RP, _mm512_permutexvar_epi16(pairs, b));
    }
  }
  return tree8(part);
}

// ---- the same arithmetic for a few rows, keys in lanes ----
// With R rows in a vector's 16 lanes the rows-in-lanes path computes 16 / R times the scores and exps it needs (a
// decode step: 3 rows). Here a vector holds 16 keys of one row instead: the keys are transposed in registers (dimension
// pair d of 16 keys in one vector), and each score is the same vdpbf16ps chain over d from zero, with the key pair and
// the query pair in the other operands (their products commute exactly; the instruction sums a lane's two products by
// their position in the pair, the same in both layouts). The numerators, the reference and the key-order sum l are
// softmax_pairs' operations on the same values, and p v is pv_dot on the same key pairs: every output bit equals the
// rows-in-lanes path's (tests/test_kernels.py). Zen 5, 32K, 30 layers x 3 KV heads, 3 rows: see dot_every_row.
constexpr int64_t KEYS_IN_LANES_MAX_ROWS = 8;

// 16 rows of 16 dwords (row i at p + i * stride) -> t[c]: column c, row i in lane i
ALWAYS_INLINE void transpose16(const int32_t* p, int64_t stride, __m512i (&t)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_si512(p + i * stride);
  for (int i = 0; i < 8; ++i) {
    b[2 * i] = _mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // a[4 i + m], 128-bit lane L: column 4 L + m of rows 4 i .. 4 i + 3
    a[4 * i] = _mm512_unpacklo_epi64(b[4 * i], b[4 * i + 2]);
    a[4 * i + 1] = _mm512_unpackhi_epi64(b[4 * i], b[4 * i + 2]);
    a[4 * i + 2] = _mm512_unpacklo_epi64(b[4 * i + 1], b[4 * i + 3]);
    a[4 * i + 3] = _mm512_unpackhi_epi64(b[4 * i + 1], b[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0x88), x1 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0xdd);
    const __m512i y0 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0xdd);
    t[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[8 + m] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    t[4 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}

// Scores of NR rows against one tile of 16 keys (kt: its dimension pair d in kt[d], keys in lanes) into
// s[r * ss + i]; qd: the rows' query pairs, row r's pair d at qd[d * 16 + r] (scores_dot's qb layout).
template <int64_t D, int NR>
ALWAYS_INLINE void keys_tile_scores(const int32_t* qd, const __m512i (&kt)[D / 2], float* s, int64_t ss, Prefetch& pf) {
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int d = 0; d < D / 2; ++d) {
    pf.step(NR);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)kt[d], (__m512bh)_mm512_set1_epi32(qd[d * 16 + r]));
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(s + r * ss, acc[r]);
}

// Scores of R <= KEYS_IN_LANES_MAX_ROWS rows (qd as above) against the block's n keys into s[r * ss + j], for j up to
// n rounded up to 16 (the last tile's keys past n: scores of zero keys, for the caller to mask). One tile of 16 keys
// a pass: with 2 or 4 (more chains in flight: 24 cycles a key and head in cache against 28) the decode step's
// attention, bound by its reads, took 3-7% longer at 32K (alternated in one process, 30 layers x 3 KV heads: 20.8
// against 19.5 ms with 2; with 1, 19.9 / 19.9 and 20.5 / 20.8 against the per-row path).
template <int64_t D>
void keys_scores(const int32_t* qd, int64_t R, const c10::BFloat16* k, int64_t n, float* s, int64_t ss,
                 Prefetch& pf_ref) {
  Prefetch pf = pf_ref;  // (a local copy: its fields stay in registers)
  const auto* kp = reinterpret_cast<const int32_t*>(k);
  for (int64_t j = 0; j < n; j += 16) {
    alignas(64) int32_t pad[16 * (D / 2)];
    const int32_t* keys = kp + j * (D / 2);
    if (j + 16 > n) {  // the last n % 16 keys from a zero-padded copy
      std::memset(pad, 0, sizeof(pad));
      std::memcpy(pad, keys, (n - j) * (D / 2) * sizeof(int32_t));
      keys = pad;
    }
    __m512i kt[D / 2];  // dimension pair d of the tile's 16 keys
    for (int c = 0; c < D / 32; ++c) {
      pf.step(2 * D);
      __m512i col[16];
      transpose16(keys + 16 * c, D / 2, col);
      for (int i = 0; i < 16; ++i) kt[16 * c + i] = col[i];
    }
    for (int64_t r0 = 0; r0 < R; r0 += 4)  // at most 4 rows per pass
      with_tile_rows<4>(R - r0, [&](auto nr) {
        keys_tile_scores<D, decltype(nr)::value>(qd + r0, kt, s + r0 * ss + j, ss, pf);
      });
  }
  pf_ref = pf;
}

// softmax_pairs' results for R rows whose scores are by key, s[r * ss + j] (masked: -inf; only j < n read): per row its
// reference m_b[r], l_b[r] (tree8 over the partials) and its rounded p in key pairs pp[u * RP + r].
inline void keys_softmax_pairs(float* s, int64_t ss, int64_t R, int64_t n, int64_t RP, int32_t* pp, float* m_b,
                               float* l_b, Prefetch& pf_ref) {
  Prefetch pf = pf_ref;  // (a local copy: its fields stay in registers)
  const Vec neg(NEG_INF);
  const int64_t n16 = (n + 15) / 16 * 16;
  for (int64_t r = 0; r < R; ++r) {
    float* x = s + r * ss;
    for (int64_t j = n; j < n16; ++j) x[j] = NEG_INF;  // the last tile's keys past n
    Vec mv = neg;
    for (int64_t j = 0; j < n16; j += 16) mv = vmax(mv, Vec::loadu(x + j));
    const Vec m2 = reference2(Vec(_mm512_reduce_max_ps(mv)));
    const Vec ms = select(m2 != neg, m2);
    __m256 part = _mm256_setzero_ps();  // partial i in lane i
    for (int64_t j = 0; j < n16; j += 16) {
      pf.step(16);
      const __m512 pz = numerator2(Vec::loadu(x + j), ms);
      part = _mm256_add_ps(_mm256_add_ps(part, _mm512_castps512_ps256(pz)), _mm512_extractf32x8_ps(pz, 1));
      alignas(32) int32_t pairs[8];  // keys 2u, 2u + 1 rounded to bf16 (vcvtneps2bf16) in dword u
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), (__m256i)_mm512_cvtneps_pbh(pz));
      for (int u = 0; u < 8; ++u) pp[(j / 2 + u) * RP + r] = pairs[u];
    }
    alignas(64) float lanes[8], mt[16];
    _mm256_store_ps(lanes, part);
    m2.store(mt);
    m_b[r] = mt[0];
    l_b[r] = tree8(lanes);
  }
  pf_ref = pf;
}

#else
constexpr bool BF16_DOT = false;
template <int64_t D, int NVG>
void scores_dot(const uint16_t*, int64_t, const c10::BFloat16*, int64_t, float*, Prefetch&, int64_t, float*) {}
inline Vec softmax_pairs(float*, int64_t, int64_t, const Vec&, int32_t*, Prefetch&) { return Vec(0.f); }
template <int64_t D>
void pv_dot(const int32_t*, int64_t, const c10::BFloat16*, int64_t, int64_t, float*, Prefetch*) {}
constexpr int64_t KEYS_IN_LANES_MAX_ROWS = 0;
template <int64_t D>
void keys_scores(const int32_t*, int64_t, const c10::BFloat16*, int64_t, float*, int64_t, Prefetch&) {}
inline void keys_softmax_pairs(float*, int64_t, int64_t, int64_t, int64_t, int32_t*, float*, float*, Prefetch&) {}
#endif

// Whether path 0 runs a bf16 cache on AVX512-BF16 dot products (the rows-in-lanes path: scores_dot, softmax_pairs,
// pv_dot) at every row count, the decode step's 1-3 rows included. That path's sums do not depend on the rows beside
// a row (each score one vdpbf16ps chain over the head's dimension pairs from zero, in a lane of its own; p summed and
// p v paired in key order from the block's start; a verification's masked keys add exact zeros), so a verification
// is then bit for bit the decode step wherever it runs. Zen 5 (family 26), 32K, 30 layers x 3 KV heads, bf16 K/V,
// the per-row path (1) against it (2) (benchmarks/attention_time.py): 3 rows 20.6 vs 22.4 ms, 15 rows 36.0 vs 25.2;
// a prefill chain's 63 rows per call ran the per-row path. Zen 4 ran the lanes path's dot products slower than the
// per row path below 12 rows (lanes_min_rows) and is not measured with this rule; Intel's CPUs run vdpbf16ps at half
// an FMA's rate (AMX serves there).
inline bool dot_every_row() { return BF16_DOT && amd_avx512_family() >= 26; }

// Masks a block's scores (at(r, j): row r's score of key j) from mask_from on: where mask(r, j) says row r does not see
// key j, or, for a plain causal chain (row_end: not null), from each row's row_end[r] on (the same keys: a division
// and a branch per row and key were 20% of a prefill chain's call over one block).
template <typename Mask, typename At>
ALWAYS_INLINE void mask_scores(int64_t R, int64_t n, int64_t mask_from, const Mask& mask, const int64_t* row_end,
                               const At& at) {
  if (row_end != nullptr) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = std::max(mask_from, row_end[r]); j < n; ++j) at(r, j) = NEG_INF;
    return;
  }
  for (int64_t jj = mask_from; jj < n; ++jj)
    for (int64_t r = 0; r < R; ++r)
      if (!mask(r, jj)) at(r, jj) = NEG_INF;
}

// One (head, block) work item on the rows-in-lanes path; the contract of block_rows, with
// qt [D][RP] (RP = NV * W) instead of q, and st scratch [BS][RP]. qb (bf16 K/V only; else null): the queries in
// AMX's pair layout (scores_amx); with `tiles`, AMX's tiles then compute the block's scores (but its last n % 16
// keys') and its p v (pv_amx; but its last n % 32 keys'), the rest by FMAs; without, AVX512-BF16 dot products
// (scores_dot, pv_dot; BF16_DOT builds only).
template <int64_t D, bool B2, typename KV, typename Mask>
void block_lanes(const float* qt, int64_t NV, const KV* k, const KV* v, int64_t R, int64_t n, int64_t mask_from,
                 const Mask& mask, float* st, const char* next_k, const char* next_v, float* o_b, float* m_b,
                 float* l_b, const uint16_t* qb = nullptr, bool tiles = false, const int64_t* row_end = nullptr) {
  const int64_t RP = NV * W;
  int64_t j_fma = 0;  // the keys from here on: scores by FMAs
  const char* pf_k = nullptr;  // AMX: the next block's keys, prefetched a row per key during the softmax below
  const bool dot = std::is_same_v<KV, c10::BFloat16> && BF16_DOT && qb != nullptr && !tiles;
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    if (dot && R <= KEYS_IN_LANES_MAX_ROWS) {  // a few rows: the same arithmetic with the keys in lanes
      // the next block's K paced over the scores, its V over the softmax and p v, as the per-row path's decode step
      // (one stream over the whole item, as below, was 4% slower at 32K)
      const int64_t ss = (n + 15) / 16 * 16;  // st as s [R][ss]: R <= 8 rows of at most BS keys
      const int64_t bytes = block_keys<D, KV>() * D * sizeof(KV);
      Prefetch pk(next_k, nullptr, bytes), pv(nullptr, next_v, bytes);
      pk.pace(ss / 16 * (R * D / 2 + D * D / 16));
      pv.pace(R * ss + n * (2 * R + 2 * ((R + TILE - 1) / TILE)) * D / 64);
      keys_scores<D>(reinterpret_cast<const int32_t*>(qb), R, k, n, st, ss, pk);
      pk.finish();
      mask_scores(R, n, mask_from, mask, row_end, [&](int64_t r, int64_t j) -> float& { return st[r * ss + j]; });
      alignas(64) int32_t pp[(BLOCK_FLOATS / D + 1) / 2 * std::max<int64_t>(1, KEYS_IN_LANES_MAX_ROWS)];  // stride R
      keys_softmax_pairs(st, ss, R, n, R, pp, m_b, l_b, pv);
      pv_dot<D>(pp, R, v, R, n, o_b, &pv);
      pv.finish();
      return;
    }
    if (qb != nullptr && tiles) {  // (the tiles' loads run far ahead of a few prefetches each: spread out, they arrive)
      j_fma = n - n % 16;
      scores_amx<D>(qb, NV, RP, k, j_fma, st);
      pf_k = next_k;
      next_k = nullptr;
    }
  }
  const KV* kf = k + j_fma * D;
  const int64_t nf = n - j_fma;
  // the next block's K and V paced over the scores (FMAs or dot products), the softmax (an exp per key and row
  // vector counted as 16) and p v (FMAs; dot products and interleaves) (AMX: its own prefetches, above)
  Prefetch pf(tiles ? nullptr : next_k, tiles ? nullptr : next_v, block_keys<D, KV>() * D * sizeof(KV));
  pf.pace(dot ? n * NV * (D / 2 + 16) + n * (2 * R + 2 * ((R + TILE - 1) / TILE)) * D / 64
              : n * NV * (D + 16) + n * R * D / W);
  alignas(64) float mx[MAX_ROWS];  // dot products: each row's maximum over the keys before mask_from
  for (int64_t g0 = 0; g0 < NV && nf > 0;) {  // groups of up to NVG_MAX row vectors share each loaded key
    const int64_t left = NV - g0;
    const float* qg = qt + g0 * W;
    float* sg = st + j_fma * RP + g0 * W;
    const int ng = static_cast<int>(std::min<int64_t>(left, NVG_MAX));
    if constexpr (std::is_same_v<KV, c10::BFloat16>) {
      if (dot) {
        const uint16_t* qbg = qb + g0 * (D / 2) * 32;
        switch (ng) {
          case 1: scores_dot<D, 1>(qbg, RP, kf, nf, sg, pf, mask_from - j_fma, mx + g0 * W); break;
          case 2: scores_dot<D, 2>(qbg, RP, kf, nf, sg, pf, mask_from - j_fma, mx + g0 * W); break;
          case 3: scores_dot<D, 3>(qbg, RP, kf, nf, sg, pf, mask_from - j_fma, mx + g0 * W); break;
          default: scores_dot<D, NVG_MAX>(qbg, RP, kf, nf, sg, pf, mask_from - j_fma, mx + g0 * W); break;
        }
        g0 += ng;
        continue;
      }
    }
    switch (ng) {
      case 1: scores_lanes<D, 1, KV>(qg, RP, kf, nf, sg, pf); break;
      case 2: scores_lanes<D, NVG_MAX >= 2 ? 2 : 1, KV>(qg, RP, kf, nf, sg, pf); break;
      case 3: scores_lanes<D, NVG_MAX >= 3 ? 3 : 1, KV>(qg, RP, kf, nf, sg, pf); break;
      default: scores_lanes<D, NVG_MAX, KV>(qg, RP, kf, nf, sg, pf); break;
    }
    g0 += ng;
  }
  mask_scores(R, n, mask_from, mask, row_end, [&](int64_t r, int64_t j) -> float& { return st[j * RP + r]; });
  // block-local softmax numerators, W rows per vector (one vector at a time: its max and sum stay
  // in registers; with the vectors inner, indexed at run time, they went through memory: +15%)
  float mt[MAX_ROWS], lt[MAX_ROWS];
  // dot products: the rounded p go straight into p v's key pairs
  alignas(64) int32_t pp[std::is_same_v<KV, c10::BFloat16> && BF16_DOT ? (BLOCK_FLOATS / D + 1) / 2 * MAX_ROWS : 1];
  const Vec neg(NEG_INF);
  for (int64_t g = 0; g < NV; ++g) {
    float* col = st + g * W;
    Vec m = neg, l(0.f);
    // (dot products: the keys before mask_from were maxed as scores_dot stored them; a pass over st from L2 took
    // 12 cycles a key of a 63-row prefill call on Zen 5)
    int64_t jj = 0;
    if (dot) m = Vec::loadu(mx + g * W), jj = mask_from;
    for (; jj < n; ++jj) m = vmax(m, Vec::loadu(col + jj * RP));
    if constexpr (B2) m = reference2(m);  // base2_reference
    const Vec ms = select(m != neg, m);  // fully masked rows (m = -inf) subtract 0; their p are zeroed
    if (dot)
      l = softmax_pairs(col, RP, n, ms, pp + g * W, pf);
    else
      for (int64_t jj = 0; jj < n; ++jj) {
        if (pf_k != nullptr && g == 0)
          for (int64_t b = jj * D * int64_t(sizeof(KV)); b < (jj + 1) * D * int64_t(sizeof(KV)); b += 64)
            prefetch_l2(pf_k + b);
        pf.step(16);
        const Vec x = Vec::loadu(col + jj * RP);
        if constexpr (B2) {
          const Vec p = select(x != neg, exp2(x * Vec(LOG2E) - ms));
          round_bf16(p).store(col + jj * RP);
          l = l + p;
        } else {
          const Vec p = select(x != neg, exp(x - ms));
          p.store(col + jj * RP);
          l = l + p;
        }
      }
    m.store(mt + g * W);
    l.store(lt + g * W);
  }
  for (int64_t r = 0; r < R; ++r) {
    m_b[r] = mt[r];
    l_b[r] = lt[r];
  }
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    if (dot) {
      pv_dot<D>(pp, RP, v, R, n, o_b, &pf);
      pf.finish();
      return;
    }
    if (qb != nullptr) {  // p v on the tiles, a cache end's last n % 32 keys by FMAs, added
      const int64_t n32 = n - n % 32;
      pv_amx<D>(st, RP, NV, v, R, n32, o_b, next_v);
      if (n32 < n) {
        std::vector<float> tail(R * D);
        block_pv<D, 1>(st + n32 * RP, RP, v + n32 * D, R, n - n32, tail.data());
        for (int64_t i = 0; i < R * D; ++i) o_b[i] += tail[i];
      }
      return;
    }
  }
  block_pv<D, 1>(st, RP, v, R, n, o_b, &pf);
  pf.finish();
}

// block_lanes, with a call's last, partly filled row vector on the keys-in-lanes layout where that is a few rows (dot
// products; 1-8 rows past a multiple of 16): a 6-token verification's 18 rows took two 16-lane vectors, as dear as 32
// rows (a 32K forward of 6 tokens 45 ms against 26 for 5). Both layouts give a row the same bits, so which one a row
// takes does not show in its output; the second pass finds the block's keys in L1 / L2.
template <int64_t D, bool B2, typename KV, typename Mask>
void block_lanes_rows(const float* qt, int64_t NV, const KV* k, const KV* v, int64_t R, int64_t n, int64_t mask_from,
                      const Mask& mask, float* st, const char* next_k, const char* next_v, float* o_b, float* m_b,
                      float* l_b, const uint16_t* qb, bool tiles, const int64_t* row_end) {
  const int64_t tail = R % 16;
  if (!(std::is_same_v<KV, c10::BFloat16> && BF16_DOT && qb != nullptr && !tiles && R > 16 && tail != 0 &&
        tail <= KEYS_IN_LANES_MAX_ROWS)) {
    block_lanes<D, B2>(qt, NV, k, v, R, n, mask_from, mask, st, next_k, next_v, o_b, m_b, l_b, qb, tiles, row_end);
    return;
  }
  const int64_t full = R - tail;
  block_lanes<D, B2>(qt, full / W, k, v, full, n, mask_from, mask, st, next_k, next_v, o_b, m_b, l_b, qb, false,
                     row_end);
  const auto tail_mask = [&](int64_t r, int64_t j) { return mask(full + r, j); };
  block_lanes<D, B2>(qt, 1, k, v, tail, n, mask_from, tail_mask, st, nullptr, nullptr, o_b + full * D, m_b + full,
                     l_b + full, qb + (full / 16) * (D / 2) * 32, false, row_end == nullptr ? nullptr : row_end + full);
}

// 2^e for an integer-valued e, 0 from -200 down (a block far below the row's largest adds nothing)
ALWAYS_INLINE float pow2(float e) { return std::ldexp(1.f, static_cast<int>(std::max(e, -200.f))); }

// One block's partial result merged into a row's running one, on the bf16 arithmetic (B2): blocks in order, m the
// largest block reference so far, l and acc [D / W vectors] scaled to it. The references are integers, so every
// weight is an exact power of two and rescaling changes no bits (short of underflow): merged as they come, the blocks
// give what one pass under the final reference gives. The partial results' merge (merge_blocks) and a prefill
// chain's item, which merges its blocks as it computes them (Attention::fused), both go through this function, so a
// row's bits do not depend on which of them merged it. A block with l_b = 0 (every key masked for the row) is skipped.
template <int64_t D>
ALWAYS_INLINE void merge2(Vec* acc, float& m, float& l, const float* o_b, float m_b, float l_b) {
  if (l_b == 0.f) return;
  if (m_b > m) {  // (from m = -inf: acc and l are 0, scaled by 0)
    const float s = pow2(m - m_b);
    for (int c = 0; c < D / W; ++c) acc[c] = acc[c] * Vec(s);
    l = l * s;
    m = m_b;
  }
  const float wt = pow2(m_b - m);
  l = std::fma(wt, l_b, l);  // (wt l_b exact: the same as l + wt l_b)
  for (int c = 0; c < D / W; ++c) acc[c] = fma(Vec(wt), Vec::loadu(o_b + c * W), acc[c]);
}

// The blocks' partial results -> out: per row, the blocks' o_b merged by their log-sum-exp (blocks with l_b = 0,
// every key masked for the row, are skipped). parts: o [H, nb, R, D], then m and l [H, nb, R]. Row r of head h
// (query head h g + r / T of the group, token r % T) goes to out + h out_h + (r / T) out_g + (r % T) out_t: for
// [H, R, D], out_h = R D, out_g = T D, out_t = D; for a layer's attention output [T, Hq D], g D, D and Hq D.
// B2: m_b are base-2 references (integers), merged as they come by merge2.
template <int64_t D, bool B2 = false>
void merge_blocks(const float* o_part, int64_t H, int64_t nb, int64_t R, int64_t T, float* out, int64_t out_h,
                  int64_t out_g, int64_t out_t) {
  const float* m_part = o_part + H * nb * R * D;
  const float* l_part = m_part + H * nb * R;
  // a thread's share at least ~64K partial values: a decode step's 9 rows (9 x 64 blocks of 64 values at 8K)
  // merge in a few us, less than the fork of a parallel region costs
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (nb * D));
  at::parallel_for(0, H * R, grain, [&](int64_t b, int64_t e) {
    for (int64_t hr = b; hr < e; ++hr) {
      const int64_t h = hr / R, r = hr % R;
      float m = NEG_INF, l = 0.f;
      Vec acc[D / W];  // (zeros)
      if constexpr (B2) {
        for (int64_t blk = 0; blk < nb; ++blk) {
          const int64_t i = (h * nb + blk) * R + r;
          merge2<D>(acc, m, l, o_part + i * D, m_part[i], l_part[i]);
        }
      } else {
        for (int64_t blk = 0; blk < nb; ++blk) m = std::max(m, m_part[(h * nb + blk) * R + r]);
        for (int64_t blk = 0; blk < nb; ++blk) {
          const int64_t i = (h * nb + blk) * R + r;
          if (l_part[i] == 0.f) continue;
          const float wt = std::exp(m_part[i] - m);
          l += wt * l_part[i];
          const float* ob = o_part + i * D;
          for (int c = 0; c < D / W; ++c) acc[c] = fma(Vec(wt), Vec::loadu(ob + c * W), acc[c]);
        }
      }
      const Vec inv(1.f / l);
      float* o = out + h * out_h + (r / T) * out_g + (r % T) * out_t;
      for (int c = 0; c < D / W; ++c) (acc[c] * inv).store(o + c * W);
    }
  });
}

// The queries for either path, from q [H, R, D] (contiguous; where q_h is not 0, row r of head h at q + h q_h +
// (r / T) q_g + (r % T) q_t: AttentionCall's strides) into dst: per-row, q scaled [H, R, D]; lanes, q scaled,
// transposed and zero-padded [H, D, RP] (RP = NV * W). One small copy here instead of PyTorch's mul / transpose /
// pad / contiguous, each a dispatch. round: each scaled query element rounded to bf16 (the bf16 arithmetic).
void scaled_queries(const float* q, int64_t H, int64_t R, int64_t D, double scale, bool lanes, int64_t RP, bool round,
                    float* dst, int64_t T = 1, int64_t q_h = 0, int64_t q_g = 0, int64_t q_t = 0) {
  if (q_h == 0) q_h = R * D, q_g = T * D, q_t = D;
  // (vectors a row; the transposed copy W rows at a time, a vector of W rows per dimension: scalar, with a rounding
  // call per element and stores 4 RP bytes apart, it took 40 us of a prefill chain's 255-row call, 2,800 calls an
  // 8K prompt)
  const Vec sc(static_cast<float>(scale));
  alignas(64) float rows[W * 256];  // W rows of up to 256 dimensions (a heap buffer here was a malloc per call)
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r0 = 0; r0 < (lanes ? RP : R); r0 += lanes ? W : 1) {
      for (int64_t i = 0; i < (lanes ? W : 1); ++i) {
        const int64_t r = r0 + i;
        float* x = lanes ? rows + i * D : dst + (h * R + r) * D;
        const float* qr = r < R ? q + h * q_h + (r / T) * q_g + (r % T) * q_t : nullptr;
        for (int64_t d = 0; d < D; d += W) {
          const Vec qv = r < R ? Vec::loadu(qr + d) * sc : Vec(0.f);
          (round ? round_bf16(qv) : qv).store(x + d);
        }
      }
      if (lanes)
        for (int64_t d = 0; d < D; ++d) {
          alignas(64) float col[W];
          for (int64_t i = 0; i < W; ++i) col[i] = rows[i * D + d];
          Vec::loadu(col).store(dst + (h * D + d) * RP + r0);
        }
    }
}

// The arithmetic: fp32 over fp32 / fp16 K/V. Over bf16 K/V (RB) every product is bf16 x bf16 (exact in fp32) as
// on AMX's tiles: each scaled query element is rounded to bf16, and each probability, taken in base 2 against its
// block's integer reference (softmax_numerators<B2>: blocks' rounded p then differ by exact powers of two, so
// the rounding does not depend on where blocks start); sums stay fp32. So a bf16 cache's verification can run
// on the tiles and still compute the model `ar` computes, whichever path each forward takes (the sums in another
// order: the last bits, as between the per-row and rows-in-lanes paths; model.bf16_attention is the same on
// PyTorch's path).
//
// One attention call (q [H, R, D] over its own k / v): its scaled queries, its H * nb work items (head, block of
// BS keys; item() computes one into the blocks' partial results) and merge(). Several calls (a serving batch's
// sequences, each over its own cache) run their items in one parallel region (run_items): one fork and join a
// layer instead of one per sequence, and the threads' shares balanced over all the items, where one call's few
// (3 heads x 9 blocks at 2K) split 14 / 13 between two threads. An item's arithmetic does not depend on which
// call or thread runs it, so every row is the same bits either way.
template <int64_t D, typename KV>
struct Attention {
  static constexpr int64_t BS = block_keys<D, KV>();
  static constexpr bool RB = std::is_same_v<KV, c10::BFloat16>;
  AttentionCall c;
  int64_t NV, RP, nb;
  bool lanes, amx, exact;
  // A call of more than MAX_ROWS rows (a prefill chain's, bf16 K/V on dot products): its items are (head, MAX_ROWS
  // rows), each over every block in order, merging the blocks' results as it computes them (merge2) and writing its
  // rows' output. With items (head, block) for all rows, the partial results of a 32K chain (155 MB) went out to
  // memory and back for merge_blocks: 10% of the chain's time on Zen 5. The row groups of a head run side by side
  // on the threads, so a block's K/V comes from memory about once.
  bool fused;
  std::unique_ptr<float[]> qs;  // the scaled queries (scaled_queries)
  // AMX or AVX512-BF16 (bf16 K/V, lanes path): the rounded queries in the tiles' layout, [H][NV][D / 32][16 pairs]
  // [16 rows][2] (RP is a multiple of 16 on AVX-512, the only build with either)
  std::vector<uint16_t> qb;
  const KV *kp, *vp;
  float *o_part, *m_part, *l_part;
  // tree_rows: the tree tokens it computes again, and each one's visible new tokens (its ancestors and itself, in
  // order): branch_anc[branch_keys[i] .. branch_keys[i + 1]) for token branch_tokens[i]
  std::vector<int64_t> branch_tokens, branch_keys, branch_anc;

  // (attend_calls takes more than MAX_ROWS rows only over bf16 K/V on dot products: lanes, qb filled, no AMX)
  static bool fuses(const AttentionCall& call) { return call.R > MAX_ROWS; }
  // the blocks' partial results of a call (o, m, l per head, block and row): floats (none where fused)
  static int64_t partial_floats(const AttentionCall& call) {
    return fuses(call) ? 0 : call.H * ((call.S + BS - 1) / BS) * call.R * (D + 2);
  }
  // a thread's scratch for a fused item: a block's o_b, m_b, l_b and the running acc, m, l of MAX_ROWS rows
  static constexpr int64_t FUSED_FLOATS = 2 * MAX_ROWS * (D + 2);

  // parts: partial_floats(call) floats for the blocks' partial results (not zero-filled: every block writes all of
  // its rows)
  Attention(const AttentionCall& call, double scale, bool lanes_, bool amx_, bool exact_, float* parts)
      : c(call), NV((call.R + W - 1) / W), RP(NV * W), nb((call.S + BS - 1) / BS), lanes(lanes_), amx(amx_),
        exact(exact_), fused(fuses(call)), kp(static_cast<const KV*>(call.k)), vp(static_cast<const KV*>(call.v)) {
    const int64_t H = c.H, R = c.R;
    const bool transposed = lanes || exact;  // scores_exact reads them transposed
    qs.reset(new float[H * (transposed ? D * RP : R * D)]);
    scaled_queries(c.q, H, R, D, scale, transposed, RP, RB, qs.get(), c.T, c.q_h, c.q_g, c.q_t);
    if ((amx || BF16_DOT) && RB && lanes) {
      const int64_t NQ = RP / 16;
      qb.assign(H * NQ * D * 16, 0);
      const float* qt = qs.get();
      // [h][g][pair p][row i][2]: the upper halves of the (already bf16) values of dimensions 2p and 2p + 1
      for (int64_t h = 0; h < H; ++h)
        for (int64_t g = 0; g < NQ; ++g)
          for (int64_t p = 0; p < D / 2; ++p) {
            const float* x0 = qt + (h * D + 2 * p) * RP + g * 16;
            uint16_t* o = qb.data() + (((h * NQ + g) * (D / 2) + p) * 16) * 2;
#if defined(CPU_CAPABILITY_AVX512)
            const __m512i a = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(x0)), 16);
            const __m512i b = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x0 + RP)),
                                               _mm512_set1_epi32(int(0xffff0000u)));
            _mm512_storeu_si512(o, _mm512_or_si512(a, b));
#else
            for (int64_t i = 0; i < 16; ++i) {
              o[2 * i] = c10::BFloat16(x0[i]).x;
              o[2 * i + 1] = c10::BFloat16(x0[RP + i]).x;
            }
#endif
          }
    }
    // a draft tree's branches (tree_rows): the tokens whose keys in the block are not the first t + 1
    if (c.visible != nullptr && c.causal && c.gap == nullptr && !amx && (!lanes || !qb.empty())) {
      const int64_t T = c.T;
      for (int64_t t = 0; t < T; ++t) {
        bool chain = true;
        for (int64_t u = 0; u < T; ++u) chain = chain && c.visible[t * T + u] == (u <= t);
        if (chain) continue;
        branch_tokens.push_back(t);
        branch_keys.push_back(static_cast<int64_t>(branch_anc.size()));
        for (int64_t u = 0; u < T; ++u)
          if (c.visible[t * T + u]) branch_anc.push_back(u);
      }
      branch_keys.push_back(static_cast<int64_t>(branch_anc.size()));
    }
    TORCH_CHECK(!fused || branch_tokens.empty(), "decode_attention: a draft tree of at most ", MAX_ROWS, " rows");
    o_part = parts;
    m_part = o_part + H * nb * R * D;
    l_part = m_part + H * nb * R;
  }

  int64_t row_groups() const { return (c.R + MAX_ROWS - 1) / MAX_ROWS; }
  int64_t items() const { return fused ? c.H * row_groups() : c.H * nb; }
  bool uses_amx() const { return !qb.empty() && amx; }

  // Work item w: (head, block) for every row into the partial results, or where fused (head, MAX_ROWS rows) over every
  // block into the output. s: MAX_ROWS * BS floats, st: BS * RP (scores_exact's keys x rows), f: FUSED_FLOATS (fused
  // calls), this thread's scratch.
  void item(int64_t w, float* s, float* st, float* f) const {
    if (!fused) {
      const int64_t h = w / nb, blk = w % nb, j0 = blk * BS;
      float* ob = o_part + w * c.R * D;
      float* mb = m_part + w * c.R;
      float* lb = l_part + w * c.R;
      if (!block(h, blk, 0, c.R, s, st, ob, mb, lb))
        for (int64_t r = 0; r < c.R; ++r) mb[r] = NEG_INF, lb[r] = 0.f;
      else if (!branch_tokens.empty() && j0 + std::min(BS, c.S - j0) > c.S - c.T)
        tree_rows(h, j0, s, ob, mb, lb);
      return;
    }
    const int64_t groups = row_groups(), h = w / groups, r0 = (w % groups) * MAX_ROWS;
    const int64_t rows = std::min(MAX_ROWS, c.R - r0);
    float* ob = f;  // this block's
    float* mb = ob + MAX_ROWS * D;
    float* lb = mb + MAX_ROWS;
    float* acc = lb + MAX_ROWS;  // the rows' running merge
    float* m = acc + MAX_ROWS * D;
    float* l = m + MAX_ROWS;
    std::fill(acc, acc + rows * D, 0.f);
    std::fill(m, m + rows, NEG_INF);
    std::fill(l, l + rows, 0.f);
    for (int64_t blk = 0; blk < nb; ++blk) {
      if (!block(h, blk, r0, rows, s, st, ob, mb, lb)) continue;
      for (int64_t r = 0; r < rows; ++r) {
        Vec a[D / W];
        for (int i = 0; i < D / W; ++i) a[i] = Vec::loadu(acc + r * D + i * W);
        merge2<D>(a, m[r], l[r], ob + r * D, mb[r], lb[r]);
        for (int i = 0; i < D / W; ++i) a[i].store(acc + r * D + i * W);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // as merge_blocks writes a row
      const Vec inv(1.f / l[r]);
      float* o = c.out + h * c.out_h + ((r0 + r) / c.T) * c.out_g + ((r0 + r) % c.T) * c.out_t;
      for (int i = 0; i < D / W; ++i) (Vec::loadu(acc + r * D + i * W) * inv).store(o + i * W);
    }
  }

  // Block blk of head h for the call's rows [r0, r0 + rows) (r0 > 0 or rows < R: dot products only): its p v, maximum
  // and sum per row into o_b [rows, D], m_b, l_b; false where a gap hides the block from every row (nothing written).
  bool block(int64_t h, int64_t blk, int64_t r0, int64_t rows, float* s, float* st, float* ob, float* mb,
             float* lb) const {
    const int64_t R = c.R, S = c.S, T = c.T;
    const int64_t j0 = blk * BS, n = std::min(BS, S - j0);
    const KV* kh = kp + h * c.ks + j0 * D;
    const KV* vh = vp + h * c.vs + j0 * D;
    const bool last = blk + 1 == nb;
    const char* next_k = last ? nullptr : reinterpret_cast<const char*>(kh + BS * D);
    const char* next_v = last ? nullptr : reinterpret_cast<const char*>(vh + BS * D);
    // causal: the key at S - T + u is new token u, visible to the rows of tokens >= u; a token block (a draft
    // tree): to the rows of the tokens t with visible[t][u]. The keys before the new tokens are seen by every
    // row: only the new ones are checked, a division each. gap (a StreamingLLM window): keys gap[0] ..
    // gap[1 + t] - 1 are hidden from token t's rows (between the sinks and its window); a block that every
    // row's gap covers is not read at all.
    const bool causal = c.causal;
    const bool* visible = c.visible;
    const int64_t* gap = c.gap;
    int64_t mask_from = causal ? std::clamp<int64_t>(S - T - j0, 0, n) : n;
    if (gap != nullptr) {
      const int64_t from = std::max(gap[0], j0);  // the block's first key a gap can hide
      const auto [to_min, to_max] = std::minmax_element(gap + 1, gap + 1 + T);
      if (from == j0 && *to_min >= j0 + n) return false;  // hidden from every row
      if (from < j0 + n && *to_max > from) mask_from = std::min(mask_from, from - j0);
    }
    const auto mask = [&](int64_t r, int64_t j) {  // r: the row within [r0, r0 + rows)
      const int64_t u = j0 + j - (S - T), t = (r0 + r) % T;
      if (gap != nullptr && j0 + j >= gap[0] && j0 + j < gap[1 + t]) return false;
      if (u < 0) return true;
      return causal ? (visible ? visible[t * T + u] : u <= t) : true;
    };
    int64_t row_end[MAX_ROWS];  // a plain causal chain on the lanes path: row r sees the block's keys below it
    const bool plain = lanes && causal && visible == nullptr && gap == nullptr;
    if (plain)
      for (int64_t r = 0; r < rows; ++r) row_end[r] = S - T + (r0 + r) % T + 1 - j0;
    if (rows < R) {  // a fused call's row group: dot products, the group's queries from its place in qb
      block_lanes_rows<D, RB>(nullptr, (rows + W - 1) / W, kh, vh, rows, n, mask_from, mask, s, next_k, next_v, ob, mb,
                              lb, qb.data() + (h * (RP / 16) + r0 / 16) * D * 16, false, plain ? row_end : nullptr);
    } else if (lanes) {
      block_lanes_rows<D, RB>(qs.get() + h * D * RP, NV, kh, vh, R, n, mask_from, mask, s, next_k, next_v, ob, mb, lb,
                              qb.empty() ? nullptr : qb.data() + h * (RP / 16) * D * 16, amx, plain ? row_end : nullptr);
    } else {
      block_rows<D, BS, RB>(exact ? nullptr : qs.get() + h * R * D, kh, vh, R, n, mask_from, mask, s, next_k, next_v,
                            ob, mb, lb, exact ? qs.get() + h * D * RP : nullptr, RP, st);
    }
    return true;
  }

  // A draft tree's token t whose visible new keys are not the first t + 1 (a branch after its first): its rows over
  // this block computed again, over its own keys gathered in the order the decode step will read them once the branch
  // is accepted (the prompt's, then its ancestors' and its own, moved up), by the decode step's own path (g rows, no
  // mask). Over the block as it lies, the masked keys between a row's keys would shift which lane sums a key's p, which
  // key shares its pair in p v, and where the blocks end: other last bits than `ar`'s, so a greedy tree could pick
  // another token at a near-tie. Only the blocks holding new tokens are recomputed (one or two per head).
  void tree_rows(int64_t h, int64_t j0, float* s, float* ob, float* mb, float* lb) const {
    const int64_t S = c.S, T = c.T, R = c.R, g = R / T, prompt = S - T;
    const auto all = [](int64_t, int64_t) { return true; };
    thread_local std::vector<KV> kg, vg;
    thread_local std::vector<float> qg, og, mg, lg;
    thread_local std::vector<uint16_t> qbg;
    kg.resize(BS * D), vg.resize(BS * D), og.resize(g * D), mg.resize(g), lg.resize(g);
    const KV* kh = kp + h * c.ks;
    const KV* vh = vp + h * c.vs;
    for (size_t i = 0; i < branch_tokens.size(); ++i) {
      const int64_t t = branch_tokens[i];
      const int64_t* anc = branch_anc.data() + branch_keys[i];
      const int64_t n = std::min(BS, prompt + (branch_keys[i + 1] - branch_keys[i]) - j0);  // its keys in the block
      if (n <= 0) {  // its keys end before this block
        for (int64_t gi = 0; gi < g; ++gi) mb[gi * T + t] = NEG_INF, lb[gi * T + t] = 0.f;
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = j0 + j < prompt ? j0 + j : prompt + anc[j0 + j - prompt];
        std::memcpy(kg.data() + j * D, kh + key * D, D * sizeof(KV));
        std::memcpy(vg.data() + j * D, vh + key * D, D * sizeof(KV));
      }
      if (lanes) {  // dot products: the rows' query pairs in qb's layout, groups of 16 rows
        const int64_t NQ = RP / 16, NG = (g + 15) / 16;
        qbg.assign(NG * D * 16, 0);
        for (int64_t gi = 0; gi < g; ++gi) {
          const int64_t r = gi * T + t;
          for (int64_t p = 0; p < D / 2; ++p) {
            const uint16_t* src = qb.data() + ((h * NQ + r / 16) * (D / 2) + p) * 32 + (r % 16) * 2;
            uint16_t* dst = qbg.data() + ((gi / 16) * (D / 2) + p) * 32 + (gi % 16) * 2;
            dst[0] = src[0], dst[1] = src[1];
          }
        }
        block_lanes<D, RB>(nullptr, NG * 16 / W, kg.data(), vg.data(), g, n, n, all, s, nullptr, nullptr, og.data(),
                           mg.data(), lg.data(), qbg.data());
      } else {  // the per-row path, its queries [g][D]
        qg.resize(g * D);
        const float* qp = qs.get();
        for (int64_t gi = 0; gi < g; ++gi) {
          const int64_t r = gi * T + t;
          for (int64_t d = 0; d < D; ++d)
            qg[gi * D + d] = exact ? qp[(h * D + d) * RP + r] : qp[(h * R + r) * D + d];
        }
        block_rows<D, BS, RB>(qg.data(), kg.data(), vg.data(), g, n, n, all, s, nullptr, nullptr, og.data(),
                              mg.data(), lg.data());
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t r = gi * T + t;
        std::memcpy(ob + r * D, og.data() + gi * D, D * sizeof(float));
        mb[r] = mg[gi], lb[r] = lg[gi];
      }
    }
  }

  void merge() const {  // (a fused call's items wrote its output)
    if (!fused) merge_blocks<D, RB>(o_part, c.H, nb, c.R, c.T, c.out, c.out_h, c.out_g, c.out_t);
  }
};

// Every item of every call in one parallel region (a thread's items may span calls: an item is the same whoever
// runs it). One call's items go to the threads in equal contiguous shares, so that each streams its blocks in order
// (an item prefetches the next block of its head); a batch's in chunks taken as threads come free (parallel_chunks),
// BATCH_CHUNKS_PER_THREAD of them a thread: long runs of consecutive blocks too, where a chunk's first block was the
// only one no item of its thread had prefetched. Chunks of 4 items, before: 8 one-row requests' forward at 2,176
// cached tokens 17.7 -> 15.7 ms, at 8,256 49.6 -> 40.5 (Zen 5, bf16; `kernel_ab.py --what batch`); 1 or 2 chunks
// a thread measured the same.
constexpr int64_t BATCH_CHUNKS_PER_THREAD = 4;
template <int64_t D, typename KV>
void run_items(const std::vector<Attention<D, KV>>& calls) {
  constexpr int64_t BS = block_keys<D, KV>();
  std::vector<int64_t> first(calls.size() + 1, 0);  // the calls' first items
  int64_t scratch = 0;  // scores_exact's keys x rows, the largest call's
  bool amx = false, any_fused = false;  // any_fused: a call of more than MAX_ROWS rows (a prefill chain's)
  for (size_t c = 0; c < calls.size(); ++c) {
    first[c + 1] = first[c] + calls[c].items();
    if (calls[c].exact) scratch = std::max(scratch, BS * calls[c].RP);
    amx = amx || calls[c].uses_amx();
    any_fused = any_fused || calls[c].fused;
  }
  // a thread's scratch: scores of up to MAX_ROWS rows (RP <= MAX_ROWS: R <= MAX_ROWS, a multiple of W), then
  // scores_exact's keys x rows, then a fused item's blocks and merge
  const int64_t per_thread = MAX_ROWS * BS + scratch + (any_fused ? Attention<D, KV>::FUSED_FLOATS : 0);
  const std::unique_ptr<float[]> buffers(new float[per_thread * at::get_num_threads()]);  // (not zero-filled: written before read)
  std::vector<char> configured(at::get_num_threads(), 0);
  const auto run = [&](int64_t b, int64_t e) {
    const int t = at::get_thread_num();
    float* s = buffers.get() + per_thread * t;
    if (amx && !configured[t]) amx_configure(), configured[t] = 1;
    size_t c = std::upper_bound(first.begin(), first.end(), b) - first.begin() - 1;
    for (int64_t w = b; w < e; ++w) {
      while (w >= first[c + 1]) ++c;
      calls[c].item(w - first[c], s, s + MAX_ROWS * BS, s + MAX_ROWS * BS + scratch);
    }
  };
  // (a call of more than MAX_ROWS rows, a prefill chain's, is arithmetic: its items one at a time as threads come
  // free, where equal shares of a few uneven items left one thread waiting)
  if (calls.size() == 1 && !any_fused) at::parallel_for(0, first.back(), 1, run);
  else if (calls.size() == 1 || any_fused) parallel_chunks(first.back(), 1, run);
  else parallel_chunks(first.back(), std::max<int64_t>(4, first.back() / (BATCH_CHUNKS_PER_THREAD * at::get_num_threads())),
                       run);
}

// The blocks' partial results of one attend's calls (those of 64 rows or fewer: a fused call keeps none), in a buffer
// kept by the calling thread (grown, never shrunk, up to PARTIALS_KEPT bytes; a larger need gets its own, in `own`,
// freed with it). Why: allocated per call, memory that large came back from the kernel zeroed page by page every time
// (glibc maps such blocks, or trims them once freed): when a prefill chain's calls still kept partial results (26 MB
// each at 32K), a 512-token chain over 32K keys took 98 ms, 55 ms from a kept buffer (Zen 5). A serving batch of 8
// calls of 64 rows at 32K needs 52 MB.
constexpr int64_t PARTIALS_KEPT = int64_t{1} << 28;  // 256 MB
inline float* partials_buffer(int64_t floats, std::unique_ptr<float[]>& own) {
  thread_local std::unique_ptr<float[]> kept;
  thread_local int64_t kept_floats = 0;
  if (floats <= kept_floats) return kept.get();
  if (floats * int64_t{sizeof(float)} > PARTIALS_KEPT) {
    own.reset(new float[floats]);
    return own.get();
  }
  // (grown by half again at least: a prefill's calls need more with every chunk)
  const int64_t grown = std::min(std::max(floats, kept_floats + kept_floats / 2), PARTIALS_KEPT / int64_t{sizeof(float)});
  kept.reset();  // (before the new one: not both at once)
  kept.reset(new float[grown]);
  kept_floats = grown;
  return kept.get();
}

// Several calls (or one), all of one head dim and K/V dtype, each with its own cache, mask and row count; path as
// decode_attention's. Each call's output goes where its AttentionCall says.
template <int64_t D, typename KV>
void attend(const std::vector<AttentionCall>& calls, double scale, bool lanes, bool amx, int64_t path) {
  int64_t floats = 0;
  for (const AttentionCall& c : calls) floats += Attention<D, KV>::partial_floats(c);
  std::unique_ptr<float[]> own;
  float* parts = partials_buffer(floats, own);
  std::vector<Attention<D, KV>> jobs;
  jobs.reserve(calls.size());
  for (const AttentionCall& c : calls) {
    jobs.emplace_back(c, scale, lanes, amx, path == 4 || (path == 0 && exact_rows(c.R)), parts);
    parts += Attention<D, KV>::partial_floats(c);
  }
  run_items(jobs);
  for (const auto& j : jobs) j.merge();
}

template <typename KV>
void attend_kv(const std::vector<AttentionCall>& calls, double scale, bool lanes, bool amx, int64_t path) {
  switch (calls[0].D) {
    case 64: return attend<64, KV>(calls, scale, lanes, amx, path);
    case 128: return attend<128, KV>(calls, scale, lanes, amx, path);
    default: return attend<256, KV>(calls, scale, lanes, amx, path);
  }
}

// ---- attention over the quantized KV cache (caches/quantized.py) ----
// Work items of QB = 64 keys: a quantized group or 64 positions of the full-precision buffer (blocks aligned
// to positions, as the groups are). A quantized group is read with integer dot products straight from its
// planes, nothing widened to fp32 (caches/quantized.py's arithmetic, which its PyTorch path computes too):
//  * scores: the group's per-channel key scales folded into the query, the codes centred
//    (q . k = (q * scale) . (code - 128) + q . (zero + 128 scale)), and q * scale rounded per row to 15 bits in
//    two int8 parts (quantize_queries). The key planes hold lanes of 8 channels of one token (4 in low nibbles,
//    4 in high ones), so a vector is W tokens and, with VNNI, one vpdpbusd adds 4 products per lane
//    (the two planes' nibbles joined into byte codes first: two shifts and two bit selects per 8 W codes);
//    without VNNI the query as one int16 (254 iq1 + iq2) against the codes widened to words, vpmaddwd (exact);
//  * p v: p times the values' per-token scales rounded to int16 per row and 32 channels (sigma p16). The value
//    planes pair two tokens per channel, so the byte codes widened to 16-bit words make vpdpwssd lanes of one
//    channel: one instruction per W channels, two tokens and row.
// Integer sums are exact, so a row's result depends on its query and its visible keys only (not on how many
// rows there are); softmax is the per-row path's, and so are the buffer blocks.
constexpr int64_t QB = 64;  // caches/quantized.py GROUP_K
constexpr int QTILE = 3;  // rows per register tile of a group's scores and p v (6 on AVX-512 spilled accumulators:
                          // 32K, 15 rows, 3 measured 10-15% faster than 6 on Zen 5, 4 level with 3)
constexpr int64_t LANE_BYTES = 4 * QB;  // one lane of 8 channels for a group's 64 tokens (caches/quantized.py pack_keys)
constexpr float TINY = 0x1p-100f;  // a largest value below this rounds to all zeros (caches/quantized.py TINY: 1 / it stays finite)

ALWAYS_INLINE float vmax_all(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return vmax(a, b); }, v);
}

// x rounded to the nearest integer (ties to even, as torch.round), stored as W int8 / int16 (x within range).
ALWAYS_INLINE void store_int8(const Vec& x, int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(x)));
#else
  const __m256i i = _mm256_cvtps_epi32(x);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
#endif
}
ALWAYS_INLINE void store_int16(const Vec& x, int16_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(x)));
#else
  const __m256i i = _mm256_cvtps_epi32(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
#endif
}

// Plane bytes h (upper) and l (lower; 0x88 for the 4-bit reading) -> the byte codes 16 upper + lower of their
// low-nibble positions (lo) and of their high-nibble positions (hi).
ALWAYS_INLINE void join_codes(IV h, IV l, IV& lo, IV& hi) {
  const IV top = bytes_and(iset(-1), 0xF0);
  lo = bit_select(sll16_4(h), l, top);
  hi = bit_select(h, srl16(l, 4), top);
}

// One group's queries, q * scale (the group's key scales folded in) rounded to 15 bits in two int8 parts per row:
// x = q * scale / a (a = max |q * scale| / 127), iq[r] = [round(x), round((x - round(x)) * 254)] ([R][2][D]);
// a2 [R] = a / 254, so q * scale ~ a2 (254 iq1 + iq2); bias [R] = q . (zero + 128 scale); isum [R][2] the parts'
// sums (the codes are centred). (One int8 part alone, 7 bits against the row's largest element, made the
// attention's error 5-8x that of the 8-bit keys themselves on keys with outlier channels.)
template <int64_t D>
void quantize_queries(const float* q, int64_t R, const c10::Half* ks, const c10::Half* kz, int8_t* iq, float* a2,
                      float* bias, int32_t* isum) {
  Vec sc[D / W], z[D / W];
  for (int c = 0; c < D / W; ++c) {
    sc[c] = load(ks + c * W);
    z[c] = load(kz + c * W) + Vec(128.f) * sc[c];
  }
  for (int64_t r = 0; r < R; ++r) {
    Vec qg[D / W], acc(0.f), mx(0.f);
    for (int c = 0; c < D / W; ++c) {
      const Vec x = Vec::loadu(q + r * D + c * W);
      qg[c] = x * sc[c];
      mx = vmax(mx, qg[c].abs());
      acc = fma(x, z[c], acc);
    }
    bias[r] = reduce_add(acc);
    const float amax = vmax_all(mx);
    a2[r] = amax / 127.f / 254.f;
    const Vec inv(amax > TINY ? 127.f / amax : 0.f);
    int8_t* i1 = iq + r * 2 * D;
    Vec s1(0.f), s2(0.f);  // sums of integers below 2^24: exact in fp32
    for (int c = 0; c < D / W; ++c) {
      const Vec x = qg[c] * inv, x1 = x.round(), x2 = ((x - x1) * Vec(254.f)).round();
      if constexpr (VNNI) {
        store_int8(x1, i1 + c * W);
        store_int8(x2, i1 + D + c * W);
      } else {  // the words path: 254 iq1 + iq2 as one int16 (the row's 2 D bytes)
        store_int16(fma(x1, Vec(254.f), x2), reinterpret_cast<int16_t*>(i1) + c * W);
      }
      s1 = s1 + x1;
      s2 = s2 + x2;
    }
    isum[2 * r] = static_cast<int32_t>(reduce_add(s1));
    isum[2 * r + 1] = static_cast<int32_t>(reduce_add(s2));
  }
}

// s[r * QB + j] = a2[r] (254 iq1[r] + iq2[r]) . (code[j] - 128) + bias[r] for RT rows and the group's QB keys (the
// sum exact in int32 for D <= 256); kh / kl the group's plane bytes ([D / 8][QB][4]; kl null: the 4-bit reading,
// code 16 upper + 8). next_h / next_l: the next group's planes, prefetched (null: none).
// Without VNNI, the same integers from 16-bit words: the query as iq16 = 254 iq1 + iq2 (int16, quantize_queries),
// the codes joined, centred and widened to words, vpmaddwd: a lane's 4 channels of one token widen to two int32
// lanes, summed in pairs at the end (pair_sums). (vpmaddubsw on the nibbles took 2.5x the instructions per row.)
template <int64_t D, int RT, bool LO>
void group_scores_words(const int8_t* iq, const float* a2, const float* bias, const uint8_t* kh, const uint8_t* kl,
                        float* s, const uint8_t* next_h, const uint8_t* next_l) {
  constexpr int NK = QB / W;  // token vectors in a group
  const IV eights = bytes_and(iset(-1), 0x88), c128 = iset16(128);
  const uint8_t* const pf_h = next_h != nullptr ? next_h : kh;  // as group_pv_tile's
  const uint8_t* const pf_l = next_l != nullptr ? next_l : pf_h;
  for (int k = 0; k < NK; ++k) {
    IV acc[RT][2];  // per row: int32 pair lanes of the vector's first and second halves of tokens
    for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = izero();
    for (int64_t o = 0; o < D / 8; ++o) {
      const int64_t at = o * LANE_BYTES + k * W * 4;
      prefetch_l2(pf_h + o * LANE_BYTES + k * W * 4);  // the next group's lane, a line per token vector and plane
      prefetch_l2(pf_l + o * LANE_BYTES + k * W * 4);
      IV lo, hi;
      join_codes(iload(kh + at), LO ? iload(kl + at) : eights, lo, hi);
      const IV w[4] = {isub16(widen_bytes(lower_half(lo)), c128), isub16(widen_bytes(upper_half(lo)), c128),
                       isub16(widen_bytes(lower_half(hi)), c128), isub16(widen_bytes(upper_half(hi)), c128)};
      for (int r = 0; r < RT; ++r) {
        const int16_t* qo = reinterpret_cast<const int16_t*>(iq + r * 2 * D) + o * 8;
        const IV q0 = bcast8(qo), q1 = bcast8(qo + 4);  // channels 8o .. 8o + 3 and 8o + 4 .. 8o + 7
        acc[r][0] = dot_words(dot_words(acc[r][0], w[0], q0), w[2], q1);
        acc[r][1] = dot_words(dot_words(acc[r][1], w[1], q0), w[3], q1);
      }
    }
    for (int r = 0; r < RT; ++r)
      fma(Vec(a2[r]), tof(pair_sums(acc[r][0], acc[r][1])), Vec(bias[r])).store(s + r * QB + k * W);
  }
}

template <int64_t D, int RT, bool LO>
void group_scores_tile(const int8_t* iq, const float* a2, const float* bias, const int32_t* isum, const uint8_t* kh,
                       const uint8_t* kl, float* s, const uint8_t* next_h, const uint8_t* next_l) {
  if constexpr (!VNNI) {
    group_scores_words<D, RT, LO>(iq, a2, bias, kh, kl, s, next_h, next_l);
    return;
  }
  constexpr int NK = QB / W;  // token vectors in a group
  constexpr int KP = 2;       // token vectors per pass (2 x RT x KP accumulators)
  const IV eights = bytes_and(iset(-1), 0x88);
  const uint8_t* const pf_h = next_h != nullptr ? next_h : kh;  // as group_pv_tile's
  const uint8_t* const pf_l = next_l != nullptr ? next_l : pf_h;
  for (int k0 = 0; k0 < NK; k0 += KP) {
    IV acc[2][RT][KP];
    for (int i = 0; i < 2; ++i)
      for (int r = 0; r < RT; ++r)
        for (int k = 0; k < KP; ++k) acc[i][r][k] = izero();
    for (int64_t o = 0; o < D / 8; ++o) {
      const int64_t at = o * LANE_BYTES + k0 * W * 4;
      for (int k = 0; k < KP; ++k) {  // the next group's lane, a line per token vector and plane
        prefetch_l2(pf_h + at + k * W * 4);
        prefetch_l2(pf_l + at + k * W * 4);
      }
      IV lo[KP], hi[KP];
      for (int k = 0; k < KP; ++k)
        join_codes(iload(kh + at + k * W * 4), LO ? iload(kl + at + k * W * 4) : eights, lo[k], hi[k]);
      for (int i = 0; i < 2; ++i)
        for (int r = 0; r < RT; ++r) {
          const int8_t* qo = iq + (2 * r + i) * D + o * 8;
          const IV q0 = bcast4(qo), q1 = bcast4(qo + 4);
          for (int k = 0; k < KP; ++k) acc[i][r][k] = dot_us(dot_us(acc[i][r][k], lo[k], q0), hi[k], q1);
        }
    }
    for (int r = 0; r < RT; ++r) {
      const Vec av(a2[r]), bv(bias[r]);
      const IV e1 = iset(-128 * isum[2 * r]), e2 = iset(-128 * isum[2 * r + 1]);  // the codes centred
      for (int k = 0; k < KP; ++k) {
        const IV t = iadd(times254(iadd(acc[0][r][k], e1)), iadd(acc[1][r][k], e2));
        fma(av, tof(t), bv).store(s + r * QB + (k0 + k) * W);
      }
    }
  }
}

template <int64_t D>
void group_scores(const int8_t* iq, const float* a2, const float* bias, const int32_t* isum, const uint8_t* kh,
                  const uint8_t* kl, int64_t R, float* s, const uint8_t* next_h, const uint8_t* next_l) {
  for (int64_t r = 0; r < R; r += QTILE) {
    const uint8_t* nh = r == 0 ? next_h : nullptr;
    const uint8_t* nl = r == 0 ? next_l : nullptr;
    with_tile_rows<QTILE>(R - r, [&](auto nr) {
      if (kl != nullptr)  // the 8-bit reading (the lower plane too), else the 4-bit one: no plane test in the loops
        group_scores_tile<D, decltype(nr)::value, true>(iq + r * 2 * D, a2 + r, bias + r, isum + 2 * r, kh, kl,
                                                        s + r * QB, nh, nl);
      else
        group_scores_tile<D, decltype(nr)::value, false>(iq + r * 2 * D, a2 + r, bias + r, isum + 2 * r, kh, kl,
                                                         s + r * QB, nh, nl);
    });
  }
}

// The probabilities p [R, QB] (softmax numerators, masked keys 0) of a group times its values' per-token scales
// vs [NB, QB] (fp32), rounded per row and 32-channel block: p16 [R, NB, QB] = round(p vs / sigma), sigma [R, NB] =
// max(p vs) / 32767; zsum [R, NB] = p . vz (the zeros' share).
template <int64_t D>
void quantize_probabilities(const float* p, int64_t R, const float* vs, const float* vz, int16_t* p16, float* sigma,
                            float* zsum) {
  constexpr int64_t NB = D / 32, NK = QB / W;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < NB; ++c) {
      Vec pv[NK], mx(0.f), z(0.f);
      for (int k = 0; k < NK; ++k) {
        const Vec pk = Vec::loadu(p + r * QB + k * W);
        pv[k] = pk * Vec::loadu(vs + c * QB + k * W);
        mx = vmax(mx, pv[k]);
        z = fma(pk, Vec::loadu(vz + c * QB + k * W), z);
      }
      const float m = vmax_all(mx);
      sigma[r * NB + c] = m / 32767.f;
      zsum[r * NB + c] = reduce_add(z);
      const Vec inv(m > TINY ? 32767.f / m : 0.f);
      for (int k = 0; k < NK; ++k) store_int16(pv[k] * inv, p16 + (r * NB + c) * QB + k * W);
    }
}

// o [RT, D] = sigma (p16 . code) + zsum for RT rows over the group's values (vh / vl its plane bytes: per pair of
// tokens D bytes, per 32-channel block 32 of them; vl null: the 4-bit reading). Passes of 4 W channels (4 vectors
// of accumulators per row); next_h / next_l prefetched (null: none).
template <int64_t D, int RT, bool LO>
void group_pv_tile(const int16_t* p16, const float* sigma, const float* zsum, const uint8_t* vh, const uint8_t* vl,
                   float* o, const uint8_t* next_h, const uint8_t* next_l) {
  constexpr int64_t NB = D / 32;  // channel blocks
  const IV eights = bytes_and(iset(-1), 0x88);
  // Prefetch targets without a branch in the loops (a branch there made GCC keep the accumulators on the stack):
  // with no next group, or no lower plane, the current group's own lines (already cached: a spare load slot).
  const uint8_t* const pf_h = next_h != nullptr ? next_h : vh;
  const uint8_t* const pf_l = next_l != nullptr ? next_l : pf_h;
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t CB = 2;  // blocks per pass: 64 plane bytes, 4 vectors of accumulators per row
  for (int64_t c0 = 0; c0 < NB; c0 += CB) {
    IV acc[RT][4];
    for (int r = 0; r < RT; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = izero();
    for (int64_t u = 0; u < QB / 2; ++u) {
      const int64_t at = u * D + c0 * 32;  // CB blocks of this pair: W * 4 bytes
      for (int64_t b = 0; b < D; b += 64) {  // the next group's pair: D bytes per plane (branch-free: see pf_h)
        prefetch_l2(pf_h + u * D + b);
        prefetch_l2(pf_l + u * D + b);
      }
      IV lo, hi;
      join_codes(iload(vh + at), LO ? iload(vl + at) : eights, lo, hi);
      // 16-bit words, two tokens per channel, in channel order: block c0's channels 0-15 and 16-31, block c0 + 1's
      const IV w[4] = {widen_bytes(lower_half(lo)), widen_bytes(lower_half(hi)), widen_bytes(upper_half(lo)),
                       widen_bytes(upper_half(hi))};
      for (int r = 0; r < RT; ++r)
        for (int k = 0; k < 4; ++k)
          acc[r][k] = dot_words(acc[r][k], w[k], bcast4(p16 + (r * NB + c0 + k / 2) * QB + 2 * u));
    }
    for (int r = 0; r < RT; ++r)
      for (int k = 0; k < 4; ++k) {
        const int64_t c = c0 + k / 2;
        fma(Vec(sigma[r * NB + c]), tof(acc[r][k]), Vec(zsum[r * NB + c])).store(o + r * D + c0 * 32 + k * W);
      }
  }
#else
  // 16 registers: a pass is half a block (16 channels, 2 vectors of accumulators per row), that half joined alone
  const IV top = bytes_and(iset(-1), 0xF0);
  for (int64_t c = 0; c < NB; ++c)
    for (int half = 0; half < 2; ++half) {
      IV acc[RT][2];
      for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = izero();
      for (int64_t u = 0; u < QB / 2; ++u) {
        const int64_t at = u * D + c * 32;
        for (int64_t b = 0; b < D; b += 64) {  // the next group's pair: D bytes per plane
          prefetch_l2(pf_h + u * D + b);
          prefetch_l2(pf_l + u * D + b);
        }
        const IV h = iload(vh + at), l = LO ? iload(vl + at) : eights;
        const IV codes = half == 0 ? bit_select(sll16_4(h), l, top) : bit_select(h, srl16(l, 4), top);
        const IV w0 = widen_bytes(lower_half(codes)), w1 = widen_bytes(upper_half(codes));
        for (int r = 0; r < RT; ++r) {
          const IV pp = bcast4(p16 + (r * NB + c) * QB + 2 * u);
          acc[r][0] = dot_words(acc[r][0], w0, pp);
          acc[r][1] = dot_words(acc[r][1], w1, pp);
        }
      }
      for (int r = 0; r < RT; ++r)
        for (int k = 0; k < 2; ++k)
          fma(Vec(sigma[r * NB + c]), tof(acc[r][k]), Vec(zsum[r * NB + c]))
              .store(o + r * D + c * 32 + half * 16 + k * W);
    }
#endif
}

template <int64_t D>
void group_pv(const int16_t* p16, const float* sigma, const float* zsum, const uint8_t* vh, const uint8_t* vl,
              int64_t R, float* o, const uint8_t* next_h, const uint8_t* next_l) {
  constexpr int64_t NB = D / 32;
  for (int64_t r = 0; r < R; r += QTILE) {
    const uint8_t* nh = r == 0 ? next_h : nullptr;
    const uint8_t* nl = r == 0 ? next_l : nullptr;
    with_tile_rows<QTILE>(R - r, [&](auto nr) {
      if (vl != nullptr)  // as group_scores
        group_pv_tile<D, decltype(nr)::value, true>(p16 + r * NB * QB, sigma + r * NB, zsum + r * NB, vh, vl, o + r * D,
                                                    nh, nl);
      else
        group_pv_tile<D, decltype(nr)::value, false>(p16 + r * NB * QB, sigma + r * NB, zsum + r * NB, vh, vl,
                                                     o + r * D, nh, nl);
    });
  }
}

// rows_softmax for R rows of a quantized group's QB scores (row stride QB): the same m, p and l, bit for bit (the
// max is exact in any order; p and l by softmax_numerators' operations in its order), with the group's length a
// constant, so each row's loops unroll and the rows' chains overlap.
inline void group_softmax(float* s, int64_t R, float* m_b, float* l_b) {
  constexpr int NK = QB / W;
  const Vec neg(NEG_INF);
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * QB;
    Vec x[NK];
    for (int k = 0; k < NK; ++k) x[k] = Vec::loadu(sr + k * W);
    Vec mv = x[0];
    for (int k = 1; k < NK; ++k) mv = vmax(mv, x[k]);
    const float m = vmax_all(mv);
    m_b[r] = m;
    const Vec ms(m == NEG_INF ? 0.f : m);
    Vec acc(0.f);
    for (int k = 0; k < NK; ++k) {
      const Vec p = select(x[k] != neg, exp(x[k] - ms));
      p.store(sr + k * W);
      acc = acc + p;
    }
    l_b[r] = reduce_add(acc);
  }
}

template <int64_t D, typename KV>
torch::Tensor run_quant(const torch::Tensor& q, const QuantLayer& L, const torch::Tensor& lim,
                        const torch::Tensor& fmask, int64_t T, double scale) {
  constexpr int64_t NB = D / 32;
  const int64_t H = q.size(0), R = q.size(1), Sq = L.Sq, F = L.F;
  const int64_t nq = Sq / QB, nf = (F + QB - 1) / QB, nb = nq + nf;
  const auto qc = q.contiguous();
  std::vector<float> qs(H * R * D);
  scaled_queries(qc.data_ptr<float>(), H, R, D, scale, false, R, false, qs.data());
  const auto parts = torch::empty({H * nb * R * (D + 2)}, q.options());
  float* const o_part = parts.data_ptr<float>();
  float* const m_part = o_part + H * nb * R * D;
  float* const l_part = m_part + H * nb * R;
  const float* qp = qs.data();
  const int64_t* limp = lim.data_ptr<int64_t>();
  const bool* maskp = fmask.data_ptr<bool>();
  const bool eight_bit = L.k_lo != nullptr;
  const uint8_t* khp = L.k_hi;
  const uint8_t* vhp = L.v_hi;
  const uint8_t* klp = L.k_lo;
  const uint8_t* vlp = L.v_lo;
  const c10::Half* ksp = L.k_scale;
  const c10::Half* kzp = L.k_zero;
  const c10::Half* vsp = L.v_scale;
  const c10::Half* vzp = L.v_zero;
  const KV* fkp = static_cast<const KV*>(L.fk);
  const KV* fvp = static_cast<const KV*>(L.fv);
  const int64_t plane_s = L.k_hi_s, lo_s = L.k_lo_s, ks_s = L.k_scale_s, vs_s = L.v_scale_s, fk_s = L.fk_s,
                fv_s = L.fv_s;
  const int64_t vplane_s = L.v_hi_s, vlo_s = L.v_lo_s;
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(MAX_ROWS * QB), a(MAX_ROWS), bias(MAX_ROWS), vsf(NB * QB), vzf(NB * QB),
        sigma(MAX_ROWS * NB), zsum(MAX_ROWS * NB);
    std::vector<int8_t> iq(MAX_ROWS * 2 * D);
    std::vector<int32_t> isum(MAX_ROWS * 2);
    std::vector<int16_t> p16(MAX_ROWS * NB * QB);
    for (int64_t w = b; w < e; ++w) {
      const int64_t h = w / nb, blk = w % nb;
      const float* qh = qp + h * R * D;
      float* ob = o_part + w * R * D;
      float* mb = m_part + w * R;
      float* lb = l_part + w * R;
      if (blk < nq) {
        const int64_t j0 = blk * QB;
        bool any = false, masked = false;
        for (int64_t r = 0; r < R; ++r) {
          any = any || limp[r] > j0;
          masked = masked || limp[r] < j0 + QB;
        }
        if (!any) {  // no row reads this group from the planes
          for (int64_t r = 0; r < R; ++r) mb[r] = NEG_INF, lb[r] = 0.f;
          continue;
        }
        const bool next = blk + 1 < nq;
        const int64_t gb = QB * D / 2;  // a group's bytes in one plane
        const uint8_t* kh = khp + h * plane_s + j0 * (D / 2);
        const uint8_t* kl = eight_bit ? klp + h * lo_s + j0 * (D / 2) : nullptr;
        const uint8_t* vh = vhp + h * vplane_s + j0 * (D / 2);
        const uint8_t* vl = eight_bit ? vlp + h * vlo_s + j0 * (D / 2) : nullptr;
        quantize_queries<D>(qh, R, ksp + h * ks_s + blk * D, kzp + h * ks_s + blk * D, iq.data(), a.data(),
                            bias.data(), isum.data());
        group_scores<D>(iq.data(), a.data(), bias.data(), isum.data(), kh, kl, R, s.data(), next ? kh + gb : nullptr,
                        next && kl != nullptr ? kl + gb : nullptr);
        if (masked)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t j = std::max<int64_t>(0, limp[r] - j0); j < QB; ++j) s[r * QB + j] = NEG_INF;
        group_softmax(s.data(), R, mb, lb);
        const c10::Half* vs = vsp + h * vs_s + j0 * NB;  // [NB, QB] per group (caches/quantized.py's storage order)
        const c10::Half* vz = vzp + h * vs_s + j0 * NB;
        for (int64_t i = 0; i < NB * QB; i += W) {
          load(vs + i).store(vsf.data() + i);
          load(vz + i).store(vzf.data() + i);
        }
        if (next)
          for (int64_t i = 0; i < NB * QB * 2; i += 64) {
            prefetch_l2(reinterpret_cast<const char*>(vs + NB * QB) + i);
            prefetch_l2(reinterpret_cast<const char*>(vz + NB * QB) + i);
          }
        quantize_probabilities<D>(s.data(), R, vsf.data(), vzf.data(), p16.data(), sigma.data(), zsum.data());
        group_pv<D>(p16.data(), sigma.data(), zsum.data(), vh, vl, R, ob, next ? vh + gb : nullptr,
                    next && vl != nullptr ? vl + gb : nullptr);
      } else {
        const int64_t f0 = (blk - nq) * QB, n = std::min(QB, F - f0);
        const KV* kh = fkp + h * fk_s + f0 * D;
        const KV* vh = fvp + h * fv_s + f0 * D;
        const auto mask = [&](int64_t r, int64_t j) { return maskp[(r % T) * F + f0 + j]; };
        block_rows<D, QB, false>(qh, kh, vh, R, n, 0, mask, s.data(), nullptr, nullptr, ob, mb, lb);
      }
    }
  });
  auto out = torch::empty({H, R, D}, q.options());
  merge_blocks<D>(o_part, H, nb, R, T, out.data_ptr<float>(), R * D, T * D, D);
  return out;
}

}  // namespace

// q [H, R, D] fp32 (any layout; copied scaled), k/v [H, S, D] fp32, bf16 or fp16 (both the same)
// with contiguous rows, D in {64, 128, 256}, T tokens per row group, causal over the last T keys if
// `causal` -> out [H, R, D] fp32. path: 0 what the model runs (the per-row path, or over bf16 K/V on Zen 5 path 2's
// dot products at every row count: exact per row either way), 1 the per-row path, 2 the rows-in-lanes path on the vector units (bf16 K/V: vdpbf16ps where the build has AVX512-BF16, else FMAs), 3 rows in lanes on AMX (bf16 K/V; for tests and
// measurements). bf16 K/V: the bf16 arithmetic (run()).
bool bf16_dot_attention() { return BF16_DOT || amx_usable(); }

namespace {
// k / v [H, S, D] of one dtype with rows of D contiguous (`who`: the op, for the message)
void check_kv(const torch::Tensor& k, const torch::Tensor& v, int64_t D, const char* who) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), who, ": k and v of one dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              who, ": k/v rows must be contiguous");
}

// decode_attention's checks of its operands -> the call, writing into out [H, R, D]
AttentionCall checked_call(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t T,
                           bool causal, const c10::optional<torch::Tensor>& visible,
                           const c10::optional<torch::Tensor>& gap, torch::Tensor& out) {
  // (the head dim, the row count and T against the keys: decode_attention_calls checks them, for every caller)
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "decode_attention: q [H, R, D], k/v [H, S, D]");
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(2) == D && v.size(2) == D, "decode_attention: q, k and v of one head dim");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous(), "decode_attention: q must be contiguous fp32");
  check_kv(k, v, D, "decode_attention");
  const int64_t H = q.size(0), R = q.size(1), S = k.size(1);
  TORCH_CHECK(k.size(0) == H && v.size(0) == H && v.size(1) == S, "decode_attention: bad shapes");
  const bool* vis = nullptr;
  if (visible.has_value()) {
    TORCH_CHECK(causal, "decode_attention: a visible block [T, T] needs causal (its keys are the last T)");
    TORCH_CHECK(visible->scalar_type() == torch::kBool && visible->dim() == 2 && visible->size(0) == T &&
                    visible->size(1) == T && visible->is_contiguous() && visible->device().is_cpu(),
                "decode_attention: visible must be a contiguous [T, T] bool CPU tensor");
    vis = visible->data_ptr<bool>();
  }
  const int64_t* gp = nullptr;
  if (gap.has_value()) {
    TORCH_CHECK(gap->scalar_type() == torch::kLong && gap->dim() == 1 && gap->size(0) == T + 1 &&
                    gap->is_contiguous() && gap->device().is_cpu(),
                "decode_attention: gap must be a contiguous [T + 1] int64 CPU tensor (first hidden key, then each "
                "token's first key past its gap)");
    gp = gap->data_ptr<int64_t>();
  }
  out = torch::empty({H, R, D}, q.options());
  return {q.data_ptr<float>(), H, R, D, k.data_ptr(), v.data_ptr(), S, k.stride(0), v.stride(0), k.scalar_type(),
          T, causal, vis, gp, out.data_ptr<float>(), R * D, T * D, D};
}
}  // namespace

namespace {
// decode_attention_calls for calls of one K/V dtype and head dim
void attend_calls(const std::vector<AttentionCall>& calls, double scale, int64_t path) {
  const auto dtype = calls[0].kv;
  TORCH_CHECK(path != 3 || (amx_usable() && dtype == torch::kBFloat16),
              "decode_attention: path 3 needs bf16 K/V and AMX (compiled for this CPU, granted by Linux)");
  // path 0 over bf16 K/V on Zen 5: path 2's dot products at every row count (dot_every_row)
  const bool dot_rows = path == 0 && dtype == torch::kBFloat16 && dot_every_row();
  // bf16 K/V on dot products (AVX512-BF16, not AMX): up to DOT_MAX_ROWS rows (a prefill chain's calls)
  const bool dot_chain = dot_rows || (path == 2 && dtype == torch::kBFloat16 && BF16_DOT);
  for (const AttentionCall& c : calls)
    TORCH_CHECK(c.R <= (dot_chain ? DOT_MAX_ROWS : MAX_ROWS) && c.T >= 1 && c.R % c.T == 0 && c.S >= c.T,
                "decode_attention: bad shapes (at most ", dot_chain ? DOT_MAX_ROWS : MAX_ROWS, " rows)");
  // path 0 (what the model runs) is the per-row path at every row count, its scores computed rows-in-lanes where
  // exact_rows says that is faster (path 4, scores_exact: the same bits): a row's sums then run in the same order
  // whatever rows come with it, so a verification's rows are bit for bit the decode step's and greedy output stays
  // exactly ar's. Over bf16 K/V on Zen 5 (dot_every_row) it is path 2's dot products at every row count instead, the
  // decode step's 1-3 rows included: the same property in another arithmetic.
  // Elsewhere the rows-in-lanes path (2, 3) sums in another order than the per-row path, which flipped a near-tie
  // (logits 0.02 apart) at 32K: it runs only when asked.
  const bool lanes = path == 2 || path == 3 || dot_rows;
  const bool amx = path == 3;
  switch (dtype) {
    case torch::kFloat: return attend_kv<float>(calls, scale, lanes, false, path);
    case torch::kBFloat16: return attend_kv<c10::BFloat16>(calls, scale, lanes, amx, path);
    case torch::kHalf: return attend_kv<c10::Half>(calls, scale, lanes, false, path);
    default: TORCH_CHECK(false, "decode_attention: k/v must be fp32, bf16 or fp16");
  }
}
}  // namespace

void decode_attention_calls(const std::vector<AttentionCall>& calls, double scale, int64_t path) {
  TORCH_CHECK(!calls.empty(), "decode_attention: no calls");
  TORCH_CHECK(path >= 0 && path <= 4,
              "decode_attention: path 0 (auto), 1 (per row), 2 (lanes), 3 (lanes on AMX), 4 (per row, scores in lanes)");
  for (const AttentionCall& c : calls)
    TORCH_CHECK(c.D == 64 || c.D == 128 || c.D == 256, "decode_attention: head dim 64, 128 or 256");
  // A serving batch may join caches of several K/V dtypes (a request's drafting level, fp16, beside another's full
  // cache, bf16): one parallel region per dtype and head dim. A call's bits do not depend on the calls beside it.
  std::vector<AttentionCall> group;
  std::vector<bool> done(calls.size(), false);
  for (size_t i = 0; i < calls.size(); ++i) {
    if (done[i]) continue;
    group.clear();
    for (size_t j = i; j < calls.size(); ++j)
      if (!done[j] && calls[j].kv == calls[i].kv && calls[j].D == calls[i].D) group.push_back(calls[j]), done[j] = true;
    attend_calls(group, scale, path);
  }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t T, bool causal,
                               double scale, int64_t path, c10::optional<torch::Tensor> visible,
                               c10::optional<torch::Tensor> gap) {
  q = q.contiguous();
  torch::Tensor out;
  decode_attention_calls({checked_call(q, k, v, T, causal, visible, gap, out)}, scale, path);
  return out;
}

torch::Tensor chain_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t rows) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "chain_attention: q [Hq, T, D], k/v [Hkv, S, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.stride(2) == 1, "chain_attention: q fp32, rows of D contiguous");
  const int64_t Hq = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(T >= 1 && Hkv >= 1 && Hq % Hkv == 0 && S >= T && k.size(2) == D && v.sizes() == k.sizes(),
              "chain_attention: q [Hq, T, D] with Hq a multiple of k's Hkv, k/v [Hkv, S >= T, D]");
  check_kv(k, v, D, "chain_attention");
  const int64_t g = Hq / Hkv, n = std::max<int64_t>(1, rows / g);
  auto out = torch::empty({T, Hq, D}, q.options());
  std::vector<AttentionCall> calls;
  for (int64_t t0 = 0; t0 < T; t0 += n) {
    const int64_t tc = std::min(T, t0 + n) - t0;
    AttentionCall c{q.data_ptr<float>() + t0 * q.stride(1), Hkv, g * tc, D, k.data_ptr(), v.data_ptr(), S - T + t0 + tc,
                    k.stride(0), v.stride(0), k.scalar_type(), tc, true, nullptr, nullptr,
                    out.data_ptr<float>() + t0 * Hq * D, g * D, D, Hq * D};
    c.q_h = g * q.stride(0), c.q_g = q.stride(0), c.q_t = q.stride(1);
    calls.push_back(c);
  }
  decode_attention_calls(calls, scale, 0);
  return out;
}

bool amx_attention() { return amx_usable(); }

// The arithmetic peak of this build's vector units on all threads, in FLOP/s: W-lane FMAs (2 FLOPs per lane) or, with
// dot, AVX512-BF16's vdpbf16ps (4 per fp32 lane: two products, two sums); 0 for dot where the build has no
// AVX512-BF16. The peak probes' chains (threads_rate: 12 a thread, more than latency x issue rate, 4 x 2, on the
// CPUs we know), operands in registers: what the attention's arithmetic is compared with (bench/decode_step.py).
// (MKL's sgemm, the figure before, runs AVX2 code on AMD's AVX-512 CPUs: 225 GFLOP/s on Zen 5 against 536 for zmm
// FMAs.)
double vector_peak_flops(bool dot) {
  if (dot && !BF16_DOT) return 0.0;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if (dot)
    return threads_rate(double(PEAK_ITERS) * PEAK_CHAINS * W * 4, [] {
      __m512 acc[PEAK_CHAINS];
      for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = _mm512_set1_ps(float(c));
      const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3c00), y = (__m512bh)_mm512_set1_epi16(0x2000);  // tiny
      for (int64_t i = 0; i < PEAK_ITERS; ++i)
        for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
      double total = 0.0;
      for (int c = 0; c < PEAK_CHAINS; ++c) total += _mm512_reduce_add_ps(acc[c]);
      return total;
    });
#endif
  return threads_rate(double(PEAK_ITERS) * PEAK_CHAINS * W * 2, [] {
    Vec acc[PEAK_CHAINS];
    for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = Vec(float(c));
    const Vec x(0.999f), y(0.001f);  // a fixed point at 1: no overflow, no denormals
    for (int64_t i = 0; i < PEAK_ITERS; ++i)
      for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = fma(acc[c], x, y);
    double total = 0.0;
    for (int c = 0; c < PEAK_CHAINS; ++c) total += reduce_add(acc[c]);
    return total;
  });
}
int64_t attention_lanes_min_rows(bool bf16_dot) { return lanes_min_rows(bf16_dot); }
bool attention_exact_rows(int64_t rows) { return exact_rows(rows); }
bool attention_dot_every_row() { return dot_every_row(); }
int64_t attention_chain_rows() { return dot_every_row() ? DOT_MAX_ROWS : MAX_ROWS; }

}  // namespace triforce

namespace triforce {

// Attention over a quantized KV cache (caches/quantized.py, QuantizedKV.attend): q [H, R, D] fp32; the planes
// k_hi / v_hi [H, Sq, D / 2] uint8 of the first Sq positions (Sq a multiple of 64; a key group's 64 rows hold
// its [D, 32] channel-major bytes; k_lo / v_lo the same, or empty tensors for the 4-bit reading), key scales / zeros [H, Sq / 64, D] and value scales / zeros
// [H, Sq, D / 32] fp16; lim [R] int64: row r reads the quantized positions < lim[r]; the full-precision buffer
// fk / fv [H, F, D] (fp32, bf16 or fp16) with fmask [T, F] bool (row r reads buffer key j iff fmask[r % T][j]);
// rows of every tensor contiguous. -> [H, R, D] fp32. D 64, 128 or 256; R <= 64.
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k_hi, torch::Tensor k_lo, torch::Tensor k_scale,
                              torch::Tensor k_zero, torch::Tensor v_hi, torch::Tensor v_lo, torch::Tensor v_scale,
                              torch::Tensor v_zero, torch::Tensor lim, torch::Tensor fk, torch::Tensor fv,
                              torch::Tensor fmask, int64_t T, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat, "quant_attention: q [H, R, D] fp32");
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2), Sq = k_hi.size(1), F = fk.size(1);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "quant_attention: head dim 64, 128 or 256");
  TORCH_CHECK(R <= MAX_ROWS && T >= 1 && R % T == 0, "quant_attention: at most 64 rows, a multiple of T");
  TORCH_CHECK(Sq % QB == 0 && k_hi.size(0) == H && k_hi.size(2) == D / 2 && k_hi.stride(1) == D / 2 &&
                  v_hi.sizes() == k_hi.sizes() && v_hi.stride(1) == D / 2 && k_hi.scalar_type() == torch::kByte &&
                  v_hi.scalar_type() == torch::kByte,
              "quant_attention: planes [H, Sq, D / 2] uint8 with contiguous rows, Sq a multiple of 64");
  const bool eight = k_lo.numel() > 0;
  TORCH_CHECK(eight == (v_lo.numel() > 0), "quant_attention: both lower planes or neither");
  TORCH_CHECK(!eight || (k_lo.sizes() == k_hi.sizes() && v_lo.sizes() == k_hi.sizes() && k_lo.stride(1) == D / 2 &&
                         v_lo.stride(1) == D / 2 && k_lo.scalar_type() == torch::kByte &&
                         v_lo.scalar_type() == torch::kByte),
              "quant_attention: lower planes shaped as the upper ones");
  TORCH_CHECK(k_scale.scalar_type() == torch::kHalf && k_zero.scalar_type() == torch::kHalf &&
                  v_scale.scalar_type() == torch::kHalf && v_zero.scalar_type() == torch::kHalf &&
                  k_scale.size(0) == H && k_scale.size(1) == Sq / QB && k_scale.size(2) == D && k_scale.stride(2) == 1 &&
                  k_scale.stride(1) == D && k_zero.strides() == k_scale.strides() && k_zero.sizes() == k_scale.sizes() &&
                  v_scale.size(0) == H && v_scale.size(1) == Sq && v_scale.size(2) == D / 32 &&
                  v_scale.stride(1) == D / 32 && v_scale.stride(2) == 1 && v_zero.strides() == v_scale.strides() &&
                  v_zero.sizes() == v_scale.sizes(),
              "quant_attention: fp16 scales / zeros, keys [H, Sq / 64, D], values [H, Sq, D / 32], contiguous rows");
  TORCH_CHECK(lim.scalar_type() == torch::kLong && lim.numel() == R && lim.is_contiguous(),
              "quant_attention: lim [R] int64");
  TORCH_CHECK(fk.dim() == 3 && fk.size(0) == H && fk.size(2) == D && fk.stride(2) == 1 && fk.stride(1) == D &&
                  fv.sizes() == fk.sizes() && fv.stride(2) == 1 && fv.stride(1) == D &&
                  fv.scalar_type() == fk.scalar_type(),
              "quant_attention: buffer fk / fv [H, F, D] of one dtype with contiguous rows");
  TORCH_CHECK(fmask.scalar_type() == torch::kBool && fmask.dim() == 2 && fmask.size(0) == T && fmask.size(1) == F &&
                  fmask.is_contiguous(),
              "quant_attention: fmask [T, F] bool, contiguous");
  QuantLayer L{};
  L.k_hi = k_hi.data_ptr<uint8_t>();
  L.v_hi = v_hi.data_ptr<uint8_t>();
  L.k_lo = eight ? k_lo.data_ptr<uint8_t>() : nullptr;
  L.v_lo = eight ? v_lo.data_ptr<uint8_t>() : nullptr;
  L.k_scale = k_scale.data_ptr<c10::Half>();
  L.k_zero = k_zero.data_ptr<c10::Half>();
  L.v_scale = v_scale.data_ptr<c10::Half>();
  L.v_zero = v_zero.data_ptr<c10::Half>();
  L.k_hi_s = k_hi.stride(0), L.v_hi_s = v_hi.stride(0);
  L.k_lo_s = eight ? k_lo.stride(0) : 0, L.v_lo_s = eight ? v_lo.stride(0) : 0;
  L.k_scale_s = k_scale.stride(0), L.v_scale_s = v_scale.stride(0);
  L.Sq = Sq;
  L.fk = fk.data_ptr(), L.fv = fv.data_ptr();
  L.fk_s = fk.stride(0), L.fv_s = fv.stride(0), L.F = F;
  L.kv = fk.scalar_type();
  return quant_attention_layer(q, L, lim, fmask, T, scale);
}

// The kernel itself over one layer's raw planes (checked by the caller: quant_attention above, or
// decode_layers_quant once for all layers).
torch::Tensor quant_attention_layer(const torch::Tensor& q, const QuantLayer& L, const torch::Tensor& lim,
                                    const torch::Tensor& fmask, int64_t T, double scale) {
  const int64_t D = q.size(2);
  auto run = [&](auto kv_tag) {
    using KV = decltype(kv_tag);
    switch (D) {
      case 64: return run_quant<64, KV>(q, L, lim, fmask, T, scale);
      case 128: return run_quant<128, KV>(q, L, lim, fmask, T, scale);
      default: return run_quant<256, KV>(q, L, lim, fmask, T, scale);
    }
  };
  switch (L.kv) {
    case torch::kFloat: return run(float{});
    case torch::kBFloat16: return run(c10::BFloat16{});
    case torch::kHalf: return run(c10::Half{});
    default: TORCH_CHECK(false, "quant_attention: the buffer must be fp32, bf16 or fp16");
  }
}

}  // namespace triforce
