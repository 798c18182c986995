// Paged decode attention on the CPU: one query token per sequence against its context K/V, read in place
// from the paged pool through the block table. Design note: services/engine/model/paged_attn.py.
//
// Where the pool's rows hold the kv heads back to back (the engine's pools) and AVX-512 applies, one task per
// (sequence b, chunk of keys) reads whole rows for every kv head (all_heads_avx512_d64, run_all_heads);
// otherwise, per (sequence b, kv head h) task, over one chunk of its visible keys (the whole context unless there are
// too few tasks for the threads, see split_of): the G = H / KVH query heads that share kv head h are scored
// together against each K row, a max-subtracted softmax over the float score buffer (two passes: scores,
// then weights), and the weighted V rows summed into G float accumulators; a task's chunks are then merged
// (finish_task). K/V rows are taken in runs within one page (one block-table read per run) and the next
// run's rows are prefetched. Chunk bodies: AVX-512 intrinsics for head dim 64 (chunk_avx512_d64) and 256
// (chunk_avx512_wide, Gemma 3), and
// plain C++ loops the compiler vectorizes (OpenMP simd pragmas on the reductions, a polynomial exp) for
// everything else, correct with or without -march=native and OpenMP (checked with -O2 alone).
// Tasks are parallel with at::parallel_for, which needs -fopenmp to use torch's OpenMP threads (it links to
// the libgomp torch already loaded); without it the tasks run serially.

#include <torch/extension.h>

#include "cpu_math.h"
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <utility>
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
  int64_t split_keys = 0;  // 0: split_of's adaptive split; > 0: fixed chunks of this many keys (Split)
  int64_t qs0, qs1, os0, os1, ks0, ks1, vs0, vs1;
  float scale;
};

// One task's result over a chunk of the visible keys, per query head g of its group: the chunk's max score,
// its sum of exp(score - max) and the V rows weighted by those exps (D floats). A task's chunks are merged
// by the usual rescaling (finish_task); a task with one chunk just divides.
inline int64_t part_floats(const Shape& s) { return s.G * (s.D + 2); }

// Numerically stable softmax weights, unnormalized, in place: row g of the [G][m] scores becomes
// exp(score - max); its max and its sum of weights go to mxs[g] and sums[g].
inline void softmax_weights(float* scores, int64_t G, int64_t m, float* mxs, float* sums) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * m;
    const float mx = max_of(sg, m);
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) sg[j] = talaria_cpu::exp_clamped(sg[j] - mx);
    mxs[g] = mx;
    sums[g] = sum_of(sg, m);
  }
}

// The visible keys [start, n) of sequence b.
inline std::pair<int64_t, int64_t> visible(const Shape& s, const int32_t* lens, int64_t b) {
  const int64_t n = lens[b];
  return {s.window > 0 ? std::max<int64_t>(0, n - s.window) : 0, n};
}

// Portable chunk: keys [j0, j1) of task (b, kh). buf holds G*m scores + G*D scaled queries + kBlock float
// rows. (Keeping a V accumulator chunk in registers across a block of rows measured slower here than
// the per-row update below, which GCC vectorizes cleanly.)
// DC: the head dim when known at compile time (the row loops then unroll and stay in registers), else 0.
template <typename T, int DC>
void chunk_portable(const Shape& s, int64_t b, int64_t kh, int64_t j0, int64_t j1, const T* q, const T* k,
                    const T* v, const int32_t* tables, float* part, std::vector<float>& buf) {
  const int64_t m = j1 - j0;
  const int64_t G = s.G, D = DC > 0 ? DC : s.D;
  buf.resize(static_cast<size_t>(G * m + G * D + kBlock * D));
  float* scores = buf.data();
  float* qf = scores + G * m;
  float* rows = qf + G * D;
  float* mxs = part;
  float* sums = part + G;
  float* acc = part + 2 * G;
  for (int64_t g = 0; g < G; ++g) {
    const T* qrow = q + b * s.qs0 + (kh * G + g) * s.qs1;
    for (int64_t i = 0; i < D; ++i) qf[g * D + i] = to_float(qrow[i]) * s.scale;
  }
  std::fill(acc, acc + G * D, 0.f);
  const int32_t* table = tables + b * s.P;
  const T* kh_base = k + kh * s.ks1;
  auto krow = [&](int64_t slot) { return kh_base + slot * s.ks0; };
  for_blocks(table, s.page_size, j0, j1, krow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {  // scores
    for (int64_t r = 0; r < cnt; ++r) load_row(krow(slot + r), rows + r * D, D);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < cnt; ++r) scores[g * m + (j - j0) + r] = dot(qf + g * D, rows + r * D, D);
  });
  softmax_weights(scores, G, m, mxs, sums);
  const T* vh_base = v + kh * s.vs1;
  auto vrow = [&](int64_t slot) { return vh_base + slot * s.vs0; };
  for_blocks(table, s.page_size, j0, j1, vrow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {  // V sum
    for (int64_t r = 0; r < cnt; ++r) load_row(vrow(slot + r), rows + r * D, D);
    for (int64_t r = 0; r < cnt; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[g * m + (j - j0) + r];
        float* __restrict a = acc + g * D;
        const float* x = rows + r * D;
        for (int64_t i = 0; i < D; ++i) a[i] += w * x[i];
      }
  });
}

#if defined(__AVX512F__)
// AVX-512 chunk for head dim 64 (SmolLM2, Llama-3.2-1B/3B, ...), G query heads per kv head known at compile
// time so the G x 4 V accumulators live in registers for the whole chunk. Scores of a run of <= 16 K rows
// are 16 row-wise dot-product vectors reduced together by a transpose-add tree (45 shuffles/adds for 16
// rows instead of 16 separate horizontal sums); bf16 rows are multiplied as bf16 pairs with fp32
// accumulation (VDPBF16PS: the products are exact, as with a bf16 -> fp32 conversion first) when the CPU
// has AVX512_BF16, and the score scale is applied to the reduced sums.

// sums of 16 vectors: lane r of the result = the sum of v[r]'s 16 lanes
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of rows 4i .. 4i+3
    const __m512d a = _mm512_castps_pd(w[2 * i]), c = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], kEven), _mm512_shuffle_f32x4(x[0], x[1], kOdd));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], kEven), _mm512_shuffle_f32x4(x[2], x[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, kEven), _mm512_shuffle_f32x4(y0, y1, kOdd));
}

// one query row, held in registers in the form its dot products with K rows use
struct QF32 {
  __m512 v[4];
  QF32() = default;
  explicit QF32(const float* q) { for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(q + 16 * i); }
  __m512 dot(const float* k) const {
    __m512 a = _mm512_mul_ps(v[0], _mm512_loadu_ps(k));
    for (int i = 1; i < 4; ++i) a = _mm512_fmadd_ps(v[i], _mm512_loadu_ps(k + 16 * i), a);
    return a;
  }
};

#if defined(__AVX512BF16__)
struct QBF16 {
  __m512bh v[2];
  QBF16() = default;
  explicit QBF16(const c10::BFloat16* q) {
    for (int i = 0; i < 2; ++i) v[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
  }
  __m512 dot(const c10::BFloat16* k) const {
    const __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0], (__m512bh)_mm512_loadu_si512(k));
    return _mm512_dpbf16_ps(a, v[1], (__m512bh)_mm512_loadu_si512(k + 32));
  }
};
#endif

template <typename T> struct QRow;
template <> struct QRow<float> { using type = QF32; };
#if defined(__AVX512BF16__)
template <> struct QRow<c10::BFloat16> { using type = QBF16; };
#endif

// a V row (64 values) as 4 float vectors
inline void vrow4(const float* x, __m512* r) { for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(x + 16 * i); }
inline void vrow4(const c10::BFloat16* x, __m512* r) {
  for (int i = 0; i < 4; ++i) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * i)));
    r[i] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));  // bf16 = the high half of an fp32
  }
}

template <typename T, int G>
void chunk_avx512_d64(const Shape& s, int64_t b, int64_t kh, int64_t j0, int64_t j1, const T* q, const T* k,
                      const T* v, const int32_t* tables, float* part, std::vector<float>& buf) {
  using Q = typename QRow<T>::type;
  constexpr int64_t D = 64;
  const int64_t m = j1 - j0;
  buf.resize(static_cast<size_t>(G * m + 16));
  float* scores = buf.data();
  const int32_t* table = tables + b * s.P;
  const T* kh_base = k + kh * s.ks1;
  auto krow = [&](int64_t slot) { return kh_base + slot * s.ks0; };
  {
    Q qr[G];
    for (int g = 0; g < G; ++g) qr[g] = Q(q + b * s.qs0 + (kh * G + g) * s.qs1);
    const __m512 scale = _mm512_set1_ps(s.scale);
    for_blocks(table, s.page_size, j0, j1, krow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {
      const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1u);
      for (int g = 0; g < G; ++g) {
        __m512 d[16];
        for (int64_t r = 0; r < 16; ++r) d[r] = r < cnt ? qr[g].dot(krow(slot + r)) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(scores + g * m + (j - j0), keep, _mm512_mul_ps(hsum16(d), scale));
      }
    });
  }
  float* mxs = part;
  float* sums = part + G;
  float* accp = part + 2 * G;
  softmax_weights(scores, G, m, mxs, sums);
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  const T* vh_base = v + kh * s.vs1;
  auto vrow = [&](int64_t slot) { return vh_base + slot * s.vs0; };
  for_blocks(table, s.page_size, j0, j1, vrow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {
    for (int64_t r = 0; r < cnt; ++r) {
      __m512 x[4];
      vrow4(vrow(slot + r), x);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * m + (j - j0) + r]);
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(w, x[i], acc[g][i]);
      }
    }
  });
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(accp + g * D + 16 * i, acc[g][i]);
}

// AVX-512 chunk for wider heads (D a multiple of 64: head dim 256 of Gemma 3), G known at compile time. The
// G query rows do not fit in registers with their accumulators (G x D / 16 vectors), so per run of <= 16 K
// rows each query row is loaded again (from L1) and scored as in chunk_avx512_d64 (16 dot-product vectors,
// one transpose-add tree); the V sum runs per 64-dim quarter, its G x 4 accumulators loaded from and stored
// back to the task's part once per run, each V row quarter converted once for all G heads.
template <typename T, int NV> struct QWide;  // one query row of NV x 16 values
template <int NV> struct QWide<float, NV> {
  __m512 v[NV];
  explicit QWide(const float* q) { for (int i = 0; i < NV; ++i) v[i] = _mm512_loadu_ps(q + 16 * i); }
  __m512 dot(const float* k) const {
    __m512 a = _mm512_mul_ps(v[0], _mm512_loadu_ps(k));
    for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(v[i], _mm512_loadu_ps(k + 16 * i), a);
    return a;
  }
};
#if defined(__AVX512BF16__)
template <int NV> struct QWide<c10::BFloat16, NV> {
  __m512bh v[NV / 2];
  explicit QWide(const c10::BFloat16* q) { for (int i = 0; i < NV / 2; ++i) v[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i); }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < NV / 2; ++i) a = _mm512_dpbf16_ps(a, v[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return a;
  }
};
#endif

template <typename T, int G, int64_t D>
void chunk_avx512_wide(const Shape& s, int64_t b, int64_t kh, int64_t j0, int64_t j1, const T* q, const T* k,
                       const T* v, const int32_t* tables, float* part, std::vector<float>& buf) {
  static_assert(D % 64 == 0, "whole 64-dim quarters");
  using Q = QWide<T, static_cast<int>(D / 16)>;
  const int64_t m = j1 - j0;
  buf.resize(static_cast<size_t>(G * m + 16));
  float* scores = buf.data();
  const int32_t* table = tables + b * s.P;
  const T* kh_base = k + kh * s.ks1;
  auto krow = [&](int64_t slot) { return kh_base + slot * s.ks0; };
  const __m512 scale = _mm512_set1_ps(s.scale);
  for_blocks(table, s.page_size, j0, j1, krow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {
    const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1u);
    for (int g = 0; g < G; ++g) {
      const Q qg(q + b * s.qs0 + (kh * G + g) * s.qs1);
      __m512 d[16];
      for (int64_t r = 0; r < 16; ++r) d[r] = r < cnt ? qg.dot(krow(slot + r)) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(scores + g * m + (j - j0), keep, _mm512_mul_ps(hsum16(d), scale));
    }
  });
  float* accp = part + 2 * G;
  softmax_weights(scores, G, m, part, part + G);
  std::fill(accp, accp + G * D, 0.f);
  const T* vh_base = v + kh * s.vs1;
  auto vrow = [&](int64_t slot) { return vh_base + slot * s.vs0; };
  for_blocks(table, s.page_size, j0, j1, vrow, D * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {
    for (int64_t qd = 0; qd < D; qd += 64) {
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_loadu_ps(accp + g * D + qd + 16 * i);
      for (int64_t r = 0; r < cnt; ++r) {
        __m512 x[4];
        vrow4(vrow(slot + r) + qd, x);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(scores[g * m + (j - j0) + r]);
          for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(w, x[i], acc[g][i]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(accp + g * D + qd + 16 * i, acc[g][i]);
    }
  });
}

// Every kv head of sequence b over keys [j0, j1), for a pool whose rows hold the KVH heads back to back
// (strides ks1 = D, ks0 = KVH * D): each run's K rows, then its V rows, are read whole (the KVH heads one
// after the other while the run is in cache) instead of one head's 128 bytes of each row per task. Out of
// cache (a decode step reads each layer's K/V once) that took the read rate from 8-10 to ~11.5 GB/s at batch
// 8 (measured: paged_attn.py). part: KVH per-head parts of part_floats(s) floats, back to back.
template <typename T, int G>
void all_heads_avx512_d64(const Shape& s, int64_t b, int64_t j0, int64_t j1, const T* q, const T* k,
                          const T* v, const int32_t* tables, float* part, std::vector<float>& buf) {
  using Q = typename QRow<T>::type;
  constexpr int64_t D = 64;
  const int64_t m = j1 - j0, KVH = s.KVH, PF = part_floats(s);
  buf.resize(static_cast<size_t>(KVH * G * m + 16));
  float* scores = buf.data();  // [KVH * G][m]
  const int32_t* table = tables + b * s.P;
  auto krow = [&](int64_t slot) { return k + slot * s.ks0; };
  auto vrow = [&](int64_t slot) { return v + slot * s.vs0; };
  const __m512 scale = _mm512_set1_ps(s.scale);
  for_blocks(table, s.page_size, j0, j1, krow, s.ks0 * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {
    const __mmask16 keep = static_cast<__mmask16>((1u << cnt) - 1u);
    for (int64_t kh = 0; kh < KVH; ++kh) {
      const T* base = k + kh * s.ks1;
      for (int g = 0; g < G; ++g) {
        const Q qg(q + b * s.qs0 + (kh * G + g) * s.qs1);
        __m512 d[16];
        for (int64_t r = 0; r < 16; ++r) d[r] = r < cnt ? qg.dot(base + (slot + r) * s.ks0) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(scores + (kh * G + g) * m + (j - j0), keep, _mm512_mul_ps(hsum16(d), scale));
      }
    }
  });
  for (int64_t kh = 0; kh < KVH; ++kh) {
    float* p = part + kh * PF;
    softmax_weights(scores + kh * G * m, G, m, p, p + G);
    std::fill(p + 2 * G, p + 2 * G + G * D, 0.f);
  }
  for_blocks(table, s.page_size, j0, j1, vrow, s.vs0 * sizeof(T), [&](int64_t j, int64_t slot, int64_t cnt) {
    for (int64_t kh = 0; kh < KVH; ++kh) {
      float* accp = part + kh * PF + 2 * G;
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_loadu_ps(accp + g * D + 16 * i);
      const T* base = v + kh * s.vs1;
      const float* sc = scores + kh * G * m + (j - j0);
      for (int64_t r = 0; r < cnt; ++r) {
        __m512 x[4];
        vrow4(base + (slot + r) * s.vs0, x);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(sc[g * m + r]);
          for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(w, x[i], acc[g][i]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(accp + g * D + 16 * i, acc[g][i]);
    }
  });
}
#endif  // __AVX512F__

template <typename T>
using ChunkFn = void (*)(const Shape&, int64_t, int64_t, int64_t, int64_t, const T*, const T*, const T*,
                         const int32_t*, float*, std::vector<float>&);

template <typename T>
using AllHeadsFn = void (*)(const Shape&, int64_t, int64_t, int64_t, const T*, const T*, const T*, const int32_t*,
                            float*, std::vector<float>&);

#if defined(__AVX512F__)
// T has an AVX-512 body: float, and bf16 where the CPU has AVX512_BF16
template <typename T>
constexpr bool kVecType = std::is_same_v<T, float>
#if defined(__AVX512BF16__)
                          || std::is_same_v<T, c10::BFloat16>
#endif
    ;

// The AVX-512 head-dim-64 bodies of one G, so that a runtime G picks both from one switch.
template <typename T, int G>
struct Bodies {
  static constexpr ChunkFn<T> chunk = chunk_avx512_d64<T, G>;
  static constexpr AllHeadsFn<T> all = all_heads_avx512_d64<T, G>;
  static constexpr ChunkFn<T> chunk256 = chunk_avx512_wide<T, G, 256>;
};

// get(Bodies<T, G>{}) for the call's G (1 .. 6), else nullptr.
template <typename T, typename Fn, typename Get>
Fn for_group(int64_t G, Get get) {
  switch (G) {
    case 1: return get(Bodies<T, 1>{});
    case 2: return get(Bodies<T, 2>{});
    case 3: return get(Bodies<T, 3>{});
    case 4: return get(Bodies<T, 4>{});
    case 5: return get(Bodies<T, 5>{});
    case 6: return get(Bodies<T, 6>{});
    default: return nullptr;
  }
}
#endif

template <typename T>
ChunkFn<T> pick_chunk(const Shape& s) {
#if defined(__AVX512F__)
  if constexpr (kVecType<T>) {
    if (s.D == 64)
      if (const ChunkFn<T> f = for_group<T, ChunkFn<T>>(s.G, [](auto b) { return decltype(b)::chunk; })) return f;
    if (s.D == 256)
      if (const ChunkFn<T> f = for_group<T, ChunkFn<T>>(s.G, [](auto b) { return decltype(b)::chunk256; })) return f;
  }
#endif
  return s.D == 64 ? chunk_portable<T, 64> : s.D == 128 ? chunk_portable<T, 128> : s.D == 256 ? chunk_portable<T, 256>
                                                                                               : chunk_portable<T, 0>;
}

// The all-heads body where it applies (AVX-512 for T, head dim 64, G <= 6, heads back to back in each pool
// row); nullptr otherwise (the per-head tasks run).
template <typename T>
AllHeadsFn<T> pick_all_heads(const Shape& s) {
#if defined(__AVX512F__)
  if constexpr (kVecType<T>) {
    if (s.D == 64 && s.ks1 == 64 && s.vs1 == 64 && s.ks0 == s.KVH * 64 && s.vs0 == s.KVH * 64)
      return for_group<T, AllHeadsFn<T>>(s.G, [](auto b) { return decltype(b)::all; });
  }
#endif
  return nullptr;
}

constexpr int64_t kMinChunk = 256;  // keys: below this a chunk's merge and task overhead outweigh the balance

// How many chunks each of `tasks` tasks' keys are split into (flash-decoding's split over the
// context): 1 when there are already at least two tasks per thread; else enough for ~4 tasks per thread,
// each chunk at least kMinChunk keys. At batch 1 with 3 kv heads on 2 threads, one thread otherwise did
// two of the three tasks.
inline int64_t split_of(int64_t tasks, int threads) {
  return tasks >= 2 * threads ? 1 : (4 * threads + tasks - 1) / tasks;
}

// How a call's keys are split over tasks (flash-decoding's split over the context): per sequence b, its keys
// are nchunks[b] chunks (at least kMinChunk keys each, at most `want`) and its tasks are first[b] ..
// first[b + 1] - 1, `per_chunk` tasks a chunk (the kv heads, for per-head tasks; 1 for all-heads tasks).
// With `fixed` > 0 (the deterministic split, a multiple of kBlock) chunk c is keys [j0 + c * fixed, j0 + (c + 1) *
// fixed) of the visible ones, whatever the batch and the thread count: a query's chunks, and so the order of its
// sums and of their merge, depend only on its own visible keys (batch-invariant decode attention).
struct Split {
  std::vector<int64_t> nchunks, first;
  int64_t fixed;
  Split(const Shape& s, const int32_t* lens, int64_t want, int64_t per_chunk, int64_t fixed_keys = 0)
      : nchunks(s.B), first(s.B + 1, 0), fixed(fixed_keys) {
    for (int64_t b = 0; b < s.B; ++b) {
      const auto [j0, j1] = visible(s, lens, b);
      nchunks[b] = fixed > 0 ? std::max<int64_t>(1, (j1 - j0 + fixed - 1) / fixed)
                             : std::max<int64_t>(1, std::min(want, (j1 - j0) / kMinChunk));
      first[b + 1] = first[b] + nchunks[b] * per_chunk;
    }
  }
  int64_t tasks() const { return first.back(); }
  int64_t seq_of(int64_t t) const { return std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1; }
  // keys of chunk c of sequence b: on multiples of kBlock keys but the last
  std::pair<int64_t, int64_t> bounds(const Shape& s, const int32_t* lens, int64_t b, int64_t c) const {
    const int64_t C = nchunks[b];
    const auto [j0, j1] = visible(s, lens, b);
    if (fixed > 0) return {j0 + c * fixed, std::min(j1, j0 + (c + 1) * fixed)};
    const int64_t m = j1 - j0;
    return {j0 + (c == 0 ? 0 : m * c / C / kBlock * kBlock), c + 1 == C ? j1 : j0 + m * (c + 1) / C / kBlock * kBlock};
  }
};

// The output rows of task (b, kh) from its C chunk parts (PF floats apart): one chunk is divided by its sum;
// several are rescaled to their common max first. Writes only those G output rows.
template <typename T>
void finish_task(const Shape& s, const float* p0, int64_t C, int64_t PF, int64_t b, int64_t kh, T* op) {
  const int64_t G = s.G, D = s.D;
  std::vector<float> acc(C == 1 ? 0 : D);  // the rescaled sum (several chunks)
  for (int64_t g = 0; g < G; ++g) {
    T* orow = op + b * s.os0 + (kh * G + g) * s.os1;
    if (C == 1) {  // the common case: no rescaling
      const float sum = p0[G + g];
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const float* a = p0 + 2 * G + g * D;
      for (int64_t i = 0; i < D; ++i) orow[i] = static_cast<T>(a[i] * inv);
      continue;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, p0[c * PF + g]);
    float sum = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < C; ++c) {
      const float* pc = p0 + c * PF;
      if (pc[G + g] <= 0.f) continue;  // an empty chunk
      const float w = std::exp(pc[g] - mx);
      sum += w * pc[G + g];
      for (int64_t i = 0; i < D; ++i) acc[i] += w * pc[2 * G + g * D + i];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t i = 0; i < D; ++i) orow[i] = static_cast<T>(acc[i] * inv);
  }
}

// The all-heads tasks: one per (sequence, chunk of its keys) -- chunks only when there are fewer than two
// sequences per thread (each at least kMinChunk keys, ~4 tasks per thread) -- then each (sequence, kv head)
// finished from its chunks' parts, as the per-head tasks are.
template <typename T>
void run_all_heads(const Shape& s, AllHeadsFn<T> all, const T* qp, const T* kp, const T* vp, const int32_t* tp,
                   const int32_t* lp, T* op) {
  const Split sp(s, lp, split_of(s.B, at::get_num_threads()), 1, s.split_keys);
  const int64_t PF = part_floats(s), TF = s.KVH * PF;  // floats of one task's parts
  std::vector<float> parts(static_cast<size_t>(sp.tasks() * TF));
  at::parallel_for(0, sp.tasks(), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = sp.seq_of(t);
      const auto [lo_j, hi_j] = sp.bounds(s, lp, b, t - sp.first[b]);
      all(s, b, lo_j, hi_j, qp, kp, vp, tp, parts.data() + t * TF, buf);
      if (sp.nchunks[b] == 1)
        for (int64_t kh = 0; kh < s.KVH; ++kh) finish_task(s, parts.data() + t * TF + kh * PF, 1, TF, b, kh, op);
    }
  });
  if (sp.tasks() == s.B) return;  // no sequence was split: every output is written
  at::parallel_for(0, s.B * s.KVH, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / s.KVH, kh = t % s.KVH;
      if (sp.nchunks[b] > 1) finish_task(s, parts.data() + sp.first[b] * TF + kh * PF, sp.nchunks[b], TF, b, kh, op);
    }
  });
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
  if (const AllHeadsFn<T> all = pick_all_heads<T>(s)) {
    run_all_heads(s, all, qp, kp, vp, tp, lp, op);
    return;
  }
  const ChunkFn<T> chunk = pick_chunk<T>(s);
  const Split sp(s, lp, split_of(s.B * s.KVH, at::get_num_threads()), s.KVH, s.split_keys);
  const int64_t PF = part_floats(s);
  if (sp.tasks() == s.B * s.KVH) {  // no split: each task finishes its own output (one parallel region)
    at::parallel_for(0, s.B * s.KVH, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> buf, part(static_cast<size_t>(PF));
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t b = t / s.KVH, kh = t % s.KVH;
        const auto [lo_j, hi_j] = sp.bounds(s, lp, b, 0);
        chunk(s, b, kh, lo_j, hi_j, qp, kp, vp, tp, part.data(), buf);
        finish_task(s, part.data(), 1, PF, b, kh, op);
      }
    });
    return;
  }
  std::vector<float> parts(static_cast<size_t>(sp.tasks() * PF));
  at::parallel_for(0, sp.tasks(), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf;
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = sp.seq_of(t);
      const int64_t C = sp.nchunks[b], kh = (t - sp.first[b]) / C, c = (t - sp.first[b]) % C;
      const auto [lo_j, hi_j] = sp.bounds(s, lp, b, c);
      chunk(s, b, kh, lo_j, hi_j, qp, kp, vp, tp, parts.data() + t * PF, buf);
    }
  });
  at::parallel_for(0, s.B * s.KVH, 1, [&](int64_t lo, int64_t hi) {  // merge a task's chunks
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t b = t / s.KVH, kh = t % s.KVH;
      finish_task(s, parts.data() + (sp.first[b] + kh * sp.nchunks[b]) * PF, sp.nchunks[b], PF, b, kh, op);
    }
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
                                  at::Tensor context_lens, int64_t page_size, double scale, int64_t window,
                                  int64_t split_keys) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q [B,H,D], pools [S,KVH,D]");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q, k_pool and v_pool must share a dtype");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool and v_pool shapes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, "int32 tables and lengths");
  TORCH_CHECK(page_size > 0 && window >= 0, "page_size > 0, window >= 0");
  TORCH_CHECK(split_keys >= 0 && split_keys % kBlock == 0, "split_keys must be 0 (adaptive) or a multiple of ", kBlock);
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
  s.G = s.H / s.KVH; s.P = block_tables.size(1); s.page_size = page_size; s.window = window; s.split_keys = split_keys;
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
at::Tensor fused_gemma_rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor fused_gelu_tanh_mul(at::Tensor gu);
// the prefill attention of prefill_attn.cpp (AMX tiles or AVX-512 BF16)
std::vector<std::string> prefill_attention_isas();
bool prefill_attention_supported();
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots,
                             std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens, double scale, std::string isa);

// the decode-step GEMM of decode_gemm.cpp (AVX-512 BF16)
bool decode_gemm_supported();
at::Tensor decode_gemm_pack(at::Tensor w);
at::Tensor decode_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_gemm_supported", &decode_gemm_supported, "the decode GEMM's ISA (AVX-512 BF16) is in this build (decode_gemm.cpp)");
  m.def("decode_gemm_pack", &decode_gemm_pack, "a [N, K] bf16 weight in the decode GEMM's layout (decode_gemm.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_gemm", &decode_gemm, "y = x W^T + b for a decode step's few rows (decode_gemm.cpp)", py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, in place over the pool)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("page_size"), py::arg("scale"), py::arg("window"), py::arg("split_keys") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_rms_norm", &fused_rms_norm, "RMSNorm in one pass (fused_ops.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm in one pass (fused_ops.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_silu_mul", &fused_silu_mul, "SiLU(gate) * up in one pass (fused_ops.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_rope", &fused_rope, "rotary embedding in one pass (fused_ops.cpp)", py::call_guard<py::gil_scoped_release>());
  m.def("fused_gemma_rms_norm", &fused_gemma_rms_norm, "Gemma's (1 + w) RMSNorm in one pass (fused_ops.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_gelu_tanh_mul", &fused_gelu_tanh_mul, "GELU-tanh(gate) * up in one pass (fused_ops.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_isas", &prefill_attention_isas,
        "instruction sets the prefill attention kernel can use in this process, fastest first (prefill_attn.cpp)");
  m.def("prefill_attention_supported", &prefill_attention_supported, "any prefill attention ISA usable here (prefill_attn.cpp)");
  m.def("prefill_attention", &prefill_attention, "prefill attention over the paged pool, AMX tiles or AVX-512 BF16 (prefill_attn.cpp)",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"), py::arg("q_lens"), py::arg("ctx_lens"),
        py::arg("scale"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());
}
