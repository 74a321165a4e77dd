// The retrieval cache's chunk scores (caches/retrieval.py, RetrievalCache.select): a chunk of c keys is scored by
// its mean key, q . (k_0 + ... + k_{c-1}) / c. Done in PyTorch as a widened copy of every key, a sum over each chunk
// and a product with the query, it took 63-70 ms over the embedded model's 30 layers at 32K on an Intel Xeon (fp16 or
// bf16 keys), against 14 ms to read the keys once at its 26 GB/s; this takes 20-26 (benchmarks/chunk_scores_ab.py).
// Each key is read once, widened in registers and added to its chunk's fp32 sum (keys in order), and the chunk's
// score is that sum's dot product with the query, reduced over the lanes, divided by c.
// Written over simd.h's Vec (one source for AVX2 and AVX-512).
#include <ATen/Parallel.h>

#include "ops.h"
#include "simd.h"

namespace triforce {
namespace {

template <int64_t D, typename KV>
void chunk_scores_head(const KV* k, const float* q, int64_t c, float* out, int64_t j0, int64_t j1) {
  constexpr int NC = D / W;
  Vec qv[NC];
  for (int i = 0; i < NC; ++i) qv[i] = Vec::loadu(q + i * W);
  const float inv = 1.0f / static_cast<float>(c);
  for (int64_t j = j0; j < j1; ++j) {
    const KV* kj = k + j * c * D;
    Vec sum[NC];
    for (int i = 0; i < NC; ++i) sum[i] = load(kj + i * W);
    for (int64_t t = 1; t < c; ++t)
      for (int i = 0; i < NC; ++i) sum[i] = sum[i] + load(kj + t * D + i * W);
    Vec dot = sum[0] * qv[0];
    for (int i = 1; i < NC; ++i) dot = fma(sum[i], qv[i], dot);
    out[j] = reduce_add(dot) * inv;
  }
}

template <typename KV>
void chunk_scores_typed(const torch::Tensor& keys, const torch::Tensor& q, int64_t c, int64_t n_chunks,
                        torch::Tensor& out) {
  const int64_t H = keys.size(0), D = keys.size(2), hs = keys.stride(0);
  const KV* kp = reinterpret_cast<const KV*>(keys.data_ptr());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // work items of about 64 KB of keys, over every head: 3 KV heads on 2 threads split evenly
  const int64_t per_item = std::max<int64_t>(1, (int64_t{1} << 16) / (c * D * int64_t(sizeof(KV))));
  const int64_t items_per_head = (n_chunks + per_item - 1) / per_item;
  at::parallel_for(0, H * items_per_head, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t h = it / items_per_head, j0 = (it % items_per_head) * per_item;
      const int64_t j1 = std::min(n_chunks, j0 + per_item);
      const KV* kh = kp + h * hs;
      switch (D) {
        case 64: chunk_scores_head<64>(kh, qp + h * 64, c, op + h * n_chunks, j0, j1); break;
        case 128: chunk_scores_head<128>(kh, qp + h * 128, c, op + h * n_chunks, j0, j1); break;
        default: chunk_scores_head<256>(kh, qp + h * 256, c, op + h * n_chunks, j0, j1); break;
      }
    }
  });
}

}  // namespace

torch::Tensor chunk_scores(torch::Tensor keys, torch::Tensor q, int64_t c) {
  TORCH_CHECK(keys.dim() == 3 && q.dim() == 2 && q.size(0) == keys.size(0) && q.size(1) == keys.size(2),
              "chunk_scores: keys [H, N, D], q [H, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat, "chunk_scores: fp32 queries");
  const int64_t D = keys.size(2);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "chunk_scores: head dim 64, 128 or 256");
  TORCH_CHECK(c >= 1, "chunk_scores: chunk size >= 1");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == D, "chunk_scores: each head's keys contiguous");
  q = q.contiguous();
  const int64_t n_chunks = keys.size(1) / c;
  auto out = torch::empty({keys.size(0), n_chunks}, q.options());
  if (n_chunks == 0) return out;
  switch (keys.scalar_type()) {
    case torch::kFloat: chunk_scores_typed<float>(keys, q, c, n_chunks, out); break;
    case torch::kBFloat16: chunk_scores_typed<c10::BFloat16>(keys, q, c, n_chunks, out); break;
    case torch::kHalf: chunk_scores_typed<c10::Half>(keys, q, c, n_chunks, out); break;
    default: TORCH_CHECK(false, "chunk_scores: keys in fp32, bf16 or fp16");
  }
  return out;
}

}  // namespace triforce
