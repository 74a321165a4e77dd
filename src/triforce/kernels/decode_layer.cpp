// Decoder layers of a decode-sized forward (a step, a verification, a drafting level's forward: T <= 16
// tokens; over a float cache, decode_layers, or a quantized one, decode_layers_quant): the same kernels in the same order as model.Block.forward's kernel path, so the result is bit
// for bit the same. What it saves is Python: module calls, views and the cache's bookkeeping cost about
// 50 us per layer (1.5 ms of a 9 ms step of the embedded model at 8K), and calling one layer at a time
// still cost about 20 us per layer of argument conversion and checks (0.65 ms of a 7 ms step at 1K on an
// Intel Xeon): decode_layers runs every layer in one call over weights converted once (LayerStack).
#include "ops.h"

namespace triforce {

namespace {

// A linear layer as model.py holds it: parts with their GGML types and row counts for the integer
// kernel (linear_packed), or one panels tensor with types {-1} and rows {out_features}.
torch::Tensor linear(const torch::Tensor& x, const LinearWeights& w, const c10::optional<torch::Tensor>& bias) {
  torch::Tensor y = (w.types.size() == 1 && w.types[0] < 0) ? linear_panels(x, w.parts[0], w.rows[0])
                                                           : linear_packed(x, w.parts, w.types, w.rows);
  return bias.has_value() ? y + *bias : y;
}

// y += x for a fresh contiguous fp32 y of x's shape -> y: a residual connection without a tensor operation's
// dispatch (a few us each, 60 per step). The same single fp32 addition per element as x + y.
torch::Tensor add_into(torch::Tensor y, const torch::Tensor& x) {
  TORCH_CHECK(y.is_contiguous() && y.sizes() == x.sizes() && y.scalar_type() == torch::kFloat &&
                  x.scalar_type() == torch::kFloat, "decode_layers: residual shapes");
  const torch::Tensor xc = x.contiguous();
  float* yp = y.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0, n = y.numel(); i < n; ++i) yp[i] = xp[i] + yp[i];
  return y;
}

// One layer over its cache layer k_cache / v_cache [1, Hkv, capacity, D], written at `slot` -> {x, q}; `attend`
// (q [Hkv, g T, D], T) -> [Hkv, g T, D] reads the cache.
template <typename Attend>
std::vector<torch::Tensor> layer_forward(torch::Tensor x, const LayerWeights& w, const torch::Tensor& cos,
                                         const torch::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                                         const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t slot,
                                         const Attend& attend) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && k_cache.dim() == 4 && k_cache.size(0) == 1,
              "decode_layers: x [1, T, hidden], k/v cache [n_layers, 1, Hkv, capacity, D]");
  const int64_t T = x.size(1), D = k_cache.size(3), g = n_heads / n_kv_heads;
  TORCH_CHECK(slot + T <= k_cache.size(2), "decode_layers: the cache is full");
  auto qkv = linear(rms_norm(x, w.attn_norm, w.eps), w.qkv, w.qkv_bias);
  // q [1, Hq, T, D]; k and v written into the cache's slots in its dtype, as FullCache.update stores them
  auto q = rope_store(qkv, cos, sin, n_heads, n_kv_heads, k_cache.select(0, 0).narrow(1, slot, T),
                      v_cache.select(0, 0).narrow(1, slot, T));
  auto attn = attend(q.view({n_kv_heads, g * T, D}), T);
  attn = T == 1 ? attn.view({1, 1, n_heads * D})  // [Hq, 1, D] is already [1, Hq * D]
                : attn.view({1, n_heads, T, D}).transpose(1, 2).reshape({1, T, n_heads * D});
  x = add_into(linear(attn, w.o, c10::nullopt), x);
  auto m = linear(silu_mul(linear(rms_norm(x, w.mlp_norm, w.eps), w.gate_up, c10::nullopt)), w.down, c10::nullopt);
  return {add_into(m, x), q};
}

}  // namespace

std::vector<torch::Tensor> decode_layers(torch::Tensor x, const LayerStack& stack, torch::Tensor cos, torch::Tensor sin,
                                         int64_t n_heads, int64_t n_kv_heads, torch::Tensor k_cache,
                                         torch::Tensor v_cache, int64_t slot, bool queries,
                                         c10::optional<torch::Tensor> gap) {
  const int64_t L = static_cast<int64_t>(stack.layers.size());
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes(),
              "decode_layers: k/v cache [n_layers, 1, Hkv, capacity, D], one layer per LayerWeights");
  std::vector<torch::Tensor> out{x};
  for (int64_t i = 0; i < L; ++i) {
    const auto kc = k_cache.select(0, i), vc = v_cache.select(0, i);
    const double scale = stack.layers[i].scale;
    const auto attend = [&](const torch::Tensor& q, int64_t T) {
      return decode_attention(q, kc.narrow(2, 0, slot + T).select(0, 0), vc.narrow(2, 0, slot + T).select(0, 0), T,
                              T > 1, scale, 0, c10::nullopt, gap);
    };
    auto xq = layer_forward(out[0], stack.layers[i], cos, sin, n_heads, n_kv_heads, kc, vc, slot, attend);
    out[0] = xq[0];
    if (queries) out.push_back(xq[1]);
  }
  return out;
}

std::vector<torch::Tensor> decode_layers_quant(torch::Tensor x, const LayerStack& stack, torch::Tensor cos,
                                               torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                                               std::vector<torch::Tensor> planes, int64_t q_end, torch::Tensor lim,
                                               torch::Tensor fk, torch::Tensor fv, int64_t slot, torch::Tensor fmask,
                                               bool queries) {
  const int64_t L = static_cast<int64_t>(stack.layers.size());
  TORCH_CHECK(planes.size() == 8 && fk.dim() == 5 && fk.size(0) == L && fv.sizes() == fk.sizes(),
              "decode_layers_quant: 8 plane tensors [n_layers, 1, Hkv, ...], buffer [n_layers, 1, Hkv, slots, D]");
  constexpr int64_t G = 64;  // caches/quantized.py GROUP_K
  std::vector<torch::Tensor> out{x};
  for (int64_t i = 0; i < L; ++i) {
    const auto kc = fk.select(0, i), vc = fv.select(0, i);
    const double scale = stack.layers[i].scale;
    const auto layer = [&](int j, int64_t rows) {  // plane tensor j of this layer, its first `rows` rows
      const auto t = planes[j];
      return t.numel() == 0 ? t : t.select(0, i).select(0, 0).narrow(1, 0, rows);
    };
    const auto attend = [&](const torch::Tensor& q, int64_t T) {
      return quant_attention(q, layer(0, q_end), layer(1, q_end), layer(2, q_end / G), layer(3, q_end / G),
                             layer(4, q_end), layer(5, q_end), layer(6, q_end), layer(7, q_end), lim,
                             kc.select(0, 0).narrow(1, 0, slot + T), vc.select(0, 0).narrow(1, 0, slot + T), fmask, T,
                             scale);
    };
    auto xq = layer_forward(out[0], stack.layers[i], cos, sin, n_heads, n_kv_heads, kc, vc, slot, attend);
    out[0] = xq[0];
    if (queries) out.push_back(xq[1]);
  }
  return out;
}

}  // namespace triforce
