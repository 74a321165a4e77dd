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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t D = 64;
constexpr int64_t BS = 256;     // keys per work item: 64 KB of K plus 64 KB of V
constexpr int64_t TILE = 6;     // query rows per register tile in p v (6 x 4 zmm accumulators)
constexpr int64_t MAX_ROWS = 64;

// exp(x) for x <= 0: 2^n * 2^f with f in [-1/2, 1/2] by its Taylor polynomial (relative error < 1e-7).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

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
  // p v
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
      for (int64_t r = 0; r < nr; ++r) {
        const __m512 p = _mm512_set1_ps(s[(r0 + r) * BS + j]);
        acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o_b + (r0 + r) * D + 16 * c, acc[r][c]);
  }
}

}  // namespace

// q [H, R, 64] (any layout; copied scaled), k/v [H, S, 64] with contiguous rows, T tokens per row
// group, causal over the last T keys if `causal` -> out [H, R, 64].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t T, bool causal,
                               double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.size(2) == D && k.size(2) == D && v.size(2) == D,
              "decode_attention: q [H, R, 64], k/v [H, S, 64]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "decode_attention: fp32 only");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "decode_attention: k/v rows must be contiguous");
  const int64_t H = q.size(0), R = q.size(1), S = k.size(1);
  TORCH_CHECK(R <= MAX_ROWS && T >= 1 && R % T == 0 && S >= T && k.size(0) == H && v.size(0) == H && v.size(1) == S,
              "decode_attention: bad shapes");
  const auto qs = (q * scale).contiguous();
  const int64_t nb = (S + BS - 1) / BS;
  std::vector<float> o_part(H * nb * R * D), m_part(H * nb * R), l_part(H * nb * R);
  const float* qp = qs.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, H * nb, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(MAX_ROWS * BS);
    for (int64_t w = b; w < e; ++w) {
      const int64_t h = w / nb, blk = w % nb, j0 = blk * BS, n = std::min(BS, S - j0);
      block_attention(qp + h * R * D, kp + h * ks, vp + h * vs, R, T, j0, n, S, causal, s.data(),
                      o_part.data() + w * R * D, m_part.data() + w * R, l_part.data() + w * R);
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
        const float* ob = o_part.data() + i * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * ob[d];
      }
      for (int64_t d = 0; d < D; ++d) op[(h * R + r) * D + d] = acc[d] / l;
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "softmax(q k^T * scale) v for q [H, R, 64] over k/v [H, S, 64], causal over the last T keys if asked");
}
