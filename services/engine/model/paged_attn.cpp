// Paged decode attention on the CPU: one query token per sequence against its context K/V, read in place
// from the paged pool through the block table. Design note: services/engine/model/paged_attn.py.
//
// Per (sequence b, kv head h) task: the G = H / KVH query heads that share kv head h are scored together
// against each visible K row (the row is converted to float once, then G dot products), a max-subtracted
// softmax over the float score buffer (two passes: scores, then weights), and the weighted V rows summed
// into G float accumulators. K/V rows are taken in runs within one page (one block-table read per run) and
// the next run's rows are prefetched. Plain C++ loops the compiler vectorizes (OpenMP simd pragmas on the
// reductions, a polynomial exp); correct with or without -march=native and OpenMP (checked with -O2 alone).
// Tasks are parallel over (sequence, kv head) with at::parallel_for, which needs -fopenmp to use torch's
// OpenMP threads (it links to the libgomp torch already loaded); without it the tasks run serially.

#include <torch/extension.h>

#include "cpu_math.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the high half of an fp32: a shift, no rounding
  return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

// Reductions as OpenMP simd loops: the pragma allows the reassociation a vectorized sum needs (compiled
// without OpenMP it is ignored and the loops run in order: slower, same results up to rounding).
inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline float max_of(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = mx > x[i] ? mx : x[i];
  return mx;
}

inline float sum_of(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

constexpr int64_t kBlock = 16;  // K/V rows converted to float and used together (at most one page's run)

// Calls fn(j, slot, cnt) for runs of cnt <= kBlock consecutive context positions j.. in [start, n) that lie
// in one page (one table read and one division per run): slot = block_table[j / page_size] * page_size +
// j % page_size is the pool row of position j, and the run's rows are slot .. slot + cnt - 1.
// Before each run, the rows of the next run are prefetched (pages are scattered: the hardware prefetcher
// cannot guess where the next one starts): row(slot) is a row's address, row_bytes its length.
template <typename Row, typename Fn>
inline void for_blocks(const int32_t* table, int64_t page_size, int64_t start, int64_t n, Row&& row,
                       int64_t row_bytes, Fn&& fn) {
  auto run_at = [&](int64_t j, int64_t& slot) {
    const int64_t page = j / page_size, off = j - page * page_size;
    slot = static_cast<int64_t>(table[page]) * page_size + off;
    return std::min({n - j, page_size - off, kBlock});
  };
  int64_t slot = 0, cnt = start < n ? run_at(start, slot) : 0;
  for (int64_t j = start; j < n;) {
    int64_t next_slot = 0;
    const int64_t next_cnt = j + cnt < n ? run_at(j + cnt, next_slot) : 0;
    for (int64_t r = 0; r < next_cnt; ++r)
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row(next_slot + r)) + b);
    fn(j, slot, cnt);
    j += cnt;
    slot = next_slot;
    cnt = next_cnt;
  }
}

struct Shape {
  int64_t B, H, KVH, G, D, P, page_size, window;
  int64_t qs0, qs1, os0, os1, ks0, ks1, vs0, vs1;
  float scale;
};

// One task: sequence b, kv head kh. buf holds G*m scores + G*D accumulators + G*D scaled queries + kBlock
// float rows. (Keeping a V accumulator chunk in registers across a block of rows measured slower here than
// the per-row update below, which GCC vectorizes cleanly.)
// DC: the head dim when known at compile time (the row loops then unroll and stay in registers), else 0.
template <typename T, int DC>
void attend_one(const Shape& s, int64_t b, int64_t kh, const T* q, const T* k, const T* v, const int32_t* tables,
                const int32_t* lens, T* out, std::vector<float>& buf) {
  const int64_t n = lens[b];
  const int64_t start = s.window > 0 ? std::max<int64_t>(0, n - s.window) : 0;
  const int64_t m = n - start;  // visible keys: start .. n-1
  const int64_t G = s.G, D = DC > 0 ? DC : s.D;
  buf.resize(static_cast<size_t>(G * m + 2 * G * D + kBlock * D));
  float* scores = buf.data();
  float* acc = scores + G * m;
  float* qf = acc + G * D;
  float* rows = qf + G * D;
  for (int64_t g = 0; g < G; ++g) {
    const T* qrow = q + b * s.qs0 + (kh * G + g) * s.qs1;
    for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(qrow[i]) * s.scale;
  }
  std::fill(acc, acc + G * D, 0.f);
  const int32_t* table = tables + b * s.P;
  const T* kh_base = k + kh * s.ks1;
  auto krow = [&](int64_t slot) { return kh_base + slot * s.ks0; };
  for_blocks(table, s.page_size, start, n, krow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {  // scores
    for (int64_t r = 0; r < cnt; ++r) load_row(krow(slot + r), rows + r * D, D);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < cnt; ++r) scores[g * m + (j - start) + r] = dot(qf + g * D, rows + r * D, D);
  });
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {  // numerically stable softmax weights (unnormalized), 1 / sum kept
    float* sg = scores + g * m;
    const float mx = max_of(sg, m);
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) sg[j] = talaria_cpu::exp_clamped(sg[j] - mx);
    const float sum = sum_of(sg, m);
    inv[g] = m > 0 ? 1.f / sum : 0.f;
  }
  const T* vh_base = v + kh * s.vs1;
  auto vrow = [&](int64_t slot) { return vh_base + slot * s.vs0; };
  for_blocks(table, s.page_size, start, n, vrow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {  // V sum
    for (int64_t r = 0; r < cnt; ++r) load_row(vrow(slot + r), rows + r * D, D);
    for (int64_t r = 0; r < cnt; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[g * m + (j - start) + r];
        float* __restrict a = acc + g * D;
        const float* x = rows + r * D;
        for (int64_t i = 0; i < D; ++i) a[i] += w * x[i];
      }
  });
  for (int64_t g = 0; g < G; ++g) {
    T* orow = out + b * s.os0 + (kh * G + g) * s.os1;
    for (int64_t i = 0; i < D; ++i) orow[i] = static_cast<T>(acc[g * D + i] * inv[g]);
  }
}

template <typename T>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
         const at::Tensor& lens, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  auto task = s.D == 64 ? attend_one<T, 64> : s.D == 128 ? attend_one<T, 128> : attend_one<T, 0>;
  at::parallel_for(0, s.B * s.KVH, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t t = lo; t < hi; ++t) task(s, t / s.KVH, t % s.KVH, qp, kp, vp, tp, lp, op, buf);
  });
}

void check_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t page_size, int64_t num_slots) {
  const int64_t B = tables.size(0), P = tables.size(1), pages = num_slots / page_size;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lp[b];
    TORCH_CHECK(n >= 0 && n <= P * page_size, "sequence ", b, ": context length ", n, " exceeds its ", P, " pages");
    for (int64_t p = 0; p < (n + page_size - 1) / page_size; ++p)
      TORCH_CHECK(tp[b * P + p] >= 0 && tp[b * P + p] < pages, "sequence ", b, ": page ", tp[b * P + p],
                  " outside the pool of ", pages, " pages");
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t page_size, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [B,H,D], pools [S,KVH,D]");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q, k_pool and v_pool must share a dtype");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool and v_pool shapes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables and lengths");
  TORCH_CHECK(page_size > 0 && window >= 0, "page_size > 0, window >= 0");
  if (q.stride(2) != 1) q = q.contiguous();
  if (k_pool.stride(2) != 1) k_pool = k_pool.contiguous();
  if (v_pool.stride(2) != 1) v_pool = v_pool.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  Shape s;
  s.B = q.size(0); s.H = q.size(1); s.D = q.size(2); s.KVH = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == s.D, "head dims differ");
  TORCH_CHECK(s.KVH > 0 && s.H % s.KVH == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == s.B && context_lens.numel() == s.B,
              "block_tables [B, pages] and context_lens [B]");
  check_tables(block_tables, context_lens, page_size, k_pool.size(0));
  s.G = s.H / s.KVH; s.P = block_tables.size(1); s.page_size = page_size; s.window = window;
  s.scale = static_cast<float>(scale);
  at::Tensor out = at::empty({s.B, s.H, s.D}, q.options());
  s.qs0 = q.stride(0); s.qs1 = q.stride(1); s.os0 = out.stride(0); s.os1 = out.stride(1);
  s.ks0 = k_pool.stride(0); s.ks1 = k_pool.stride(1); s.vs0 = v_pool.stride(0); s.vs1 = v_pool.stride(1);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(s, q, k_pool, v_pool, block_tables, context_lens, out); break;
    case at::kBFloat16: run<c10::BFloat16>(s, q, k_pool, v_pool, block_tables, context_lens, out); break;
    case at::kHalf: run<c10::Half>(s, q, k_pool, v_pool, block_tables, context_lens, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
  return out;
}

// the fused elementwise ops of fused_ops.cpp (same extension: one build, one load)
at::Tensor fused_rms_norm(at::Tensor x, at::Tensor w, double eps);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(at::Tensor x, at::Tensor res, at::Tensor w, double eps);
at::Tensor fused_silu_mul(at::Tensor gu);
at::Tensor fused_rope(at::Tensor x, at::Tensor cos, at::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, in place over the pool)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_rms_norm", &fused_rms_norm, "RMSNorm in one pass (fused_ops.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm in one pass (fused_ops.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_silu_mul", &fused_silu_mul, "SiLU(gate) * up in one pass (fused_ops.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_rope", &fused_rope, "rotary embedding in one pass (fused_ops.cpp)", py::call_guard<py::gil_scoped_release>());
}
