// One decoder layer of a decode-sized forward (a step, a verification, a drafting level's forward:
// T <= 16 tokens) in one call: the same kernels in the same order as model.Block.forward's kernel
// path, so the result is bit for bit the same. What it saves is Python: module calls, views and the
// cache's bookkeeping cost about 50 us per layer, 1.5 ms of a 9 ms step of the embedded model at 8K.
#include "ops.h"

namespace triforce {

namespace {

// A linear layer as model.py holds it: parts with their GGML types and row counts for the integer
// kernel (linear_packed), or one panels tensor with types {-1} and rows {out_features}.
torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types,
                     const std::vector<int64_t>& rows, const c10::optional<torch::Tensor>& bias) {
  torch::Tensor y = (types.size() == 1 && types[0] < 0) ? linear_panels(x, parts[0], rows[0])
                                                       : linear_packed(x, parts, types, rows);
  return bias.has_value() ? y + *bias : y;
}

}  // namespace

std::vector<torch::Tensor> decode_layer(
    torch::Tensor x, torch::Tensor attn_norm, torch::Tensor mlp_norm, double eps,
    std::vector<torch::Tensor> qkv_parts, std::vector<int64_t> qkv_types, std::vector<int64_t> qkv_rows,
    c10::optional<torch::Tensor> qkv_bias,
    std::vector<torch::Tensor> o_parts, std::vector<int64_t> o_types, std::vector<int64_t> o_rows,
    std::vector<torch::Tensor> gu_parts, std::vector<int64_t> gu_types, std::vector<int64_t> gu_rows,
    std::vector<torch::Tensor> d_parts, std::vector<int64_t> d_types, std::vector<int64_t> d_rows,
    torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t slot, double scale) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && k_cache.dim() == 4 && k_cache.size(0) == 1,
              "decode_layer: x [1, T, hidden], k/v cache [1, Hkv, capacity, D]");
  const int64_t T = x.size(1), D = k_cache.size(3), g = n_heads / n_kv_heads;
  TORCH_CHECK(slot + T <= k_cache.size(2), "decode_layer: the cache is full");
  auto qkv = linear(rms_norm(x, attn_norm, eps), qkv_parts, qkv_types, qkv_rows, qkv_bias);
  auto qkv_split = rope_split(qkv, cos, sin, n_heads, n_kv_heads);  // q [1, Hq, T, D], k / v [1, Hkv, T, D]
  const torch::Tensor& q = qkv_split[0];
  k_cache.narrow(2, slot, T).copy_(qkv_split[1]);  // stored in the cache's dtype, as FullCache.update does
  v_cache.narrow(2, slot, T).copy_(qkv_split[2]);
  auto attn = decode_attention(q.reshape({n_kv_heads, g * T, D}), k_cache.narrow(2, 0, slot + T).select(0, 0),
                               v_cache.narrow(2, 0, slot + T).select(0, 0), T, T > 1, scale, 0);
  attn = attn.view({1, n_heads, T, D}).transpose(1, 2).reshape({1, T, n_heads * D});
  x = x + linear(attn, o_parts, o_types, o_rows, c10::nullopt);
  auto m = linear(silu_mul(linear(rms_norm(x, mlp_norm, eps), gu_parts, gu_types, gu_rows, c10::nullopt)), d_parts,
                  d_types, d_rows, c10::nullopt);
  return {x + m, q};
}

}  // namespace triforce
