// Decode attention on the CPU with AVX-512 (fp32, head dim 64), for a few query rows over a long
// KV cache: out = softmax(q k^T * scale) v, in one pass over K and V.
//
// Why: decoding reads the whole cache per token, so attention must stream it at memory bandwidth.
// PyTorch's CPU flash kernel parallelises over heads only (3 KV heads on 2 threads) and reached
// about 7 GB/s at 32K. Here the keys are split into blocks of BS, every (KV head, block) is one work
// item (flash-decoding): scores, a block-local softmax (max m_b, sum l_b) and the block's p v are
// computed while the block sits in L1/L2, and the blocks are merged by their log-sum-exp at the end.
//
// Rows are (group head, token) pairs as in model.py: row r belongs to token r % T. Masks: none, or
// causal over the last T keys (key S - T + u is visible to token t iff u <= t).
//
// Two ways to compute a block, chosen by the number of query rows R:
//  * few rows (a decode step): per row, 16 keys' dot products reduced together (hsum16); K is read
//    once per row, which is cheap for R <= a few;
//  * many rows (verifying k draft tokens, R = g * k): "rows in lanes", a small GEMM. The scores are
//    computed transposed, s[key][row], with the rows of 16 queries in the 16 lanes of a vector: per
//    head dimension d one broadcast k[key][d] times the vector q[rows][d], for a tile of keys at
//    once. Every K element is loaded once per block (not once per row) and no horizontal sums are
//    needed: at 32K, attention for 7 tokens took 2.3x that of one token instead of 3.8x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <limits>
#include <vector>

namespace triforce {
namespace {

constexpr int64_t D = 64;
constexpr int64_t BS = 256;     // keys per work item: 64 KB of K plus 64 KB of V
constexpr int64_t TILE = 6;     // query rows per register tile in p v (6 x 4 zmm accumulators)
constexpr int64_t MAX_ROWS = 64;
constexpr int64_t LANES_MIN_ROWS = 8;  // from this many rows on, the rows-in-lanes path (measured: equal at 6)

// 16 vectors -> one vector of their 16 horizontal sums, in order (a transpose-and-add tree:
// 45 shuffles/adds instead of 16 separate reductions).
inline __m512 hsum16(const __m512* t) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

// o_b [R, D] = p v for one block of n keys starting at j0, with p(r, j) = p[r * RS + j * JS] (the
// per-row path keeps scores by row, the lanes path by key; compile-time strides: runtime ones cost
// 10-20%). TILE rows at a time: 6 x 4 accumulators, V loaded once per tile. Prefetches the next
// block while the first tile runs.
template <int64_t RS, int64_t JS>
void block_pv(const float* p, const float* k, const float* v, int64_t R, int64_t j0, int64_t n, int64_t S,
              float* o_b) {
  for (int64_t r0 = 0; r0 < R; r0 += TILE) {
    const int64_t nr = std::min(TILE, R - r0);
    __m512 acc[TILE][4];
    for (int64_t r = 0; r < nr; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + (j0 + j) * D;
      if (r0 == 0 && j0 + BS + j < S) {  // stream the next block in while this one computes
        const float* kn = k + (j0 + BS + j) * D;
        const float* vn = vj + BS * D;
        for (int c = 0; c < 4; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(kn + 16 * c), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(vn + 16 * c), _MM_HINT_T1);
        }
      }
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
      const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
      const float* pj = p + r0 * RS + j * JS;
      for (int64_t r = 0; r < nr; ++r) {
        const __m512 pr = _mm512_set1_ps(pj[r * RS]);
        acc[r][0] = _mm512_fmadd_ps(pr, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(pr, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(pr, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(pr, v3, acc[r][3]);
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o_b + (r0 + r) * D + 16 * c, acc[r][c]);
  }
}

// One (head, block) work item. s: scratch [R, BS]; writes o_b [R, D], m_b [R], l_b [R].
void block_attention(const float* q, const float* k, const float* v, int64_t R, int64_t T, int64_t j0, int64_t n,
                     int64_t S, bool causal, float* s, float* o_b, float* m_b, float* l_b) {
  // scores: 16 keys at a time per row, their 16 partial-sum vectors reduced together (hsum16)
  int64_t j16 = n - n % 16;
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = q + r * D;
    const __m512 q0 = _mm512_loadu_ps(qr), q1 = _mm512_loadu_ps(qr + 16);
    const __m512 q2 = _mm512_loadu_ps(qr + 32), q3 = _mm512_loadu_ps(qr + 48);
    for (int64_t j = 0; j < j16; j += 16) {
      __m512 t[16];
      for (int i = 0; i < 16; ++i) {
        const float* kj = k + (j0 + j + i) * D;
        __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kj));
        a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kj + 16), a);
        a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kj + 32), a);
        t[i] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kj + 48), a);
      }
      _mm512_storeu_ps(s + r * BS + j, hsum16(t));
    }
    for (int64_t j = j16; j < n; ++j) {
      const float* kj = k + (j0 + j) * D;
      __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kj));
      a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kj + 16), a);
      a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kj + 32), a);
      a = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kj + 48), a);
      s[r * BS + j] = _mm512_reduce_add_ps(a);
    }
  }
  const float NEG = -std::numeric_limits<float>::infinity();
  if (causal && j0 + n > S - T) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = r % T;
      for (int64_t j = std::max<int64_t>(0, S - T + t + 1 - j0); j < n; ++j) s[r * BS + j] = NEG;
    }
  }
  // block-local softmax numerators
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * BS;
    float m = NEG;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, sr[j]);
    m_b[r] = m;
    if (m == NEG) {  // every key of this block is masked for this row
      l_b[r] = 0.f;
      for (int64_t j = 0; j < n; ++j) sr[j] = 0.f;
      continue;
    }
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 x = _mm512_loadu_ps(sr + j);
      __m512 p = exp512(_mm512_sub_ps(x, mv));
      p = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmp_ps_mask(x, _mm512_set1_ps(NEG), _CMP_NEQ_OQ), p);
      _mm512_storeu_ps(sr + j, p);
      acc = _mm512_add_ps(acc, p);
    }
    float l = _mm512_reduce_add_ps(acc);
    for (; j < n; ++j) {
      sr[j] = sr[j] == NEG ? 0.f : std::exp(sr[j] - m);
      l += sr[j];
    }
    l_b[r] = l;
  }
  block_pv<BS, 1>(s, k, v, R, j0, n, S, o_b);
}

// Rows in lanes: scores of JT keys for all NV * 16 (padded) rows. qt [D][NV*16] holds the scaled,
// transposed queries (zero in padded lanes); st [n][NV*16] receives the scores.
template <int NV, int JT>
inline void scores_lanes(const float* qt, const float* k, float* st) {
  __m512 acc[JT][NV];
  for (int jj = 0; jj < JT; ++jj)
    for (int v = 0; v < NV; ++v) acc[jj][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qt + d * NV * 16 + 16 * v);
    for (int jj = 0; jj < JT; ++jj) {
      const __m512 kb = _mm512_set1_ps(k[jj * D + d]);
      for (int v = 0; v < NV; ++v) acc[jj][v] = _mm512_fmadd_ps(kb, qv[v], acc[jj][v]);
    }
  }
  for (int jj = 0; jj < JT; ++jj)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + jj * NV * 16 + 16 * v, acc[jj][v]);
}

// One (head, block) work item on the rows-in-lanes path; same contract as block_attention, with
// qt [D][NV*16] instead of q, and st scratch [BS][NV*16].
template <int NV>
void block_attention_lanes(const float* qt, const float* k, const float* v, int64_t R, int64_t T, int64_t j0,
                           int64_t n, int64_t S, bool causal, float* st, float* o_b, float* m_b, float* l_b) {
  constexpr int RP = NV * 16;
  constexpr int JT = NV == 1 ? 16 : (NV == 2 ? 12 : (NV == 4 ? 4 : 8));  // <= 24 accumulators
  int64_t j = 0;
  for (; j + JT <= n; j += JT) scores_lanes<NV, JT>(qt, k + (j0 + j) * D, st + j * RP);
  for (; j < n; ++j) scores_lanes<NV, 1>(qt, k + (j0 + j) * D, st + j * RP);
  const float NEG = -std::numeric_limits<float>::infinity();
  if (causal && j0 + n > S - T) {
    for (int64_t jj = std::max<int64_t>(0, S - T - j0); jj < n; ++jj) {
      const int64_t u = j0 + jj - (S - T);  // the key is new token u: visible to rows of tokens >= u
      for (int64_t r = 0; r < R; ++r)
        if (r % T < u) st[jj * RP + r] = NEG;
    }
  }
  // block-local softmax numerators, 16 rows per vector
  __m512 m[NV], l[NV];
  for (int w = 0; w < NV; ++w) {
    m[w] = _mm512_set1_ps(NEG);
    l[w] = _mm512_setzero_ps();
  }
  for (int64_t jj = 0; jj < n; ++jj)
    for (int w = 0; w < NV; ++w) m[w] = _mm512_max_ps(m[w], _mm512_loadu_ps(st + jj * RP + 16 * w));
  __m512 ms[NV];  // fully masked rows (m = -inf) subtract 0 instead; their p are zeroed below
  for (int w = 0; w < NV; ++w)
    ms[w] = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmp_ps_mask(m[w], _mm512_set1_ps(NEG), _CMP_NEQ_OQ), m[w]);
  for (int64_t jj = 0; jj < n; ++jj)
    for (int w = 0; w < NV; ++w) {
      const __m512 x = _mm512_loadu_ps(st + jj * RP + 16 * w);
      __m512 p = exp512(_mm512_sub_ps(x, ms[w]));
      p = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmp_ps_mask(x, _mm512_set1_ps(NEG), _CMP_NEQ_OQ), p);
      _mm512_storeu_ps(st + jj * RP + 16 * w, p);
      l[w] = _mm512_add_ps(l[w], p);
    }
  float mt[RP], lt[RP];
  for (int w = 0; w < NV; ++w) {
    _mm512_storeu_ps(mt + 16 * w, m[w]);
    _mm512_storeu_ps(lt + 16 * w, l[w]);
  }
  for (int64_t r = 0; r < R; ++r) {
    m_b[r] = mt[r];
    l_b[r] = lt[r];
  }
  block_pv<1, RP>(st, k, v, R, j0, n, S, o_b);
}

}  // namespace

// q [H, R, 64] (any layout; copied scaled), k/v [H, S, 64] with contiguous rows, T tokens per row
// group, causal over the last T keys if `causal` -> out [H, R, 64]. path: 0 chooses by R, 1 forces
// the per-row path, 2 the rows-in-lanes path (for tests and measurements).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t T, bool causal,
                               double scale, int64_t path) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.size(2) == D && k.size(2) == D && v.size(2) == D,
              "decode_attention: q [H, R, 64], k/v [H, S, 64]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "decode_attention: fp32 only");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "decode_attention: k/v rows must be contiguous");
  const int64_t H = q.size(0), R = q.size(1), S = k.size(1);
  TORCH_CHECK(R <= MAX_ROWS && T >= 1 && R % T == 0 && S >= T && k.size(0) == H && v.size(0) == H && v.size(1) == S,
              "decode_attention: bad shapes");
  const bool lanes = path == 2 || (path == 0 && R >= LANES_MIN_ROWS);
  const int64_t NV = (R + 15) / 16, RP = NV * 16;
  // per-row path: q scaled [H, R, D]; lanes path: q scaled, transposed and zero-padded [H, D, RP]
  const auto qs = lanes ? torch::constant_pad_nd((q * scale).transpose(1, 2), {0, RP - R}).contiguous()
                        : (q * scale).contiguous();
  const int64_t nb = (S + BS - 1) / BS;
  // per-block partial results (not zero-filled: every block writes all of its rows)
  const auto parts = torch::empty({H * nb * R * (D + 2)}, q.options());
  float* const o_part = parts.data_ptr<float>();
  float* const m_part = o_part + H * nb * R * D;
  float* const l_part = m_part + H * nb * R;
  const float* qp = qs.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(MAX_ROWS * BS);
    for (int64_t w = b; w < e; ++w) {
      const int64_t h = w / nb, blk = w % nb, j0 = blk * BS, n = std::min(BS, S - j0);
      float* ob = o_part + w * R * D;
      float* mb = m_part + w * R;
      float* lb = l_part + w * R;
      const float* qh = qp + h * R * D;
      if (!lanes) {
        block_attention(qh, kp + h * ks, vp + h * vs, R, T, j0, n, S, causal, s.data(), ob, mb, lb);
        continue;
      }
      qh = qp + h * D * RP;
      switch (NV) {
        case 1: block_attention_lanes<1>(qh, kp + h * ks, vp + h * vs, R, T, j0, n, S, causal, s.data(), ob, mb, lb); break;
        case 2: block_attention_lanes<2>(qh, kp + h * ks, vp + h * vs, R, T, j0, n, S, causal, s.data(), ob, mb, lb); break;
        case 3: block_attention_lanes<3>(qh, kp + h * ks, vp + h * vs, R, T, j0, n, S, causal, s.data(), ob, mb, lb); break;
        default: block_attention_lanes<4>(qh, kp + h * ks, vp + h * vs, R, T, j0, n, S, causal, s.data(), ob, mb, lb);
      }
    }
  });
  auto out = torch::empty({H, R, D}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t blk = 0; blk < nb; ++blk) m = std::max(m, m_part[(h * nb + blk) * R + r]);
      float l = 0.f, acc[D] = {0.f};
      for (int64_t blk = 0; blk < nb; ++blk) {
        const int64_t i = (h * nb + blk) * R + r;
        if (l_part[i] == 0.f) continue;
        const float w = std::exp(m_part[i] - m);
        l += w * l_part[i];
        const float* ob = o_part + i * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * ob[d];
      }
      for (int64_t d = 0; d < D; ++d) op[(h * R + r) * D + d] = acc[d] / l;
    }
  }
  return out;
}

}  // namespace triforce
