// Decoder layers of a decode-sized forward (a step, a verification, a drafting level's forward: T <= 16
// tokens; over a float cache, decode_layers, or a quantized one, decode_layers_quant): the same kernels in the same order as model.Block.forward's kernel path, so the result is bit
// for bit the same. What it saves is Python: module calls, views and the cache's bookkeeping cost about
// 50 us per layer (1.5 ms of a 9 ms step of the embedded model at 8K), and calling one layer at a time
// still cost about 20 us per layer of argument conversion and checks (0.65 ms of a 7 ms step at 1K on an
// Intel Xeon): decode_layers runs every layer in one call over weights converted once (LayerStack).
#include <ATen/ops/add.h>

#include "ops.h"

namespace triforce {

namespace {

// A linear layer as model.py holds it: parts with their GGML types and row counts for the integer
// kernel (linear_packed), or one panels tensor with types {-1} and rows {out_features}.
torch::Tensor linear(const torch::Tensor& x, const LinearWeights& w, const c10::optional<torch::Tensor>& bias) {
  torch::Tensor y = (w.types.size() == 1 && w.types[0] < 0) ? linear_panels(x, w.parts[0], w.rows[0])
                                                           : linear_packed(x, w.parts, w.types, w.rows);
  return bias.has_value() ? at::add(y, *bias) : y;
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

// One segment of a forward's rows: one sequence's T consecutive rows of x, over its own cache layer: k / v
// [Hkv, capacity, D] of dtype kv (each head's rows contiguous, heads hs elements apart), written at `slot`.
// Pointers, not tensor views: views cost a dispatch each, about 20 per sequence and layer, and a serving batch of 8
// one-row requests spent 4 ms a step on them (26.3 ms against 22.4 for one 8-row request at 16 cached tokens).
// A forward over several sequences (a serving batch: decode_layers_batch) has one segment per sequence; a single
// sequence's forward has one.
struct Segment {
  char* k;
  char* v;
  int64_t hs;
  c10::ScalarType kv;
  int64_t slot, rows;
  const int64_t* gap;  // a StreamingLLM window's (decode_attention's gap), or null
};

// One layer over the segments' rows -> {x, then (queries) each segment's rotated q [1, Hq, T, D]}. The linear
// layers, norms and the MLP run over every row at once (the weights read once for all segments); RoPE and the cache
// write per segment, and attention over each segment's own cache, all segments' in one call. Every operation is
// row-wise or per segment, and the kernels compute a row the same way whatever rows come with it (linear_panels,
// linear_packed: the same sums in the same order; decode_attention_calls: each call's bits alone), so a segment's
// output is bit for bit what the same layer gives it alone. cos / sin: [R, D] contiguous. `attend` (q: each
// segment's [Hq, T, D] in turn, attn [1, R, Hq D]) writes each segment's attention output at its rows.
template <typename Attend>
std::vector<torch::Tensor> layer_forward(torch::Tensor x, const LayerWeights& w, const torch::Tensor& cos,
                                         const torch::Tensor& sin, int64_t n_heads, int64_t n_kv_heads,
                                         const std::vector<Segment>& segments, bool queries, const Attend& attend) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "decode_layers: x [1, rows, hidden]");
  const int64_t R = x.size(1), D = cos.size(1), C = (n_heads + 2 * n_kv_heads) * D;
  const auto qkv = linear(rms_norm(x, w.attn_norm, w.eps), w.qkv, w.qkv_bias).contiguous();
  TORCH_CHECK(qkv.size(1) == R && qkv.size(2) == C, "decode_layers: qkv [1, rows, (Hq + 2 Hkv) D]");
  auto q = torch::empty({R * n_heads * D}, x.options());
  const float* qkvp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  std::vector<torch::Tensor> out{torch::Tensor()};
  int64_t r0 = 0;
  for (const auto& seg : segments) {
    const int64_t T = seg.rows, at = seg.slot * D * c10::elementSize(seg.kv);
    // k and v written into the cache's slots in its dtype, as FullCache.update stores them
    rope_store_rows(qkvp + r0 * C, cp + r0 * D, sp + r0 * D, T, D, n_heads, n_kv_heads, qp + r0 * n_heads * D,
                    seg.k + at, seg.v + at, seg.hs, seg.kv);
    if (queries) out.push_back(q.narrow(0, r0 * n_heads * D, T * n_heads * D).view({1, n_heads, T, D}));
    r0 += T;
  }
  TORCH_CHECK(r0 == R, "decode_layers: the segments' rows must add up to x's");
  auto attn = torch::empty({1, R, n_heads * D}, x.options());
  attend(q, attn);
  x = add_into(linear(attn, w.o, c10::nullopt), x);
  auto m = linear(silu_mul(linear(rms_norm(x, w.mlp_norm, w.eps), w.gate_up, c10::nullopt)), w.down, c10::nullopt);
  out[0] = add_into(m, x);
  return out;
}

}  // namespace

std::vector<torch::Tensor> decode_layers_batch(torch::Tensor x, const LayerStack& stack, torch::Tensor cos,
                                               torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                                               std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                                               std::vector<int64_t> slots, std::vector<int64_t> rows, bool queries,
                                               std::vector<torch::Tensor> gaps) {
  const int64_t L = static_cast<int64_t>(stack.layers.size());
  const size_t S = k_caches.size();
  TORCH_CHECK(S > 0 && v_caches.size() == S && slots.size() == S && rows.size() == S && (gaps.empty() || gaps.size() == S),
              "decode_layers_batch: one k/v cache, slot and row count (and gap, if any) per segment");
  TORCH_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "decode_layers: query heads a multiple of the KV heads");
  const int64_t g = n_heads / n_kv_heads;
  cos = cos.contiguous();
  sin = sin.contiguous();
  // every cache checked here once; each layer's segments are then pointer arithmetic
  std::vector<Segment> segments(S);
  for (size_t s = 0; s < S; ++s) {
    const auto& k = k_caches[s];
    const auto& v = v_caches[s];
    TORCH_CHECK(k.dim() == 5 && k.size(0) == L && k.size(1) == 1 && k.size(2) == n_kv_heads && v.sizes() == k.sizes() &&
                    v.strides() == k.strides() && v.scalar_type() == k.scalar_type() && k.size(4) == cos.size(1) &&
                    k.stride(4) == 1 && k.stride(3) == k.size(4),
                "decode_layers: k/v cache [n_layers, 1, Hkv, capacity, D] of one dtype with contiguous rows, one layer "
                "per LayerWeights");
    TORCH_CHECK(slots[s] >= 0 && rows[s] >= 1 && slots[s] + rows[s] <= k.size(3) && g * rows[s] <= 64,
                "decode_layers: each cache with room for its rows, at most 64 query rows per KV head");
    const int64_t* gp = nullptr;
    if (!gaps.empty() && gaps[s].numel() > 0) {
      TORCH_CHECK(gaps[s].scalar_type() == torch::kLong && gaps[s].dim() == 1 && gaps[s].size(0) == rows[s] + 1 &&
                      gaps[s].is_contiguous() && gaps[s].device().is_cpu(),
                  "decode_layers: a gap must be a contiguous [T + 1] int64 CPU tensor");
      gp = gaps[s].data_ptr<int64_t>();
    }
    segments[s] = {static_cast<char*>(k.data_ptr()), static_cast<char*>(v.data_ptr()), k.stride(2), k.scalar_type(),
                   slots[s], rows[s], gp};
  }
  TORCH_CHECK(cos.size(0) == x.size(1) && sin.sizes() == cos.sizes(), "decode_layers: cos / sin [rows, D]");
  const int64_t D = cos.size(1);
  std::vector<torch::Tensor> out{x};
  std::vector<Segment> layer(S);  // this layer's
  std::vector<AttentionCall> calls(S);
  for (int64_t i = 0; i < L; ++i) {
    for (size_t s = 0; s < S; ++s) {
      const int64_t bytes = i * k_caches[s].stride(0) * k_caches[s].element_size();
      layer[s] = segments[s];
      layer[s].k += bytes;
      layer[s].v += bytes;
    }
    const auto attend = [&](const torch::Tensor& q, torch::Tensor& attn) {
      const float* qp = q.data_ptr<float>();
      float* ap = attn.data_ptr<float>();
      int64_t r0 = 0;
      for (size_t s = 0; s < S; ++s) {
        const auto& seg = layer[s];
        const int64_t T = seg.rows;
        // q [Hkv, g T, D] over the keys up to the segment's last row; its rows into attn's [T, Hq D] at its rows
        calls[s] = {qp + r0 * n_heads * D, n_kv_heads, g * T, D, seg.k, seg.v, seg.slot + T, seg.hs, seg.hs, seg.kv,
                    T, T > 1, nullptr, seg.gap, ap + r0 * n_heads * D, g * D, D, n_heads * D};
        r0 += T;
      }
      decode_attention_calls(calls, stack.layers[i].scale);
    };
    auto xq = layer_forward(out[0], stack.layers[i], cos, sin, n_heads, n_kv_heads, layer, queries, attend);
    out[0] = xq[0];
    if (queries) out.insert(out.end(), xq.begin() + 1, xq.end());
  }
  return out;
}

std::vector<torch::Tensor> decode_layers(torch::Tensor x, const LayerStack& stack, torch::Tensor cos, torch::Tensor sin,
                                         int64_t n_heads, int64_t n_kv_heads, torch::Tensor k_cache,
                                         torch::Tensor v_cache, int64_t slot, bool queries,
                                         c10::optional<torch::Tensor> gap) {
  std::vector<torch::Tensor> gaps;
  if (gap.has_value()) gaps.push_back(*gap);
  return decode_layers_batch(x, stack, cos, sin, n_heads, n_kv_heads, {k_cache}, {v_cache}, {slot}, {x.size(1)},
                             queries, gaps);
}

std::vector<torch::Tensor> decode_layers_quant(torch::Tensor x, const LayerStack& stack, torch::Tensor cos,
                                               torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                                               std::vector<torch::Tensor> planes, int64_t q_end, torch::Tensor lim,
                                               torch::Tensor fk, torch::Tensor fv, int64_t slot, torch::Tensor fmask,
                                               bool queries) {
  const int64_t L = static_cast<int64_t>(stack.layers.size());
  TORCH_CHECK(planes.size() == 8 && fk.dim() == 5 && fk.size(0) == L && fk.size(1) == 1 && fv.sizes() == fk.sizes() &&
                  fk.strides() == fv.strides(),
              "decode_layers_quant: 8 plane tensors [n_layers, 1, Hkv, ...], buffer [n_layers, 1, Hkv, slots, D]");
  constexpr int64_t G = 64;  // caches/quantized.py GROUP_K
  const int64_t H = fk.size(2), D = fk.size(4), T = x.size(1), F = slot + T;
  TORCH_CHECK(q_end % G == 0 && F <= fk.size(3) && fk.stride(4) == 1 && fk.stride(3) == D,
              "decode_layers_quant: q_end a multiple of 64, the buffer's rows contiguous and holding slot + T");
  TORCH_CHECK((D == 64 || D == 128 || D == 256) && H == n_kv_heads && n_heads % n_kv_heads == 0 &&
                  (n_heads / n_kv_heads) * T <= 64 && lim.numel() == (n_heads / n_kv_heads) * T,
              "decode_layers_quant: head dim 64, 128 or 256, the buffer's Hkv heads, at most 64 query rows per KV "
              "head, one lim per row");
  TORCH_CHECK(fmask.scalar_type() == torch::kBool && fmask.dim() == 2 && fmask.size(0) == T && fmask.size(1) == F &&
                  fmask.is_contiguous() && lim.scalar_type() == torch::kLong && lim.is_contiguous(),
              "decode_layers_quant: fmask [T, slot + T] bool, lim int64, both contiguous");
  // Each layer's planes by pointer arithmetic (QuantLayer), the whole tensors checked here once: plane j is
  // [L, 1, H, rows, cols] with contiguous rows of `cols` elements and at least `rows` rows.
  const bool eight = planes[1].numel() > 0;
  TORCH_CHECK(eight == (planes[5].numel() > 0), "decode_layers_quant: both lower planes or neither");
  const auto check = [&](int j, int64_t rows, int64_t cols, c10::ScalarType dtype) {
    const auto& t = planes[j];
    TORCH_CHECK(t.dim() == 5 && t.size(0) == L && t.size(1) == 1 && t.size(2) == H && t.size(3) >= rows &&
                    t.size(4) == cols && t.stride(4) == 1 && t.stride(3) == cols && t.scalar_type() == dtype,
                "decode_layers_quant: plane ", j, " must be [n_layers, 1, Hkv, >= ", rows, ", ", cols,
                "] with contiguous rows of ", c10::toString(dtype));
  };
  for (int j : {0, 4}) check(j, q_end, D / 2, torch::kByte);
  if (eight)
    for (int j : {1, 5}) check(j, q_end, D / 2, torch::kByte);
  for (int j : {2, 3}) check(j, q_end / G, D, torch::kHalf);
  for (int j : {6, 7}) check(j, q_end, D / 32, torch::kHalf);
  TORCH_CHECK(planes[3].strides() == planes[2].strides() && planes[7].strides() == planes[6].strides(),
              "decode_layers_quant: zeros laid out as their scales");
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "decode_layers_quant: cos / sin [T, D]");
  const auto at = [&](int j, int64_t i) { return static_cast<const char*>(planes[j].data_ptr()) +
                                                 i * planes[j].stride(0) * planes[j].element_size(); };
  std::vector<torch::Tensor> out{x};
  for (int64_t i = 0; i < L; ++i) {
    const double scale = stack.layers[i].scale;
    QuantLayer ql{};
    ql.k_hi = reinterpret_cast<const uint8_t*>(at(0, i));
    ql.v_hi = reinterpret_cast<const uint8_t*>(at(4, i));
    ql.k_lo = eight ? reinterpret_cast<const uint8_t*>(at(1, i)) : nullptr;
    ql.v_lo = eight ? reinterpret_cast<const uint8_t*>(at(5, i)) : nullptr;
    ql.k_scale = reinterpret_cast<const c10::Half*>(at(2, i));
    ql.k_zero = reinterpret_cast<const c10::Half*>(at(3, i));
    ql.v_scale = reinterpret_cast<const c10::Half*>(at(6, i));
    ql.v_zero = reinterpret_cast<const c10::Half*>(at(7, i));
    ql.k_hi_s = planes[0].stride(2), ql.v_hi_s = planes[4].stride(2);
    ql.k_lo_s = eight ? planes[1].stride(2) : 0, ql.v_lo_s = eight ? planes[5].stride(2) : 0;
    ql.k_scale_s = planes[2].stride(2), ql.v_scale_s = planes[6].stride(2);
    ql.Sq = q_end;
    ql.fk = static_cast<const char*>(fk.data_ptr()) + i * fk.stride(0) * fk.element_size();
    ql.fv = static_cast<const char*>(fv.data_ptr()) + i * fv.stride(0) * fv.element_size();
    ql.fk_s = fk.stride(2), ql.fv_s = fv.stride(2), ql.F = F;
    ql.kv = fk.scalar_type();
    const auto attend = [&](const torch::Tensor& q, torch::Tensor& attn) {  // (one segment: [Hkv, g T, D] -> [T, Hq D])
      const int64_t g = n_heads / n_kv_heads;
      const auto a = quant_attention_layer(q.view({n_kv_heads, g * T, D}), ql, lim, fmask, T, scale);
      attn.view({T, n_kv_heads, g, D}).permute({1, 2, 0, 3}).copy_(a.view({n_kv_heads, g, T, D}));
    };
    // (the buffer's layer, as QuantLayer holds it: its rows are written here, read by quant_attention_layer)
    const Segment seg{static_cast<char*>(const_cast<void*>(ql.fk)), static_cast<char*>(const_cast<void*>(ql.fv)),
                      fk.stride(2), fk.scalar_type(), slot, T, nullptr};
    auto xq = layer_forward(out[0], stack.layers[i], cos, sin, n_heads, n_kv_heads, {seg}, queries, attend);
    out[0] = xq[0];
    if (queries) out.push_back(xq[1]);
  }
  return out;
}

}  // namespace triforce
