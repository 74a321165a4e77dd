// y = x W^T for a few rows of x (a decode step, or the verification of a few draft tokens), with
// W in fp32 or bf16 and x, y and the accumulation in fp32. Decoding reads every weight once per
// forward, so it must stream W at memory bandwidth whatever the number of rows: MKL's GEMM with
// 2-16 rows did not (a 7-row forward's linear layers cost 1.6-2.3x a 1-row one), this does.
// bf16 weights halve the bytes read: draft levels use them (the top level verifies with the fp32
// weights, so the output stays the target's). PyTorch's bf16 paths convert the activations too and
// were no faster than fp32 on this CPU.
//
// W is stored in panels of 16 output features, [P, K, 16] (P = ceil(N / 16), zero-padded): for
// each input feature k the 16 weights of a panel are one load (two on AVX2; bf16: widened to fp32
// by a shift), multiplied by x[t][k] broadcast, accumulating 16 outputs per panel: no horizontal sums.
// One source over simd.h's Vec for AVX2 and AVX-512; register tiles sized from W and REGS.
#include <ATen/Parallel.h>

#include "ops.h"
#include "simd.h"

namespace triforce {
namespace {

constexpr int64_t PB = 4;             // fewest panels per thread
constexpr int VP = 16 / W;            // vectors per 16-output panel: 1 (AVX-512) or 2 (AVX2)
constexpr int64_t TB = W == 16 ? 8 : 6;  // rows of x per pass over the weights

// panels per pass for NT rows: NP x VP x NT accumulators + NP x VP weights + 1 broadcast within the
// registers (AVX-512, 1 row: 4 panels; 8 rows: 3. AVX2, 1 row: 3 panels; 2: 2; 3 to 6: 1)
template <int NT>
constexpr int panels_per_pass() {
  int best = 1;
  for (int np = 1; np <= 4; ++np)
    if (np * VP * NT + np * VP + 1 <= REGS - 1) best = np;
  return best;
}

template <int NP, int NT, typename Wt>
void panels_rows(const float* x, int64_t K, const Wt* w, int64_t p0, float* y, int64_t N) {
  Vec acc[NP][VP][NT];
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[NP][VP];
    for (int i = 0; i < NP; ++i)
      for (int c = 0; c < VP; ++c) wv[i][c] = load(w + ((p0 + i) * K + k) * 16 + c * W);
    for (int t = 0; t < NT; ++t) {
      const Vec xb(x[t * K + k]);
      for (int i = 0; i < NP; ++i)
        for (int c = 0; c < VP; ++c) acc[i][c][t] = fma(xb, wv[i][c], acc[i][c][t]);
    }
  }
  for (int i = 0; i < NP; ++i) {
    const int64_t o = (p0 + i) * 16;
    for (int c = 0; c < VP; ++c)
      for (int t = 0; t < NT; ++t) store(acc[i][c][t], y + t * N + o + c * W, N - o - c * W);
  }
}

// A thread's panels for NT rows, NP panels at a time.
template <int NT, typename Wt>
void rows_block(const float* x, int64_t K, const Wt* w, int64_t p0, int64_t np, float* y, int64_t N) {
  constexpr int NP = panels_per_pass<NT>();
  int64_t p = p0;
  for (; p + NP <= p0 + np; p += NP) panels_rows<NP, NT>(x, K, w, p, y, N);
  for (; p < p0 + np; ++p) panels_rows<1, NT>(x, K, w, p, y, N);
}

template <typename Wt>
void run(const float* xp, const Wt* wp, float* yp, int64_t M, int64_t K, int64_t N, int64_t P) {
  at::parallel_for(0, P, PB, [&](int64_t p0, int64_t e) {  // each thread: a contiguous range of panels
    const int64_t np = e - p0;
    for (int64_t r = 0; r < M; r += TB) {
      const float* xr = xp + r * K;
      float* yr = yp + r * N;
      switch (std::min(TB, M - r)) {
        case 1: rows_block<1>(xr, K, wp, p0, np, yr, N); break;
        case 2: rows_block<2>(xr, K, wp, p0, np, yr, N); break;
        case 3: rows_block<3>(xr, K, wp, p0, np, yr, N); break;
        case 4: rows_block<4>(xr, K, wp, p0, np, yr, N); break;
        case 5: rows_block<5>(xr, K, wp, p0, np, yr, N); break;
        case 6: rows_block<6>(xr, K, wp, p0, np, yr, N); break;
        case 7: rows_block<7>(xr, K, wp, p0, np, yr, N); break;
        default: rows_block<TB>(xr, K, wp, p0, np, yr, N);
      }
    }
  });
}

}  // namespace

torch::Tensor linear_panels(torch::Tensor x, torch::Tensor panels, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "linear_panels: x must be fp32");
  const bool bf16 = panels.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || panels.scalar_type() == torch::kFloat) && panels.dim() == 3 && panels.size(2) == 16 &&
                  panels.is_contiguous(), "linear_panels: panels [P, K, 16] fp32 or bf16, contiguous");
  const int64_t P = panels.size(0), K = panels.size(1), N = out_features;
  TORCH_CHECK(x.size(-1) == K && (N + 15) / 16 == P, "linear_panels: shapes");
  x = x.contiguous();
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  if (bf16)
    run(x.data_ptr<float>(), panels.data_ptr<at::BFloat16>(), y.data_ptr<float>(),
        M, K, N, P);
  else
    run(x.data_ptr<float>(), panels.data_ptr<float>(), y.data_ptr<float>(), M, K, N, P);
  return y;
}

}  // namespace triforce
