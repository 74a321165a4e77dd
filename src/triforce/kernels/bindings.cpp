// pybind11 and the tensor casters; not <torch/extension.h>, which adds the whole C++ frontend to parse (ops.h)
#include <torch/python.h>

#include "ops.h"
#include "simd.h"

// Every function below runs with the GIL released: it reads and writes tensors only, and a serving batch's forward
// (decode_layers_batch, 80-250 ms at 8K) would otherwise stop every other Python thread of the server for its whole
// length (the event loop's streaming, the other requests' host work between forwards).
#define GIL_FREE py::call_guard<py::gil_scoped_release>()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = triforce::ISA;       // the instruction set this module was compiled for
  m.attr("LANES") = triforce::W;       // fp32 lanes per vector
  m.attr("HALF_KV") = true;            // decode_attention reads bf16 / fp16 K and V
  m.def("decode_attention", &triforce::decode_attention, GIL_FREE,
        "softmax(q k^T * scale) v for q [H, R, D] fp32 over k/v [H, S, D] (fp32, bf16 or fp16; D 64, 128 or 256), "
        "causal over the last T keys if asked, or with visible [T, T] bool (a token block: new token t sees new key u "
        "iff visible[t][u]; every older key is seen by all); gap [T + 1] int64 (a StreamingLLM window): keys gap[0] "
        ".. gap[1 + t] - 1 hidden from new token t",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("T"), py::arg("causal"), py::arg("scale"),
        py::arg("path") = 0, py::arg("visible") = py::none(), py::arg("gap") = py::none());
  m.def("chain_attention", &triforce::chain_attention, GIL_FREE,
        "q [Hq, T, D] fp32, k/v [Hkv, S, D]: a causal chain over the last T keys in calls of `rows` rows, all in one "
        "parallel region -> [T, Hq, D]");
  m.def("amx_attention", &triforce::amx_attention, GIL_FREE,
        "whether decode_attention's path 3 (bf16 K/V's rows in lanes: scores and p v) runs on AMX tiles in this process");
  m.def("bf16_dot_attention", &triforce::bf16_dot_attention, GIL_FREE,
        "whether decode_attention's rows-in-lanes path over bf16 K/V runs on dot products in this process: AMX "
        "tiles (amx_attention) or AVX512-BF16's vdpbf16ps");
  m.def("attention_lanes_min_rows", &triforce::attention_lanes_min_rows, GIL_FREE,
        "from how many query rows per KV head the rows-in-lanes path (paths 2, 3) outruns the per-row one on this CPU "
        "(bf16_dot: bf16 K/V on AVX512-BF16 or AMX dot products); path 0 keeps the per-row path, exact per row", py::arg("bf16_dot"));
  m.def("attention_exact_rows", &triforce::attention_exact_rows, GIL_FREE,
        "whether path 0 computes this many query rows' scores rows-in-lanes in the per-row order (path 4: the per-row "
        "path's bits, faster where the rows fill the vectors' lanes on this CPU)", py::arg("rows"));
  m.def("attention_dot_every_row", &triforce::attention_dot_every_row, GIL_FREE,
        "whether path 0 runs bf16 K/V on AVX512-BF16 dot products (the rows-in-lanes path, path 2) at every row count "
        "on this CPU: a decode step and a verification then share that arithmetic, exact per row");
  m.def("attention_chain_rows", &triforce::attention_chain_rows, GIL_FREE,
        "the most query rows per KV head a path-0 call over bf16 K/V takes on this CPU: 256 where it runs on dot "
        "products at every row count (attention_dot_every_row), else 64");
  m.def("vector_peak_flops", &triforce::vector_peak_flops, GIL_FREE,
        "this build's vector arithmetic peak on all threads in FLOP/s: FMAs, or with dot AVX512-BF16's vdpbf16ps (0 "
        "where the build has none); register-resident chains, about 10 ms", py::arg("dot") = false);
  m.def("integer_peak_ops", &triforce::integer_peak_ops, GIL_FREE,
        "this build's VNNI peak on all threads in operations a second (vpdpbusd: a byte product and its sum, 2 per "
        "product; 0 where the build has no VNNI): the linear layers' arithmetic, two byte products per weight and x "
        "row; register-resident chains, about 10 ms");
  m.def("quant_attention", &triforce::quant_attention, GIL_FREE,
        "softmax(q k^T * scale) v for q [H, R, D] fp32 over a quantized KV cache: planes k_hi/k_lo/v_hi/v_lo "
        "[H, Sq, D/2] uint8 (lower planes empty: 4-bit reading), fp16 scales/zeros (keys [H, Sq/64, D], values "
        "[H, Sq, D/32]), lim [R] (quantized positions row r reads), buffer fk/fv [H, F, D] with fmask [T, F]",
        py::arg("q"), py::arg("k_hi"), py::arg("k_lo"), py::arg("k_scale"), py::arg("k_zero"), py::arg("v_hi"),
        py::arg("v_lo"), py::arg("v_scale"), py::arg("v_zero"), py::arg("lim"), py::arg("fk"), py::arg("fv"),
        py::arg("fmask"), py::arg("T"), py::arg("scale"));
  m.def("chunk_scores", &triforce::chunk_scores, GIL_FREE,
        "the retrieval cache's chunk scores: q [H, D] fp32 . the mean of each chunk of c keys of keys [H, N, D] (fp32, "
        "bf16 or fp16) -> [H, N / c] fp32", py::arg("keys"), py::arg("q"), py::arg("c"));
  m.def("rms_norm", &triforce::rms_norm, GIL_FREE, "x [..., C] -> x / sqrt(mean(x^2) + eps) * weight");
  m.def("rope_split", &triforce::rope_split, GIL_FREE,
        "qkv [B, T, (Hq + 2 Hkv) D], cos/sin [T, D] -> q [B, Hq, T, D], k [B, Hkv, T, D] (both rotated), v [B, Hkv, T, D]");
  m.def("linear_panels", &triforce::linear_panels, GIL_FREE,
        "x [..., K] fp32 @ W^T, W (fp32 or bf16) in 16-output panels [P, K, 16] -> [..., N] fp32");
  m.def("linear_quant", &triforce::linear_quant, GIL_FREE,
        "x [..., K] fp32 @ W^T, W given as parts [N_i, row_bytes] uint8 in GGML types (F16, BF16, Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) -> [..., sum N_i] fp32");
  m.def("linear_packed", &triforce::linear_packed, GIL_FREE,
        "x [..., K] fp32 @ W^T, W given as parts in Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K repacked 16 rows at a time "
        "[ceil(N_i / 16), 16 row_bytes] uint8 with N_i rows each -> [..., sum N_i] fp32 (x taken to 16 bits per block)",
        py::arg("x"), py::arg("parts"), py::arg("types"), py::arg("rows"));
  // the GGML types whose many-row path linear_packed has (from 4-16 rows per format, the tiles' bits): QuantLinear
  // sends a verification's 17-64 rows through it in one call instead of 16 rows at a time
  m.attr("PACKED_MANY_ROWS") = py::cast(triforce::packed_many_rows_types());
  // whether linear_packed takes a prefill's rows too (faster than dequantized weights through PyTorch's GEMM here)
  m.attr("PACKED_PREFILL") = triforce::packed_prefill();
  m.def("unpack_rows", &triforce::unpack_rows, GIL_FREE,
        "rows [start, stop) of a linear_packed part back in the file's layout [stop - start, row_bytes] uint8 "
        "(head / tail: each block's scale bytes before / after its code words, size: its bytes)",
        py::arg("packed"), py::arg("head"), py::arg("tail"), py::arg("size"), py::arg("start"), py::arg("stop"));
  m.def("dequantize_rows", &triforce::dequantize_rows, GIL_FREE,
        "raw [N, row_bytes] uint8 of a GGML type -> its fp32 values [N, K]");
  m.def("silu_mul", &triforce::silu_mul, GIL_FREE, "[..., 2F] -> silu(first half) * second half [..., F]");
  // module_local: each ISA's module registers its own type (two variants may be loaded in one process)
  py::class_<triforce::LayerStack>(m, "LayerStack", py::module_local(),
                                   "every decoder layer's weights as decode_layers takes them, converted once")
      .def(py::init([](const py::list& layers) {
             // each: execution/fused.py's layer_args tuple (attn_norm, mlp_norm, eps, then per linear parts, types, rows,
             // qkv's bias after its own) followed by the attention scale
             triforce::LayerStack stack;
             for (const auto& item : layers) {
               const auto t = item.cast<py::tuple>();
               TORCH_CHECK(t.size() == 17, "LayerStack: each layer is layer_args' 16 values and a scale");
               auto lin = [&](size_t i) {
                 return triforce::LinearWeights{t[i].cast<std::vector<torch::Tensor>>(),
                                                t[i + 1].cast<std::vector<int64_t>>(),
                                                t[i + 2].cast<std::vector<int64_t>>()};
               };
               stack.layers.push_back({t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(), t[2].cast<double>(),
                                       lin(3), t[6].cast<c10::optional<torch::Tensor>>(), lin(7), lin(10), lin(13),
                                       t[16].cast<double>()});
             }
             return stack;
           }),
           py::arg("layers"));
  m.def("decode_layers", &triforce::decode_layers, GIL_FREE,
        "every decoder layer of a T <= 16-token forward in turn over the cache k/v [n_layers, 1, Hkv, capacity, D] "
        "written at `slot` (model.Block.forward's kernel path) -> [x] + (each layer's rotated q if `queries`)",
        py::arg("x"), py::arg("stack"), py::arg("cos"), py::arg("sin"), py::arg("n_heads"), py::arg("n_kv_heads"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot"), py::arg("queries"), py::arg("gap") = py::none());
  m.def("decode_layers_batch", &triforce::decode_layers_batch, GIL_FREE,
        "decode_layers over several sequences at once: x [1, R, hidden] holds each segment's rows in order, each "
        "over its own cache (k_caches[s], v_caches[s], slots[s], rows[s], gaps: [] or one per segment, empty for "
        "none); linear layers over all R rows, attention per segment -> [x] + (per layer, each segment's rotated q)",
        py::arg("x"), py::arg("stack"), py::arg("cos"), py::arg("sin"), py::arg("n_heads"), py::arg("n_kv_heads"),
        py::arg("k_caches"), py::arg("v_caches"), py::arg("slots"), py::arg("rows"), py::arg("queries"),
        py::arg("gaps"));
  m.def("decode_layers_quant", &triforce::decode_layers_quant, GIL_FREE,
        "decode_layers over a quantized cache (caches/quantized.py QuantizedCache.fused_inputs) -> [x] + (each "
        "layer's rotated q if `queries`)",
        py::arg("x"), py::arg("stack"), py::arg("cos"), py::arg("sin"), py::arg("n_heads"), py::arg("n_kv_heads"),
        py::arg("planes"), py::arg("q_end"), py::arg("lim"), py::arg("fk"), py::arg("fv"), py::arg("slot"),
        py::arg("fmask"), py::arg("queries"));
}
