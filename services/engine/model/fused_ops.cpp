// Fused elementwise parts of a transformer layer on the CPU: RMSNorm (optionally after the residual add),
// SiLU(gate) * up, and rotary embedding. Design note: services/engine/model/fused_ops.py.
//
// Each op is one pass over its rows instead of the 4-6 ATen kernels (and their temporaries) the eager
// code runs, and rounds to the storage dtype exactly where the eager code's intermediate tensors do, so in
// bf16 the result equals eager's except where the float math itself differs (a reduction's order, the
// polynomial exp): at most one bf16 step, rarely. Rows run in parallel with at::parallel_for over chunks of
// at least kGrainElems elements, so a decode step's few rows stay on the calling thread (no team barrier).

#include <torch/extension.h>

#include "cpu_math.h"
#include <ATen/Parallel.h>

// No a*b+c contraction into FMAs in this file: eager rounds each product before the sum (RoPE, the norm's
// scaling), and float32 results should match it too.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t kGrainElems = 32768;  // ATen's own grain for elementwise kernels

// Storage types: float, or bf16 as its raw 16 bits (uint16_t: plain integer ops the compiler vectorizes;
// c10::BFloat16's struct kept these loops scalar).
inline float load(float x) { return x; }
inline float load(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }

// float -> storage, rounding to nearest even as c10::BFloat16 does (NaN stays a quiet NaN).
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  *dst = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
}
// the value a tensor of dtype T holds after storing x (eager's intermediate rounding)
inline float round_to_t(float x, float*) { return x; }
inline float round_to_t(float x, uint16_t*) {
  uint16_t t;
  store(&t, x);
  return load(t);
}
template <typename T>
inline float round_to(float x) { return round_to_t(x, static_cast<T*>(nullptr)); }

template <typename T>
inline T* data(const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }  // bf16 data as uint16_t bits

inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

// eager: w * F.rms_norm(x.float()).to(T)  ->  round(w * round(x * rsqrt(mean(x^2) + eps)))
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) store(out + i, load(w[i]) * round_to<T>(load(x[i]) * inv));
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, float eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = data<T>(x);
  const T* wp = data<T>(w);
  T* op = data<T>(out);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * n, wp, op + r * n, n, eps);
  });
}

// eager: h = x + r (rounded to T); out = rms_norm(h)
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, at::Tensor& h,
                       at::Tensor& out, float eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = data<T>(x);
  const T* rp = data<T>(res);
  const T* wp = data<T>(w);
  T* hp = data<T>(h);
  T* op = data<T>(out);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* hr = hp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(hr + i, load(xp[r * n + i]) + load(rp[r * n + i]));
      norm_row(hr, wp, op + r * n, n, eps);
    }
  });
}

// eager: F.silu(gate) * up with gate, up = gu.chunk(2, -1)  ->  round(round(g / (1 + exp(-g))) * u)
template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t two_i = gu.size(-1), inter = two_i / 2, rows = gu.numel() / two_i;
  const T* gp = data<T>(gu);
  T* op = data<T>(out);
  at::parallel_for(0, rows, grain_rows(two_i), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * two_i;
      const T* u = g + inter;
      T* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = load(g[i]);
        store(o + i, round_to<T>(gv / (1.f + talaria_cpu::exp_clamped(-gv))) * load(u[i]));
      }
    }
  });
}

// Gemma's norm, eager: (F.rms_norm(x.float()) * (1 + w.float())).to(T)  ->  round(x * rsqrt(mean(x^2) + eps) * (1 + w)),
// one rounding (the weight is zero-centred and applied in float, unlike norm_row's w * round(norm)).
template <typename T>
void gemma_rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, float eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = data<T>(x);
  const T* wp = data<T>(w);
  T* op = data<T>(out);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = load(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(op + r * n + i, load(xr[i]) * inv * (1.f + load(wp[i])));
    }
  });
}

// eager: F.gelu(gate, approximate="tanh") * up with gate, up = gu.chunk(2, -1)
//   ->  round(round(0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))) * u)   (Gemma's GeGLU)
template <typename T>
void gelu_tanh_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t two_i = gu.size(-1), inter = two_i / 2, rows = gu.numel() / two_i;
  const T* gp = data<T>(gu);
  T* op = data<T>(out);
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  at::parallel_for(0, rows, grain_rows(two_i), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * two_i;
      const T* u = g + inter;
      T* o = op + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = load(g[i]);
        const float act = 0.5f * gv * (1.f + std::tanh(kBeta * (gv + kKappa * gv * gv * gv)));
        store(o + i, round_to<T>(act) * load(u[i]));
      }
    }
  });
}

// eager apply_rope: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T.
// x [tokens, heads, D] (any token/head strides, unit stride in D); cos/sin [tokens, 1, D] -> out contiguous.
template <typename T>
void rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  const T* xp = data<T>(x);
  const T* cp = data<T>(cos);
  const T* sp = data<T>(sin);
  T* op = data<T>(out);
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cp + t * cs0;
      const T* s = sp + t * ss0;
      for (int64_t hd = 0; hd < heads; ++hd) {
        const T* xr = xp + t * xs0 + hd * xs1;
        T* o = op + (t * heads + hd) * d;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(xr[i]), x2 = load(xr[i + half]);
          store(o + i, round_to<T>(x1 * load(c[i])) + round_to<T>(-x2 * load(s[i])));
          store(o + i + half, round_to<T>(x2 * load(c[i + half])) + round_to<T>(x1 * load(s[i + half])));
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(t.is_contiguous(), what, ": must be contiguous");
}

#define TALARIA_DISPATCH(dtype, ...)                                             \
  switch (dtype) {                                                               \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }               \
    case at::kBFloat16: { using scalar = uint16_t; __VA_ARGS__; break; }         \
    default: TORCH_CHECK(false, "fused ops: unsupported dtype ", dtype);         \
  }

}  // namespace

at::Tensor fused_rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(w, "weight");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "weight [N] for x [..., N]");
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  TALARIA_DISPATCH(x.scalar_type(), rms_norm_impl<scalar>(x, w, out, static_cast<float>(eps)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(at::Tensor x, at::Tensor res, at::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(res, "residual");
  check_rows(w, "weight");
  TORCH_CHECK(x.scalar_type() == res.scalar_type() && x.scalar_type() == w.scalar_type(), "x, residual and weight must share a dtype");
  TORCH_CHECK(x.sizes() == res.sizes(), "x and residual shapes differ");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "weight [N] for x [..., N]");
  at::Tensor h = at::empty_like(x), out = at::empty_like(x);
  if (x.numel() == 0) return {h, out};
  TALARIA_DISPATCH(x.scalar_type(), add_rms_norm_impl<scalar>(x, res, w, h, out, static_cast<float>(eps)));
  return {h, out};
}

at::Tensor fused_silu_mul(at::Tensor gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "gate_up [..., 2 * I]");
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, gu.options());
  if (gu.numel() == 0) return out;
  TALARIA_DISPATCH(gu.scalar_type(), silu_mul_impl<scalar>(gu, out));
  return out;
}

at::Tensor fused_gemma_rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(w, "weight");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "weight [N] for x [..., N]");
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  TALARIA_DISPATCH(x.scalar_type(), gemma_rms_norm_impl<scalar>(x, w, out, static_cast<float>(eps)));
  return out;
}

at::Tensor fused_gelu_tanh_mul(at::Tensor gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "gate_up [..., 2 * I]");
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, gu.options());
  if (gu.numel() == 0) return out;
  TALARIA_DISPATCH(gu.scalar_type(), gelu_tanh_mul_impl<scalar>(gu, out));
  return out;
}

at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x [tokens, heads, D] with unit stride in D, D even");
  TORCH_CHECK(cos.dim() == 3 && sin.dim() == 3 && cos.size(0) == x.size(0) && sin.size(0) == x.size(0) &&
              cos.size(2) == x.size(2) && sin.size(2) == x.size(2) && cos.stride(2) == 1 && sin.stride(2) == 1,
              "cos/sin [tokens, 1, D] with unit stride in D");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(), "x, cos and sin must share a dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.numel() == 0) return out;
  TALARIA_DISPATCH(x.scalar_type(), rope_impl<scalar>(x, cos, sin, out));
  return out;
}
