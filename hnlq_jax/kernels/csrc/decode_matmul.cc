// hnlq_decode_matmul: y[B, N] = x[B, K] @ W_hat[N, K]^T with the weight given only by its codes.
//
// The CPU twin of hq.matmul's XLA path (implementation="native"). Each task owns a tile of
// weight rows. For up to kFusedRows rows of x it decodes a register of 8 weights at a time
// straight into the rows' sums; for more it decodes chunk by chunk along K into a small float
// buffer that stays in L1 and multiplies the chunk into every activation row while it is hot.
// The dense weight never exists in memory. Decoding follows the XLA reference operation by
// operation, so the decoded weights are identical bit for bit (only the sums run in another
// order):
//
//   c   = sum_m q^m r(k_m)                        exact int32, r from the int8 codebook
//   w   = ((beta * (float(c) * cart - z)) * 2^(alpha T)) * row_scale     float32, in order
//   w   = bfloat16(w)                             when the activations are bfloat16
//
// A failed block (u = 0), a T field value above max_T + 1 or an index >= q^d reads NaN from
// the pow2 table / the index check, as the reference's valid_blocks does.
//
// Inputs: x f32[B, K]; index u8|u16[N, nb, M]; tfield u8[N, tb] (4-bit: two blocks a byte,
// low nibble first; 8-bit: a byte a block); scale f32[N] (empty: none); codebook s8[R, d]
// with R = the index dtype's range (rows >= q^d are padding), or another layout (Mode);
// pow2 f32[256] indexed by u (NaN where u is not a valid step); dither f32[d]. Output
// y f32[B, N].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HNLQ_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowTile = 8;    // weight rows per task and per pass over x
constexpr int64_t kChunk = 512;    // weights of a row decoded at a time (a multiple of 8)
constexpr int64_t kFusedRows = 4;  // up to this many rows of x: decoded registers go straight
                                   // into the sums (more: through the buffer, 4 x 2 blocking)

// The codebook argument's layout (chosen by hnlq_jax.kernels.cpu, see pairs_avx2 and
// horner_avx2): kGeneric and kHorner pass r itself, kPairs the two-level table.
enum Mode : int64_t { kGeneric = 0, kPairs = 1, kHorner = 2 };

struct Problem {
  const float* x;
  const void* index;
  const uint8_t* tfield;
  const float* scale;              // nullptr: no row scale
  const int8_t* codebook;
  const float* pow2;               // [256]
  const float* dither;             // [d]
  float* y;
  int64_t B, K, N, nb, M, d, tb, qd, q;
  float beta, cart;
  bool t4, bf16, u16;
  int64_t mode;                // a Mode: the codebook's layout
  const float* pair_steps;     // 4-bit T: [256][8] steps of both blocks of a byte; else null
};

inline float round_bf16(float w) {
  // float32 -> bfloat16 -> float32, round to nearest even (NaN stays NaN: the quiet bit is
  // above the rounded-off half).
  uint32_t b;
  std::memcpy(&b, &w, 4);
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&w, &b, 4);
  return w;
}

// Decodes blocks [j0, j1) of row r into out[(j - j0) * d + i].
template <typename Index, int D>
inline __attribute__((always_inline)) void decode_row(const Problem& p, int64_t r, int64_t j0,
                                                       int64_t j1, float* out) {
  const int d = D > 0 ? D : static_cast<int>(p.d);
  const Index* idx = static_cast<const Index*>(p.index) + (r * p.nb + j0) * p.M;
  const uint8_t* tf = p.tfield + r * p.tb;
  const float rs = p.scale ? p.scale[r] : 1.0f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t j = j0; j < j1; ++j, idx += p.M) {
    const int u = p.t4 ? (tf[j >> 1] >> ((j & 1) * 4)) & 15 : tf[j];
    float s = p.pow2[u];
    int32_t c[D > 0 ? D : 8];
    int64_t weight = 1;
    bool bad = false;
    for (int i = 0; i < d; ++i) c[i] = 0;
    if (p.mode == kPairs) {  // M = 2, q^d = 256: one 16-bit key, every key valid
      const int64_t key = static_cast<const uint16_t*>(p.index)[r * p.nb + j];
      for (int i = 0; i < d; ++i) c[i] = p.codebook[key * d + i];
    }
    for (int64_t m = 0; m < (p.mode == kPairs ? 0 : p.M); ++m, weight *= p.q) {
      const int64_t k = idx[m];
      bad |= k >= p.qd;
      const int8_t* row = p.codebook + k * d;
      for (int i = 0; i < d; ++i) c[i] += static_cast<int32_t>(weight) * row[i];
    }
    if (bad) s = nan;
    float* o = out + (j - j0) * d;
    for (int i = 0; i < d; ++i) {
      float w = (p.beta * (static_cast<float>(c[i]) * p.cart - p.dither[i])) * s;
      if (p.scale) w *= rs;
      o[i] = p.bf16 ? round_bf16(w) : w;
    }
  }
}

#ifdef HNLQ_X86
// decode_row with AVX2, the same operations in the same order (so the same values bit for
// bit), in two layouts chosen by the caller (hnlq_jax.kernels.cpu):
//
// * kPairs (d = 4, M = 2, uint8 index): the codebook argument is the two-level table
//   c[k0 + 256 k1] = r(k0) + q r(k1) (65,536 x 4 int8, 256 KiB: L2), read with one 16-bit key
//   per block; two blocks a register.
// * kHorner (d = 8, q a power of two): c = r(k_{M-1}) q + ... + r(k_0) summed in int8 lanes
//   (the caller checked that every partial sum fits), one block a register.
//
// Both give the int32 c of decode_row exactly (the sums fit int8, so no lane wraps).

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The constants of one row's decode, in registers (a struct of locals: stores through the
// output pointer cannot alias them, so the loop does not reload them).
struct RowConsts {
  __m256 beta, cart, rs, z;
  bool scale, bf16;
};

__attribute__((target("avx2,fma"))) inline __m256 finish_avx2(const RowConsts& k, __m256i c,
                                                               __m256 s) {
  const __m256 xhat = _mm256_mul_ps(_mm256_cvtepi32_ps(c), k.cart);
  __m256 w = _mm256_mul_ps(_mm256_mul_ps(k.beta, _mm256_sub_ps(xhat, k.z)), s);
  if (k.scale) w = _mm256_mul_ps(w, k.rs);
  if (k.bf16) {  // as round_bf16
    __m256i b = _mm256_castps_si256(w);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    w = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  return w;
}

__attribute__((target("avx2,fma"))) inline RowConsts row_consts(const Problem& p, int64_t r,
                                                                __m256 z) {
  return RowConsts{_mm256_set1_ps(p.beta), _mm256_set1_ps(p.cart),
                   _mm256_set1_ps(p.scale ? p.scale[r] : 1.0f), z, p.scale != nullptr, p.bf16};
}

inline float step_of(const Problem& p, const uint8_t* tf, int64_t j) {
  return p.pow2[p.t4 ? (tf[j >> 1] >> ((j & 1) * 4)) & 15 : tf[j]];
}

// Decodes blocks [j0, j1) of row r (j0 even) a register at a time, handing each register of 8
// weights to sink(offset of its first weight from block j0, weights); returns the first block
// not decoded (the caller finishes the rest with decode_row).
template <typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t pairs_avx2(const Problem& p, int64_t r,
                                                              int64_t j0, int64_t j1,
                                                              Sink& sink) {
  const uint16_t* key = static_cast<const uint16_t*>(p.index) + (r * p.nb + j0);
  const uint8_t* tf = p.tfield + r * p.tb;
  const RowConsts k = row_consts(
      p, r, _mm256_setr_ps(p.dither[0], p.dither[1], p.dither[2], p.dither[3], p.dither[0],
                           p.dither[1], p.dither[2], p.dither[3]));
  const int32_t* table = reinterpret_cast<const int32_t*>(p.codebook);
  const float* pair_steps = p.pair_steps;  // non-null with a 4-bit field: both blocks' T a byte
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2, key += 2) {
    const __m128i raw = _mm_insert_epi32(_mm_cvtsi32_si128(table[key[0]]), table[key[1]], 1);
    const __m256 s = pair_steps ? _mm256_loadu_ps(pair_steps + 8 * tf[j >> 1])
                                : _mm256_set_m128(_mm_set1_ps(step_of(p, tf, j + 1)),
                                                  _mm_set1_ps(step_of(p, tf, j)));
    sink((j - j0) * 4, finish_avx2(k, _mm256_cvtepi8_epi32(raw), s));
  }
  return j;
}

template <typename Index, typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t horner_avx2(const Problem& p, int64_t r,
                                                               int64_t j0, int64_t j1,
                                                               Sink& sink) {
  const Index* idx = static_cast<const Index*>(p.index) + (r * p.nb + j0) * p.M;
  const uint8_t* tf = p.tfield + r * p.tb;
  const RowConsts rk = row_consts(p, r, _mm256_loadu_ps(p.dither));
  const int8_t* codebook = p.codebook;
  const int64_t M = p.M, qd = p.qd;
  const int shifts = __builtin_ctzll(static_cast<unsigned long long>(p.q));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t j = j0; j < j1; ++j, idx += M) {
    float s = step_of(p, tf, j);
    int64_t k = idx[M - 1];
    bool bad = k >= qd;
    __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codebook + k * 8));
    for (int64_t m = M - 2; m >= 0; --m) {
      for (int i = 0; i < shifts; ++i) c = _mm_add_epi8(c, c);
      k = idx[m];
      bad |= k >= qd;
      c = _mm_add_epi8(c, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codebook + k * 8)));
    }
    if (bad) s = nan;
    sink((j - j0) * 8, finish_avx2(rk, _mm256_cvtepi8_epi32(c), _mm256_set1_ps(s)));
  }
  return j1;
}

// The two sinks: store into the decode buffer; multiply into NB activation rows' sums.
struct Store {
  float* out;
  __attribute__((target("avx2,fma"))) void operator()(int64_t o, __m256 w) {
    _mm256_storeu_ps(out + o, w);
  }
};

template <int NB>
struct Dot {
  const float* x;  // activation row 0 at the first decoded weight
  int64_t K;       // row stride of x
  __m256 acc[NB];
  __attribute__((target("avx2,fma"))) void operator()(int64_t o, __m256 w) {
    for (int b = 0; b < NB; ++b)
      acc[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + b * K + o), acc[b]);
  }
};

// Decodes blocks [j0, j1) of row r into out with the register layouts where they apply.
template <typename Index, int D>
__attribute__((target("avx2,fma"))) void decode_row_avx2(const Problem& p, int64_t r,
                                                          int64_t j0, int64_t j1, float* out) {
  Store sink{out};
  int64_t j = j0;
  if (D == 4 && p.mode == kPairs) j = pairs_avx2(p, r, j0, j1, sink);
  if (D == 8 && p.mode == kHorner) j = horner_avx2<Index>(p, r, j0, j1, sink);
  if (j < j1) decode_row<Index, D>(p, r, j, j1, out + (j - j0) * D);
}

// Small batches (NB rows of x): each weight register is multiplied into the sums as it is
// decoded, with no buffer. Row r's whole registers (those inside K) go this way; the ragged
// end through decode_row and scalar sums. y[b * N + r] = the row's product with x row b.
template <typename Index, int D, int NB>
__attribute__((target("avx2,fma"))) void row_dot_avx2(const Problem& p, int64_t r) {
  Dot<NB> sink{p.x, p.K, {}};
  for (int b = 0; b < NB; ++b) sink.acc[b] = _mm256_setzero_ps();
  const int64_t whole = p.K / 8 * (8 / D);  // blocks in whole registers inside K
  const int64_t j = D == 4 ? pairs_avx2(p, r, 0, whole, sink)
                           : horner_avx2<Index>(p, r, 0, whole, sink);
  float tail[16];
  float sums[NB];
  for (int b = 0; b < NB; ++b) sums[b] = hsum(sink.acc[b]);
  for (int64_t j0 = j; j0 < p.nb; j0 += 16 / D) {
    const int64_t j1 = std::min(p.nb, j0 + 16 / D);
    decode_row<Index, D>(p, r, j0, j1, tail);
    for (int64_t k = j0 * D; k < std::min(p.K, j1 * D); ++k)
      for (int b = 0; b < NB; ++b) sums[b] += p.x[b * p.K + k] * tail[k - j0 * D];
  }
  for (int b = 0; b < NB; ++b) p.y[b * p.N + r] = sums[b];
}
#endif

// acc[b * R + r] += sum_k x[b, k0 + k] * w[r * ldw + k] for k < len.
inline __attribute__((always_inline)) void tile_product(const Problem& p, int64_t k0,
                                                         int64_t len, const float* w,
                                                         int64_t ldw, int64_t R, float* acc) {
  for (int64_t b = 0; b < p.B; ++b) {
    const float* xb = p.x + b * p.K + k0;
    for (int64_t r = 0; r < R; ++r) {
      const float* wr = w + r * ldw;
      float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= len; k += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += xb[k + l] * wr[k + l];
      float sum = 0;
      for (; k < len; ++k) sum += xb[k] * wr[k];
      for (int l = 0; l < 8; ++l) sum += lanes[l];
      acc[b * R + r] += sum;
    }
  }
}

#ifdef HNLQ_X86
// The same product with AVX2: 4 weight rows x 2 activation rows in registers.

__attribute__((target("avx2,fma"))) void tile_product_avx2(const Problem& p, int64_t k0,
                                                            int64_t len, const float* w,
                                                            int64_t ldw, int64_t R,
                                                            float* acc) {
  const int64_t len8 = len & ~int64_t{7};
  int64_t b = 0;
  for (; b < p.B; b += 2) {
    const bool two = b + 1 < p.B;
    const float* x0 = p.x + b * p.K + k0;
    const float* x1 = two ? x0 + p.K : x0;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
      const float* w0 = w + r * ldw;
      __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
      __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
      for (int64_t k = 0; k < len8; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
        const __m256 c0 = _mm256_loadu_ps(w0 + k), c1 = _mm256_loadu_ps(w0 + ldw + k);
        const __m256 c2 = _mm256_loadu_ps(w0 + 2 * ldw + k);
        const __m256 c3 = _mm256_loadu_ps(w0 + 3 * ldw + k);
        a00 = _mm256_fmadd_ps(v0, c0, a00); a01 = _mm256_fmadd_ps(v0, c1, a01);
        a02 = _mm256_fmadd_ps(v0, c2, a02); a03 = _mm256_fmadd_ps(v0, c3, a03);
        a10 = _mm256_fmadd_ps(v1, c0, a10); a11 = _mm256_fmadd_ps(v1, c1, a11);
        a12 = _mm256_fmadd_ps(v1, c2, a12); a13 = _mm256_fmadd_ps(v1, c3, a13);
      }
      float t0[4] = {hsum(a00), hsum(a01), hsum(a02), hsum(a03)};
      float t1[4] = {hsum(a10), hsum(a11), hsum(a12), hsum(a13)};
      for (int64_t k = len8; k < len; ++k)
        for (int i = 0; i < 4; ++i) {
          t0[i] += x0[k] * w0[i * ldw + k];
          t1[i] += x1[k] * w0[i * ldw + k];
        }
      for (int i = 0; i < 4; ++i) {
        acc[b * R + r + i] += t0[i];
        if (two) acc[(b + 1) * R + r + i] += t1[i];
      }
    }
    for (; r < R; ++r) {  // the last rows of a ragged tile
      const float* wr = w + r * ldw;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0;
      for (int64_t k = 0; k < len8; k += 8) {
        const __m256 c = _mm256_loadu_ps(wr + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), c, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), c, a1);
      }
      float t0 = hsum(a0), t1 = hsum(a1);
      for (int64_t k = len8; k < len; ++k) {
        t0 += x0[k] * wr[k];
        t1 += x1[k] * wr[k];
      }
      acc[b * R + r] += t0;
      if (two) acc[(b + 1) * R + r] += t1;
    }
  }
}
#endif

// One task: weight rows [r0, r0 + R) against every activation row.
template <typename Index, int D, bool AVX2>
inline __attribute__((always_inline)) void row_tile(const Problem& p, int64_t r0, int64_t R,
                                                     float* buf, float* acc) {
  const int64_t d = D > 0 ? D : p.d;
  const int64_t blocks = kChunk / d;  // blocks per chunk; kChunk is a multiple of d
#ifdef HNLQ_X86
  if constexpr (AVX2 && (D == 4 || D == 8)) {  // small batches: no buffer
    if (p.mode == (D == 4 ? kPairs : kHorner) && p.B <= kFusedRows) {
      for (int64_t r = r0; r < r0 + R; ++r) {
        switch (p.B) {
          case 1: row_dot_avx2<Index, D, 1>(p, r); break;
          case 2: row_dot_avx2<Index, D, 2>(p, r); break;
          case 3: row_dot_avx2<Index, D, 3>(p, r); break;
          default: row_dot_avx2<Index, D, 4>(p, r); break;
        }
      }
      return;
    }
  }
#endif
  std::fill(acc, acc + p.B * R, 0.0f);
  for (int64_t j0 = 0; j0 < p.nb; j0 += blocks) {
    const int64_t j1 = std::min(p.nb, j0 + blocks);
    const int64_t k0 = j0 * d, len = std::min(p.K, j1 * d) - k0;
    if (len <= 0) break;
#ifdef HNLQ_X86
    if (AVX2) {
      for (int64_t r = 0; r < R; ++r) {
        if constexpr (D == 4 || D == 8)
          decode_row_avx2<Index, D>(p, r0 + r, j0, j1, buf + r * kChunk);
        else
          decode_row<Index, D>(p, r0 + r, j0, j1, buf + r * kChunk);
      }
      tile_product_avx2(p, k0, len, buf, kChunk, R, acc);
      continue;
    }
#endif
    for (int64_t r = 0; r < R; ++r) decode_row<Index, D>(p, r0 + r, j0, j1, buf + r * kChunk);
    tile_product(p, k0, len, buf, kChunk, R, acc);
  }
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t r = 0; r < R; ++r) p.y[b * p.N + r0 + r] = acc[b * R + r];
}

template <typename Index, int D, bool AVX2>
void run_tiles(const Problem& p, std::atomic<int64_t>& next, int64_t tiles) {
  std::vector<float> buf(kRowTile * kChunk), acc(p.B * kRowTile);
  for (int64_t t; (t = next.fetch_add(1)) < tiles;) {
    const int64_t r0 = t * kRowTile;
    row_tile<Index, D, AVX2>(p, r0, std::min(kRowTile, p.N - r0), buf.data(), acc.data());
  }
}

#ifdef HNLQ_X86
template <typename Index, int D>
__attribute__((target("avx2,fma"))) void run_tiles_avx2(const Problem& p,
                                                        std::atomic<int64_t>& next,
                                                        int64_t tiles) {
  run_tiles<Index, D, true>(p, next, tiles);
}
#endif

template <typename Index, int D>
void run(const Problem& p, std::atomic<int64_t>& next, int64_t tiles) {
#ifdef HNLQ_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return run_tiles_avx2<Index, D>(p, next, tiles);
#endif
  run_tiles<Index, D, false>(p, next, tiles);
}

template <typename Index>
void run_index(const Problem& p, std::atomic<int64_t>& next, int64_t tiles) {
  switch (p.d) {
    case 2: return run<Index, 2>(p, next, tiles);
    case 4: return run<Index, 4>(p, next, tiles);
    case 8: return run<Index, 8>(p, next, tiles);
    default: return run<Index, 0>(p, next, tiles);
  }
}

// The state of one call: tasks claim row tiles until none is left. The calling thread works
// too and then waits only for tasks that hold a tile, never for one not yet started, so a busy
// or absent thread pool cannot deadlock the call.
struct Call {
  alignas(32) float pair_steps[256 * 8];
  Problem p;
  int64_t tiles = 0;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t busy = 0;
};

void work(Call& call) {
  if (call.p.u16)
    run_index<uint16_t>(call.p, call.next, call.tiles);
  else
    run_index<uint8_t>(call.p, call.next, call.tiles);
}

ffi::Error Check(bool ok, const char* what) {
  return ok ? ffi::Error::Success()
            : ffi::Error::InvalidArgument(std::string("hnlq_decode_matmul: ") + what);
}

ffi::Error DecodeMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer index,
                            ffi::Buffer<ffi::U8> tfield, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S8> codebook, ffi::Buffer<ffi::F32> pow2,
                            ffi::Buffer<ffi::F32> dither, ffi::ResultBuffer<ffi::F32> y,
                            float beta, float cart, int64_t q, int64_t qd, bool t4, bool bf16,
                            int64_t mode) {
  const auto xd = x.dimensions(), id = index.dimensions(), td = tfield.dimensions();
  const auto cd = codebook.dimensions(), yd = y->dimensions();
  const bool u16 = index.element_type() == ffi::DataType::U16;
  ffi::Error e = Check(u16 || index.element_type() == ffi::DataType::U8, "index must be u8/u16");
  if (e.failure()) return e;
  e = Check(xd.size() == 2 && id.size() == 3 && td.size() == 2 && cd.size() == 2 &&
                yd.size() == 2, "ranks: x [B, K], index [N, nb, M], tfield [N, tb], "
                "codebook [R, d], y [B, N]");
  if (e.failure()) return e;
  Problem p{};
  p.B = xd[0]; p.K = xd[1]; p.N = id[0]; p.nb = id[1]; p.M = id[2]; p.d = cd[1];
  p.tb = td[1]; p.qd = qd; p.q = q; p.beta = beta; p.cart = cart; p.t4 = t4; p.bf16 = bf16;
  p.u16 = u16; p.mode = mode;
  const int64_t range = u16 ? 65536 : 256;
  const bool pairs = mode == kPairs;
  e = Check(p.d >= 1 && p.d <= 8 && 512 % p.d == 0 && qd >= 1 && qd <= range && p.M >= 1 &&
                q >= 2 && cd[0] == (pairs ? 65536 : range) && mode >= kGeneric &&
                mode <= kHorner && (!pairs || (!u16 && p.M == 2 && qd == 256)) &&
                (mode != kHorner || (p.d == 8 && (q & (q - 1)) == 0)),
            "codebook must be s8[index range, d <= 8] in a layout that fits the codes");
  if (e.failure()) return e;
  e = Check(p.K > (p.nb - 1) * p.d && p.K <= p.nb * p.d && td[0] == p.N &&
                p.tb == (t4 ? (p.nb + 1) / 2 : p.nb) && yd[0] == p.B && yd[1] == p.N &&
                pow2.element_count() == 256 && dither.element_count() == p.d &&
                (scale.element_count() == 0 || scale.element_count() == p.N),
            "shapes of x, codes, tables and y disagree");
  if (e.failure()) return e;
  if (p.B == 0 || p.N == 0) return ffi::Error::Success();
  p.x = x.typed_data(); p.index = index.untyped_data(); p.tfield = tfield.typed_data();
  p.scale = scale.element_count() ? scale.typed_data() : nullptr;
  p.codebook = codebook.typed_data(); p.pow2 = pow2.typed_data(); p.dither = dither.typed_data();
  p.y = y->typed_data();

  auto call = std::make_shared<Call>();
  if (t4) {  // the steps of both blocks of a T byte, one aligned register each
    for (int t = 0; t < 256; ++t)
      for (int i = 0; i < 8; ++i) call->pair_steps[8 * t + i] = p.pow2[i < 4 ? t & 15 : t >> 4];
    p.pair_steps = call->pair_steps;
  }
  call->p = p;
  call->tiles = (p.N + kRowTile - 1) / kRowTile;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), call->tiles) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([call] {
      {
        std::lock_guard<std::mutex> lock(call->mu);
        if (call->next.load() >= call->tiles) return;  // nothing left: touch nothing
        ++call->busy;
      }
      work(*call);
      std::lock_guard<std::mutex> lock(call->mu);
      if (--call->busy == 0) call->cv.notify_all();
    });
  }
  work(*call);
  std::unique_lock<std::mutex> lock(call->mu);
  call->cv.wait(lock, [&] { return call->busy == 0; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HnlqDecodeMatmul, DecodeMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::AnyBuffer>()          // index
                                  .Arg<ffi::Buffer<ffi::U8>>()    // tfield
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale
                                  .Arg<ffi::Buffer<ffi::S8>>()    // codebook
                                  .Arg<ffi::Buffer<ffi::F32>>()   // pow2
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dither
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<float>("beta")
                                  .Attr<float>("cart")
                                  .Attr<int64_t>("q")
                                  .Attr<int64_t>("qd")
                                  .Attr<bool>("t4")
                                  .Attr<bool>("bf16")
                                  .Attr<int64_t>("mode"));
