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
constexpr int kMaxRows = 8;     // rows per register pass (2 x 8 accumulators + 2 weights + 1 broadcast <= 32 zmm)

#ifdef TALARIA_DECODE_GEMM
// R rows x (one or two) column blocks over the whole K: the weight block [Kp][16][2] is streamed once per pass,
// each row's k-pair broadcast against it (VDPBF16PS: acc[j] += w[j][0] * x[k] + w[j][1] * x[k + 1], float32).
template <int R>
void column_pair(const uint32_t* const* xr, const uint16_t* w0p, const uint16_t* w1p, int64_t kp_n, const float* bias,
                 c10::BFloat16* const* yr, int64_t n0, int64_t n) {
  __m512 acc0[R], acc1[R];
  for (int m = 0; m < R; ++m) {
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  const bool two = w1p != nullptr;
  for (int64_t kp = 0; kp < kp_n; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w0p + kp * 2 * kCols);
    const __m512bh w1 = two ? (__m512bh)_mm512_loadu_si512(w1p + kp * 2 * kCols) : w0;
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[m][kp]));
      acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, xb);
      if (two) acc1[m] = _mm512_dpbf16_ps(acc1[m], w1, xb);
    }
  }
  const int64_t left0 = std::min<int64_t>(kCols, n - n0);
  const int64_t left1 = two ? std::min<int64_t>(kCols, n - n0 - kCols) : 0;
  const __mmask16 k0 = static_cast<__mmask16>((1u << left0) - 1);
  const __mmask16 k1 = static_cast<__mmask16>((1u << std::max<int64_t>(0, left1)) - 1);
  const __m512 b0 = bias != nullptr ? _mm512_maskz_loadu_ps(k0, bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias != nullptr && two ? _mm512_maskz_loadu_ps(k1, bias + n0 + kCols) : _mm512_setzero_ps();
  for (int m = 0; m < R; ++m) {  // float32 sum + bias, rounded to bf16 once (nearest even), as oneDNN's output
    _mm256_mask_storeu_epi16(yr[m] + n0, k0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc0[m], b0)));
    if (two) _mm256_mask_storeu_epi16(yr[m] + n0 + kCols, k1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc1[m], b1)));
  }
}

template <int R>
void columns(const uint32_t* const* xr, const uint16_t* w, int64_t kp_n, const float* bias, c10::BFloat16* const* yr,
             int64_t n, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const uint16_t* w0 = w + nb * kp_n * 2 * kCols;
    const uint16_t* w1 = nb + 1 < nb1 ? w0 + kp_n * 2 * kCols : nullptr;
    column_pair<R>(xr, w0, w1, kp_n, bias, yr, nb * kCols, n);
  }
}

using ColumnsFn = void (*)(const uint32_t* const*, const uint16_t*, int64_t, const float*, c10::BFloat16* const*, int64_t,
                           int64_t, int64_t);
constexpr ColumnsFn kColumns[kMaxRows] = {columns<1>, columns<2>, columns<3>, columns<4>,
                                          columns<5>, columns<6>, columns<7>, columns<8>};
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
// undefined. Column blocks in pairs are spread over torch's threads; every pass streams the weights once for up to 8 rows.
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
  const int64_t pairs = (nb_n + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, pairs / (4 * at::get_num_threads()));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    const int64_t nb0 = p0 * 2, nb1 = std::min(nb_n, p1 * 2);
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      const int r = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m0));
      const uint32_t* xr[kMaxRows];
      c10::BFloat16* yr[kMaxRows];
      for (int m = 0; m < r; ++m) {
        xr[m] = xp + (m0 + m) * kp_n;
        yr[m] = yp + (m0 + m) * n;
      }
      kColumns[r - 1](xr, wp, kp_n, bp, yr, n, nb0, nb1);
    }
  });
  return y.view(sizes);
#else
  TORCH_CHECK(false, "decode_gemm: this build has no AVX-512 BF16 (decode_gemm_supported() is false)");
#endif
}
