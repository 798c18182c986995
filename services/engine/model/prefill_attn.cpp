// Prefill attention on the CPU: the queries of several sequences, each a chunk of new tokens after its own
// earlier keys, against their contexts read from the paged KV pool through a slot list, on AMX tiles or on
// AVX-512 BF16 dot products. Design note: services/engine/model/prefill_attn.py (bound in paged_attn.cpp's
// module).
//
// Per (sequence, kv head) the context's K and V are gathered from the pool and packed once into the
// layouts a bf16-pair multiply wants (K: 16 keys x 32 dims as a dword transpose; V: 32 keys x 16 dims as
// key pairs); both ISAs read the same packing. Then per (sequence, query head, block of 16 query rows)
// task, FlashAttention's online softmax (Dao et al., NeurIPS'22, Alg. 1) runs over spans of keys: S = Q K^T,
// row max / exp / sum in AVX-512 registers (one row of 16 scores per register), P rounded to bf16, and
// P V added into float accumulators rescaled by exp(m_old - m_new). AMX: S in two 16x16 float tiles per 32
// keys and P V in four 16x16 tiles. AVX-512 BF16 (no AMX): VDPBF16PS on register blocks of 4 query rows x
// 64 keys (S) and 4 query rows x 64 dims (P V), skipping each 4-row group's keys past its causal limit. The
// causal limit of a row is bottom-right aligned (row i of a chunk of n_q after p earlier keys sees keys
// < p + i + 1), so a chunk after its prefix is one pass, no log-sum-exp merge. bf16 and head dim 64 only;
// the caller checks support (prefill_attention_isas) and uses ATen's flash kernel otherwise.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define TALARIA_BF16_SIMD 1
#include <immintrin.h>
#endif
#if defined(TALARIA_BF16_SIMD) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TALARIA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#ifdef TALARIA_BF16_SIMD
constexpr int64_t kD = 64;   // head dim
constexpr int64_t kQB = 16;  // query rows per task
constexpr int64_t kKB = 32;  // keys per tile block
constexpr int64_t kSpan = 128;  // keys per softmax step (4 tile blocks)

#ifdef TALARIA_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool request_amx() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Every tile 16 rows x 64 bytes: A (16 x 32 bf16), B (16 x 16 bf16 pairs), C (16 x 16 floats).
inline void load_tile_config() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}
#endif  // TALARIA_AMX

// exp(x) for x <= 0 (scores minus their running max): 2^(x / ln2) split as 2^i * 2^f, 2^f by a degree-6
// polynomial (relative error < 3e-7, far below the bf16 rounding of P); x below -87 gives ~0.
inline __m512 exp_neg(__m512 x) {
  const __m512 shift = _mm512_set1_ps(12582912.f);  // 1.5 * 2^23: rounds to the nearest integer
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift);
  const __m512 fi = _mm512_sub_ps(y, shift);
  const __m512i i = _mm512_sub_epi32(_mm512_castps_si512(y), _mm512_castps_si512(shift));
  const __m512 r = _mm512_fnmadd_ps(fi, _mm512_set1_ps(0.69314718055994531f), x);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// One query row's step of the online softmax over a span: its ``nv`` (even) vectors of 16 raw scores in srow,
// scaled and masked to the row's ``lim`` visible keys; the row's running max m and sum l updated; P rounded
// to bf16 into pr (zero past lim, so P V over the whole span adds nothing for hidden keys). Returns alpha =
// exp(m_old - m_new), the factor the row's accumulator is rescaled by (1 when the row sees no key here).
inline float softmax_row(const float* srow, int64_t nv, int64_t lim, float scale, float& m, float& l, uint16_t* pr) {
  if (lim <= 0) {
    std::memset(pr, 0, nv * 16 * sizeof(uint16_t));
    return 1.f;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 x[kSpan / 16];
  __mmask16 mk[kSpan / 16];
  __m512 mx = ninf;
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t left = std::clamp<int64_t>(lim - v * 16, 0, 16);
    mk[v] = left == 16 ? static_cast<__mmask16>(0xffff) : _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(left)));
    x[v] = left ? _mm512_mask_mul_ps(ninf, mk[v], _mm512_loadu_ps(srow + v * 16), vscale) : ninf;
    mx = _mm512_max_ps(mx, x[v]);
  }
  const float mn = std::max(m, _mm512_reduce_max_ps(mx));
  const __m512 vmn = _mm512_set1_ps(mn);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t v = 0; v < nv; v += 2) {
    const __m512 p0 = _mm512_maskz_mov_ps(mk[v], exp_neg(_mm512_sub_ps(x[v], vmn)));
    const __m512 p1 = _mm512_maskz_mov_ps(mk[v + 1], exp_neg(_mm512_sub_ps(x[v + 1], vmn)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    _mm512_storeu_si512(pr + v * 16, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  const float a = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - mn);
  l = l * a + _mm512_reduce_add_ps(sum);
  m = mn;
  return a;
}

// The finished rows of a task: acc / l rounded to bf16, row i at out + i * os0 (64 contiguous dims).
inline void write_rows(const float* acc, const float* l, int64_t rows, uint16_t* out, int64_t os0) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / l[i]);
    uint16_t* o = out + i * os0;
    for (int c = 0; c < 4; c += 2) {
      const __m512 x0 = _mm512_mul_ps(_mm512_load_ps(acc + i * kD + c * 16), inv);
      const __m512 x1 = _mm512_mul_ps(_mm512_load_ps(acc + i * kD + c * 16 + 16), inv);
      _mm512_storeu_si512(o + c * 16, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
  }
}

struct Seq {
  int64_t q0, n_q, k0, n;  // first query row in q, its new tokens, first slot index in slots, context length
  int64_t kv_off;          // offset of its packed K/V (per kv head: padded keys * kD bf16 each)
  int64_t padded;          // context length rounded up to kKB
};

// The tile operands of one (sequence, kv head). K, per block of 16 keys and half h of the dims, as the B
// operand of S = Q K^T: row j holds, for each key n, the dword of dims (32 h + 2 j, 32 h + 2 j + 1) -- a
// 16 x 16 dword transpose, done by gathers (the rows come from scattered pool slots anyway). V, per block of
// 32 keys and block c of 16 dims, as the B operand of P V: row r holds, for each dim, the pair (key 2 r,
// key 2 r + 1) -- two rows interleaved by one permute per 16 dims. Keys past n are zero.
void pack_kv(const uint16_t* k_pool, const uint16_t* v_pool, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1,
             const int64_t* slots, const Seq& s, int64_t kvh, uint32_t* kp, uint32_t* vp) {
  // kp: [padded / 16][2][16 rows][16 keys] dwords; vp: [padded / 32][4][16 key pairs][16 dims] dwords
  const auto* kpool = reinterpret_cast<const int*>(k_pool);
  for (int64_t b = 0; b < s.padded / 16; ++b) {
    const int64_t keys = std::min<int64_t>(16, s.n - b * 16);
    uint32_t* kb = kp + b * 512;
    if (keys <= 0) {
      std::memset(kb, 0, 512 * sizeof(uint32_t));
      continue;
    }
    alignas(64) int64_t offs[16];  // dword index of each key's row (0 past n: masked off below)
    for (int64_t n = 0; n < 16; ++n) offs[n] = n < keys ? (slots[s.k0 + b * 16 + n] * ks0 + kvh * ks1) / 2 : 0;
    const __m512i lo = _mm512_load_si512(offs), hi = _mm512_load_si512(offs + 8);
    const __mmask8 mlo = static_cast<__mmask8>(keys >= 8 ? 0xff : (1u << keys) - 1);
    const __mmask8 mhi = static_cast<__mmask8>(keys >= 16 ? 0xff : keys <= 8 ? 0 : (1u << (keys - 8)) - 1);
    for (int64_t j = 0; j < 32; ++j) {
      const __m512i dj = _mm512_set1_epi64(j);
      const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), mlo, _mm512_add_epi64(lo, dj), kpool, 4);
      const __m256i c = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), mhi, _mm512_add_epi64(hi, dj), kpool, 4);
      _mm512_store_si512(kb + (j / 16) * 256 + (j % 16) * 16, _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1));
    }
  }
  alignas(64) static constexpr uint16_t kEvenOdd[2][32] = {  // (key 2r, key 2r+1) pairs of dims 0-15 / 16-31
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i p0 = _mm512_load_si512(kEvenOdd[0]), p1 = _mm512_load_si512(kEvenOdd[1]);
  for (int64_t r = 0; r < s.padded / 2; ++r) {  // key pairs
    __m512i row[2][2];  // [key of the pair][dims 0-31 / 32-63]
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t key = 2 * r + e;
      if (key < s.n) {
        const uint16_t* vr = v_pool + slots[s.k0 + key] * vs0 + kvh * vs1;
        row[e][0] = _mm512_loadu_si512(vr);
        row[e][1] = _mm512_loadu_si512(vr + 32);
      } else {
        row[e][0] = row[e][1] = _mm512_setzero_si512();
      }
    }
    uint32_t* vb = vp + (r / 16) * 4 * 256 + (r % 16) * 16;
    for (int64_t c = 0; c < 4; ++c)
      _mm512_store_si512(vb + c * 256, _mm512_permutex2var_epi16(row[0][c / 2], c % 2 ? p1 : p0, row[1][c / 2]));
  }
}

#ifdef TALARIA_AMX
void task(const uint16_t* q, int64_t qs0, int64_t qs1, const Seq& s, int64_t h, int64_t r0,
          const uint32_t* kp, const uint32_t* vp, float scale, uint16_t* out, int64_t os0, int64_t os1) {
  alignas(64) uint16_t qbuf[kQB * kD];
  alignas(64) float sbuf[kQB * kSpan];
  alignas(64) uint16_t pbuf[kQB * kSpan];
  alignas(64) float pv[kQB * kD];
  alignas(64) float acc[kQB * kD];
  float m[kQB], l[kQB], alpha[kQB];
  const int64_t rows = std::min<int64_t>(kQB, s.n_q - r0);
  for (int64_t i = 0; i < kQB; ++i) {
    if (i < rows)
      std::memcpy(qbuf + i * kD, q + (s.q0 + r0 + i) * qs0 + h * qs1, kD * sizeof(uint16_t));
    else
      std::memset(qbuf + i * kD, 0, kD * sizeof(uint16_t));
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.f;
  }
  std::memset(acc, 0, sizeof(acc));
  const int64_t p = s.n - s.n_q;
  const int64_t end = std::min(s.n, p + r0 + rows);  // keys any row of the block sees
  _tile_loadd(0, qbuf, kD * 2);
  _tile_loadd(1, qbuf + 32, kD * 2);
  for (int64_t key0 = 0; key0 < end; key0 += kSpan) {
    const int64_t nsub = std::min<int64_t>(kSpan / kKB, (end - key0 + kKB - 1) / kKB);  // 32-key sub-blocks
    for (int64_t j = 0; j < nsub; ++j) {
      const uint32_t* kb = kp + ((key0 + j * kKB) / 16) * 2 * 256;
      _tile_zero(3);
      _tile_zero(4);
      _tile_loadd(2, kb, 64);
      _tile_dpbf16ps(3, 0, 2);
      _tile_loadd(2, kb + 256, 64);
      _tile_dpbf16ps(3, 1, 2);
      _tile_loadd(2, kb + 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(2, kb + 768, 64);
      _tile_dpbf16ps(4, 1, 2);
      _tile_stored(3, sbuf + j * kKB, kSpan * 4);
      _tile_stored(4, sbuf + j * kKB + 16, kSpan * 4);
    }
    const int64_t nv = nsub * 2;  // 16-score vectors per row
    for (int64_t i = 0; i < kQB; ++i) {
      const int64_t lim = i < rows ? std::min(s.n, p + r0 + i + 1) - key0 : 0;  // visible keys of row i here
      alpha[i] = softmax_row(sbuf + i * kSpan, nv, lim, scale, m[i], l[i], pbuf + i * kSpan);
    }
    const uint32_t* vb = vp + (key0 / kKB) * 4 * 256;
    for (int c = 0; c < 4; ++c) {
      _tile_zero(7);
      for (int64_t j = 0; j < nsub; ++j) {
        _tile_loadd(5, pbuf + j * kKB, kSpan * 2);
        _tile_loadd(6, vb + (j * 4 + c) * 256, 64);
        _tile_dpbf16ps(7, 5, 6);
      }
      _tile_stored(7, pv + c * 16, kD * 4);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 a = _mm512_set1_ps(alpha[i]);
      for (int c = 0; c < 4; ++c) {
        float* o = acc + i * kD + c * 16;
        _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), a, _mm512_load_ps(pv + i * kD + c * 16)));
      }
    }
  }
  write_rows(acc, l, rows, out + (s.q0 + r0) * os0 + h * os1, os0);
}
#endif  // TALARIA_AMX

// P V of the 4 query rows at r of one span into acc (rescaled by alpha first): VDPBF16PS over key pairs, the
// pair of P from pbuf broadcast as one dword, V's packed row of 16 dims for that pair.
inline void pv_rows4(const uint16_t* pbuf, const uint32_t* vp, int64_t key0, int64_t pairs, int64_t r,
                     const float* alpha, float* acc) {
  __m512 o[4][4];
  for (int i = 0; i < 4; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[r + i]);
    for (int c = 0; c < 4; ++c) o[i][c] = _mm512_mul_ps(_mm512_load_ps(acc + (r + i) * kD + c * 16), a);
  }
  const auto* p32 = reinterpret_cast<const uint32_t*>(pbuf);
  for (int64_t pr = 0; pr < pairs; ++pr) {
    const int64_t g = key0 / 2 + pr;  // the pair's index in the context
    const uint32_t* vr = vp + (g / 16) * 4 * 256 + (g % 16) * 16;
    const __m512bh v0 = (__m512bh)_mm512_load_si512(vr), v1 = (__m512bh)_mm512_load_si512(vr + 256);
    const __m512bh v2 = (__m512bh)_mm512_load_si512(vr + 512), v3 = (__m512bh)_mm512_load_si512(vr + 768);
    for (int i = 0; i < 4; ++i) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(p32[(r + i) * (kSpan / 2) + pr]));
      o[i][0] = _mm512_dpbf16_ps(o[i][0], pp, v0);
      o[i][1] = _mm512_dpbf16_ps(o[i][1], pp, v1);
      o[i][2] = _mm512_dpbf16_ps(o[i][2], pp, v2);
      o[i][3] = _mm512_dpbf16_ps(o[i][3], pp, v3);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + (r + i) * kD + c * 16, o[i][c]);
}

// S = Q K^T of the 4 query rows at r against NB blocks of 16 keys (the first at block kb of the packing),
// into sbuf at column col: per dim pair one dword of each query broadcast against the 16 keys' dwords.
template <int NB>
inline void qk_rows4(const uint32_t* qbuf, const uint32_t* kb, int64_t r, float* sbuf, int64_t col) {
  __m512 c[4][NB];
  for (int i = 0; i < 4; ++i)
    for (int b = 0; b < NB; ++b) c[i][b] = _mm512_setzero_ps();
  for (int64_t pj = 0; pj < kD / 2; ++pj) {
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_load_si512(kb + b * 512 + pj * 16);
    for (int i = 0; i < 4; ++i) {
      const __m512bh qq = (__m512bh)_mm512_set1_epi32(static_cast<int>(qbuf[(r + i) * (kD / 2) + pj]));
      for (int b = 0; b < NB; ++b) c[i][b] = _mm512_dpbf16_ps(c[i][b], qq, k[b]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int b = 0; b < NB; ++b) _mm512_store_ps(sbuf + (r + i) * kSpan + col + b * 16, c[i][b]);
}

// One task on AVX-512 BF16 (no AMX): like task(), but per group of 4 rows, and each group stops at the last
// key its own last row sees (a 16-row tile block would compute up to 15 masked keys per row more).
void task_avx(const uint16_t* q, int64_t qs0, int64_t qs1, const Seq& s, int64_t h, int64_t r0,
              const uint32_t* kp, const uint32_t* vp, float scale, uint16_t* out, int64_t os0, int64_t os1) {
  alignas(64) uint32_t qbuf[kQB * kD / 2];
  alignas(64) float sbuf[kQB * kSpan];
  alignas(64) uint16_t pbuf[kQB * kSpan];
  alignas(64) float acc[kQB * kD];
  float m[kQB], l[kQB], alpha[kQB];
  const int64_t rows = std::min<int64_t>(kQB, s.n_q - r0);
  const int64_t groups = (rows + 3) / 4;
  for (int64_t i = 0; i < groups * 4; ++i) {
    if (i < rows)
      std::memcpy(qbuf + i * (kD / 2), q + (s.q0 + r0 + i) * qs0 + h * qs1, kD * sizeof(uint16_t));
    else
      std::memset(qbuf + i * (kD / 2), 0, kD * sizeof(uint16_t));
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.f;
  }
  std::memset(acc, 0, sizeof(acc));
  const int64_t p = s.n - s.n_q;
  const int64_t end = std::min(s.n, p + r0 + rows);  // keys any row of the block sees
  for (int64_t key0 = 0; key0 < end; key0 += kSpan) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r = g * 4;
      const int64_t gend = std::min(s.n, p + r0 + std::min<int64_t>(r + 4, rows));  // keys the group's last row sees
      const int64_t nblk = std::min<int64_t>(kSpan / 16, (gend - key0 + 15) / 16);      // 16-key blocks of this span
      if (nblk <= 0) continue;  // every row of the group is done: their acc, m, l stay
      const uint32_t* kb = kp + (key0 / 16) * 512;
      for (int64_t b = 0; b < nblk; b += 4) {
        switch (std::min<int64_t>(4, nblk - b)) {
          case 4: qk_rows4<4>(qbuf, kb + b * 512, r, sbuf, b * 16); break;
          case 3: qk_rows4<3>(qbuf, kb + b * 512, r, sbuf, b * 16); break;
          case 2: qk_rows4<2>(qbuf, kb + b * 512, r, sbuf, b * 16); break;
          default: qk_rows4<1>(qbuf, kb + b * 512, r, sbuf, b * 16); break;
        }
      }
      const int64_t nv = nblk + (nblk & 1);  // P written in whole key pairs of vectors (pad with zeros)
      for (int64_t i = r; i < r + 4; ++i) {
        const int64_t lim = i < rows ? std::min(s.n, p + r0 + i + 1) - key0 : 0;  // visible keys of row i here
        alpha[i] = softmax_row(sbuf + i * kSpan, nv, lim, scale, m[i], l[i], pbuf + i * kSpan);
      }
      pv_rows4(pbuf, vp, key0, nv * 8, r, alpha, acc);
    }
  }
  write_rows(acc, l, rows, out + (s.q0 + r0) * os0 + h * os1, os0);
}
#endif  // TALARIA_BF16_SIMD

}  // namespace

// The instruction sets this process can run the kernel on, fastest first: "amx" (AMX-BF16 tiles, granted by
// the OS) and "avx512_bf16" (AVX-512 with VDPBF16PS). Empty: ATen's flash kernel is the only path.
// Probed once per process (asking the OS for AMX tiles is a syscall; the answer cannot change).
static const std::vector<std::string>& available_isas() {
  static const std::vector<std::string> isas = [] {
    std::vector<std::string> out;
#ifdef TALARIA_AMX
    if (request_amx()) out.push_back("amx");
#endif
#ifdef TALARIA_BF16_SIMD
    out.push_back("avx512_bf16");
#endif
    return out;
  }();
  return isas;
}

std::vector<std::string> prefill_attention_isas() { return available_isas(); }

bool prefill_attention_supported() { return !prefill_attention_isas().empty(); }

// q [T, H, 64] bf16 (unit stride in the last dim); k_pool / v_pool [S, KVH, 64] bf16; slots int64: the
// contexts' slots, sequence after sequence; q_lens / ctx_lens per sequence (sum(q_lens) == T, sum(ctx_lens)
// == slots.numel(), q_len <= ctx_len); isa: one of prefill_attention_isas(), or "" for the first of them.
// Returns [T, H, 64] bf16. Reads only.
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots,
                             std::vector<int64_t> q_lens, std::vector<int64_t> ctx_lens, double scale, std::string isa) {
  const std::vector<std::string>& isas = available_isas();
  TORCH_CHECK(!isas.empty(), "prefill_attention: neither AMX-BF16 nor AVX-512 BF16 is available on this CPU/build");
  if (isa.empty()) isa = isas.front();
  TORCH_CHECK(std::find(isas.begin(), isas.end(), isa) != isas.end(), "prefill_attention: isa '", isa,
              "' is not available here (available: ", c10::Join(", ", isas), ")");
#ifdef TALARIA_BF16_SIMD
  [[maybe_unused]] const bool amx = isa == "amx";  // false where the build has no AMX path
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu() && slots.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kD && k_pool.dim() == 3 && k_pool.size(2) == kD && v_pool.sizes() == k_pool.sizes(),
              "q [T, H, 64], pools [S, KVH, 64]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots int64 [sum(ctx_lens)]");
  TORCH_CHECK(q_lens.size() == ctx_lens.size() && !q_lens.empty(), "one q_len and ctx_len per sequence");
  if (q.stride(2) != 1) q = q.contiguous();
  if (k_pool.stride(2) != 1) k_pool = k_pool.contiguous();
  if (v_pool.stride(2) != 1) v_pool = v_pool.contiguous();
  slots = slots.contiguous();
  TORCH_CHECK(k_pool.stride(0) % 2 == 0 && k_pool.stride(1) % 2 == 0 && k_pool.storage_offset() % 2 == 0,
              "k_pool rows must start on 4-byte boundaries (even strides)");
  const int64_t H = q.size(1), KVH = k_pool.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of kv heads");
  const int64_t G = H / KVH;
  std::vector<Seq> seqs;
  int64_t qa = 0, ka = 0, off = 0;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    const int64_t nq = q_lens[i], n = ctx_lens[i];
    TORCH_CHECK(nq >= 1 && nq <= n, "each sequence needs 1 <= q_len <= ctx_len");
    const int64_t padded = (n + kKB - 1) / kKB * kKB;
    seqs.push_back({qa, nq, ka, n, off, padded});
    qa += nq;
    ka += n;
    off += padded * kD * KVH;
  }
  TORCH_CHECK(qa == q.size(0) && ka == slots.numel(), "q_lens / ctx_lens do not match q and slots");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t S = k_pool.size(0);
  for (int64_t i = 0; i < ka; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "slot out of range");
  // packed K and V: per sequence and kv head, padded keys x 64 bf16 each (as dwords)
  at::Tensor kpack = at::empty({off / 2}, at::kInt), vpack = at::empty({off / 2}, at::kInt);
  auto* kp = reinterpret_cast<uint32_t*>(kpack.data_ptr<int32_t>());
  auto* vp = reinterpret_cast<uint32_t*>(vpack.data_ptr<int32_t>());
  const auto* kpool = reinterpret_cast<const uint16_t*>(k_pool.data_ptr());
  const auto* vpool = reinterpret_cast<const uint16_t*>(v_pool.data_ptr());
  const int64_t nseq = static_cast<int64_t>(seqs.size());
  at::parallel_for(0, nseq * KVH, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Seq& s = seqs[t / KVH];
      const int64_t kvh = t % KVH;
      const int64_t base = (s.kv_off + kvh * s.padded * kD) / 2;
      pack_kv(kpool, vpool, k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), sp, s, kvh, kp + base, vp + base);
    }
  });
  at::Tensor out = at::empty({q.size(0), H, kD}, q.options());
  std::vector<int64_t> first;  // first task index of each sequence
  int64_t ntasks = 0;
  for (const Seq& s : seqs) {
    first.push_back(ntasks);
    ntasks += H * ((s.n_q + kQB - 1) / kQB);
  }
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float sc = static_cast<float>(scale);
  // tasks dealt round-robin to the threads: a task's cost grows with its context, so contiguous ranges
  // would leave one thread idle behind the other's long sequence
  const int64_t nthr = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntasks));
  at::parallel_for(0, nthr, 1, [&](int64_t w0, int64_t w1) {
#ifdef TALARIA_AMX
    if (amx) load_tile_config();
#endif
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t t = w; t < ntasks; t += nthr) {
        const int64_t si = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
        const Seq& s = seqs[si];
        const int64_t local = t - first[si], nqb = (s.n_q + kQB - 1) / kQB;
        const int64_t h = local / nqb, r0 = (local % nqb) * kQB, kvh = h / G;
        const int64_t base = (s.kv_off + kvh * s.padded * kD) / 2;
#ifdef TALARIA_AMX
        if (amx) {
          task(qp, q.stride(0), q.stride(1), s, h, r0, kp + base, vp + base, sc, op, out.stride(0), out.stride(1));
          continue;
        }
#endif
        task_avx(qp, q.stride(0), q.stride(1), s, h, r0, kp + base, vp + base, sc, op, out.stride(0), out.stride(1));
      }
    }
#ifdef TALARIA_AMX
    if (amx) _tile_release();
#endif
  });
  return out;
#else
  return q;
#endif
}
