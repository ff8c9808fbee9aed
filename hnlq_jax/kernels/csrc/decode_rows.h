// What the kernels that decode codes share: the decoding of a row's blocks (decode_row, and
// with AVX2 decode_row_avx2, bit for bit the XLA reference's operations), the checks of the
// codes' arguments and the FFI bindings of the codes' operands.
//
// Decoding, per block of d weights of row r (the XLA reference's operations in its order):
//
//   c   = sum_m q^m r(k_m)                        exact int32, r from the int8 codebook
//   w   = ((beta * (float(c) * cart - z)) * 2^(alpha T)) * row_scale     float32, in order
//   w   = bfloat16(w)                             when bf16 is set
//
// A failed block (u = 0), a T field value above max_T + 1 or an index >= q^d reads NaN from
// the pow2 table / the index check, as the reference's valid_blocks does.
//
// Codes arguments: index u8|u16[N, nb, M]; tfield u8[N, tb] (4-bit: two blocks a byte, low
// nibble first; 8-bit: a byte a block); scale f32[N] (empty: none); codebook s8[R, d] with
// R = the index dtype's range (rows >= q^d are padding), or another layout (Mode); pow2
// f32[256] indexed by u (NaN where u is not a valid step); dither f32[d].

#ifndef HNLQ_DECODE_ROWS_H_
#define HNLQ_DECODE_ROWS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define HNLQ_X86 1
#endif

#include "common.h"

namespace hnlq {

// The codebook argument's layout (chosen by hnlq_jax.kernels.cpu, see pairs_avx2 and
// horner_avx2): kGeneric and kHorner pass r itself, kPairs the two-level table then r,
// kPacked r as one 32-bit word a row (8 coordinates of 4 bits, excess 7: r_i = nibble_i - 7),
// half the bytes of kHorner's table (E8 q = 4: 256 KiB, which stays in a 512 KiB L2).
enum Mode : int64_t { kGeneric = 0, kPairs = 1, kHorner = 2, kPacked = 3 };

// The codebook argument's rows in layout `mode` for an index of 8 or 16 (u16) bits.
inline int64_t codebook_rows(int64_t mode, bool u16) {
  const int64_t range = u16 ? 65536 : 256;
  return mode == kPairs ? 65536 + 256 : mode == kPacked ? range / 2 : range;
}

inline int32_t packed_coordinate(uint32_t word, int i) {
  return static_cast<int32_t>((word >> (4 * i)) & 15u) - 7;
}

// The instruction sets a kernel has code for, in order. A call runs the best one the CPU has
// (checked once, at run time: the build does not assume any), at most isa_limit() (module.cc's
// set_isa_limit: tests and benchmarks compare the levels on one machine). kAvx512's products
// sum 16 lanes where kAvx2's sum 8, and kVbmi's D4 pair codes sum by coordinate planes
// (planes_vbmi) and lut_matmul.cc's sums a column a lane, so their float sums differ in
// rounding; decoded weights are the same bits on every level.
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kVbmi = 3 };

inline int supported_isa() {
#ifdef HNLQ_X86
  static const int isa = [] {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return kPortable;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512dq") || !__builtin_cpu_supports("avx512vl"))
      return kAvx2;
    return __builtin_cpu_supports("avx512vbmi") ? kVbmi : kAvx512;
  }();
  return isa;
#else
  return kPortable;
#endif
}

inline std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{kVbmi};
  return limit;
}

// The level a call starting now runs (read once per call: its threads all run the same code).
inline int active_isa() { return std::min(supported_isa(), isa_limit().load()); }

struct Problem {
  const float* x;
  const void* index;
  const uint8_t* tfield;
  const float* scale;              // nullptr: no row scale
  const int8_t* codebook;
  const float* pow2;               // [256]
  const float* dither;             // [d]
  float* y;                        // the output: y[B, N] of a product, W_hat[N, K] of a decode
  int64_t B, K, N, nb, M, d, tb, qd, q;
  float beta, cart;
  bool t4, bf16, u16;
  bool fold;                   // no dither and no bf16 rounding: a product may apply
                               // beta * cart * row_scale once per row (decode_matmul.cc)
  int64_t mode;                // a Mode: the codebook's layout
  const float* pair_steps;     // 4-bit T, d = 4 or 8: [256][2d] steps of both blocks of a byte
                               // (each d times); else null
  const int8_t* planes;        // kPairs: r's coordinate planes, byte k of plane i r_i(k)
                               // [4][256] (decode_matmul.cc's planes_vbmi); else null
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

// Decodes blocks [j0, j1) of row r into out[(j - j0) * d + i]; Unscaled (p.fold codes only):
// c * 2^(alpha T), without the row's factor beta * cart * row_scale (decode_matmul.cc).
template <typename Index, int D, bool Unscaled = false>
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
      if (p.mode == kPacked) {
        const uint32_t word = reinterpret_cast<const uint32_t*>(p.codebook)[k];
        for (int i = 0; i < d; ++i)
          c[i] += static_cast<int32_t>(weight) * packed_coordinate(word, i);
        continue;
      }
      const int8_t* row = p.codebook + k * d;
      for (int i = 0; i < d; ++i) c[i] += static_cast<int32_t>(weight) * row[i];
    }
    if (bad) s = nan;
    float* o = out + (j - j0) * d;
    for (int i = 0; i < d; ++i) {
      if (Unscaled) {
        o[i] = static_cast<float>(c[i]) * s;
        continue;
      }
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
//   per block, two blocks a register; then r itself (256 x 4, for planes_vbmi).
// * kHorner (d = 8, q a power of two): c = r(k_{M-1}) q + ... + r(k_0) summed in int8 lanes
//   (the caller checked that every partial sum fits), one block a register.
//
// Both give the int32 c of decode_row exactly (the sums fit int8, so no lane wraps).
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

// The constants of row r's decode for a register of 8 weights of d-blocks (d = 4: two blocks,
// the dither twice; d = 8: one).
template <int D>
__attribute__((target("avx2,fma"))) inline RowConsts row_consts_of(const Problem& p,
                                                                   int64_t r) {
  const float* z = p.dither;
  return RowConsts{_mm256_set1_ps(p.beta), _mm256_set1_ps(p.cart),
                   _mm256_set1_ps(p.scale ? p.scale[r] : 1.0f),
                   D == 4 ? _mm256_setr_ps(z[0], z[1], z[2], z[3], z[0], z[1], z[2], z[3])
                          : _mm256_loadu_ps(z),
                   p.scale != nullptr, p.bf16};
}

inline float step_of(const Problem& p, const uint8_t* tf, int64_t j) {
  return p.pow2[p.t4 ? (tf[j >> 1] >> ((j & 1) * 4)) & 15 : tf[j]];
}

// Decodes blocks [j0, j1) of row r (j0 even) a register at a time, handing each register of 8
// weights to sink(offset of its first weight from block j0, c, s): the int32 lattice
// coordinates c and the blocks' steps s (2^(alpha T), NaN for a failed block), which
// finish_avx2 turns into the weights; returns the first block not decoded (the caller
// finishes the rest with decode_row).
template <typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t pairs_avx2(const Problem& p, int64_t r,
                                                              int64_t j0, int64_t j1,
                                                              Sink& sink) {
  const uint16_t* key = static_cast<const uint16_t*>(p.index) + (r * p.nb + j0);
  const uint8_t* tf = p.tfield + r * p.tb;
  const int32_t* table = reinterpret_cast<const int32_t*>(p.codebook);
  const float* pair_steps = p.pair_steps;  // non-null with a 4-bit field (8 floats a byte)
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2, key += 2) {
    const __m128i raw = _mm_insert_epi32(_mm_cvtsi32_si128(table[key[0]]), table[key[1]], 1);
    const __m256 s = pair_steps ? _mm256_loadu_ps(pair_steps + 8 * tf[j >> 1])
                                : _mm256_set_m128(_mm_set1_ps(step_of(p, tf, j + 1)),
                                                  _mm_set1_ps(step_of(p, tf, j)));
    sink((j - j0) * 4, _mm256_cvtepi8_epi32(raw), s);
  }
  return j;
}

template <typename Index, typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t horner_avx2(const Problem& p, int64_t r,
                                                               int64_t j0, int64_t j1,
                                                               Sink& sink) {
  const Index* idx = static_cast<const Index*>(p.index) + (r * p.nb + j0) * p.M;
  const uint8_t* tf = p.tfield + r * p.tb;
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
    sink((j - j0) * 8, _mm256_cvtepi8_epi32(c), _mm256_set1_ps(s));
  }
  return j1;
}

// kHorner's sums from the kPacked table: each level's word spread over 8 int32 lanes by
// variable shifts, c = (...(n_{M-1} q + n_{M-2}) q + ...) + n_0 - 7 (q^{M-1} + ... + 1).
template <typename Index, typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t packed_avx2(const Problem& p, int64_t r,
                                                               int64_t j0, int64_t j1,
                                                               Sink& sink) {
  const Index* idx = static_cast<const Index*>(p.index) + (r * p.nb + j0) * p.M;
  const uint8_t* tf = p.tfield + r * p.tb;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codebook);
  const int64_t M = p.M, qd = p.qd;
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(p.q));
  int32_t ones = 0;  // q^{M-1} + ... + 1
  for (int64_t m = 0; m < M; ++m) ones = ones * static_cast<int32_t>(p.q) + 1;
  const __m256i lanes = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(15), bias = _mm256_set1_epi32(-7 * ones);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t j = j0; j < j1; ++j, idx += M) {
    float s = step_of(p, tf, j);
    int64_t k = idx[M - 1];
    bool bad = k >= qd;
    __m256i c = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(words[k])), lanes), nibble);
    for (int64_t m = M - 2; m >= 0; --m) {
      k = idx[m];
      bad |= k >= qd;
      const __m256i n = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(words[k])), lanes), nibble);
      c = _mm256_add_epi32(_mm256_slli_epi32(c, shift), n);
    }
    if (bad) s = nan;
    sink((j - j0) * 8, _mm256_add_epi32(c, bias), _mm256_set1_ps(s));
  }
  return j1;
}

// packed_avx2 for the usual E8 codes, M = 2 levels of uint16 indices (q^d = 65,536: every
// index valid) and a 4-bit T field (one byte the steps of two blocks): the same sums with no
// per-level loop or index checks, two blocks an iteration (j0 even); decodes every block.
inline bool packed2_applies(const Problem& p) {
  return p.mode == kPacked && p.M == 2 && p.u16 && p.qd == 65536 && p.pair_steps != nullptr;
}

// The 8 int32 coordinates of one block: (n_1 << shift) + n_0 - 7 (q + 1), n_m level m's word
// split into 4-bit lanes.
__attribute__((target("avx2,fma"))) inline __m256i packed2_block(const uint32_t* words,
                                                                 const uint16_t* k, int shift) {
  const __m256i lanes = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(15);
  const __m256i n1 = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(words[k[1]])), lanes), nibble);
  const __m256i n0 = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(words[k[0]])), lanes), nibble);
  return _mm256_add_epi32(_mm256_slli_epi32(n1, shift), n0);
}

template <typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t packed2_avx2(const Problem& p, int64_t r,
                                                                int64_t j0, int64_t j1,
                                                                Sink& sink) {
  const uint16_t* idx = static_cast<const uint16_t*>(p.index) + (r * p.nb + j0) * 2;
  const uint8_t* tf = p.tfield + r * p.tb;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codebook);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(p.q));
  const __m256i bias = _mm256_set1_epi32(-7 * static_cast<int32_t>(p.q + 1));
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2, idx += 4) {
    const float* steps = p.pair_steps + 16 * tf[j >> 1];
    sink((j - j0) * 8, _mm256_add_epi32(packed2_block(words, idx, shift), bias),
         _mm256_load_ps(steps));
    sink((j - j0) * 8 + 8, _mm256_add_epi32(packed2_block(words, idx + 2, shift), bias),
         _mm256_load_ps(steps + 8));
  }
  if (j < j1) {  // an odd last block (the first of its T byte): a register, as packed_avx2
    sink((j - j0) * 8, _mm256_add_epi32(packed2_block(words, idx, shift), bias),
         _mm256_load_ps(p.pair_steps + 16 * tf[j >> 1]));
    ++j;
  }
  return j;
}

// The register decode of blocks [j0, j1) of row r in the codebook's layout (kPairs for d = 4,
// kHorner or kPacked for d = 8; the caller checked that one applies).
template <typename Index, int D, typename Sink>
__attribute__((target("avx2,fma"))) inline int64_t registers_avx2(const Problem& p, int64_t r,
                                                                  int64_t j0, int64_t j1,
                                                                  Sink& sink) {
  if constexpr (D == 4) {
    return pairs_avx2(p, r, j0, j1, sink);
  } else {
    if (packed2_applies(p) && j0 % 2 == 0) return packed2_avx2(p, r, j0, j1, sink);
    return p.mode == kPacked ? packed_avx2<Index>(p, r, j0, j1, sink)
                             : horner_avx2<Index>(p, r, j0, j1, sink);
  }
}

// Whether the register decode applies to the codes (else decode_row, a weight at a time).
template <int D>
inline bool registers_apply(const Problem& p) {
  return D == 4 ? p.mode == kPairs : D == 8 && (p.mode == kHorner || p.mode == kPacked);
}

#define HNLQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define HNLQ_VBMI \
  __attribute__((target("avx512vbmi,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

// The sum of a register's lanes (the products' and lut_matmul.cc's, in one order).
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

HNLQ_AVX512 inline float hsum512(__m512 v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

// The register decodes with AVX-512 (kAvx512; decode_matmul.cc's small-batch product): 16
// weights a register (four D4 blocks, two E8 blocks), each lane computed as finish_avx2's.
struct RowConsts512 {
  __m512 beta, cart, rs, z;
  bool scale, bf16;
};

HNLQ_AVX512 inline __m512 finish_avx512(const RowConsts512& k, __m512 c, __m512 s) {
  const __m512 xhat = _mm512_mul_ps(c, k.cart);
  __m512 w = _mm512_mul_ps(_mm512_mul_ps(k.beta, _mm512_sub_ps(xhat, k.z)), s);
  if (k.scale) w = _mm512_mul_ps(w, k.rs);
  if (k.bf16) {  // as round_bf16
    __m512i b = _mm512_castps_si512(w);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    w = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  return w;
}

template <int D>
HNLQ_AVX512 inline RowConsts512 row_consts512_of(const Problem& p, int64_t r) {
  const __m256 z = row_consts_of<D>(p, r).z;  // the dither of 8 weights
  return RowConsts512{_mm512_set1_ps(p.beta), _mm512_set1_ps(p.cart),
                      _mm512_set1_ps(p.scale ? p.scale[r] : 1.0f),
                      _mm512_insertf32x8(_mm512_castps256_ps512(z), z, 1), p.scale != nullptr,
                      p.bf16};
}

// A failed block's step: pow2[0] is NaN (u = 0), as decode_row's `if (bad) s = nan`.
inline float checked_step(const Problem& p, const uint8_t* tf, int64_t j, bool bad) {
  return bad ? std::numeric_limits<float>::quiet_NaN() : step_of(p, tf, j);
}

// Blocks [j0, j1) of row r (j0 a multiple of 4), four a register; returns the first block not
// decoded.
template <typename Sink>
HNLQ_AVX512 inline int64_t pairs_avx512(const Problem& p, int64_t r, int64_t j0, int64_t j1,
                                        Sink& sink) {
  const uint16_t* key = static_cast<const uint16_t*>(p.index) + (r * p.nb + j0);
  const uint8_t* tf = p.tfield + r * p.tb;
  const int32_t* table = reinterpret_cast<const int32_t*>(p.codebook);
  const float* pair_steps = p.pair_steps;
  const __m512i quads = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i up = _mm512_setr_epi32(24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0, 24, 16, 8, 0);
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4, key += 4) {
    // Block i's word in lanes 4i..4i+3 by (masked) broadcast loads, no shuffles; lane l keeps
    // its byte l % 4, sign-extended by a shift left and an arithmetic shift right.
    __m512i c = _mm512_set1_epi32(table[key[0]]);
    c = _mm512_mask_set1_epi32(c, 0x00F0, table[key[1]]);
    c = _mm512_mask_set1_epi32(c, 0x0F00, table[key[2]]);
    c = _mm512_mask_set1_epi32(c, 0xF000, table[key[3]]);
    c = _mm512_srai_epi32(_mm512_sllv_epi32(c, up), 24);
    const __m512 s =
        pair_steps
            ? _mm512_insertf32x8(
                  _mm512_castps256_ps512(_mm256_loadu_ps(pair_steps + 8 * tf[j >> 1])),
                  _mm256_loadu_ps(pair_steps + 8 * tf[(j >> 1) + 1]), 1)
            : _mm512_permutexvar_ps(
                  quads, _mm512_castps128_ps512(_mm_setr_ps(step_of(p, tf, j),
                                                            step_of(p, tf, j + 1),
                                                            step_of(p, tf, j + 2),
                                                            step_of(p, tf, j + 3))));
    sink((j - j0) * 4, c, s);
  }
  return j;
}

// packed_avx2's sums for two blocks a register (lanes 0-7 block j, 8-15 block j + 1).
template <typename Index, typename Sink>
HNLQ_AVX512 inline int64_t packed_avx512(const Problem& p, int64_t r, int64_t j0, int64_t j1,
                                         Sink& sink) {
  const int64_t M = p.M, qd = p.qd;
  const Index* idx = static_cast<const Index*>(p.index) + (r * p.nb + j0) * M;
  const uint8_t* tf = p.tfield + r * p.tb;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codebook);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(p.q));
  int32_t ones = 0;  // q^{M-1} + ... + 1
  for (int64_t m = 0; m < M; ++m) ones = ones * static_cast<int32_t>(p.q) + 1;
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24,
                                          28);
  const __m512i nibble = _mm512_set1_epi32(15), bias = _mm512_set1_epi32(-7 * ones);
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2, idx += 2 * M) {
    int64_t ka = idx[M - 1], kb = idx[2 * M - 1];
    bool bad_a = ka >= qd, bad_b = kb >= qd;
    __m512i c = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(words[ka])),
                                                 0xFF00, static_cast<int>(words[kb])),
                          lanes),
        nibble);
    for (int64_t m = M - 2; m >= 0; --m) {
      ka = idx[m];
      kb = idx[M + m];
      bad_a |= ka >= qd;
      bad_b |= kb >= qd;
      const __m512i n = _mm512_and_si512(
          _mm512_srlv_epi32(
              _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(words[ka])), 0xFF00,
                                     static_cast<int>(words[kb])),
              lanes),
          nibble);
      c = _mm512_add_epi32(_mm512_slli_epi32(c, shift), n);
    }
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(checked_step(p, tf, j, bad_a)), 0xFF00,
                                        _mm512_set1_ps(checked_step(p, tf, j + 1, bad_b)));
    sink((j - j0) * 8, _mm512_add_epi32(c, bias), s);
  }
  return j;
}

// horner_avx2's int8 sums for two blocks at once (bytes 0-7 block j, 8-15 block j + 1).
template <typename Index, typename Sink>
HNLQ_AVX512 inline int64_t horner_avx512(const Problem& p, int64_t r, int64_t j0, int64_t j1,
                                         Sink& sink) {
  const int64_t M = p.M, qd = p.qd;
  const Index* idx = static_cast<const Index*>(p.index) + (r * p.nb + j0) * M;
  const uint8_t* tf = p.tfield + r * p.tb;
  const int8_t* codebook = p.codebook;
  const int shifts = __builtin_ctzll(static_cast<unsigned long long>(p.q));
  auto rows = [&](int64_t ka, int64_t kb) {
    return _mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codebook + ka * 8)),
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codebook + kb * 8)));
  };
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2, idx += 2 * M) {
    int64_t ka = idx[M - 1], kb = idx[2 * M - 1];
    bool bad_a = ka >= qd, bad_b = kb >= qd;
    __m128i c = rows(ka, kb);
    for (int64_t m = M - 2; m >= 0; --m) {
      for (int i = 0; i < shifts; ++i) c = _mm_add_epi8(c, c);
      ka = idx[m];
      kb = idx[M + m];
      bad_a |= ka >= qd;
      bad_b |= kb >= qd;
      c = _mm_add_epi8(c, rows(ka, kb));
    }
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(checked_step(p, tf, j, bad_a)), 0xFF00,
                                        _mm512_set1_ps(checked_step(p, tf, j + 1, bad_b)));
    sink((j - j0) * 8, _mm512_cvtepi8_epi32(c), s);
  }
  return j;
}

// Level m's 4-bit coordinates of blocks j (lanes 0-7) and j + 1 (8-15), indices k.
HNLQ_AVX512 inline __m512i packed2_level(const uint32_t* words, const uint16_t* k, int m,
                                         __m512i lanes, __m512i nibble) {
  const __m512i w = _mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(words[k[m]])),
                                           0xFF00, static_cast<int>(words[k[2 + m]]));
  return _mm512_and_si512(_mm512_srlv_epi32(w, lanes), nibble);
}

// packed2_avx2's sums, two blocks a register.
template <typename Sink>
HNLQ_AVX512 inline int64_t packed2_avx512(const Problem& p, int64_t r, int64_t j0, int64_t j1,
                                          Sink& sink) {
  const uint16_t* idx = static_cast<const uint16_t*>(p.index) + (r * p.nb + j0) * 2;
  const uint8_t* tf = p.tfield + r * p.tb;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codebook);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(p.q));
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24,
                                          28);
  const __m512i nibble = _mm512_set1_epi32(15);
  const __m512i bias = _mm512_set1_epi32(-7 * static_cast<int32_t>(p.q + 1));
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2, idx += 4) {
    const __m512i c = _mm512_add_epi32(
        _mm512_slli_epi32(packed2_level(words, idx, 1, lanes, nibble), shift),
        packed2_level(words, idx, 0, lanes, nibble));
    sink((j - j0) * 8, _mm512_add_epi32(c, bias), _mm512_load_ps(p.pair_steps + 16 * tf[j >> 1]));
  }
  return j;
}

template <typename Index, int D, typename Sink>
HNLQ_AVX512 inline int64_t registers_avx512(const Problem& p, int64_t r, int64_t j0,
                                            int64_t j1, Sink& sink) {
  if constexpr (D == 4) {
    return pairs_avx512(p, r, j0, j1, sink);
  } else {
    if (packed2_applies(p) && j0 % 2 == 0) return packed2_avx512(p, r, j0, j1, sink);
    return p.mode == kPacked ? packed_avx512<Index>(p, r, j0, j1, sink)
                             : horner_avx512<Index>(p, r, j0, j1, sink);
  }
}

// A sink that stores decoded registers into a buffer (Unscaled: as decode_row's).
template <bool Unscaled>
struct Store {
  float* out;
  RowConsts k;
  __attribute__((target("avx2,fma"))) void operator()(int64_t o, __m256i c, __m256 s) {
    _mm256_storeu_ps(out + o, Unscaled ? _mm256_mul_ps(_mm256_cvtepi32_ps(c), s)
                                       : finish_avx2(k, c, s));
  }
};

// kPairs codes with AVX512-VBMI (kVbmi), 64 blocks (256 weights) a step by coordinate planes
// (decode_step: decode_matmul.cc's products and decode.cc): the keys' bytes split into levels
// 0 and 1 (two byte permutes); each level looked up in r's planes (p.planes, a plane's 256
// bytes in four registers) by two two-register byte permutes and a blend on the key's top bit;
// c_i = r_i(k0) + q r_i(k1) summed in int8 lanes (q = 4; _mode checked that the sums fit). No
// table is read from memory: a step costs the same after a GEMM has emptied the caches.

// A byte of each lane of k looked up in a 256-byte table (four registers).
HNLQ_VBMI inline __m512i lookup256(const __m512i* t, __m512i k, __mmask64 top) {
  return _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[0], k, t[1]),
                                _mm512_permutex2var_epi8(t[2], k, t[3]));
}

// The steps of blocks j..j + 15 of a row (T field tf), one a lane.
HNLQ_VBMI inline __m512 steps16(const Problem& p, const uint8_t* tf, int64_t j, __m512 pow2) {
  if (p.t4) {  // u < 16: a permute of pow2[0..15]; byte j / 2 doubled, then its nibbles
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tf + (j >> 1)));
    const __m512i u = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                          _mm512_set1_epi64(int64_t{4} << 32)),
        _mm512_set1_epi32(15));
    return _mm512_permutexvar_ps(u, pow2);
  }
  const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tf + j)));
  return _mm512_i32gather_ps(u, p.pow2, 4);
}

// A decoded step of one weight row: folded, c (by plane i and lanes h) and the steps; else
// the weights.
struct PlaneStep {
  __m512 v[4][4];  // [i][h]
  __m512 s[4];     // [h], folded only
};

// What decode_step needs of a call, in registers.
struct PlaneConsts {
  __m512i t[4][4];  // r's planes
  __m512i even, odd;
  __m512 pow2;
  __m512 z[4];
};

HNLQ_VBMI inline PlaneConsts plane_consts(const Problem& p) {
  PlaneConsts c;
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 4; ++h) c.t[i][h] = _mm512_load_si512(p.planes + 256 * i + 64 * h);
  alignas(64) uint8_t pick[2][64];  // the even (level 0) and odd (level 1) bytes of 128
  for (int l = 0; l < 64; ++l) pick[0][l] = static_cast<uint8_t>(2 * l), pick[1][l] = 2 * l + 1;
  c.even = _mm512_load_si512(pick[0]);
  c.odd = _mm512_load_si512(pick[1]);
  c.pow2 = _mm512_loadu_ps(p.pow2);
  for (int i = 0; i < 4; ++i) c.z[i] = _mm512_set1_ps(p.dither[i]);
  return c;
}

template <bool Fold>
HNLQ_VBMI inline void decode_step(const Problem& p, int64_t r, int64_t g, const PlaneConsts& pc,
                                  const RowConsts512& k, PlaneStep& out) {
  const uint8_t* key = static_cast<const uint8_t*>(p.index) + (r * p.nb + 64 * g) * 2;
  const uint8_t* tf = p.tfield + r * p.tb;
  const __m512i lo = _mm512_loadu_si512(key), hi = _mm512_loadu_si512(key + 64);
  const __m512i k0 = _mm512_permutex2var_epi8(lo, pc.even, hi);
  const __m512i k1 = _mm512_permutex2var_epi8(lo, pc.odd, hi);
  const __mmask64 top0 = _mm512_movepi8_mask(k0), top1 = _mm512_movepi8_mask(k1);
  __m512 s[4];
  for (int h = 0; h < 4; ++h) s[h] = steps16(p, tf, 64 * g + 16 * h, pc.pow2);
  alignas(64) int8_t cb[4][64];  // widened from memory: no extracts
  for (int i = 0; i < 4; ++i) {
    const __m512i r1 = lookup256(pc.t[i], k1, top1);
    const __m512i c = _mm512_add_epi8(r1, r1);
    _mm512_store_si512(cb[i], _mm512_add_epi8(lookup256(pc.t[i], k0, top0), _mm512_add_epi8(c, c)));
  }
  for (int i = 0; i < 4; ++i) {
    RowConsts512 ki = k;
    ki.z = pc.z[i];
    for (int h = 0; h < 4; ++h) {
      const __m512 cf = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(cb[i] + 16 * h))));
      out.v[i][h] = Fold ? cf : finish_avx512(ki, cf, s[h]);
    }
  }
  for (int h = 0; h < 4; ++h) out.s[h] = s[h];
}

// Decodes blocks [j0, j1) of row r into out with the register layouts where they apply.
template <typename Index, int D, bool Unscaled = false>
__attribute__((target("avx2,fma"))) void decode_row_avx2(const Problem& p, int64_t r,
                                                          int64_t j0, int64_t j1, float* out) {
  Store<Unscaled> sink{out, row_consts_of<D>(p, r)};
  const int64_t j = registers_apply<D>(p) ? registers_avx2<Index, D>(p, r, j0, j1, sink) : j0;
  if (j < j1) decode_row<Index, D, Unscaled>(p, r, j, j1, out + (j - j0) * D);
}
#endif  // HNLQ_X86

// A call's state: the problem and the row tiles that the calling thread and its helpers
// claim (common.h).
struct Shared : Tasks {
  alignas(64) float pair_steps[256 * 16];
  alignas(64) int8_t planes[4 * 256];
  std::vector<float> xp;  // the activations in plane order (decode_matmul.cc's plane_order)
  Problem p;
  int isa = kPortable;  // the call's Isa (active_isa() when its codes were set)
  void (*work)(Shared&) = nullptr;
};

// Kernel<Index, D, Isa>::run(call) for the codes' index type and d at the call's Isa level
// (each level's code compiled for its instruction set).
#ifdef HNLQ_X86
template <template <typename, int, int> class Kernel, typename Index, int D>
HNLQ_VBMI void run_vbmi(Shared& call) {
  Kernel<Index, D, kVbmi>::run(call);
}

template <template <typename, int, int> class Kernel, typename Index, int D>
HNLQ_AVX512 void run_avx512(Shared& call) {
  Kernel<Index, D, kAvx512>::run(call);
}

template <template <typename, int, int> class Kernel, typename Index, int D>
__attribute__((target("avx2,fma"))) void run_avx2(Shared& call) {
  Kernel<Index, D, kAvx2>::run(call);
}
#endif

template <template <typename, int, int> class Kernel, typename Index, int D>
void run_cpu(Shared& call) {
#ifdef HNLQ_X86
  if (call.isa == kVbmi) return run_vbmi<Kernel, Index, D>(call);
  if (call.isa == kAvx512) return run_avx512<Kernel, Index, D>(call);
  if (call.isa == kAvx2) return run_avx2<Kernel, Index, D>(call);
#endif
  Kernel<Index, D, kPortable>::run(call);
}

template <template <typename, int, int> class Kernel, typename Index>
void run_index(Shared& call) {
  switch (call.p.d) {
    case 2: return run_cpu<Kernel, Index, 2>(call);
    case 4: return run_cpu<Kernel, Index, 4>(call);
    case 8: return run_cpu<Kernel, Index, 8>(call);
    default: return run_cpu<Kernel, Index, 0>(call);
  }
}

template <template <typename, int, int> class Kernel>
void dispatch(Shared& call) {
  if (call.p.u16)
    run_index<Kernel, uint16_t>(call);
  else
    run_index<Kernel, uint8_t>(call);
}

// The codes of a weight [N, K] as plain pointers and sizes: from XLA's buffers (parse_codes)
// or from a direct call (module.cc), checked alike by set_codes.
struct CodesView {
  const void* index;
  bool u16;
  int64_t N, nb, M;  // index [N, nb, M]
  const uint8_t* tfield;
  int64_t tN, tb;  // tfield [tN, tb]
  const float* scale;
  int64_t scales;  // 0 (none) or N
  const int8_t* codebook;
  int64_t rows, d;  // codebook [rows, d]
  const float* pow2;
  int64_t steps;  // 256
  const float* dither;
  int64_t dithers;  // d
};

// The codes' attributes (hnlq_jax.kernels.cpu._codes_args).
struct Attrs {
  float beta, cart;
  int64_t q, qd;
  bool t4, bf16;
  int64_t mode;
};

// Checks the codes of a weight [N, K] and points call.p at them (and, with a 4-bit T field, at
// the steps of both blocks of a T byte, d = 4 or 8: one aligned register or two each).
inline ffi::Error set_codes(const char* kernel, const CodesView& v, const Attrs& a, int64_t K,
                            Shared& call) {
  Problem& p = call.p;
  p.K = K; p.N = v.N; p.nb = v.nb; p.M = v.M; p.d = v.d; p.tb = v.tb; p.qd = a.qd; p.q = a.q;
  p.beta = a.beta; p.cart = a.cart; p.t4 = a.t4; p.bf16 = a.bf16; p.u16 = v.u16;
  p.mode = a.mode;
  const int64_t range = v.u16 ? 65536 : 256;
  const bool pairs = a.mode == kPairs, packed = a.mode == kPacked;
  ffi::Error e = check(
      p.d >= 1 && p.d <= 8 && 512 % p.d == 0 && a.qd >= 1 && a.qd <= range && p.M >= 1 &&
          a.q >= 2 && v.rows == codebook_rows(a.mode, v.u16) &&
          a.mode >= kGeneric && a.mode <= kPacked &&
          (!pairs || (!v.u16 && p.d == 4 && p.M == 2 && a.qd == 256)) &&
          ((a.mode != kHorner && !packed) || (p.d == 8 && (a.q & (a.q - 1)) == 0)),
      kernel, "codebook must be s8[index range, d <= 8] in a layout that fits the codes");
  if (e.failure()) return e;
  e = check(p.N >= 0 && p.nb >= 1 && p.K > (p.nb - 1) * p.d && p.K <= p.nb * p.d &&
                v.tN == p.N && p.tb == (a.t4 ? (p.nb + 1) / 2 : p.nb) && v.steps == 256 &&
                v.dithers == p.d && (v.scales == 0 || v.scales == p.N),
            kernel, "shapes of codes, tables and output disagree");
  if (e.failure()) return e;
  p.index = v.index; p.tfield = v.tfield; p.scale = v.scales ? v.scale : nullptr;
  p.codebook = v.codebook; p.pow2 = v.pow2; p.dither = v.dither;
  call.isa = active_isa();
  p.fold = !p.bf16 && std::all_of(v.dither, v.dither + p.d, [](float z) { return z == 0.0f; });
  p.planes = nullptr;
  if (pairs) {  // the pair table's 65,536 rows, then r's 256
    for (int64_t k = 0; k < 256; ++k)
      for (int64_t i = 0; i < 4; ++i) call.planes[256 * i + k] = v.codebook[4 * (65536 + k) + i];
    p.planes = call.planes;
  }
  p.pair_steps = nullptr;
  if (a.t4 && (p.d == 4 || p.d == 8)) {
    const int64_t d = p.d;
    for (int t = 0; t < 256; ++t)
      for (int64_t i = 0; i < 2 * d; ++i)
        call.pair_steps[2 * d * t + i] = p.pow2[i < d ? t & 15 : t >> 4];
    p.pair_steps = call.pair_steps;
  }
  return ffi::Error::Success();
}

// set_codes of XLA's buffers.
inline ffi::Error parse_codes(const char* kernel, ffi::AnyBuffer index,
                              ffi::Buffer<ffi::U8> tfield, ffi::Buffer<ffi::F32> scale,
                              ffi::Buffer<ffi::S8> codebook, ffi::Buffer<ffi::F32> pow2,
                              ffi::Buffer<ffi::F32> dither, const Attrs& a, int64_t K,
                              Shared& call) {
  const auto id = index.dimensions(), td = tfield.dimensions(), cd = codebook.dimensions();
  const bool u16 = index.element_type() == ffi::DataType::U16;
  ffi::Error e = check(u16 || index.element_type() == ffi::DataType::U8, kernel,
                       "index must be u8/u16");
  if (e.failure()) return e;
  e = check(id.size() == 3 && td.size() == 2 && cd.size() == 2, kernel,
            "ranks: index [N, nb, M], tfield [N, tb], codebook [R, d]");
  if (e.failure()) return e;
  const CodesView v{index.untyped_data(), u16, id[0], id[1], id[2],
                    tfield.typed_data(), td[0], td[1],
                    scale.typed_data(), static_cast<int64_t>(scale.element_count()),
                    codebook.typed_data(), cd[0], cd[1],
                    pow2.typed_data(), static_cast<int64_t>(pow2.element_count()),
                    dither.typed_data(), static_cast<int64_t>(dither.element_count())};
  return set_codes(kernel, v, a, K, call);
}

// The kernels called directly (module.cc: host buffers, no XLA), on `threads` threads;
// an empty string on success, else the error.
std::string decode_direct(const CodesView& v, const Attrs& a, int64_t K, float* w,
                          int64_t threads);
std::string decode_matmul_direct(const CodesView& v, const Attrs& a, const float* x,
                                 int64_t B, int64_t K, float* y, int64_t threads);

// The codes' operands (after the kernel's own leading operands) and the attributes, in
// parse_codes' order, for a kernel's ffi::Ffi::Bind() chain (whose steps take it by value).
template <typename Binding>
auto bind_codes(Binding b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()               // index
      .template Arg<ffi::Buffer<ffi::U8>>()         // tfield
      .template Arg<ffi::Buffer<ffi::F32>>()        // scale
      .template Arg<ffi::Buffer<ffi::S8>>()         // codebook
      .template Arg<ffi::Buffer<ffi::F32>>()        // pow2
      .template Arg<ffi::Buffer<ffi::F32>>();       // dither
}

template <typename Binding>
auto bind_attrs(Binding b) {
  return std::move(b)
      .template Attr<float>("beta")
      .template Attr<float>("cart")
      .template Attr<int64_t>("q")
      .template Attr<int64_t>("qd")
      .template Attr<bool>("t4")
      .template Attr<bool>("bf16")
      .template Attr<int64_t>("mode");
}

}  // namespace hnlq

#endif  // HNLQ_DECODE_ROWS_H_
