// The small operations of a decoder layer, each fused into one pass. At decode time a layer's
// tensors are a few KB, so PyTorch's cost per operation (dispatch, temporaries, threading) is the
// whole cost: RMSNorm as pow/mean/add/rsqrt/mul and RoPE as split/neg/cat/mul/add/transpose
// took about 1 ms per layer, a third of a short-context decode step. fp32, contiguous inputs.
// Written over simd.h's Vec (one source for AVX2 and AVX-512).
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#include "ops.h"
#include "simd.h"

namespace triforce {

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "rms_norm: fp32 only");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t C = x.size(-1), N = x.numel() / C;
  TORCH_CHECK(weight.numel() == C, "rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t CW = C - C % W;
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* xr = xp + i * C;
      float* yr = yp + i * C;
      Vec acc(0.f);
      for (int64_t c = 0; c < CW; c += W) {
        const Vec v = Vec::loadu(xr + c);
        acc = fma(v, v, acc);
      }
      float ss = reduce_add(acc);
      for (int64_t c = CW; c < C; ++c) ss += xr[c] * xr[c];
      const float inv = 1.0f / std::sqrt(ss / C + static_cast<float>(eps));
      const Vec iv(inv);
      for (int64_t c = 0; c < CW; c += W) (Vec::loadu(xr + c) * iv * Vec::loadu(wp + c)).store(yr + c);
      for (int64_t c = CW; c < C; ++c) yr[c] = xr[c] * inv * wp[c];
    }
  });
  return y;
}

namespace {

// q, k rotated and v copied for tokens [b0, e0) of qkv [B, T, N] (N = (Hq + 2 Hkv) D): q into qp
// [B, Hq, T, D] fp32; k and v as KV (fp32, or rounded to nearest-even into bf16 / fp16 as a tensor copy
// rounds) into kp / vp, row (b, h, t) at (b * Hkv + h) * head_stride + t * D.
template <typename KV>
void rotate_tokens(const float* xp, const float* cp, const float* sp, int64_t T, int64_t D, int64_t n_heads,
                   int64_t n_kv_heads, float* qp, KV* kp, KV* vp, int64_t head_stride, int64_t b0, int64_t e0) {
  const int64_t half = D / 2, N = (n_heads + 2 * n_kv_heads) * D;
  for (int64_t bt = b0; bt < e0; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    const float* x = xp + bt * N;
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    // the half-split (NeoX / Hugging Face) rotation: out = x cos + (-x2, x1) sin
    auto rotate = [&](const float* in, auto* out) {
      using T_out = std::remove_pointer_t<decltype(out)>;
      for (int64_t d = 0; d < half; ++d) out[d] = static_cast<T_out>(in[d] * c[d] - in[d + half] * s[d]);
      for (int64_t d = half; d < D; ++d) out[d] = static_cast<T_out>(in[d] * c[d] + in[d - half] * s[d]);
    };
    for (int64_t h = 0; h < n_heads; ++h) rotate(x + h * D, qp + ((b * n_heads + h) * T + t) * D);
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      const int64_t row = (b * n_kv_heads + h) * head_stride + t * D;
      rotate(x + (n_heads + h) * D, kp + row);
      const float* xv = x + (n_heads + n_kv_heads + h) * D;
      for (int64_t d = 0; d < D; ++d) vp[row + d] = static_cast<KV>(xv[d]);
    }
  }
}

void check_rope_args(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads,
                     int64_t n_kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes(), "rope_split: qkv [B, T, N], cos/sin [T, D]");
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat, "rope_split: fp32 only");
  const int64_t D = cos.size(1);
  TORCH_CHECK(cos.size(0) == qkv.size(1) && D % 2 == 0 && qkv.size(2) == (n_heads + 2 * n_kv_heads) * D,
              "rope_split: shapes");
}

}  // namespace

std::vector<torch::Tensor> rope_split(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t n_heads,
                                      int64_t n_kv_heads) {
  check_rope_args(qkv, cos, sin, n_heads, n_kv_heads);
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), D = cos.size(1);
  const auto opts = qkv.options();
  auto q = torch::empty({B, n_heads, T, D}, opts);
  auto k = torch::empty({B, n_kv_heads, T, D}, opts);
  auto v = torch::empty({B, n_kv_heads, T, D}, opts);
  at::parallel_for(0, B * T, 64, [&](int64_t b0, int64_t e0) {
    rotate_tokens<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T, D, n_heads,
                         n_kv_heads, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), T * D, b0, e0);
  });
  return {q, k, v};
}

void rope_store_rows(const float* qkv, const float* cos, const float* sin, int64_t T, int64_t D, int64_t n_heads,
                     int64_t n_kv_heads, float* q, void* k_dst, void* v_dst, int64_t head_stride, c10::ScalarType kv) {
  switch (kv) {  // a few KB: one thread
    case torch::kFloat:
      rotate_tokens(qkv, cos, sin, T, D, n_heads, n_kv_heads, q, static_cast<float*>(k_dst), static_cast<float*>(v_dst),
                    head_stride, 0, T);
      break;
    case torch::kHalf:
      rotate_tokens(qkv, cos, sin, T, D, n_heads, n_kv_heads, q, static_cast<c10::Half*>(k_dst),
                    static_cast<c10::Half*>(v_dst), head_stride, 0, T);
      break;
    case torch::kBFloat16:
      rotate_tokens(qkv, cos, sin, T, D, n_heads, n_kv_heads, q, static_cast<c10::BFloat16*>(k_dst),
                    static_cast<c10::BFloat16*>(v_dst), head_stride, 0, T);
      break;
    default: TORCH_CHECK(false, "rope_store: k/v must be fp32, bf16 or fp16");
  }
}

torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                         torch::Tensor k_dst, torch::Tensor v_dst) {
  check_rope_args(qkv, cos, sin, n_heads, n_kv_heads);
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t T = qkv.size(1), D = cos.size(1);
  TORCH_CHECK(qkv.size(0) == 1 && k_dst.dim() == 3 && k_dst.size(0) == n_kv_heads && k_dst.size(1) == T &&
                  k_dst.size(2) == D && v_dst.sizes() == k_dst.sizes() && v_dst.strides() == k_dst.strides() &&
                  k_dst.stride(2) == 1 && k_dst.stride(1) == D && k_dst.scalar_type() == v_dst.scalar_type(),
              "rope_store: k/v destinations [Hkv, T, D] with contiguous token rows, one dtype");
  auto q = torch::empty({1, n_heads, T, D}, qkv.options());
  rope_store_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), T, D, n_heads, n_kv_heads,
                  q.data_ptr<float>(), k_dst.data_ptr(), v_dst.data_ptr(), k_dst.stride(0), k_dst.scalar_type());
  return q;
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat && gate_up.size(-1) % 2 == 0, "silu_mul: fp32 [..., 2F]");
  gate_up = gate_up.contiguous();
  const int64_t F2 = gate_up.size(-1), F = F2 / 2, N = gate_up.numel() / F2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t FW = F - F % W;
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = gp + i * F2;
      const float* u = g + F;
      float* o = op + i * F;
      for (int64_t f = 0; f < FW; f += W) {
        const Vec x = Vec::loadu(g + f);
        (x * Vec::loadu(u + f) / (Vec(1.0f) + exp(Vec(0.f) - x))).store(o + f);
      }
      for (int64_t f = FW; f < F; ++f) o[f] = g[f] / (1.0f + std::exp(-g[f])) * u[f];
    }
  });
  return out;
}

}  // namespace triforce
