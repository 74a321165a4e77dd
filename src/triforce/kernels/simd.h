// The vector type every CPU kernel is written over: PyTorch's at::vec::Vectorized<float>, which this
// source is compiled with once per ISA (kernels/__init__.py): -DCPU_CAPABILITY_AVX2 gives 8 lanes
// in 16 registers, -DCPU_CAPABILITY_AVX512 16 lanes in 32 registers. Kernels size their register
// tiles from W and REGS below, so one source serves both. The few operations at::vec does not offer
// (horizontal sums of W vectors at once, an exp accurate to 1e-7) are here, with one short
// intrinsic body per ISA where needed.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#error "the triforce kernels are built with -DCPU_CAPABILITY_AVX2 or -DCPU_CAPABILITY_AVX512 (kernels/__init__.py)"
#endif

namespace triforce {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;
constexpr int W = Vec::size();          // fp32 lanes per vector: 8 (AVX2) or 16 (AVX-512)
constexpr int REGS = W == 16 ? 32 : 16;  // vector registers: tiles keep their accumulators within these
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

#if defined(CPU_CAPABILITY_AVX512)
constexpr const char* ISA = "avx512";
#else
constexpr const char* ISA = "avx2";
#endif

// W consecutive values, widened to fp32 (bf16: a shift; fp16: vcvtph2ps, F16C).
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {
  Vec o;
  at::vec::load_fp32_from_bf16(p, o);
  return o;
}
inline Vec load(const c10::Half* p) {
  Vec o;
  at::vec::load_fp32_from_fp16(p, o);
  return o;
}

inline Vec fma(const Vec& a, const Vec& b, const Vec& c) { return at::vec::fmadd(a, b, c); }

// (the quantized-weight kernels keep their per-format decoders inlined into their tile loops: GCC otherwise
// left some as calls, with the accumulators through memory)
#define ALWAYS_INLINE __attribute__((always_inline)) inline

// W int32 lanes, raw, and the few operations both quantized-weight kernels take from them.
#if defined(CPU_CAPABILITY_AVX512)
using IV = __m512i;
ALWAYS_INLINE IV iset(int v) { return _mm512_set1_epi32(v); }
ALWAYS_INLINE IV iand(IV a, IV b) { return _mm512_and_si512(a, b); }
ALWAYS_INLINE IV ior(IV a, IV b) { return _mm512_or_si512(a, b); }
ALWAYS_INLINE IV srl(IV a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
ALWAYS_INLINE IV sll4(IV a) { return _mm512_slli_epi32(a, 4); }
ALWAYS_INLINE Vec tof(IV a) { return _mm512_cvtepi32_ps(a); }
#else
using IV = __m256i;
ALWAYS_INLINE IV iset(int v) { return _mm256_set1_epi32(v); }
ALWAYS_INLINE IV iand(IV a, IV b) { return _mm256_and_si256(a, b); }
ALWAYS_INLINE IV ior(IV a, IV b) { return _mm256_or_si256(a, b); }
ALWAYS_INLINE IV srl(IV a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
ALWAYS_INLINE IV sll4(IV a) { return _mm256_slli_epi32(a, 4); }
ALWAYS_INLINE Vec tof(IV a) { return _mm256_cvtepi32_ps(a); }
#endif

// Byte and word operations on IV: the quantized caches' and weights' integer dot products.
#if defined(CPU_CAPABILITY_AVX512)
ALWAYS_INLINE IV izero() { return _mm512_setzero_si512(); }
ALWAYS_INLINE IV iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
ALWAYS_INLINE IV bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
ALWAYS_INLINE IV low_nibbles(IV v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
ALWAYS_INLINE IV high_nibbles(IV v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
ALWAYS_INLINE IV bytes_and(IV a, int c) { return _mm512_and_si512(a, _mm512_set1_epi8(static_cast<char>(c))); }
ALWAYS_INLINE IV srl16(IV a, int n) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)); }
ALWAYS_INLINE IV sll16_4(IV a) { return _mm512_slli_epi16(a, 4); }
ALWAYS_INLINE IV iadd(IV a, IV b) { return _mm512_add_epi32(a, b); }
ALWAYS_INLINE IV times254(IV a) { return _mm512_mullo_epi32(a, _mm512_set1_epi32(254)); }
// (a & m) | (b & ~m), bitwise
ALWAYS_INLINE IV bit_select(IV a, IV b, IV m) { return _mm512_ternarylogic_epi32(a, b, m, 0xE4); }
#if defined(__AVX512VNNI__)  // (kernels/__init__.py adds -mavx512vnni where the CPU has it)
constexpr bool VNNI = true;
// The VNNI dot products in inline assembly, accumulating in place: through the intrinsics GCC 12 copied every
// accumulator to a second register in each iteration of the attention's tile loops (vmovdqa64 beside each
// vpdpwssd: 138 moves in group_pv, 76 after). Zen 5, int8 cache at 32K: 15 attention rows 5-12% faster, a 5-token
// verification forward 9% (docs/performance.md).
// acc + per lane sum of 4 products: unsigned bytes of u times signed bytes of s
ALWAYS_INLINE IV dot_us(IV acc, IV u, IV s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
// 4-bit codes: the same into a block accumulator that nibble_sum turns into int32 lanes (here it already is)
ALWAYS_INLINE IV dot_nibbles(IV acc, IV u, IV s) { return dot_us(acc, u, s); }
ALWAYS_INLINE IV nibble_sum(IV acc) { return acc; }
// acc + per lane sum of 2 products of signed 16-bit words (exact)
ALWAYS_INLINE IV dot_words(IV acc, IV a, IV b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#else
constexpr bool VNNI = false;
ALWAYS_INLINE IV dot_us(IV acc, IV u, IV s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
// 4-bit codes (Q4_K): pairs of products (each within 2 * 15 * 127) summed in 16 bits over up to 8 words
// (within 30480), widened to int32 lanes once per block by nibble_sum
ALWAYS_INLINE IV dot_nibbles(IV acc, IV u, IV s) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s)); }
ALWAYS_INLINE IV nibble_sum(IV acc) { return _mm512_madd_epi16(acc, _mm512_set1_epi16(1)); }
ALWAYS_INLINE IV dot_words(IV acc, IV a, IV b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
// 2 W bytes -> 2 W zero-extended 16-bit words
ALWAYS_INLINE IV widen_bytes(const __m256i& b) { return _mm512_cvtepu8_epi16(b); }
ALWAYS_INLINE __m256i lower_half(IV a) { return _mm512_castsi512_si256(a); }
ALWAYS_INLINE __m256i upper_half(IV a) { return _mm512_extracti64x4_epi64(a, 1); }
ALWAYS_INLINE IV isub16(IV a, IV b) { return _mm512_sub_epi16(a, b); }
ALWAYS_INLINE IV iset16(int v) { return _mm512_set1_epi16(static_cast<short>(v)); }
ALWAYS_INLINE IV bcast8(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}
// the sums of adjacent int32 lanes of a then b, in order: W lanes
ALWAYS_INLINE IV pair_sums(IV a, IV b) {
  const IV even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b),
                          _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b));
}
#else
ALWAYS_INLINE IV izero() { return _mm256_setzero_si256(); }
ALWAYS_INLINE IV iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
ALWAYS_INLINE IV bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
ALWAYS_INLINE IV low_nibbles(IV v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
ALWAYS_INLINE IV high_nibbles(IV v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
ALWAYS_INLINE IV bytes_and(IV a, int c) { return _mm256_and_si256(a, _mm256_set1_epi8(static_cast<char>(c))); }
ALWAYS_INLINE IV srl16(IV a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
ALWAYS_INLINE IV sll16_4(IV a) { return _mm256_slli_epi16(a, 4); }
ALWAYS_INLINE IV iadd(IV a, IV b) { return _mm256_add_epi32(a, b); }
ALWAYS_INLINE IV times254(IV a) { return _mm256_mullo_epi32(a, _mm256_set1_epi32(254)); }
ALWAYS_INLINE IV bit_select(IV a, IV b, IV m) { return _mm256_or_si256(_mm256_and_si256(a, m), _mm256_andnot_si256(m, b)); }
constexpr bool VNNI = false;
// vpmaddubsw saturates pairs at 16 bits: 6-bit codes (Q6_K) keep a pair within 2 * 63 * 127
ALWAYS_INLINE IV dot_us(IV acc, IV u, IV s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
// 4-bit codes (Q4_K): pairs of products (each within 2 * 15 * 127) summed in 16 bits over up to 8 words
// (within 30480), widened to int32 lanes once per block by nibble_sum
ALWAYS_INLINE IV dot_nibbles(IV acc, IV u, IV s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
ALWAYS_INLINE IV nibble_sum(IV acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
ALWAYS_INLINE IV dot_words(IV acc, IV a, IV b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
ALWAYS_INLINE IV widen_bytes(const __m128i& b) { return _mm256_cvtepu8_epi16(b); }
ALWAYS_INLINE __m128i lower_half(IV a) { return _mm256_castsi256_si128(a); }
ALWAYS_INLINE __m128i upper_half(IV a) { return _mm256_extracti128_si256(a, 1); }
ALWAYS_INLINE IV isub16(IV a, IV b) { return _mm256_sub_epi16(a, b); }
ALWAYS_INLINE IV iset16(int v) { return _mm256_set1_epi16(static_cast<short>(v)); }
ALWAYS_INLINE IV bcast8(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_set1_epi64x(v);
}
ALWAYS_INLINE IV pair_sums(IV a, IV b) { return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8); }
#endif

// max without NaN propagation (at::vec::maximum adds a NaN check per call; scores are never NaN)
inline Vec vmax(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(a, b);
#else
  return _mm256_max_ps(a, b);
#endif
}

// x rounded to the nearest bf16 (ties to even), kept as fp32: the rounding c10::BFloat16 and the AMX / AVX512-BF16
// conversions do, for finite x (attention's queries and probabilities, never NaN).
inline Vec round_bf16(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
#else
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
#endif
}
inline float round_bf16(float x) { return static_cast<float>(c10::BFloat16(x)); }

// where(keep, x, 0) for a comparison mask `keep` (all-ones lanes)
inline Vec select(const Vec& keep, const Vec& x) { return Vec::blendv(Vec(0.f), x, keep); }

inline float reduce_add(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
}

// W vectors -> one vector of their W horizontal sums, in order: a transpose-and-add tree
// (AVX-512: 45 shuffles/adds instead of 16 separate reductions; AVX2: 6 hadds, 2 permutes, 1 add).
inline Vec hsum_lanes(const Vec* t) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = t[2 * i], b = t[2 * i + 1];
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
#else
  const __m256 a0 = _mm256_hadd_ps(t[0], t[1]), a1 = _mm256_hadd_ps(t[2], t[3]);
  const __m256 a2 = _mm256_hadd_ps(t[4], t[5]), a3 = _mm256_hadd_ps(t[6], t[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // lanes: sums of 0-3 | 4-7 halves
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
using Reg = __m512;
#else
using Reg = __m256;
#endif

// r[i] = column i of the W x W fp32 block at `in` (row stride ld): an unpack / shuffle transpose in registers.
inline void transpose_lanes(const float* in, int64_t ld, Reg (&r)[W]) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ld);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 16; i += 8)
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
  }
#else
  __m256 t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x20);
    t[k + 4] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
#endif
}

// exp(x) for x <= 88 (larger x overflow to inf), x < -87 taken as -87: 2^n * e^f with
// f = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts, Cody-Waite) by its Taylor polynomial
// (relative error about 1e-7; at::vec's exp_u20 is within 20 ulp, Sleef's exp is a library call).
// e^f * 2^n for |f| <= ln 2 / 2 and integral n: f's Taylor polynomial, scaled through the exponent bits.
inline Vec exp_reduced(const Vec& f, const Vec& n) {
  Vec p(1.0f / 5040);
  p = fma(p, f, Vec(1.0f / 720));
  p = fma(p, f, Vec(1.0f / 120));
  p = fma(p, f, Vec(1.0f / 24));
  p = fma(p, f, Vec(1.0f / 6));
  p = fma(p, f, Vec(0.5f));
  p = fma(p, f, Vec(1.0f));
  p = fma(p, f, Vec(1.0f));
  const IVec e = (at::vec::convert_to_int_of_same_size(n) + IVec(127)) << IVec(23);  // 2^n as float bits
  return p * at::vec::cast<float>(e);
}

inline Vec exp(Vec x) {
  x = vmax(x, Vec(-87.0f));
  const Vec n = (x * Vec(1.4426950408889634f)).round();
  return exp_reduced(fma(n, Vec(2.12194440e-4f), fma(n, Vec(-0.693359375f), x)), n);
}

// 2^x for x <= 0 (x < -126 taken as -126: 2^-126, the caller's p are relative to their block's maximum):
// 2^n * 2^f, n = round(x), f = x - n in [-1/2, 1/2] exactly, 2^f = e^(f ln 2) by the Taylor polynomial of exp
// (relative error about 1e-7). A bf16 cache's softmax works in base 2 (attention.cpp, run()).
inline Vec exp2(Vec x) {
  x = vmax(x, Vec(-126.0f));
  const Vec n = x.round();
  return exp_reduced((x - n) * Vec(0.6931471805599453f), n);
}

// Store the first `count` lanes (all when count >= W; none when count <= 0).
inline void store(const Vec& v, float* p, int64_t count) {
  if (count >= W)
    v.store(p);
  else if (count > 0)
    v.store(p, count);
}

inline void prefetch_l2(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
inline void prefetch_l1(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

}  // namespace triforce
