// The functions of the `triforce_cpu_<isa>` extension (bindings.cpp): fp32 arithmetic on the CPU,
// one source compiled per ISA (simd.h).
#pragma once
// Not <torch/extension.h> (pybind11 and the whole C++ API: 35 s of parsing per source on a Zen 3 core, most of a
// kernel build): the tensor type, its factories and ATen's threads. bindings.cpp adds pybind11 (torch/python.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace torch {
using namespace at;  // torch::Tensor, torch::empty, torch::kFloat: the names the kernels use (as torch/types.h does)
}  // namespace torch

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

namespace triforce {

// fn(b, e) over [0, n) in chunks of `chunk`, each taken by whichever thread is free (at::parallel_for gives each
// thread an equal share up front). Why: on a shared 2-core VM one core ran a serving batch's equal shares 5-10%
// slower than the other, and the other waited at every join (10% of its time). Chunks are independent, so the
// results do not depend on which thread runs them.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// The peak probes (vector_peak_flops, integer_peak_ops): PEAK_CHAINS independent chains of one instruction per thread,
// PEAK_ITERS instructions each, operands in registers: about 10 ms on 2 threads.
constexpr int PEAK_CHAINS = 12;
constexpr int64_t PEAK_ITERS = int64_t(1) << 21;
// chain() on every thread at once (one probe's chains; it returns a sum of them, kept so that the compiler keeps the
// chains) -> operations a second over all threads, for `ops` operations per chain() call.
template <class F>
double threads_rate(double ops, const F& chain) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> sink(threads, 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sink[t] = chain();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile double keep = 0.0;
  for (double v : sink) keep = keep + v;
  return double(threads) * ops / seconds;
}

// attention.cpp: softmax(q k^T * scale) v for q [H, R, D] fp32 over k/v [H, S, D] fp32/bf16/fp16 (see there).
// visible [T, T] bool (with causal): the new keys' visibility for a token block (a draft tree) instead of causal.
// gap [T + 1] int64 (a StreamingLLM window): keys gap[0] .. gap[1 + t] - 1 hidden from new token t's rows.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t T, bool causal,
                               double scale, int64_t path, c10::optional<torch::Tensor> visible,
                               c10::optional<torch::Tensor> gap = c10::nullopt);
// attention.cpp: one decode_attention over raw operands. q [H, R, D] fp32 (contiguous); K / V [H, S, D] of dtype kv,
// each head's rows contiguous, heads ks / vs elements apart; causal over the last T keys, visible and gap as
// decode_attention's (or null). Row r of head h (query head h g + r / T of its group, token r % T) is written to
// out + h out_h + (r / T) out_g + (r % T) out_t.
struct AttentionCall {
  const float* q;
  int64_t H, R, D;
  const void* k;
  const void* v;
  int64_t S, ks, vs;
  c10::ScalarType kv;
  int64_t T;
  bool causal;
  const bool* visible;
  const int64_t* gap;
  float* out;
  int64_t out_h, out_g, out_t;
  // q's row r of head h at q + h q_h + (r / T) q_g + (r % T) q_t (a chain's slice of a [Hq, T, D] tensor);
  // q_h 0: contiguous [H, R, D]
  int64_t q_h = 0, q_g = 0, q_t = 0;
};
// attention.cpp: several such calls at once (a serving batch's sequences, each over its own cache): every call's work
// items in one parallel region per K/V dtype and head dim, each call's rows the same bits as alone.
void decode_attention_calls(const std::vector<AttentionCall>& calls, double scale, int64_t path = 0);
// attention.cpp: a causal chain of T new tokens (the last T of k / v's S keys) longer than one call takes (a prefill
// chunk): q [Hq, T, D] (rows of D contiguous) in calls of `rows` rows (rows / g tokens) over the keys up to each
// call's last token, all in one parallel region, into out [T, Hq, D]. Each row is the decode step's bits.
torch::Tensor chain_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t rows);
// attention.cpp: whether decode_attention runs bf16 K/V's rows-in-lanes path on AMX tiles here (compiled
// for a CPU with AMX-BF16, the tile state granted by Linux, TRIFORCE_AMX not 0).
bool amx_attention();
// attention.cpp: whether it runs that path on dot products, AMX's tiles (amx_attention) or AVX512-BF16's
// vdpbf16ps (compiled for a CPU with AVX512-BF16).
bool bf16_dot_attention();
// attention.cpp: the row count from which decode_attention's path 0 takes the rows-in-lanes path on this CPU.
int64_t attention_lanes_min_rows(bool bf16_dot);
bool attention_exact_rows(int64_t rows);
bool attention_dot_every_row();
int64_t attention_chain_rows();
// retrieval.cpp: the retrieval cache's chunk scores, out [H, N / c] = q [H, D] fp32 . the mean of each chunk of c
// keys of keys [H, N, D] (fp32, bf16 or fp16; each head's rows contiguous); keys past the last whole chunk ignored.
torch::Tensor chunk_scores(torch::Tensor keys, torch::Tensor q, int64_t c);
// attention.cpp: this build's vector arithmetic peak on all threads, FLOP/s (FMAs, or AVX512-BF16 dot products).
double vector_peak_flops(bool dot);

// attention.cpp: the same over a quantized KV cache's planes (8-bit or their 4-bit reading) and its
// full-precision buffer (caches/quantized.py; see there).
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k_hi, torch::Tensor k_lo, torch::Tensor k_scale,
                              torch::Tensor k_zero, torch::Tensor v_hi, torch::Tensor v_lo, torch::Tensor v_scale,
                              torch::Tensor v_zero, torch::Tensor lim, torch::Tensor fk, torch::Tensor fv,
                              torch::Tensor fmask, int64_t T, double scale);

// One layer of a quantized cache as quant_attention's kernel reads it: raw pointers, strides between KV heads in
// elements, rows contiguous (a key group's 64 rows hold [D, 32] channel-major bytes; see quant_attention). Made from
// checked tensors by quant_attention, or by decode_layers_quant for each layer by pointer arithmetic on the whole
// cache's tensors, checked once per call: views cost about 0.4 us each, and the 24 per layer that made them were
// 0.3 ms of a 3.5 ms decode step.
struct QuantLayer {
  const uint8_t *k_hi, *k_lo, *v_hi, *v_lo;  // [H, Sq, D / 2]; k_lo / v_lo null for the 4-bit reading
  const c10::Half *k_scale, *k_zero;        // [H, Sq / 64, D]
  const c10::Half *v_scale, *v_zero;        // [H, Sq, D / 32]
  int64_t k_hi_s, k_lo_s, v_hi_s, v_lo_s, k_scale_s, v_scale_s;
  int64_t Sq;               // quantized positions below which rows may read (a multiple of 64)
  const void *fk, *fv;      // the full-precision buffer [H, F, D] of dtype kv
  int64_t fk_s, fv_s, F;
  c10::ScalarType kv;
};
torch::Tensor quant_attention_layer(const torch::Tensor& q, const QuantLayer& L, const torch::Tensor& lim,
                                    const torch::Tensor& fmask, int64_t T, double scale);

// layer_ops.cpp: the small per-layer operations of a decoder layer, fused.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> rope_split(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t n_heads,
                                      int64_t n_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
// layer_ops.cpp: rope_split for one sequence that stores k and v straight into a cache's slots k_dst / v_dst
// [Hkv, T, D] (fp32, bf16 or fp16, rounded as a tensor copy rounds) -> q [1, Hq, T, D].
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                         torch::Tensor k_dst, torch::Tensor v_dst);
// rope_store over raw rows: qkv [T, (Hq + 2 Hkv) D] and cos / sin [T, D] contiguous fp32, q [Hq, T, D] out, k / v
// rows of kv at k_dst / v_dst + h head_stride + t D.
void rope_store_rows(const float* qkv, const float* cos, const float* sin, int64_t T, int64_t D, int64_t n_heads,
                     int64_t n_kv_heads, float* q, void* k_dst, void* v_dst, int64_t head_stride, c10::ScalarType kv);

// linear_panels.cpp: x [..., K] fp32 times weights (fp32 or bf16) held in 16-output panels [P, K, 16]
// -> [..., N] fp32.
torch::Tensor linear_panels(torch::Tensor x, torch::Tensor panels, int64_t out_features);

// quant_linear.cpp: x [..., K] fp32 times weights kept in GGML block formats (GGUF's quantized tensors):
// parts [N_i, row_bytes] uint8 of GGML types `types`, outputs concatenated -> [..., sum N_i] fp32; and
// the fp32 values of such a tensor's rows.
torch::Tensor linear_quant(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types);
torch::Tensor dequantize_rows(torch::Tensor raw, int64_t type);

// quant_packed.cpp: the same for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K parts repacked 16 rows at a time (ggml_blocks.py
// pack_rows): [ceil(N_i / 16), row_bytes * 16] uint8 holding `rows[i]` rows each.
torch::Tensor linear_packed(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                            std::vector<int64_t> rows);
// the GGML types linear_packed has a many-row path for (from a few rows per format: the tiles' bits, faster)
std::vector<int64_t> packed_many_rows_types();
bool packed_prefill();
// quant_packed.cpp: vpdpbusd's peak on all threads in operations a second (2 per byte product); 0 without VNNI
double integer_peak_ops();

// quant_packed.cpp: rows [start, stop) of such a packed part back in the file's layout [stop - start, blocks * size]
// (quantized.pack_rows's inverse; head / tail: the block's scale bytes before and after its code words).
torch::Tensor unpack_rows(torch::Tensor packed, int64_t head, int64_t tail, int64_t size, int64_t start, int64_t stop);

// decode_layer.cpp: a linear layer as the kernels take it: parts, GGML types and rows for linear_packed, or
// {panels}, {-1}, {out_features} for linear_panels.
struct LinearWeights {
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> types, rows;
};

// decode_layer.cpp: one decoder layer's weights and constants (execution/fused.py's layer_args, and its attention scale).
struct LayerWeights {
  torch::Tensor attn_norm, mlp_norm;
  double eps;
  LinearWeights qkv;
  c10::optional<torch::Tensor> qkv_bias;
  LinearWeights o, gate_up, down;
  double scale;
};

// decode_layer.cpp: every layer of a model, converted from Python once.
struct LayerStack {
  std::vector<LayerWeights> layers;
};

// decode_layer.cpp: every layer of `stack` in turn over the whole cache k/v [n_layers, 1, Hkv, capacity, D]
// -> {x after the last layer} and, if `queries`, each layer's rotated q after it.
std::vector<torch::Tensor> decode_layers(torch::Tensor x, const LayerStack& stack, torch::Tensor cos, torch::Tensor sin,
                                         int64_t n_heads, int64_t n_kv_heads, torch::Tensor k_cache,
                                         torch::Tensor v_cache, int64_t slot, bool queries,
                                         c10::optional<torch::Tensor> gap = c10::nullopt);
// decode_layer.cpp: every layer over several sequences' rows at once (a serving batch): x [1, R, hidden] holds
// segment s's rows[s] rows in order, cos / sin [R, D] their RoPE, each over its own cache k_caches[s] / v_caches[s]
// [n_layers, 1, Hkv, capacity, D] written at slots[s] (gaps: none, or one per segment, empty for none) -> {x} and,
// if `queries`, each layer's rotated q of each segment (layer-major). Each segment's rows are bit for bit what
// decode_layers gives that segment alone (decode_layers is this with one segment).
std::vector<torch::Tensor> decode_layers_batch(torch::Tensor x, const LayerStack& stack, torch::Tensor cos,
                                               torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                                               std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                                               std::vector<int64_t> slots, std::vector<int64_t> rows, bool queries,
                                               std::vector<torch::Tensor> gaps);
// decode_layer.cpp: the same over a quantized cache (caches/quantized.py): planes = its 8 tensors k_hi, k_lo, k_scale,
// k_zero, v_hi, v_lo, v_scale, v_zero [n_layers, 1, Hkv, ...] (the lower planes empty for the 4-bit reading), read
// below q_end; the full-precision buffer fk / fv [n_layers, 1, Hkv, slots, D] written at `slot`; lim and fmask as
// quant_attention takes them.
std::vector<torch::Tensor> decode_layers_quant(torch::Tensor x, const LayerStack& stack, torch::Tensor cos,
                                               torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
                                               std::vector<torch::Tensor> planes, int64_t q_end, torch::Tensor lim,
                                               torch::Tensor fk, torch::Tensor fv, int64_t slot, torch::Tensor fmask,
                                               bool queries);

}  // namespace triforce
