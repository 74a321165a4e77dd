// y = x W^T with W kept in GGML block formats, exactly as a GGUF file stores it (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, the K-quants Q4_K, Q5_K, Q6_K, and F16 / BF16), for a few rows of fp32 x (a decode
// step, or the verification of a few drafts). Each 32-weight sub-block is dequantized in registers
// (NV vectors) to the values gguf.quants.dequantize gives (exactly for Q4_0, Q5_0, Q8_0, Q6_K, F16,
// BF16; within one rounding for the formats with a min, whose d * q + m is one fma here) and
// multiplied into fp32 accumulators: the arithmetic is the dequantized fp32 model's, in another
// summation order, while the bytes read are the file's (4.5 bits per weight for Q4_K instead of 32).
//
// Work split: output rows (a weight row is a run of blocks, contiguous) across threads; within a
// thread, R rows at a time against TB rows of x, all TB x rows before the next weight row, so a
// weight row is fetched from memory once however many x rows there are (re-dequantized from L1 for
// each further group of TB x rows). R > 1 gives a single x row independent accumulation chains.
// One source over simd.h's Vec for AVX2 and AVX-512. (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights that model.QuantLinear
// has repacked go through quant_packed.cpp's integer kernel instead: 2x faster at one row of x.)
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"
#include "simd.h"

#ifndef TRIFORCE_QPF
#define TRIFORCE_QPF 1024
#endif

namespace triforce {
namespace {

// The formats' prepare / sub are always inlined into the tile loop (simd.h's ALWAYS_INLINE): GCC left Q4_1's
// sub a call in the AVX2 build (weights through memory, 1.5x slower with 5 rows of x).

constexpr int NV = 32 / W;  // vectors per 32-weight sub-block: 4 (AVX2) or 2 (AVX-512)

// Integer lanes of one vector (simd.h's IV), and the further operations the formats need.
#if defined(CPU_CAPABILITY_AVX512)
inline IV widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IV widen_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IV srlv(IV a, IV n) { return _mm512_srlv_epi32(a, n); }
inline IV lanes() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline Vec iota() { return _mm512_cvtepi32_ps(lanes()); }  // 0, 1, ..., 15
inline Vec lookup(IV idx, const Vec& table) { return _mm512_permutexvar_ps(idx, table); }  // table[idx & 15]
#else
inline IV widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IV widen_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IV srlv(IV a, IV n) { return _mm256_srlv_epi32(a, n); }
inline IV lanes() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline Vec iota() { return _mm256_cvtepi32_ps(lanes()); }  // (the 16-entry lookups are AVX-512 only)
inline Vec lookup(IV, const Vec& table) { return table; }
#endif

inline float f16(const uint8_t* p) {  // an fp16 scale: one F16C instruction (c10::Half's conversion is ~15 integer ops)
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Each format: QK weights in BYTES bytes per block, SUBS = QK / 32 sub-blocks. prepare(b) decodes a
// block's scales (State); sub(b, st, s, w) puts weights 32 s .. 32 s + 31 in w[0 .. NV). (No
// callbacks: with the accumulators captured by a lambda GCC kept them in memory, halving the speed.)
// Byte layouts: ggml-common.h (block_q4_0 ...), the same as gguf.quants reads.

struct Q8_0 {  // d (f16), 32 int8: w = d q
  static constexpr int QK = 32, BYTES = 34, SUBS = 1;
  struct State { Vec d; };
  ALWAYS_INLINE static State prepare(const uint8_t* b) { return {Vec(f16(b))}; }
  ALWAYS_INLINE static void sub(const uint8_t* b, const State& st, int, Vec* w) {
    for (int j = 0; j < NV; ++j) w[j] = tof(widen_i8(b + 2 + j * W)) * st.d;
  }
};

// Q4_0 / Q4_1 / Q5_0 / Q5_1: 16 bytes of nibbles, element i < 16 the low nibble of byte i, element
// i + 16 its high nibble; Q5 adds bit i of a 32-bit qh as bit 4. w = d q + c (c = -8 d, m, -16 d, m).
template <int HEAD, bool MIN, bool HIGH, int OFFSET>
struct Nibbles32 {
  static constexpr int QK = 32, BYTES = HEAD + (HIGH ? 4 : 0) + 16, SUBS = 1;
  // AVX-512, 4-bit codes: the 16 values d q + c of the block as one vector, indexed by the codes
  // (vpermps reads the low 4 bits of each lane: no masking, no int-to-float conversion)
  static constexpr bool LUT = W == 16 && !HIGH;
  struct State { Vec d, c, table; };
  ALWAYS_INLINE static State prepare(const uint8_t* b) {
    uint32_t head;  // d, and the min of Q4_1 / Q5_1: converted together (one F16C instruction)
    std::memcpy(&head, b, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(head)));
    const Vec d = Vec(_mm_cvtss_f32(dm));
    const Vec c = MIN ? Vec(_mm_cvtss_f32(_mm_movehdup_ps(dm))) : d * Vec(static_cast<float>(-OFFSET));
    return {d, c, LUT ? fma(iota(), d, c) : d};
  }
  ALWAYS_INLINE static void sub(const uint8_t* b, const State& st, int, Vec* w) {
    const uint8_t* qs = b + HEAD + (HIGH ? 4 : 0);
    if constexpr (LUT) {
      const IV v = widen_u8(qs);
      w[0] = lookup(v, st.table);
      w[1] = lookup(srl(v, 4), st.table);
      return;
    }
    const IV lo4 = iset(15);
    for (int h = 0; h < NV / 2; ++h) {
      const IV v = widen_u8(qs + h * W);
      IV ql = iand(v, lo4), qh = srl(v, 4);
      if constexpr (HIGH) {
        uint32_t bits;
        std::memcpy(&bits, b + HEAD, 4);
        const IV all = iset(static_cast<int>(bits)), one = iset(1);
        ql = ior(ql, sll4(iand(srlv(all, ior(lanes(), iset(h * W))), one)));
        qh = ior(qh, sll4(iand(srlv(all, ior(lanes(), iset(16 + h * W))), one)));
      }
      w[h] = fma(tof(ql), st.d, st.c);
      w[h + NV / 2] = fma(tof(qh), st.d, st.c);
    }
  }
};
using Q4_0 = Nibbles32<2, false, false, 8>;
using Q4_1 = Nibbles32<4, true, false, 0>;
using Q5_0 = Nibbles32<2, false, true, 16>;
using Q5_1 = Nibbles32<4, true, true, 0>;

// The 6-bit scales and mins of Q4_K / Q5_K's 8 sub-blocks (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: d, dmin (f16), 12 bytes of scales/mins, [Q5: 32 bytes qh], 128 bytes qs. Sub-block s:
// the low nibbles of qs[32 (s / 2) ..] for even s, the high ones for odd s; Q5 adds bit s of qh[l]
// as bit 4. w = (d sc_s) q - dmin m_s.
template <bool HIGH>
struct KQuant45 {
  static constexpr int QK = 256, BYTES = 4 + 12 + (HIGH ? 32 : 0) + 128, SUBS = 8;
  struct State { float a[8], c[8]; };
  ALWAYS_INLINE static State prepare(const uint8_t* b) {
    State st;
    const float d = f16(b), dmin = f16(b + 2);
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      scale_min_k4(b + 4, s, sc, m);
      st.a[s] = d * sc;
      st.c[s] = -(dmin * m);
    }
    return st;
  }
  ALWAYS_INLINE static void sub(const uint8_t* b, const State& st, int s, Vec* w) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 16 + (HIGH ? 32 : 0) + 32 * (s / 2);
    const Vec a(st.a[s]), c(st.c[s]);
    if constexpr (W == 16 && !HIGH) {  // AVX-512 Q4_K: the sub-block's 16 values, indexed by the codes (Nibbles32)
      const Vec table = fma(iota(), a, c);
      for (int j = 0; j < NV; ++j) {
        const IV v = widen_u8(qs + j * W);
        w[j] = lookup(s % 2 ? srl(v, 4) : v, table);
      }
      return;
    }
    for (int j = 0; j < NV; ++j) {
      const IV v = widen_u8(qs + j * W);
      IV q = s % 2 ? srl(v, 4) : iand(v, iset(15));
      if constexpr (HIGH) q = ior(q, sll4(iand(srl(widen_u8(qh + j * W), s), iset(1))));
      w[j] = fma(tof(q), a, c);
    }
  }
};
using Q4_K = KQuant45<false>;
using Q5_K = KQuant45<true>;

// Q6_K: ql (128 bytes), qh (64), 16 int8 scales, d (f16). Half n (128 weights), part i (32 weights,
// sub-block 4n + i): low 4 bits from ql[64n + 32 (i & 1) + l] (high nibble when i >= 2), bits 4-5
// from qh[32n + l] >> 2i; q - 32, times d * scale of its 16-weight group (sub-block s: groups 2s, 2s+1).
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210, SUBS = 8;
  struct State { float ds[16]; };
  ALWAYS_INLINE static State prepare(const uint8_t* b) {
    State st;
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 16; ++g) st.ds[g] = d * static_cast<float>(sc[g]);
    return st;
  }
  ALWAYS_INLINE static void sub(const uint8_t* b, const State& st, int s, Vec* w) {
    const int n = s / 4, i = s % 4;
    for (int j = 0; j < NV; ++j) {
      IV l = widen_u8(b + 64 * n + 32 * (i & 1) + j * W);
      l = i >= 2 ? srl(l, 4) : iand(l, iset(15));
      const IV h = iand(srl(widen_u8(b + 128 + 32 * n + j * W), 2 * i), iset(3));
#if defined(CPU_CAPABILITY_AVX512)
      const IV q = _mm512_sub_epi32(ior(l, sll4(h)), iset(32));
#else
      const IV q = _mm256_sub_epi32(ior(l, sll4(h)), iset(32));
#endif
      w[j] = tof(q) * Vec(st.ds[2 * s + (j * W) / 16]);  // W = 8: two vectors per group; W = 16: one
    }
  }
};

template <typename Half>
struct Plain16 {  // F16 / BF16, taken 32 at a time
  static constexpr int QK = 32, BYTES = 64, SUBS = 1;
  struct State {};
  ALWAYS_INLINE static State prepare(const uint8_t*) { return {}; }
  ALWAYS_INLINE static void sub(const uint8_t* b, const State&, int, Vec* w) {
    for (int j = 0; j < NV; ++j) w[j] = load(reinterpret_cast<const Half*>(b) + j * W);
  }
};
using F16 = Plain16<c10::Half>;
using BF16 = Plain16<c10::BFloat16>;

constexpr int64_t PF_BYTES = TRIFORCE_QPF;  // prefetch distance (bytes ahead in a weight row)
constexpr int TBMAX = W == 16 ? 12 : 8;  // rows of x per pass: TBMAX accumulators + NV weights in registers

// y[t * ldy + r] = x[t] . row r, for R consecutive weight rows and TB rows of x. One accumulator per
// (row, x row); R rows give a single x row R independent chains.
template <class F, int R, int TB>
inline void tile(const float* x, int64_t K, const uint8_t* rows, int64_t row_bytes, float* y, int64_t ldy) {
  Vec acc[R][TB];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = Vec(0.f);
  const int64_t nb = K / F::QK;
  // One 64-byte line per row every EVERY blocks (all LINES of a block), PF_BYTES ahead: the
  // dequantization work per byte keeps few loads in flight, and the hardware prefetcher alone
  // streamed the weights from DRAM at well under half the bandwidth.
  constexpr int EVERY = F::BYTES >= 64 ? 1 : 64 / F::BYTES;
  constexpr int LINES = (F::BYTES + 63) / 64;
  int until_prefetch = 0;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b0 = rows + blk * F::BYTES;
    if (until_prefetch-- == 0) {
      until_prefetch = EVERY - 1;
      for (int r = 0; r < R; ++r)
        for (int l = 0; l < LINES; ++l) prefetch_l2(b0 + r * row_bytes + PF_BYTES + 64 * l);
    }
    typename F::State st[R];
    for (int r = 0; r < R; ++r) st[r] = F::prepare(b0 + r * row_bytes);
    const float* xb = x + blk * F::QK;
    for (int s = 0; s < F::SUBS; ++s)
      for (int r = 0; r < R; ++r) {
        Vec w[NV];
        F::sub(b0 + r * row_bytes, st[r], s, w);
        for (int j = 0; j < NV; ++j)
          for (int t = 0; t < TB; ++t) acc[r][t] = fma(w[j], load(xb + t * K + s * 32 + j * W), acc[r][t]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TB; ++t) y[t * ldy + r] = reduce_add(acc[r][t]);
}

// Weight rows [n0, n1) of one part against all M rows of x.
template <class F, int TB>
void rows_group(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                float* y, int64_t ldy) {
  // R weight rows at once: R x TB accumulators, enough independent fma chains (each takes NV fmas per
  // sub-block) to keep both fma ports busy, within the registers (AVX-512: 5 rows of x on 1 weight row
  // were latency-bound, 2 weight rows 1.3x faster)
  constexpr int R = TB == 1 ? 4 : (TB <= (W == 16 ? 6 : 4) ? 2 : 1);
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<F, R, TB>(x, K, w + n * row_bytes, row_bytes, y + n, ldy);
  for (; n < n1; ++n) tile<F, 1, TB>(x, K, w + n * row_bytes, row_bytes, y + n, ldy);
}

template <class F>
void rows_all(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
              float* y, int64_t ldy) {
  // A chunk of weight rows at a time (small enough to stay in L2), every group of x rows over it.
  constexpr int64_t CHUNK = 16;
  for (int64_t c = n0; c < n1; c += CHUNK) {
    const int64_t e = std::min(n1, c + CHUNK);
    for (int64_t r = 0; r < M; r += TBMAX) {
      const float* xr = x + r * K;
      float* yr = y + r * ldy;
      switch (std::min<int64_t>(TBMAX, M - r)) {
        case 1: rows_group<F, 1>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 2: rows_group<F, 2>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 3: rows_group<F, 3>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 4: rows_group<F, 4>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 5: rows_group<F, 5>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 6: rows_group<F, 6>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 7: rows_group<F, 7>(xr, K, w, row_bytes, c, e, yr, ldy); break;
#if defined(CPU_CAPABILITY_AVX512)
        case 8: rows_group<F, 8>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 9: rows_group<F, 9>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 10: rows_group<F, 10>(xr, K, w, row_bytes, c, e, yr, ldy); break;
        case 11: rows_group<F, 11>(xr, K, w, row_bytes, c, e, yr, ldy); break;
#endif
        default: rows_group<F, TBMAX>(xr, K, w, row_bytes, c, e, yr, ldy);
      }
    }
  }
}

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t { T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13,
                 T_Q6_K = 14, T_BF16 = 30 };

// Calls fn.template operator()<Format>() for the format of `type`.
template <class Fn>
void with_format(int64_t type, Fn&& fn) {
  switch (type) {
    case T_F16: fn(F16{}); break;
    case T_BF16: fn(BF16{}); break;
    case T_Q4_0: fn(Q4_0{}); break;
    case T_Q4_1: fn(Q4_1{}); break;
    case T_Q5_0: fn(Q5_0{}); break;
    case T_Q5_1: fn(Q5_1{}); break;
    case T_Q8_0: fn(Q8_0{}); break;
    case T_Q4_K: fn(Q4_K{}); break;
    case T_Q5_K: fn(Q5_K{}); break;
    case T_Q6_K: fn(Q6_K{}); break;
    default: TORCH_CHECK(false, "quantized weights: GGML type ", type, " has no kernel");
  }
}

// K of a raw [N, row_bytes] tensor of `type`.
int64_t row_length(int64_t type, int64_t row_bytes) {
  int64_t k = 0;
  with_format(type, [&](auto f) {
    using F = decltype(f);
    TORCH_CHECK(row_bytes % F::BYTES == 0, "quantized weights: a row of ", row_bytes, " bytes is not whole blocks");
    k = row_bytes / F::BYTES * F::QK;
  });
  return k;
}

}  // namespace

torch::Tensor linear_quant(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "linear_quant: x must be fp32");
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "linear_quant: one type per part");
  const int64_t K = x.size(-1);
  std::vector<int64_t> first(parts.size() + 1, 0);  // output column of each part's first row
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    TORCH_CHECK(p.scalar_type() == torch::kByte && p.dim() == 2 && p.is_contiguous(),
                "linear_quant: parts are contiguous uint8 [N, row_bytes]");
    TORCH_CHECK(row_length(types[i], p.size(1)) == K, "linear_quant: part ", i, " has rows of ",
                row_length(types[i], p.size(1)), " weights, x has ", K);
    first[i + 1] = first[i] + p.size(0);
  }
  x = x.contiguous();
  const int64_t M = x.numel() / K, N = first.back();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads take ranges of the concatenated output rows; a range may span parts.
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t lo = std::max(b, first[i]), hi = std::min(e, first[i + 1]);
      if (lo >= hi) continue;
      const uint8_t* w = parts[i].data_ptr<uint8_t>();
      const int64_t rb = parts[i].size(1);
      with_format(types[i], [&](auto f) {
        rows_all<decltype(f)>(xp, M, K, w, rb, lo - first[i], hi - first[i], yp + first[i], N);
      });
    }
  });
  return y;
}

torch::Tensor dequantize_rows(torch::Tensor raw, int64_t type) {
  TORCH_CHECK(raw.scalar_type() == torch::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "dequantize_rows: raw is contiguous uint8 [N, row_bytes]");
  const int64_t N = raw.size(0), rb = raw.size(1), K = row_length(type, rb);
  auto out = torch::empty({N, K}, torch::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  with_format(type, [&](auto f) {
    using F = decltype(f);
    at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n)
        for (int64_t blk = 0; blk < K / F::QK; ++blk) {
          float* o = dst + n * K + blk * F::QK;
          const uint8_t* b = src + n * rb + blk * F::BYTES;
          const typename F::State st = F::prepare(b);
          for (int s = 0; s < F::SUBS; ++s) {
            Vec w[NV];
            F::sub(b, st, s, w);
            for (int j = 0; j < NV; ++j) w[j].store(o + s * 32 + j * W);
          }
        }
    });
  });
  return out;
}

}  // namespace triforce
