// Small float helpers shared by the CPU kernels (paged_attn.cpp, fused_ops.cpp).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace talaria_cpu {

// exp(x) in branch-free float arithmetic the compiler vectorizes (libm's expf is a call per element):
// x = (i + f) ln2 with i the integer nearest x / ln2 (found by adding 1.5 * 2^23, which leaves i in the low
// mantissa bits under round-to-nearest), 2^f by its degree-7 Taylor polynomial in f ln2 (|f| <= 1/2:
// relative error < 1e-8; Horner steps as explicit fused multiply-adds, which the sources' fp-contract=off
// leaves alone: half the vector operations), 2^i through the exponent bits. x is clamped to [-87, 88]: exp(-87) for anything
// below (no denormals), exp(88) < FLT_MAX for anything above.
inline float exp_clamped(float x) {
  constexpr float kShift = 12582912.f;  // 1.5 * 2^23
  x = x > -87.f ? x : -87.f;
  x = x < 88.f ? x : 88.f;
  const float y = std::fma(x, 1.44269504088896341f, kShift);
  const float fi = y - kShift;  // round(x / ln2)
  const int32_t i = std::bit_cast<int32_t>(y) - std::bit_cast<int32_t>(kShift);
  const float r = std::fma(-fi, 0.69314718055994531f, x);  // f ln2, |r| <= ln2 / 2 (+ rounding)
  float p = 1.f / 5040.f;
  p = std::fma(p, r, 1.f / 720.f);
  p = std::fma(p, r, 1.f / 120.f);
  p = std::fma(p, r, 1.f / 24.f);
  p = std::fma(p, r, 1.f / 6.f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  return p * std::bit_cast<float>((i + 127) << 23);
}

}  // namespace talaria_cpu
