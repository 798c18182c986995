// Decode GEMM: y = x W^T + b for the few rows of a decode step, bf16, on AVX-512 BF16 (VDPBF16PS).
// Design note and measurements: decode_gemm.py. Built into the paged-attention extension (paged_attn.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TALARIA_DECODE_GEMM 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 16;   // outputs per column block: one zmm of float32 accumulators
constexpr int kPassRows = 4;    // rows per register pass
constexpr int kGroupBlocks = 4; // column blocks per group (4 x 4 accumulators + 4 weights + 1 broadcast <= 32 zmm)

#ifdef TALARIA_DECODE_GEMM
// R rows x C column blocks over the whole K: the C weight blocks [Kp][16][2] (adjacent in memory) are streamed once
// per call, each row's k-pair broadcast once against all C of them (VDPBF16PS: acc[j] += w[j][0] * x[k] +
// w[j][1] * x[k + 1], float32). Every output's sum runs over k in order in one accumulator, so the result does not
// depend on R or C.
template <int R, int C>
void group(const uint32_t* const* xr, const uint16_t* w, int64_t kp_n, const float* bias, c10::BFloat16* const* yr,
           int64_t n0, int64_t n) {
  __m512 acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t block = kp_n * 2 * kCols;  // elements of one column block
  for (int64_t kp = 0; kp < kp_n; ++kp) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * block + kp * 2 * kCols);
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[m][kp]));
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], wv[c], xb);
    }
  }
  for (int c = 0; c < C; ++c) {  // float32 sum + bias, rounded to bf16 once (nearest even), as oneDNN's output
    const int64_t c0 = n0 + c * kCols;
    const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(kCols, n - c0)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(k, bias + c0) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m)
      _mm256_mask_storeu_epi16(yr[m] + c0, k, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][c], b)));
  }
}

using GroupFn = void (*)(const uint32_t* const*, const uint16_t*, int64_t, const float*, c10::BFloat16* const*, int64_t,
                         int64_t);
template <int R>
constexpr GroupFn kRowGroups[kGroupBlocks] = {group<R, 1>, group<R, 2>, group<R, 3>, group<R, 4>};
constexpr const GroupFn* kGroups[kPassRows] = {kRowGroups<1>, kRowGroups<2>, kRowGroups<3>, kRowGroups<4>};
#endif

}  // namespace

bool decode_gemm_supported() {
#ifdef TALARIA_DECODE_GEMM
  return true;
#else
  return false;
#endif
}

// [N, K] bf16 -> [ceil(N / 16), K / 2, 16, 2] bf16: for each block of 16 outputs, the k-pairs of its 16 rows side by
// side (one 64-byte line per k-pair), rows past N zero. K must be even.
at::Tensor decode_gemm_pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(), "decode_gemm_pack: a [N, K] bf16 CPU weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "decode_gemm_pack: K must be even");
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), kp_n = k / 2, nb_n = (n + kCols - 1) / kCols;
  at::Tensor out = at::zeros({nb_n, kp_n, kCols, 2}, w.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // k-pairs of one row
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, nb_n, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t j = 0; j < kCols && nb * kCols + j < n; ++j) {
        const uint32_t* row = src + (nb * kCols + j) * kp_n;
        for (int64_t kp = 0; kp < kp_n; ++kp) dst[(nb * kp_n + kp) * kCols + j] = row[kp];
      }
  });
  return out;
}

// y [..., N] = x [..., K] W^T + bias for x bf16 with contiguous rows, W packed by decode_gemm_pack; bias float32 [N] or
// undefined. Runs of column blocks are spread over torch's threads; the weights come from memory once per call.
at::Tensor decode_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias_opt) {
#ifdef TALARIA_DECODE_GEMM
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "decode_gemm: bf16 CPU tensors");
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == k && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.size(0) * kCols >= n && packed.is_contiguous(),
              "decode_gemm: the packed weight does not match x / N");
  at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0), kp_n = k / 2, nb_n = (n + kCols - 1) / kCols;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty({rows, n}, x.options());
  at::Tensor bias;
  if (bias_opt.has_value() && bias_opt->defined()) {
    TORCH_CHECK(bias_opt->scalar_type() == at::kFloat && bias_opt->numel() == n && bias_opt->is_contiguous(),
                "decode_gemm: bias float32 [N]");
    bias = *bias_opt;
  }
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x2.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // Each thread takes a run of column blocks; per group of kGroupBlocks blocks, row passes of kPassRows rows: the
  // first pass reads the group's weights from memory, the others find them in L2 (a group is 4 x K x 64 bytes).
  const int64_t grain = std::max<int64_t>(1, nb_n / (4 * at::get_num_threads()));
  at::parallel_for(0, nb_n, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t g = b0; g < b1; g += kGroupBlocks) {
      const int c = static_cast<int>(std::min<int64_t>(kGroupBlocks, b1 - g));
      for (int64_t m0 = 0; m0 < rows; m0 += kPassRows) {
        const int r = static_cast<int>(std::min<int64_t>(kPassRows, rows - m0));
        const uint32_t* xr[kPassRows];
        c10::BFloat16* yr[kPassRows];
        for (int m = 0; m < r; ++m) {
          xr[m] = xp + (m0 + m) * kp_n;
          yr[m] = yp + (m0 + m) * n;
        }
        kGroups[r - 1][c - 1](xr, wp + g * kp_n * 2 * kCols, kp_n, bp, yr, g * kCols, n);
      }
    }
  });
  return y.view(sizes);
#else
  TORCH_CHECK(false, "decode_gemm: this build has no AVX-512 BF16 (decode_gemm_supported() is false)");
#endif
}
