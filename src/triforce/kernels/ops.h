// The functions of the `triforce_cpu_<isa>` extension (bindings.cpp): fp32 arithmetic on the CPU,
// one source compiled per ISA (simd.h).
#pragma once
#include <torch/extension.h>

#include <vector>

namespace triforce {

// attention.cpp: softmax(q k^T * scale) v for q [H, R, D] fp32 over k/v [H, S, D] fp32/bf16/fp16 (see there).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t T, bool causal,
                               double scale, int64_t path);

// attention.cpp: the same over a quantized KV cache's planes (8-bit or their 4-bit reading) and its
// full-precision buffer (caches/quantized.py; see there).
torch::Tensor quant_attention(torch::Tensor q, torch::Tensor k_hi, torch::Tensor k_lo, torch::Tensor k_scale,
                              torch::Tensor k_zero, torch::Tensor v_hi, torch::Tensor v_lo, torch::Tensor v_scale,
                              torch::Tensor v_zero, torch::Tensor lim, torch::Tensor fk, torch::Tensor fv,
                              torch::Tensor fmask, int64_t T, double scale);

// layer_ops.cpp: the small per-layer operations of a decoder layer, fused.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> rope_split(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t n_heads,
                                      int64_t n_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);

// linear_panels.cpp: x [..., K] fp32 times weights (fp32 or bf16) held in 16-output panels [P, K, 16]
// -> [..., N] fp32.
torch::Tensor linear_panels(torch::Tensor x, torch::Tensor panels, int64_t out_features);

// quant_linear.cpp: x [..., K] fp32 times weights kept in GGML block formats (GGUF's quantized tensors):
// parts [N_i, row_bytes] uint8 of GGML types `types`, outputs concatenated -> [..., sum N_i] fp32; and
// the fp32 values of such a tensor's rows.
torch::Tensor linear_quant(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types);
torch::Tensor dequantize_rows(torch::Tensor raw, int64_t type);

// quant_packed.cpp: the same for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K parts repacked 16 rows at a time (quantized.py
// pack_rows): [ceil(N_i / 16), row_bytes * 16] uint8 holding `rows[i]` rows each.
torch::Tensor linear_packed(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                            std::vector<int64_t> rows);

// decode_layer.cpp: one decoder layer of a decode-sized forward through the kernels above, in one call
// (model.Block.forward's kernel path, bit for bit) -> {x after the layer, the layer's rotated q}.
std::vector<torch::Tensor> decode_layer(
    torch::Tensor x, torch::Tensor attn_norm, torch::Tensor mlp_norm, double eps,
    std::vector<torch::Tensor> qkv_parts, std::vector<int64_t> qkv_types, std::vector<int64_t> qkv_rows,
    c10::optional<torch::Tensor> qkv_bias,
    std::vector<torch::Tensor> o_parts, std::vector<int64_t> o_types, std::vector<int64_t> o_rows,
    std::vector<torch::Tensor> gu_parts, std::vector<int64_t> gu_types, std::vector<int64_t> gu_rows,
    std::vector<torch::Tensor> d_parts, std::vector<int64_t> d_types, std::vector<int64_t> d_rows,
    torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t n_kv_heads,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t slot, double scale);

}  // namespace triforce
