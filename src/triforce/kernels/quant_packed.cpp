// y = x W^T for W in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K repacked 16 rows at a time (ggml_blocks.py pack_rows: the same
// bytes, interleaved), with integer dot products: llama.cpp's approach, made accurate to 16 bits of x.
//
// Why: the block kernel (quant_linear.cpp) turns every weight into an fp32 lane before its fma; at one
// row of x that is ~12 vector operations per 32 weights and the decode step was compute-bound at 2.5-3.6x
// its memory floor. Here 4-bit or 8-bit codes go into vpdpbusd (AVX-512 VNNI: 64 multiply-adds per
// instruction; AVX2: vpmaddubsw + vpmaddwd) without widening, and the 16 rows of a group sit in the 16
// lanes, so each block's scales are one vector and no horizontal sums are needed.
//
// Packed layout of a group of 16 weight rows, for each 32-weight block b in order (P = 16 rows):
//   Q4_0: d[P] fp16 | codes           Q4_1: d[P] fp16 | m[P] fp16 | codes       Q8_0: d[P] fp16 | codes
//   Q5_0: d[P] fp16 | qh | codes      Q5_1: d[P] fp16 | m[P] fp16 | qh | codes
// (qh: the word of the rows' 32 fifth bits, bit i of code i; the codes as Q4's)
// codes: for each 4-byte word j of the block's stored code bytes, the word of rows 0..15 (64 bytes):
// a lane holds 4 bytes of one row. Q4: byte i has code i in its low nibble and code i + 16 in its high
// one, so word j's low nibbles are codes 4j..4j+3 and its high nibbles codes 16+4j..16+4j+3.
//
// x: each row's 32-element block is taken as dx / 256 * X with X = 256 xq + xr (xq, xr int8:
// xq = round(x / dx), dx = max|x| / 127, xr the rounded remainder in 1/256ths), so |x - dx X / 256| <= dx / 512:
// 16 bits relative to the block's largest |x| (int8 activations alone, as llama.cpp, keep 8). Per block
// and lane the integer sum sum_i q_i X_i is exact in int32 (|X| <= 32640, |q| <= 255, 32 terms); the
// block's scale and (Q4_1) min term are applied in fp32, blocks in order. Every output row is computed
// the same way whatever the number of x rows or threads: a verification forward's row equals a decode
// step's bit for bit.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace triforce {
namespace {

constexpr int P = 16;  // rows per packed group

// One quantized x row: per 32-element block b a record of XB bytes, the int8 planes xq / xr (32 each), dx / 256, the
// integer sum of X, the fp32 sum of x and the integer sums of X's two 16-element halves (Q6_K's scale groups). Why one
// record: with a pointer per plane and sum, a 6-row tile's 24 row pointers did not fit the general registers, and
// the compiler kept them on the stack and in vector registers, reloaded in the loop; a record is one pointer per row,
// every field at a constant offset.
constexpr int64_t XB = 128;
struct QX {
  uint8_t* p;  // block 0's record
  ALWAYS_INLINE int8_t* q(int64_t b) const { return reinterpret_cast<int8_t*>(p + XB * b); }
  ALWAYS_INLINE int8_t* r(int64_t b) const { return reinterpret_cast<int8_t*>(p + XB * b + 32); }
  ALWAYS_INLINE float& scale(int64_t b) const { return *reinterpret_cast<float*>(p + XB * b + 64); }  // dx / 256
  ALWAYS_INLINE int32_t& isum(int64_t b) const { return *reinterpret_cast<int32_t*>(p + XB * b + 68); }  // sum X
  ALWAYS_INLINE float& fsum(int64_t b) const { return *reinterpret_cast<float*>(p + XB * b + 72); }  // sum x
  ALWAYS_INLINE int32_t* isum16(int64_t b) const { return reinterpret_cast<int32_t*>(p + XB * b + 76); }  // 2 halves
};

// More operations on integer lanes (simd.h's IV; the shared ones and dot_us / dot_nibbles are there).
#if defined(CPU_CAPABILITY_AVX512)
ALWAYS_INLINE IV shl8_add(IV a, IV b) { return _mm512_add_epi32(_mm512_slli_epi32(a, 8), b); }
ALWAYS_INLINE IV signed_byte(IV a, int k) {  // byte k of each lane, sign-extended
  return _mm512_sra_epi32(_mm512_sll_epi32(a, _mm_cvtsi32_si128(24 - 8 * k)), _mm_cvtsi32_si128(24));
}
ALWAYS_INLINE IV isub(IV a, IV b) { return _mm512_sub_epi32(a, b); }
ALWAYS_INLINE IV mul32(IV a, IV b) { return _mm512_mullo_epi32(a, b); }
ALWAYS_INLINE Vec half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#if defined(__AVX512VNNI__)  // (kernels/__init__.py adds -mavx512vnni where the CPU has it)
ALWAYS_INLINE IV dot_us2(IV acc, IV u, IV s, IV u2, IV s2) { return dot_us(dot_us(acc, u, s), u2, s2); }
// Q8_0's signed codes: vpdpbusd takes unsigned bytes, so q + 128 (xor of the sign bit) and 128 sum X off after
constexpr bool Q8_OFFSET = true;
ALWAYS_INLINE IV q8_dot(IV acc, IV q, IV s) { return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(q, _mm512_set1_epi8(-128)), s); }
#else
// two 4-bit-code products summed in 16 bits, then widened (as on AVX2, where it measured faster for Q4_0 / Q4_1)
ALWAYS_INLINE IV dot_us2(IV acc, IV u, IV s, IV u2, IV s2) {
  const IV p = _mm512_add_epi16(_mm512_maddubs_epi16(u, s), _mm512_maddubs_epi16(u2, s2));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
constexpr bool Q8_OFFSET = false;
ALWAYS_INLINE IV q8_dot(IV acc, IV q, IV s) {  // |q| times x with q's sign: pairs within 2 * 128 * 127
  const __mmask64 neg = _mm512_movepi8_mask(q);
  s = _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), s), _mm512_set1_epi16(1)));
}
#endif
#else
// two 4-bit-code products summed in 16 bits, then widened: Q4_0 / Q4_1 with 5 rows of x 1.73 -> 1.41 ms per
// 4096 x 8192 against dot_nibbles (which is faster for Q4_K: 3.32 -> 2.91)
ALWAYS_INLINE IV dot_us2(IV acc, IV u, IV s, IV u2, IV s2) {
  const IV p = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(u2, s2));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
ALWAYS_INLINE IV shl8_add(IV a, IV b) { return _mm256_add_epi32(_mm256_slli_epi32(a, 8), b); }
ALWAYS_INLINE IV signed_byte(IV a, int k) {  // byte k of each lane, sign-extended
  return _mm256_sra_epi32(_mm256_sll_epi32(a, _mm_cvtsi32_si128(24 - 8 * k)), _mm_cvtsi32_si128(24));
}
ALWAYS_INLINE IV isub(IV a, IV b) { return _mm256_sub_epi32(a, b); }
ALWAYS_INLINE IV mul32(IV a, IV b) { return _mm256_mullo_epi32(a, b); }
ALWAYS_INLINE Vec half16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// Q8_0: |q| times x with q's sign (vpsignb), pairs within 2 * 127 * 127: no saturation, no offset
constexpr bool Q8_OFFSET = false;
ALWAYS_INLINE IV q8_dot(IV acc, IV q, IV s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(s, q)),
                                                 _mm256_set1_epi16(1)));
}
#endif

// The int8 codes of W lanes of integer-valued fp32 (|v| <= 127) stored at p; the lanes as int32.
ALWAYS_INLINE IV store_bytes(const Vec& v, int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const IV i = _mm512_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(i));
#else
  const IV i = _mm256_cvtps_epi32(v);
  // byte 0 of each lane (its two's complement code), lanes 0-3 then 4-7 into the low 8 bytes
  const __m256i low = _mm256_shuffle_epi8(i, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p),
                   _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(low, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1))));
#endif
  return i;
}

ALWAYS_INLINE int32_t ireduce(IV v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_epi32(v);
#else
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
#endif
}

void quantize_row(const float* x, int64_t K, const QX& o) {
  // vectorised: the scalar loops (the fp32 sum a chain of 32 dependent adds per block; then the codes' conversion
  // and integer sums) took 1.1 ns an element: 23% of a 512-row Q4_1 576 x 1536 call, 3 us a decode step's linear
  constexpr int NV = 32 / W;
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    Vec v[NV], amax_v(0.f), sum_v(0.f);
    for (int i = 0; i < NV; ++i) {
      v[i] = Vec::loadu(xb + i * W);
      amax_v = vmax(amax_v, v[i].abs());
      sum_v = sum_v + v[i];
    }
    const float amax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return vmax(a, c); }, amax_v);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    IV X[NV];  // X = 256 q + r per lane: exact integers, so any order of their sums gives the same isum
    for (int i = 0; i < NV; ++i) {
      const Vec y = v[i] * Vec(inv);
      const Vec q = y.round();  // to nearest even, as std::nearbyint
      const Vec r = at::vec::clamp((y - q) * Vec(256.f), Vec(-127.f), Vec(127.f)).round();
      const IV qi = store_bytes(q, o.q(b) + i * W);
      const IV ri = store_bytes(r, o.r(b) + i * W);
      X[i] = shl8_add(qi, ri);
    }
    IV first = X[0], second = X[NV / 2];  // weights 0-15 and 16-31
    for (int i = 1; i < NV / 2; ++i) first = iadd(first, X[i]), second = iadd(second, X[NV / 2 + i]);
    const int32_t half = ireduce(first), rest = ireduce(second);
    o.isum16(b)[0] = half;
    o.isum16(b)[1] = rest;
    o.scale(b) = amax / 127.f / 256.f;
    o.isum(b) = half + rest;
    o.fsum(b) = reduce_add(sum_v);
  }
}

ALWAYS_INLINE IV bits(IV a, int shift, int mask) { return iand(srl(a, shift), iset(mask)); }  // (a >> shift) & mask
// Bits shift .. shift + 3 of each lane of qh as 0x10 in bytes 0 .. 3 (the fifth bit of 4 Q5 codes): the 4 bits
// times 0x02040810 are 4 copies at bits 4, 11, 18, 25, which put bit k at bit 8 k + 4 and nothing else there.
ALWAYS_INLINE IV fifth_bits(IV qh, int shift) { return iand(mul32(bits(qh, shift, 15), iset(0x02040810)), iset(0x10101010)); }

// The formats: bytes per row and block (BYTES), scale bytes per row (HEAD: d, and Q4_1's / Q5_1's m), code
// words per row (WORDS), a word of fifth bits before them (HIGH: Q5), and the code offset taken off through
// sum X (Q4_0: 8, Q5_0: 16).
template <int HEAD_, int WORDS_, bool FOUR_, int OFFSET_, bool MIN_, bool HIGH_ = false>
struct Fmt {
  static constexpr int HEAD = HEAD_, WORDS = WORDS_, OFFSET = OFFSET_, QK = 32, KIND = 0;
  static constexpr bool FOUR = FOUR_, MIN = MIN_, HIGH = HIGH_, K = false;
  static constexpr int BYTES = HEAD + 4 * (WORDS + HIGH);  // per row and block, as in the file
};
using PQ4_0 = Fmt<2, 4, true, 8, false>;
using PQ4_1 = Fmt<4, 4, true, 0, true>;
using PQ5_0 = Fmt<2, 4, true, 16, false, true>;
using PQ5_1 = Fmt<4, 4, true, 0, true, true>;
using PQ8_0 = Fmt<2, 8, false, 0, false>;
// Q4_K: 256-weight blocks of d, dmin (fp16), 12 bytes of 6-bit sub-block scales and mins (3 words), 128 bytes
// of codes (32 words); packed: d[P] | dmin[P] | 3 scale words of the P rows | 32 code words of the P rows.
// Sub-block s (32 weights): the low nibbles of code words 8 (s / 2) .. + 7 for even s, the high ones for odd
// s; w = d sc_s q - dmin m_s.
struct PQ4_K {
  static constexpr int QK = 256, BYTES = 144, KIND = 1;
  static constexpr bool K = true, HIGH = false;
};
// Q5_K: Q4_K with 32 bytes qh (8 words) between the scales and the codes: bit s of qh byte l is bit 4 of
// weight l of sub-block s.
struct PQ5_K {
  static constexpr int QK = 256, BYTES = 176, KIND = 1;
  static constexpr bool K = true, HIGH = true;
};
// Q6_K: 256-weight blocks of ql (128 bytes: low 4 bits), qh (64: high 2 bits), 16 int8 scales, d (fp16, last);
// packed: d[P] | 52 words of the P rows (ql 0-31, qh 32-47, scales 48-51). Sub-block 4 n + i of a block
// (ggml's dequantize_row_q6_K: half n, quarter i), word j (its weights 4j .. 4j + 3): low 4 bits from ql word
// 16 n + 8 (i & 1) + j (its high nibbles for i >= 2), bits 4-5 from qh word 32 + 8 n + j >> 2 i; q - 32, times
// d * the scale of its 16 weights (scale 8 n + 2 i, + 1 for words 4-7).
struct PQ6_K {
  static constexpr int QK = 256, BYTES = 210, KIND = 2;
  static constexpr bool K = true;
};

// x rows per pass: 3 accumulators each (+ codes, scales) within the registers; `groups` has a case for each
// count (Q4_K: 5 accumulators each)
constexpr int TBMAX = W == 16 ? 8 : 3;
constexpr int TBMAX_K = W == 16 ? 4 : 2;
// Rows per tile while more remain than one tile of `tile_rows_last` takes: 8-row tiles ran a 64-row Q4_1 call 1-2%
// slower than 6-row ones (Zen 5), but one 8-row tile ran an 8-row call (a serving batch) 7-8% faster than 6 + 2.
// Q8_0's 8-row tile ran 20% slower (its 8 code words and offset codes beside 24 accumulators: spilled), so 8-row
// tiles are for Q4_0 / Q4_1 only.
constexpr int TB_MANY = W == 16 ? 6 : 3;
// Two groups' tiles (group_tile's G = 2; KIND 0 formats, AVX-512) from PAIR_ROWS_FROM x rows, PAIR_TB rows a tile (2
// groups x 3 rows: 12 integer and 6 fp32 accumulators beside the codes within the 32 registers). Zen 5, one core, Q4_1
// 576 x 1536 and 1536 x 576, 48 rows in cache (a lab copy of the tile): 6.8 G vpdpbusd a second at 3 rows, 6.4 at 2,
// against 6.0-6.2 for one group at 6 or 8 rows. In the kernel (benchmarks/kernel_ab.py): the embedded model's layers
// (Q4_1, Q8_0 head) at 8, 16 and 48 rows 0.98-1.01 / 0.90 / 0.84x from DRAM, 0.92 / 0.86 / 0.84x in cache; one thread,
// 8-64 rows, Q8_0 1.33-1.51x the GMAC/s, Q4_0 1.07-1.14x, Q5_1 1.08-1.13x; bit-identical. 4-row tiles spilled (those
// layers 0.98-1.04x). Below 5 rows the weights' reads bound a call: from DRAM pairs took the layers at 2 and 4 rows
// 1.06-1.14x longer (two streams of reads against one group's one), at 3 and 5 0.98-0.99x. Zen 4 and Intel's AVX-512
// CPUs take the same tiles, not measured there (the outputs are the same bits either way).
constexpr int64_t PAIR_ROWS_FROM = 5;
constexpr int PAIR_TB = 3;
// (groups() cuts M rows into tiles of 3, and 4 as 2 + 2, so every tile has 2 or 3 rows: from 1 row it would not)
static_assert(PAIR_ROWS_FROM >= 2 && PAIR_TB == 3, "groups(): a pair tile of 1 row or of more than 3");
template <class F>
constexpr int tile_rows_last() {
  if constexpr (F::K) return TBMAX_K;
  else if constexpr (F::FOUR && !F::HIGH) return TBMAX;
  else return TB_MANY;
}
// Prefetch distance in bytes of a part (the hardware prefetcher alone leaves bandwidth unused). A layer's
// matrices are small (0.3-1 MB), so every call starts a new stream: 16 KB ahead, and the first 16 KB of a
// thread's groups requested before it starts, took the embedded model's linears from DRAM from 16 to 19.5
// GB/s on an Intel Xeon (2 cores, 29 GB/s); 2 KB ahead (the distance before) left the loads waiting.
constexpr int64_t PF_BYTES = 16384;
// The most x rows whose call splits the groups into one contiguous share per thread (linear_packed). Why: chunks taken
// as threads come free (a few groups each: 17 KB of a 960 x 576 Q4_1 matrix) began each chunk with its first 16 KB
// asked for at once and waited for it, so the weights' reads added to the arithmetic instead of running under it. The
// embedded model's 121 layers from DRAM, 2 threads, Zen 5 (benchmarks/kernel_ab.py --what layers): 5 rows 3.85 ->
// 2.92 ms, 8 rows 4.77 -> 3.86, 16 rows 8.16 -> 7.24, 48 rows 21.3 -> 20.5; the AVX2 build 0.89-0.95x at 5-16 rows.
constexpr int64_t STREAM_MAX_ROWS = 64;
template <int GB>
constexpr int pf_blocks() {
  return static_cast<int>((PF_BYTES + GB - 1) / GB);
}

// The W lanes [lane0, lane0 + W) of G consecutive groups (`g`: the first one's packed bytes, gbytes apart, nb blocks
// each) against TB rows of x; group k's outputs at y[t] + P k + lane0. Why G = 2 (AVX-512, PAIR_ROWS_FROM): each x
// broadcast then feeds two groups' dot products. On Zen 5 a vpbroadcastd from memory costs about what a vpdpbusd does
// (a loop of 12 independent vpdpbusd ran 8.1 G a second on one core, 5.2 with a broadcast each, 6.0 with one per two),
// so one group's tile, a broadcast per dot product, ran at about 65% of the dot products' rate. Every output lane's
// arithmetic is the same whatever G or TB: integer block sums, then the block's fp32 operations in block order.
template <class F, int TB, int G = 1>
ALWAYS_INLINE void group_tile(const uint8_t* g, int64_t gbytes, int64_t nb, int lane0, const QX* x, float* const* y) {
  constexpr int GB = P * F::BYTES;  // a block of the group
  Vec acc[G][TB];
  for (int k = 0; k < G; ++k)
    for (int t = 0; t < TB; ++t) acc[k][t] = Vec(0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[G];
    const uint8_t* codes[G];
    IV qh[G];  // (Q5: the fifth bits, then the codes)
    for (int k = 0; k < G; ++k) {
      blk[k] = g + k * gbytes + b * GB;
      for (int l = 0; l < GB; l += 64) prefetch_l2(blk[k] + pf_blocks<GB>() * GB + l);
      codes[k] = blk[k] + P * F::HEAD + 4 * lane0;
      qh[k] = izero();
      if constexpr (F::HIGH) {
        qh[k] = iload(codes[k]);
        codes[k] += 4 * P;
      }
    }
    IV hi[G][TB], lo[G][TB];  // sum q xq and sum q xr of the block, per lane
    for (int k = 0; k < G; ++k)
      for (int t = 0; t < TB; ++t) hi[k][t] = lo[k][t] = izero();
    for (int j = 0; j < F::WORDS; ++j) {
      IV v[G];
      for (int k = 0; k < G; ++k) v[k] = iload(codes[k] + 4 * P * j);
      if constexpr (F::FOUR) {
        IV a[G], c[G];
        for (int k = 0; k < G; ++k) {
          a[k] = low_nibbles(v[k]), c[k] = high_nibbles(v[k]);
          if constexpr (F::HIGH) {  // codes 4j .. 4j + 3 and 16 + 4j .. 16 + 4j + 3 (5 bits: pairs within 2 * 31 * 128)
            a[k] = ior(a[k], fifth_bits(qh[k], 4 * j));
            c[k] = ior(c[k], fifth_bits(qh[k], 16 + 4 * j));
          }
        }
        for (int t = 0; t < TB; ++t) {
          const int8_t* xq = x[t].q(b) + 4 * j;
          const int8_t* xr = x[t].r(b) + 4 * j;
          const IV q0 = bcast4(xq), q1 = bcast4(xq + 16), r0 = bcast4(xr), r1 = bcast4(xr + 16);
          for (int k = 0; k < G; ++k) {
            hi[k][t] = dot_us2(hi[k][t], a[k], q0, c[k], q1);
            lo[k][t] = dot_us2(lo[k][t], a[k], r0, c[k], r1);
          }
        }
      } else {
        for (int t = 0; t < TB; ++t) {
          const IV q0 = bcast4(x[t].q(b) + 4 * j), r0 = bcast4(x[t].r(b) + 4 * j);
          for (int k = 0; k < G; ++k) {
            hi[k][t] = q8_dot(hi[k][t], v[k], q0);
            lo[k][t] = q8_dot(lo[k][t], v[k], r0);
          }
        }
      }
    }
    for (int k = 0; k < G; ++k) {
      const Vec d = half16(blk[k] + 2 * lane0);
      for (int t = 0; t < TB; ++t) {
        IV s = shl8_add(hi[k][t], lo[k][t]);  // sum q X, exact
        if constexpr (F::OFFSET != 0) s = isub(s, iset(F::OFFSET * x[t].isum(b)));
        if constexpr (!F::FOUR && Q8_OFFSET) s = isub(s, iset(128 * x[t].isum(b)));
        acc[k][t] = fma(tof(s), d * Vec(x[t].scale(b)), acc[k][t]);
        if constexpr (F::MIN) acc[k][t] = fma(half16(blk[k] + 2 * P + 2 * lane0), Vec(x[t].fsum(b)), acc[k][t]);
      }
    }
  }
  for (int k = 0; k < G; ++k)
    for (int t = 0; t < TB; ++t) acc[k][t].store(y[t] + P * k + lane0);
}

// sc_s and m_s of Q4_K's sub-block s, per lane, from the rows' 3 scale words (ggml's get_scale_min_k4)
ALWAYS_INLINE void k_scale_min(const IV* w, int s, IV& sc, IV& m) {
  if (s < 4) {
    sc = bits(w[0], 8 * s, 63);
    m = bits(w[1], 8 * s, 63);
  } else {
    const int k = 8 * (s - 4);
    sc = ior(bits(w[2], k, 15), sll4(bits(w[0], k + 6, 3)));
    m = ior(bits(w[2], k + 4, 15), sll4(bits(w[1], k + 6, 3)));
  }
}

// The block sums of group_tile_k: 4-bit codes (Q4_K) through dot_nibbles; 5-bit ones (Q5_K: pairs up to
// 2 * 31 * 127, too large to sum 8 of in 16 bits) through dot_us.
template <bool HIGH>
ALWAYS_INLINE IV k_dot(IV acc, IV u, IV s) {
  if constexpr (HIGH) return dot_us(acc, u, s);
  else return dot_nibbles(acc, u, s);
}
template <bool HIGH>
ALWAYS_INLINE IV k_sum(IV acc) {
  if constexpr (HIGH) return acc;
  else return nibble_sum(acc);
}

// group_tile for Q4_K / Q5_K: sub-blocks in pairs (2i from the low nibbles of 8 code words, 2i + 1 from the
// high ones; Q5_K: bits 2i and 2i + 1 of the 8 qh words as bit 4), each with its own integer sums and scale.
template <class F, int TB>
ALWAYS_INLINE void group_tile_k(const uint8_t* g, int64_t nb, int lane0, const QX* x, float* const* y) {
  constexpr int GB = P * F::BYTES;
  Vec acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = Vec(0.f);
  for (int64_t sb = 0; sb < nb; ++sb) {
    const uint8_t* blk = g + sb * GB;
    for (int l = 0; l < GB; l += 64) prefetch_l2(blk + pf_blocks<GB>() * GB + l);
    const Vec d = half16(blk + 2 * lane0), dmin = half16(blk + 2 * P + 2 * lane0);
    IV words[3];
    for (int j = 0; j < 3; ++j) words[j] = iload(blk + 4 * P + 4 * P * j + 4 * lane0);
    const uint8_t* qh = blk + 16 * P + 4 * lane0;  // (Q5_K)
    const uint8_t* codes = blk + (F::HIGH ? 48 : 16) * P + 4 * lane0;
    for (int i = 0; i < 4; ++i) {
      IV ha[TB], la[TB], hb[TB], lb[TB];  // sums q xq, q xr of sub-blocks 2i (a) and 2i + 1 (b)
      for (int t = 0; t < TB; ++t) ha[t] = la[t] = hb[t] = lb[t] = izero();
      const int64_t xa = 8 * sb + 2 * i;  // x block of sub-block 2i
      for (int j = 0; j < 8; ++j) {
        const IV v = iload(codes + 4 * P * (8 * i + j));
        IV a = low_nibbles(v), c = high_nibbles(v);
        if constexpr (F::HIGH) {
          const IV h = iload(qh + 4 * P * j);
          a = ior(a, sll16_4(bytes_and(srl16(h, 2 * i), 1)));
          c = ior(c, sll16_4(bytes_and(srl16(h, 2 * i + 1), 1)));
        }
        for (int t = 0; t < TB; ++t) {
          ha[t] = k_dot<F::HIGH>(ha[t], a, bcast4(x[t].q(xa) + 4 * j));  // (Q4_K, 8 words: 8 pairs per 16-bit lane)
          la[t] = k_dot<F::HIGH>(la[t], a, bcast4(x[t].r(xa) + 4 * j));
          hb[t] = k_dot<F::HIGH>(hb[t], c, bcast4(x[t].q(xa + 1) + 4 * j));
          lb[t] = k_dot<F::HIGH>(lb[t], c, bcast4(x[t].r(xa + 1) + 4 * j));
        }
      }
      IV sc, m;
      k_scale_min(words, 2 * i, sc, m);
      const Vec da = d * tof(sc), ma = dmin * tof(m);
      k_scale_min(words, 2 * i + 1, sc, m);
      const Vec db = d * tof(sc), mb = dmin * tof(m);
      const int64_t ba = 8 * sb + 2 * i;  // x block of sub-block 2i
      for (int t = 0; t < TB; ++t) {
        acc[t] = fma(tof(shl8_add(k_sum<F::HIGH>(ha[t]), k_sum<F::HIGH>(la[t]))), da * Vec(x[t].scale(ba)), acc[t]);
        acc[t] = fma(ma, Vec(-x[t].fsum(ba)), acc[t]);
        acc[t] = fma(tof(shl8_add(k_sum<F::HIGH>(hb[t]), k_sum<F::HIGH>(lb[t]))), db * Vec(x[t].scale(ba + 1)), acc[t]);
        acc[t] = fma(mb, Vec(-x[t].fsum(ba + 1)), acc[t]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) acc[t].store(y[t] + lane0);
}

// group_tile for Q6_K: per sub-block, its two 16-weight scale groups with their own integer sums.
template <int TB>
ALWAYS_INLINE void group_tile_q6k(const uint8_t* g, int64_t nb, int lane0, const QX* x, float* const* y) {
  constexpr int GB = P * PQ6_K::BYTES;
  Vec acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = Vec(0.f);
  for (int64_t sb = 0; sb < nb; ++sb) {
    const uint8_t* blk = g + sb * GB;
    for (int l = 0; l < GB; l += 64) prefetch_l2(blk + pf_blocks<GB>() * GB + l);
    const Vec d = half16(blk + 2 * lane0);
    const uint8_t* words = blk + 2 * P + 4 * lane0;  // word k of the lane's row: words + 4 P k
    for (int n = 0; n < 2; ++n)
      for (int i = 0; i < 4; ++i) {
        IV h0[TB], l0[TB], h1[TB], l1[TB];  // sums q xq, q xr of weights 0-15 and 16-31
        for (int t = 0; t < TB; ++t) h0[t] = l0[t] = h1[t] = l1[t] = izero();
        const int64_t b = 8 * sb + 4 * n + i;  // x block
        for (int j = 0; j < 8; ++j) {
          IV ql = iload(words + 4 * P * (16 * n + 8 * (i & 1) + j));
          ql = bytes_and(i >= 2 ? srl16(ql, 4) : ql, 15);
          const IV qh = sll16_4(bytes_and(srl16(iload(words + 4 * P * (32 + 8 * n + j)), 2 * i), 3));
          const IV c = ior(ql, qh);
          for (int t = 0; t < TB; ++t) {
            const IV xq = bcast4(x[t].q(b) + 4 * j), xr = bcast4(x[t].r(b) + 4 * j);
            if (j < 4) {
              h0[t] = dot_us(h0[t], c, xq);
              l0[t] = dot_us(l0[t], c, xr);
            } else {
              h1[t] = dot_us(h1[t], c, xq);
              l1[t] = dot_us(l1[t], c, xr);
            }
          }
        }
        const int sg = 8 * n + 2 * i;  // scale of weights 0-15 (sg + 1: 16-31), in scale word sg / 4
        const IV sw = iload(words + 4 * P * (48 + sg / 4));
        const Vec d0 = d * tof(signed_byte(sw, sg % 4)), d1 = d * tof(signed_byte(sw, sg % 4 + 1));
        for (int t = 0; t < TB; ++t) {
          const IV s0 = isub(shl8_add(h0[t], l0[t]), iset(32 * x[t].isum16(b)[0]));
          const IV s1 = isub(shl8_add(h1[t], l1[t]), iset(32 * x[t].isum16(b)[1]));
          const Vec sx(x[t].scale(b));
          acc[t] = fma(tof(s0), d0 * sx, acc[t]);
          acc[t] = fma(tof(s1), d1 * sx, acc[t]);
        }
      }
  }
  for (int t = 0; t < TB; ++t) acc[t].store(y[t] + lane0);
}

template <class F, int TB>
ALWAYS_INLINE void tile(const uint8_t* g, int64_t nb, int lane0, const QX* x, float* const* y) {
  if constexpr (F::KIND == 2) {
    if constexpr (TB <= TBMAX_K) group_tile_q6k<TB>(g, nb, lane0, x, y);
  } else if constexpr (F::KIND == 1) {
    if constexpr (TB <= TBMAX_K) group_tile_k<F, TB>(g, nb, lane0, x, y);
  } else {
    group_tile<F, TB>(g, 0, nb, lane0, x, y);
  }
}

// Groups [g0, g1) of one packed part (N rows; outputs at y[t] + 16 g) against all M x rows.
template <class F>
void groups(const uint8_t* w, int64_t nb, int64_t N, int64_t g0, int64_t g1, const QX* x, int64_t M, float* y,
            int64_t ldy) {
  const int64_t gbytes = nb * P * F::BYTES;
  constexpr int64_t most = F::K ? TBMAX_K : TB_MANY, last = tile_rows_last<F>();
  float tmp[TBMAX][P];
  const uint8_t* start = w + g0 * gbytes;
  for (int64_t l = 0; l < std::min<int64_t>(PF_BYTES, (g1 - g0) * gbytes); l += 64) prefetch_l2(start + l);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = w + g * gbytes;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (F::KIND == 0) {
      if (M >= PAIR_ROWS_FROM && g + 2 <= g1 && (g + 2) * P <= N) {  // two whole groups at once
        for (int64_t m0 = 0, tb; m0 < M; m0 += tb) {
          tb = M - m0 == 4 ? 2 : std::min<int64_t>(M - m0, PAIR_TB);  // (4 rows as 2 + 2: a 4-row tile spilled)
          float* out[PAIR_TB];
          for (int t = 0; t < tb; ++t) out[t] = y + (m0 + t) * ldy + g * P;
          if (tb == 3) group_tile<F, 3, 2>(gp, gbytes, nb, 0, x + m0, out);
          else group_tile<F, 2, 2>(gp, gbytes, nb, 0, x + m0, out);  // (from 5 rows a tile has 2 or 3)
        }
        ++g;  // (and the loop's own step: past both)
        continue;
      }
    }
#endif
    const int64_t valid = std::min<int64_t>(P, N - g * P);
    for (int64_t m0 = 0, tb; m0 < M; m0 += tb) {
      tb = M - m0 <= last ? M - m0 : most;
      float* out[TBMAX];
      for (int t = 0; t < tb; ++t) out[t] = valid == P ? y + (m0 + t) * ldy + g * P : tmp[t];
      for (int lane0 = 0; lane0 < P; lane0 += W) {
        switch (tb) {
          case 1: tile<F, 1>(gp, nb, lane0, x + m0, out); break;
          case 2: tile<F, 2>(gp, nb, lane0, x + m0, out); break;
          case 3: tile<F, 3>(gp, nb, lane0, x + m0, out); break;
#if defined(CPU_CAPABILITY_AVX512)
          case 4: tile<F, 4>(gp, nb, lane0, x + m0, out); break;
          case 5: tile<F, 5>(gp, nb, lane0, x + m0, out); break;
          case 6: tile<F, 6>(gp, nb, lane0, x + m0, out); break;
          case 7: tile<F, 7>(gp, nb, lane0, x + m0, out); break;
          case 8: tile<F, 8>(gp, nb, lane0, x + m0, out); break;
#endif
          default: TORCH_CHECK(false, "linear_packed: tile of ", tb, " rows");
        }
      }
      if (valid < P)
        for (int t = 0; t < tb; ++t) std::memcpy(y + (m0 + t) * ldy + g * P, tmp[t], valid * sizeof(float));
    }
  }
}

#if !defined(CPU_CAPABILITY_AVX512)
// Several rows of x at once (a verification, a serving batch; from many_rows_from's count): the same integer
// block sums by another arithmetic. The tile path above multiplies bytes (vpmaddubsw) twice per code, once against xq and once
// against xr, and widens in between: at 2-16 rows it ran at 21-32 GMAC/s a core, and prefill took the
// weights to fp32 for MKL's GEMM instead (115-120 GFLOP/s on both cores of a Zen 3, 66-69% of the FMA peak).
// Here a block's codes are widened to 16-bit words once, kept in L1, and every x row of a chunk multiplies
// them with vpmaddwd against X = 256 xq + xr itself (|X| <= 32639 fits a word): 16 multiply-adds of 16-bit x
// per instruction, against 8 above (on Zen 3 a vpmaddwd and its vpaddd issue about once a cycle: 58-67 GMAC/s a
// core with registers only, the FMAs 46-50). The block's integer sum per output is the same exact int32
// (|sum| <= 32 * 255 * 32639), and the block scale and min are applied by the same fp32 operations in the same
// order as the tile functions', so every output equals the tile path's bit for bit. Prefill chunks do not come
// here (QuantLinear): on Zen 3 this path ran at 0.77-1.10x MKL's GEMM on dequantized weights.
//
// AVX2 only for now (the AVX-512 build keeps the tile path: its vpdpbusd already multiplies 64 bytes an
// instruction, and there was no AVX-512 machine to measure a word path on). Every packed format: a K-quant's
// sub-blocks are its units of 32 weights (Q6_K's two scale groups summed apart).
//
// Layout of a block's widened codes: for k-pair p (the block's weights 2p, 2p + 1) and half h (rows 8h ..
// 8h + 7), one vector of the 8 rows' two codes as words, a row per int32 lane, so vpmaddwd against X's pair
// broadcast adds to the row's own lane: no horizontal sums. Made from a packed word (a lane per row, 4 codes)
// by a byte shuffle and a widening, once per block for all rows of the pass.
constexpr int64_t MANY_ROWS = 64;  // x rows per pass over a group's blocks: their X (64 B a block) stay in L2
constexpr int MANY_TB = 4;         // x rows per register tile: 2 TB accumulators, TB broadcasts, codes

// v: 8 rows x 4 codes (bytes) -> out[0]: the rows' codes 0, 1 as words, out[1]: codes 2, 3
ALWAYS_INLINE void widen_pairs(__m256i v, bool is_signed, __m256i* out) {
  // per 128-bit lane (4 rows): codes 0, 1 of the rows, then codes 2, 3; then qwords to [0-3 01, 4-7 01 | 23s]
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, order), 0xD8);
  if (is_signed) {
    out[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(t));
    out[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(t, 1));
  } else {
    out[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(t));
    out[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(t, 1));
  }
}

// The 16 rows' codes of 32-weight unit u of the block at `blk` as words: c[p][h] (p: k-pair, h: half; see above).
// A unit is the block (Q4_0 ... Q8_0, u = 0) or a K-quant's sub-block (u = 0 .. 7), read as group_tile_k and
// group_tile_q6k read it.
template <class F>
ALWAYS_INLINE void unit_words(const uint8_t* blk, int u, __m256i (*c)[2]) {
  for (int h = 0; h < 2; ++h) {
    const int lane0 = 8 * h;
    __m256i w[2];
    if constexpr (F::KIND == 0) {
      const uint8_t* codes = blk + P * F::HEAD + 4 * lane0;
      IV qh = izero();
      if constexpr (F::HIGH) {
        qh = iload(codes);
        codes += 4 * P;
      }
      for (int j = 0; j < F::WORDS; ++j) {
        const IV v = iload(codes + 4 * P * j);
        if constexpr (F::FOUR) {
          IV a = low_nibbles(v), b = high_nibbles(v);  // codes 4j .. 4j + 3 and 16 + 4j .. 16 + 4j + 3
          if constexpr (F::HIGH) {
            a = ior(a, fifth_bits(qh, 4 * j));
            b = ior(b, fifth_bits(qh, 16 + 4 * j));
          }
          widen_pairs(a, false, w);
          c[2 * j][h] = w[0], c[2 * j + 1][h] = w[1];
          widen_pairs(b, false, w);
          c[8 + 2 * j][h] = w[0], c[8 + 2 * j + 1][h] = w[1];
        } else {
          widen_pairs(v, true, w);
          c[2 * j][h] = w[0], c[2 * j + 1][h] = w[1];
        }
      }
    } else if constexpr (F::KIND == 1) {  // Q4_K / Q5_K: sub-block u from the low (even u) or high nibbles
      const uint8_t* codes = blk + (F::HIGH ? 48 : 16) * P + 4 * lane0;
      for (int j = 0; j < 8; ++j) {
        const IV v = iload(codes + 4 * P * (8 * (u / 2) + j));
        IV a = u % 2 == 0 ? low_nibbles(v) : high_nibbles(v);
        if constexpr (F::HIGH) a = ior(a, sll16_4(bytes_and(srl16(iload(blk + 16 * P + 4 * lane0 + 4 * P * j), u), 1)));
        widen_pairs(a, false, w);
        c[2 * j][h] = w[0], c[2 * j + 1][h] = w[1];
      }
    } else {  // Q6_K: sub-block u = 4 n + i
      const int n = u / 4, i = u % 4;
      const uint8_t* words = blk + 2 * P + 4 * lane0;
      for (int j = 0; j < 8; ++j) {
        IV ql = iload(words + 4 * P * (16 * n + 8 * (i & 1) + j));
        ql = bytes_and(i >= 2 ? srl16(ql, 4) : ql, 15);
        const IV qh = sll16_4(bytes_and(srl16(iload(words + 4 * P * (32 + 8 * n + j)), 2 * i), 3));
        widen_pairs(ior(ql, qh), false, w);
        c[2 * j][h] = w[0], c[2 * j + 1][h] = w[1];
      }
    }
  }
}

// acc += vpmaddwd(w, x), in inline assembly: through the intrinsics GCC 12 reassociated the sums into a tree,
// computing every product of a block first and spilling them to the stack (38 GMAC/s a core at 512 rows), then
// read w from memory once per row instead of once per TB rows.
ALWAYS_INLINE void madd_into(__m256i& acc, __m256i w, __m256i x) {
  __m256i p;
  asm("vpmaddwd %2, %1, %0" : "=x"(p) : "x"(w), "x"(x));
  asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(p));
}

// s[t][h][q]: the exact sums q X of a unit for TB rows (X[t]: the row's X of this unit), rows 8h .. 8h + 7; with
// HALVES, q = 0 / 1 for the unit's weights 0-15 / 16-31 (Q6_K's scale groups), else the whole unit in q = 0
template <int TB, bool HALVES>
ALWAYS_INLINE void unit_sums(const __m256i (*c)[2], const int16_t* const* X, __m256i (*s)[2][2]) {
  constexpr int Q = HALVES ? 2 : 1;
  for (int t = 0; t < TB; ++t)
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < Q; ++q) s[t][h][q] = _mm256_setzero_si256();
  // (two loops, so that q is a constant in each: an index known only at run time put the sums on the stack)
  for (int q = 0; q < 2; ++q)
    for (int p = 8 * q; p < 8 * q + 8; ++p) {
      __m256i xb[TB];
      for (int t = 0; t < TB; ++t) xb[t] = bcast4(X[t] + 2 * p);
      for (int h = 0; h < 2; ++h) {
        const __m256i w = c[p][h];
        for (int t = 0; t < TB; ++t) madd_into(s[t][h][HALVES ? q : 0], w, xb[t]);
      }
    }
}

// TB rows from X (row stride K) through unit_sums, each row's sums handed to finish(r + t, sums)
template <int TB, bool HALVES, class Fin>
ALWAYS_INLINE void many_tile(const __m256i (*c)[2], const int16_t* X, int64_t K, Fin& finish, int64_t r) {
  const int16_t* xs[TB];
  for (int t = 0; t < TB; ++t) xs[t] = X + t * K;
  __m256i s[TB][2][2];
  unit_sums<TB, HALVES>(c, xs, s);
  for (int t = 0; t < TB; ++t) finish(r + t, s[t]);
}

// Groups [g0, g1) of one packed part against all M rows of x (X16: their X, [M, K] int16), MANY_ROWS at a time;
// each output's epilogue is its tile function's (group_tile, group_tile_k, group_tile_q6k), unit by unit in order.
template <class F>
void groups_many(const uint8_t* w, int64_t nb, int64_t N, int64_t g0, int64_t g1, const QX* x, const int16_t* X16,
                 int64_t K, int64_t M, float* y, int64_t ldy) {
  constexpr int GB = P * F::BYTES, UNITS = F::QK / 32;
  constexpr bool HALVES = F::KIND == 2;
  constexpr int TB = HALVES ? 2 : MANY_TB;  // (Q6_K: 2 sums a row and half, so half the rows within the registers)
  const int64_t gbytes = nb * GB;
  alignas(32) __m256i c[16][2];
  alignas(32) float acc[MANY_ROWS][P];
  for (int64_t m0 = 0; m0 < M; m0 += MANY_ROWS) {
    const int64_t rows = std::min<int64_t>(MANY_ROWS, M - m0);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = w + g * gbytes;
      std::memset(acc, 0, rows * sizeof(acc[0]));  // (the pass's rows only: a decode batch has a few of 64)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = gp + b * GB;
        for (int l = 0; l < GB; l += 64) prefetch_l2(blk + pf_blocks<GB>() * GB + l);
        const Vec d[2] = {half16(blk), half16(blk + 2 * 8)};
        for (int u = 0; u < UNITS; ++u) {
          unit_words<F>(blk, u, c);
          const int64_t bx = UNITS * b + u;  // the x block of this unit
          // the unit's per-output factors, as the tile functions form them
          Vec f0[2], f1[2];
          for (int h = 0; h < 2; ++h) {
            const int lane0 = 8 * h;
            if constexpr (F::KIND == 0) {
              if constexpr (F::MIN) f1[h] = half16(blk + 2 * P + 2 * lane0);
            } else if constexpr (F::KIND == 1) {
              IV words[3];
              for (int j = 0; j < 3; ++j) words[j] = iload(blk + 4 * P + 4 * P * j + 4 * lane0);
              IV sc, m;
              k_scale_min(words, u, sc, m);
              f0[h] = d[h] * tof(sc);
              f1[h] = half16(blk + 2 * P + 2 * lane0) * tof(m);
            } else {
              const int sg = 2 * u;  // scale of weights 0-15 (sg + 1: 16-31)
              const IV sw = iload(blk + 2 * P + 4 * lane0 + 4 * P * (48 + sg / 4));
              f0[h] = d[h] * tof(signed_byte(sw, sg % 4));
              f1[h] = d[h] * tof(signed_byte(sw, sg % 4 + 1));
            }
          }
          auto finish = [&](int64_t r, const __m256i (*s)[2]) {  // the tile function's epilogue for row m0 + r
            const QX& xr = x[m0 + r];
            for (int h = 0; h < 2; ++h) {
              Vec a = Vec::loadu(acc[r] + 8 * h);
              if constexpr (F::KIND == 0) {
                IV v = s[h][0];
                if constexpr (F::OFFSET != 0) v = isub(v, iset(F::OFFSET * xr.isum(bx)));
                a = fma(tof(v), d[h] * Vec(xr.scale(bx)), a);
                if constexpr (F::MIN) a = fma(f1[h], Vec(xr.fsum(bx)), a);
              } else if constexpr (F::KIND == 1) {
                a = fma(tof(s[h][0]), f0[h] * Vec(xr.scale(bx)), a);
                a = fma(f1[h], Vec(-xr.fsum(bx)), a);
              } else {
                const IV s0 = isub(s[h][0], iset(32 * xr.isum16(bx)[0]));
                const IV s1 = isub(s[h][1], iset(32 * xr.isum16(bx)[1]));
                const Vec sx(xr.scale(bx));
                a = fma(tof(s0), f0[h] * sx, a);
                a = fma(tof(s1), f1[h] * sx, a);
              }
              a.store(acc[r] + 8 * h);
            }
          };
          const int16_t* X = X16 + m0 * K + 32 * bx;
          int64_t r = 0;
          for (; r + TB <= rows; r += TB) many_tile<TB, HALVES>(c, X + r * K, K, finish, r);
          switch (rows - r) {
            case 3: if constexpr (TB > 3) many_tile<3, HALVES>(c, X + r * K, K, finish, r); break;
            case 2: if constexpr (TB > 2) many_tile<2, HALVES>(c, X + r * K, K, finish, r); break;
            case 1: many_tile<1, HALVES>(c, X + r * K, K, finish, r); break;
            default: break;
          }
        }
      }
      const int64_t valid = std::min<int64_t>(P, N - g * P);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m0 + r) * ldy + g * P, acc[r], valid * sizeof(float));
    }
  }
}
template <class F>
constexpr bool has_many_rows() { return true; }
#else
template <class F>
constexpr bool has_many_rows() { return false; }
#endif
// Fewest x rows for groups_many, per format (below it, the tile path: the codes' widening is not yet repaid).
// Zen 3, one thread, best of alternated processes, many-row / tile speed: Q8_0 1.13-1.26 at 4-5 rows, 1.4 at 8;
// Q6_K 1.25-1.31 at 4-5, 1.75 at 8 (0.83-0.90 at 2); Q4_K 0.85-1.05 at 4-5, 1.2 at 8; Q4_1 0.8-0.9 at 4-5, 1.0 at 8,
// 1.2 at 16.
template <class F>
constexpr int64_t many_rows_from() {
  if constexpr (!has_many_rows<F>()) return INT64_MAX;
  else if constexpr (F::KIND == 2) return 4;  // Q6_K
  else if constexpr (F::KIND == 1) return 8;  // Q4_K, Q5_K
  else return F::FOUR ? 16 : 4;               // Q4_0, Q4_1, Q5_0, Q5_1; Q8_0
}

enum : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

template <class Fn>
void with_packed(int64_t type, Fn&& fn) {
  switch (type) {
    case T_Q4_0: fn(PQ4_0{}); break;
    case T_Q4_1: fn(PQ4_1{}); break;
    case T_Q5_0: fn(PQ5_0{}); break;
    case T_Q5_1: fn(PQ5_1{}); break;
    case T_Q8_0: fn(PQ8_0{}); break;
    case T_Q4_K: fn(PQ4_K{}); break;
    case T_Q5_K: fn(PQ5_K{}); break;
    case T_Q6_K: fn(PQ6_K{}); break;
    default: TORCH_CHECK(false, "linear_packed: GGML type ", type, " is not packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K are)");
  }
}

}  // namespace

torch::Tensor linear_packed(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                            std::vector<int64_t> rows) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "linear_packed: x must be fp32");
  TORCH_CHECK(!parts.empty() && parts.size() == types.size() && parts.size() == rows.size(),
              "linear_packed: one type and row count per part");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 32 == 0, "linear_packed: K must be a multiple of 32");
  const int64_t nb = K / 32;
  std::vector<int64_t> first(parts.size() + 1, 0), gfirst(parts.size() + 1, 0);
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    with_packed(types[i], [&](auto f) {
      using F = decltype(f);
      TORCH_CHECK(p.scalar_type() == torch::kByte && p.is_contiguous() && p.dim() == 2 &&
                      K % F::QK == 0 && p.size(0) == (rows[i] + P - 1) / P && p.size(1) == K / F::QK * P * F::BYTES,
                  "linear_packed: part ", i, " is not ", rows[i], " packed rows of ", K, " weights");
    });
    first[i + 1] = first[i] + rows[i];
    gfirst[i + 1] = gfirst[i] + parts[i].size(0);
  }
  x = x.contiguous();
  const int64_t M = x.numel() / K, N = first.back();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  // the x rows, quantized once (each row on its own: a row's result does not depend on the others)
  // (plain vectors, not tensors: this runs 121 times a decode step)
  std::vector<uint8_t> records(M * nb * XB);
  std::vector<QX> qx(M);
  const float* xp = x.data_ptr<float>();
  bool many = false;  // a part takes groups_many
  for (size_t i = 0; i < parts.size(); ++i) with_packed(types[i], [&](auto f) { many = many || M >= many_rows_from<decltype(f)>(); });
  std::vector<int16_t> X16(many ? M * K : 0);  // groups_many's X = 256 xq + xr
  auto quantize = [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      qx[m] = {records.data() + m * nb * XB};
      quantize_row(xp + m * K, K, qx[m]);
      if (many)
        for (int64_t k = 0; k < K; ++k)
          X16[m * K + k] = static_cast<int16_t>(256 * qx[m].q(k / 32)[k % 32] + qx[m].r(k / 32)[k % 32]);
    }
  };
  // (each row on its own, as one row is; from 4 rows the fork is repaid: 2 us a row of 576)
  if (M >= 4) at::parallel_for(0, M, 2, quantize);
  else quantize(0, M);
  float* yp = y.data_ptr<float>();
  // x rows [m0, m1) against groups [b, e) of all parts
  const auto run = [&](int64_t m0, int64_t m1, int64_t b, int64_t e) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t lo = std::max(b, gfirst[i]), hi = std::min(e, gfirst[i + 1]);
      if (lo >= hi) continue;
      with_packed(types[i], [&](auto f) {
        using F = decltype(f);
        const uint8_t* w = parts[i].data_ptr<uint8_t>();
        if constexpr (has_many_rows<F>()) {
#if !defined(CPU_CAPABILITY_AVX512)
          if (M >= many_rows_from<F>()) {
            groups_many<F>(w, K / F::QK, rows[i], lo - gfirst[i], hi - gfirst[i], qx.data() + m0, X16.data() + m0 * K,
                           K, m1 - m0, yp + m0 * N + first[i], N);
            return;
          }
#endif
        }
        groups<F>(w, K / F::QK, rows[i], lo - gfirst[i], hi - gfirst[i], qx.data() + m0, m1 - m0,
                  yp + m0 * N + first[i], N);
      });
    }
  };
  const int64_t G = gfirst.back();
  // x's rows in slices of about 256 KB of codes, slice by slice: every group pass reads its rows' codes again, and a
  // 512-row prefill chunk's x for the 1536-wide down projection (1.5 MB) came from L3 each time (the call ran at 364
  // GFLOP/s on 2 threads against 554 for 192 rows; Zen 5, 576 x 1536 Q4_1). K = 576 takes 224 rows a slice, 1,536
  // 80, 4,096 32: a 48-row call over a 4,096-wide layer (384 KB of codes) walks them in two slices, however the
  // groups are shared out below.
  const int64_t slice = std::max<int64_t>(TBMAX, (int64_t{1} << 18) / (2 * K) / TBMAX * TBMAX);
  const int64_t slices = (M + slice - 1) / slice;
  // Up to STREAM_MAX_ROWS rows (a decode step, a verification, a serving batch's rows) stream the weights from
  // memory: each thread an equal contiguous share, in order, so that its prefetches run ahead over the whole share.
  if (M <= STREAM_MAX_ROWS) {
    at::parallel_for(0, G, 1, [&](int64_t b, int64_t e) {
      for (int64_t m0 = 0; m0 < M; m0 += slice) run(m0, std::min(M, m0 + slice), b, e);
    });
    return y;
  }
  // Past that the arithmetic is the time: groups in chunks taken as threads come free (parallel_chunks), 8 a
  // thread, slice by slice.
  parallel_chunks(slices * G, std::max<int64_t>(1, G / (8 * at::get_num_threads())), [&](int64_t b, int64_t e) {
    while (b < e) {  // (a chunk may span two slices)
      const int64_t s = b / G, g0 = b % G, g1 = std::min(G, g0 + (e - b));
      run(s * slice, std::min(M, (s + 1) * slice), g0, g1);
      b += g1 - g0;
    }
  });
  return y;
}

std::vector<int64_t> packed_many_rows_types() {
  std::vector<int64_t> out;
  for (int64_t t : {T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K})
    with_packed(t, [&](auto f) {
      if (has_many_rows<decltype(f)>()) out.push_back(t);
    });
  return out;
}

// Whether a prefill's rows (more than a verification's 64) run here too rather than through dequantized weights and
// PyTorch's GEMM: AVX-512 VNNI builds, where vpdpbusd multiplies 64 code bytes an instruction. AMD Zen 5, 2 threads,
// 512 rows, random blocks (MKL's sgemm runs AVX2 code on AMD's CPUs, 185-225 GFLOP/s; benchmarks/linear_prefill.py):
// Q4_0 / Q4_1 2.3-3.6x, Q5_1 2.1-2.5x, Q8_0 / Q4_K / Q5_0 1.75-2.15x, Q5_K / Q6_K 1.56-1.86x. Each row is then the
// decode step's bits, so a prompt's cache does not depend on its prefill's chunking. (AVX2, Zen 3: 0.77-1.10x MKL,
// not taken. Intel's AVX-512 CPUs, where MKL runs AVX-512 code: not measured.)
bool packed_prefill() { return VNNI; }

// The peak of the linear layers' arithmetic on all threads: VNNI's vpdpbusd, in operations a second (a byte product
// and its sum, 2 per product: 4 per lane and instruction, 128 per 16-lane one); 0 where the build has no VNNI. The
// peak probes' chains (threads_rate, as vector_peak_flops). A linear layer's weight times an x row takes two byte
// products (x's xq and xr planes), so its FLOPs, 2 per weight and row, run at most at half this.
double integer_peak_ops() {
  if constexpr (!VNNI) {
    return 0.0;
  } else {
    return threads_rate(double(PEAK_ITERS) * PEAK_CHAINS * W * 4 * 2, [] {
      IV acc[PEAK_CHAINS];
      for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = iset(c);
      const IV u = iset(0x01010101), v = iset(0x01FF01FF);  // products of +1 and -1: sums stay small
      for (int64_t i = 0; i < PEAK_ITERS; ++i)
        for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = dot_us(acc[c], u, v);
      int32_t total = 0;
      for (int c = 0; c < PEAK_CHAINS; ++c) total += ireduce(acc[c]);
      return double(total);
    });
  }
}

torch::Tensor unpack_rows(torch::Tensor packed, int64_t head, int64_t tail, int64_t size, int64_t start, int64_t stop) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(1) % (P * size) == 0 && head % 2 == 0 && tail % 2 == 0 && (size - head - tail) % 4 == 0 &&
                  0 <= start && start <= stop && stop <= packed.size(0) * P,
              "unpack_rows: packed [groups, blocks * 16 * size] uint8 and rows within it");
  const int64_t nb = packed.size(1) / (P * size), fields = (head + tail) / 2, words = (size - head - tail) / 4;
  auto out = torch::empty({stop - start, nb * size}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(start, stop, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t p = r % P;
      const uint8_t* g = src + r / P * packed.size(1);
      uint8_t* row = dst + (r - start) * nb * size;
      for (int64_t blk = 0; blk < nb; ++blk, g += P * size, row += size) {
        // a packed block: the 16 rows' 2-byte scale units (unit u of row p at 2 (16 u + p)), then their 4-byte
        // code words (word w of row p at 2 * 16 * fields + 4 (16 w + p)); in the row: head, words, tail
        for (int64_t u = 0; u < fields; ++u) {
          const int64_t o = 2 * u < head ? 2 * u : size - tail + 2 * u - head;
          std::memcpy(row + o, g + 2 * (P * u + p), 2);
        }
        for (int64_t w = 0; w < words; ++w) std::memcpy(row + head + 4 * w, g + 2 * P * fields + 4 * (P * w + p), 4);
      }
    }
  });
  return out;
}

}  // namespace triforce
