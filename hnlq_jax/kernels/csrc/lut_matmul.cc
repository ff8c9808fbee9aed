// hnlq_lut_matmul: the lookup-table product's sums, y[m, n] = sum_k s[n, k] (sum_j q^j
// U[m, k, idx[n, k, j]] - E[m, k]), with s[n, k] = steps[u[n, k]] (NaN where an index is
// >= Q: an invalid block, as the reference's valid_blocks), u read from the codes' T field.
//
// The CPU twin of hnlq_jax.lut's _gather_matmul, which both lookup-table products end in: the
// one-sided one (U[m, k, b] = <r(b), x_mk>, the tables of real activations: weight-only
// quantization, implementation="lut") and the two-sided one (U[m, k, b] = s^A_mk <c^A_mk,
// r(b)>, from the exact integer table of codebook inner products). Per block and level one
// lookup and an add; per block one multiply by its step. Each task owns a tile of columns n
// (weight rows) and sums them against every row m, 16 blocks a register with AVX-512 gathers
// (U's row m stays in L2 across the tile), else a block at a time. With AVX512-VBMI, two
// levels of uint8 indices take span_vbmi instead: 64 columns a register, no gathers.
//
// Inputs: U f32[m, nb, Q]; E f32[m, nb] or f32[0] (no offsets); idx u8|u16[n, nb, M];
// tfield u8[n, tb] (the blocks' T field values u: 4-bit, two blocks a byte, low nibble first,
// or a byte a block); steps f32[256] (beta 2^(alpha T) by u, NaN where u is not valid).
// Attributes q, t_bits. Output y f32[m, n].

#include <cstring>
#include <vector>

#include "decode_rows.h"

namespace {

using namespace hnlq;  // NOLINT: Tasks, run_on_pool and the Isa levels

constexpr int64_t kColumnTile = 8;  // columns n per task
constexpr char kName[] = "hnlq_lut_matmul";

struct LutCall : Tasks {
  const float* U;
  const float* E;  // nullptr: no offsets
  const void* idx;
  const uint8_t* tf;  // the T field, tb bytes a column
  const float* steps;
  float* y;
  int64_t m, n, nb, Q, M, q, tb;
  bool u16, t4;
  int isa;
  const uint8_t* planes = nullptr;  // span_vbmi's tables (null: the other paths)
  int64_t vbmi_tiles = 0;           // the first tasks: span_vbmi's (kVbmiColumns wide tiles)
  int64_t vbmi_spans = 0;
  void (*work)(LutCall&) = nullptr;
};

// Block k's u in column c.
inline int u_of(const LutCall& p, int64_t c, int64_t k) {
  const uint8_t* t = p.tf + c * p.tb;
  return p.t4 ? (t[k >> 1] >> (4 * (k & 1))) & 15 : t[k];
}

// Column c's sum with row r over blocks [k0, nb), a block at a time.
template <typename Index>
float column_rest(const LutCall& p, int64_t r, int64_t c, int64_t k0) {
  const Index* idx = static_cast<const Index*>(p.idx) + c * p.nb * p.M;
  const float* U = p.U + r * p.nb * p.Q;
  float sum = 0.0f;
  for (int64_t k = k0; k < p.nb; ++k) {
    float v = 0.0f, weight = 1.0f;
    bool bad = false;
    for (int64_t j = 0; j < p.M; ++j, weight *= static_cast<float>(p.q)) {
      const int64_t b = idx[k * p.M + j];
      bad |= b >= p.Q;
      v += weight * (b < p.Q ? U[k * p.Q + b] : 0.0f);
    }
    if (p.E) v -= p.E[r * p.nb + k];
    const float s = bad ? std::numeric_limits<float>::quiet_NaN() : p.steps[u_of(p, c, k)];
    sum += s * v;
  }
  return sum;
}

#ifdef HNLQ_X86
// Columns [c0, c1) (at most kColumnTile) against row r: two-level uint8 indices (D4 q = 4, ...)
// 16 blocks a register, level j's entries by a gather each, then the rest as column_rest.
// Blocks outer, columns inner: the 16 tables of a step (16 KiB for Q = 256) are read from L2
// once and stay in L1 for the tile's other columns.
HNLQ_AVX512 void tile_avx512(const LutCall& p, int64_t r, int64_t c0, int64_t c1) {
  const float* U = p.U + r * p.nb * p.Q;
  const float* E = p.E ? p.E + r * p.nb : nullptr;
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(p.Q)));
  const __m512i Q = _mm512_set1_epi32(static_cast<int>(p.Q)), low = _mm512_set1_epi32(255);
  const __m512 q = _mm512_set1_ps(static_cast<float>(p.q));
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  __m512 acc[kColumnTile];
  for (int64_t c = 0; c < c1 - c0; ++c) acc[c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= p.nb; k += 16) {
    const __m512i base = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(k * p.Q)));
    const __m512 e = E ? _mm512_loadu_ps(E + k) : _mm512_setzero_ps();
    for (int64_t c = 0; c < c1 - c0; ++c) {
      const uint8_t* idx = static_cast<const uint8_t*>(p.idx) + ((c0 + c) * p.nb + k) * 2;
      // lane l: block k + l's level-0 index in its low byte, level 1's in the next
      const __m512i pair =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)));
      const __m512i b0 = _mm512_and_si512(pair, low), b1 = _mm512_srli_epi32(pair, 8);
      const __mmask16 ok = _mm512_cmplt_epi32_mask(b0, Q) & _mm512_cmplt_epi32_mask(b1, Q);
      const __m512 g0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), ok,
                                                 _mm512_add_epi32(base, b0), U, 4);
      const __m512 g1 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), ok,
                                                 _mm512_add_epi32(base, b1), U, 4);
      __m512 v = _mm512_add_ps(g0, _mm512_mul_ps(q, g1));
      if (E) v = _mm512_sub_ps(v, e);
      const uint8_t* tf = p.tf + (c0 + c) * p.tb;
      __m512i t;
      if (p.t4) {  // byte k / 2 doubled, then its nibbles (as decode_rows.h's steps16)
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(tf + (k >> 1)));
        t = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                                               _mm512_set1_epi64(int64_t{4} << 32)),
                             _mm512_set1_epi32(15));
      } else {
        t = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tf + k)));
      }
      const __m512 s = _mm512_mask_blend_ps(ok, nan, _mm512_i32gather_ps(t, p.steps, 4));
      acc[c] = _mm512_fmadd_ps(s, v, acc[c]);
    }
  }
  for (int64_t c = 0; c < c1 - c0; ++c)
    p.y[r * p.n + c0 + c] = hsum512(acc[c]) + column_rest<uint8_t>(p, r, c0 + c, k);
}
#endif

// Two levels of uint8 indices with AVX512-VBMI: the columns (weight rows) are the lanes, 64
// a register, so that block k's table, the same for every column, is looked up by byte
// permutes as decode_matmul.cc's planes_vbmi looks up the codebook. U[r, k] (1 KiB for
// Q = 256) is first split into its four byte planes (planes_of, once a call; entries >= Q
// NaN, so that an invalid index makes its sum NaN); a block's lookup is then two two-register
// byte permutes and a blend a plane and level, and the four planes' bytes of 16 lanes become
// floats by two rounds of unpacks. The index bytes (and T fields) of 64 columns at a block
// come from their rows, 64 bytes at a time, by transposes (transpose64); a last step of
// fewer than 64 blocks from copies of the rows' ends. Each lane sums its blocks in order,
// v = U0 + q U1 (- E), acc += s v, as tile_avx512's lanes do.

constexpr int64_t kVbmiColumns = 64;
constexpr int64_t kVbmiSpan = 8;    // tiles of 64 columns a task
constexpr int64_t kVbmiBlocks = 64;  // blocks a step (the index: 128 bytes a column)

#ifdef HNLQ_X86
// Whether a call takes span_vbmi: the steps beyond u = 31 are NaN (a 4-bit T field's u < 16
// always; span_vbmi looks up 32 entries), so that a permute of 32 is exact.
bool vbmi_applies(const LutCall& p) {
  if (p.isa < kVbmi || p.u16 || p.M != 2 || p.Q > 256 || p.n < kVbmiColumns) return false;
  for (int i = 32; i < 256; ++i)
    if (!std::isnan(p.steps[i])) return false;
  return true;
}

// Byte permutes: within 16 floats, byte i of entry e to 16 i + e (planes_of); an 8 x 8 byte
// transpose, byte 8 c + e to 8 e + c (transpose64).
template <int Rows, int Cols>
struct Transpose {
  alignas(64) uint8_t at[64];
  constexpr Transpose() : at() {
    for (int i = 0; i < Rows; ++i)
      for (int e = 0; e < Cols; ++e) at[Cols * i + e] = static_cast<uint8_t>(Rows * e + i);
  }
};
constexpr Transpose<4, 16> kPlaneOrderTable;
constexpr Transpose<8, 8> kTranspose8Table;
constexpr const uint8_t* kPlaneOrder = kPlaneOrderTable.at;
constexpr const uint8_t* kTranspose8 = kTranspose8Table.at;

// The four byte planes of U[r, k] (Q floats, NaN from Q to 256) at out: plane i's 256 bytes
// (byte i of each entry) at out + 256 i.
HNLQ_VBMI void planes_of(const float* U, int64_t Q, uint8_t* out) {
  const __m512i order = _mm512_load_si512(kPlaneOrder);
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (int h = 0; h < 4; ++h) {  // entries 64 h .. 64 h + 63
    __m512i z[4];
    for (int t = 0; t < 4; ++t) {
      const int64_t e0 = 64 * h + 16 * t;
      const int64_t left = std::clamp<int64_t>(Q - e0, 0, 16);
      const __mmask16 in = static_cast<__mmask16>((1u << left) - 1u);
      z[t] = _mm512_permutexvar_epi8(
          order, _mm512_castps_si512(_mm512_mask_loadu_ps(nan, in, U + std::min(e0, Q))));
    }
    // z[t]'s 128-bit lane i: plane i of entries 64 h + 16 t ..; plane i's quarter h gathers
    // lane i of z[0..3]
    const __m512i a = _mm512_shuffle_i32x4(z[0], z[1], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(z[2], z[3], 0x44);
    const __m512i c = _mm512_shuffle_i32x4(z[0], z[1], 0xEE);
    const __m512i d = _mm512_shuffle_i32x4(z[2], z[3], 0xEE);
    _mm512_store_si512(out + 64 * h, _mm512_shuffle_i32x4(a, b, 0x88));
    _mm512_store_si512(out + 256 + 64 * h, _mm512_shuffle_i32x4(a, b, 0xDD));
    _mm512_store_si512(out + 512 + 64 * h, _mm512_shuffle_i32x4(c, d, 0x88));
    _mm512_store_si512(out + 768 + 64 * h, _mm512_shuffle_i32x4(c, d, 0xDD));
  }
}

// out[e] 8-byte piece j = in[j] piece e: an 8 x 8 transpose of 8-byte pieces (unpacks and
// lane shuffles).
HNLQ_AVX512 inline void transpose_pieces(const __m512i (&in)[8], __m512i (&out)[8]) {
  for (int odd = 0; odd < 2; ++odd) {  // pieces e = 2 L + odd of lane L
    __m512i a[4];  // in[2 i], in[2 i + 1]: lane L holds piece 2 L + odd of both
    for (int i = 0; i < 4; ++i)
      a[i] = odd ? _mm512_unpackhi_epi64(in[2 * i], in[2 * i + 1])
                 : _mm512_unpacklo_epi64(in[2 * i], in[2 * i + 1]);
    // pieces {0, 4} (+ odd) and {2, 6} of in[0..3] and in[4..7], then each piece of all 8
    const __m512i c0 = _mm512_shuffle_i64x2(a[0], a[1], 0x88);
    const __m512i d0 = _mm512_shuffle_i64x2(a[0], a[1], 0xDD);
    const __m512i c4 = _mm512_shuffle_i64x2(a[2], a[3], 0x88);
    const __m512i d4 = _mm512_shuffle_i64x2(a[2], a[3], 0xDD);
    out[odd] = _mm512_shuffle_i64x2(c0, c4, 0x88);
    out[4 + odd] = _mm512_shuffle_i64x2(c0, c4, 0xDD);
    out[2 + odd] = _mm512_shuffle_i64x2(d0, d4, 0x88);
    out[6 + odd] = _mm512_shuffle_i64x2(d0, d4, 0xDD);
  }
}

// out[e], byte lane c: byte e < Bytes of the Bytes (64 or 32) at src + c stride (64 rows'
// pieces, loaded whole: gathers of 8 bytes cost 3x the sums). Per group of 8 rows a
// transpose of their 8-byte pieces and a byte transpose of each piece (a permute), then a
// transpose of the groups' pieces.
template <int Bytes>
HNLQ_VBMI void transpose64(const uint8_t* src, int64_t stride, __m512i* out) {
  const __m512i order = _mm512_load_si512(kTranspose8);
  __m512i t[8][8];  // [e][j]: piece p of row group j's bytes 8 e + p
  for (int j = 0; j < 8; ++j) {
    __m512i rows[8], pieces[8];
    for (int i = 0; i < 8; ++i) {
      const uint8_t* row = src + (8 * j + i) * stride;
      rows[i] = Bytes == 64 ? _mm512_loadu_si512(row)
                            : _mm512_zextsi256_si512(
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    }
    transpose_pieces(rows, pieces);  // pieces[e] piece i: row i's bytes 8 e ..
    for (int e = 0; e < 8; ++e) t[e][j] = _mm512_permutexvar_epi8(order, pieces[e]);
  }
  for (int e = 0; e < Bytes / 8; ++e) {
    __m512i o[8];
    transpose_pieces(t[e], o);
    for (int p = 0; p < 8; ++p) out[8 * e + p] = o[p];
  }
}

// Bytes of 64 lanes as 4 registers of 32-bit lanes, f[j] lane 4 L + i from byte lane
// 16 L + 4 j + i: of four planes (byte i of each value), or of one (zero-extended).
HNLQ_VBMI inline void widen(const __m512i p0, const __m512i p1, const __m512i p2,
                            const __m512i p3, __m512i (&f)[4]) {
  const __m512i lo01 = _mm512_unpacklo_epi8(p0, p1), hi01 = _mm512_unpackhi_epi8(p0, p1);
  const __m512i lo23 = _mm512_unpacklo_epi8(p2, p3), hi23 = _mm512_unpackhi_epi8(p2, p3);
  f[0] = _mm512_unpacklo_epi16(lo01, lo23);
  f[1] = _mm512_unpackhi_epi16(lo01, lo23);
  f[2] = _mm512_unpacklo_epi16(hi01, hi23);
  f[3] = _mm512_unpackhi_epi16(hi01, hi23);
}

// The entries of one level's 64 indices k in a table's planes (16 registers), as widen's f.
HNLQ_VBMI inline void lookup_level(const __m512i (&t)[4][4], __m512i k, __m512 (&f)[4]) {
  const __mmask64 top = _mm512_movepi8_mask(k);
  __m512i b[4];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[i][0], k, t[i][1]),
                                  _mm512_permutex2var_epi8(t[i][2], k, t[i][3]));
  __m512i w[4];
  widen(b[0], b[1], b[2], b[3], w);
  for (int j = 0; j < 4; ++j) f[j] = _mm512_castsi512_ps(w[j]);
}

// The index bytes and T fields of columns [c, c + 64), blocks [k0, k0 + 64) or the rest:
// keys[2 e + l] level l of block k0 + e, u[e] its u, one byte lane a column.
HNLQ_VBMI void step_keys(const LutCall& p, int64_t c, int64_t k0, __m512i* keys, __m512i* u) {
  const uint8_t* idx = static_cast<const uint8_t*>(p.idx) + 2 * (c * p.nb + k0);
  const uint8_t* tf = p.tf + c * p.tb + (p.t4 ? k0 / 2 : k0);
  const int64_t count = std::min(kVbmiBlocks, p.nb - k0);
  const int64_t tbytes = p.t4 ? (count + 1) / 2 : count;
  alignas(64) uint8_t ends[kVbmiColumns][2 * kVbmiBlocks + kVbmiBlocks];  // the rows' ends
  int64_t stride = 2 * p.nb, tstride = p.tb;
  if (count < kVbmiBlocks) {  // a last step: its bytes copied, so that no load reads past
    std::memset(ends, 0, sizeof(ends));
    for (int64_t i = 0; i < kVbmiColumns; ++i) {
      std::memcpy(ends[i], idx + i * stride, 2 * count);
      std::memcpy(ends[i] + 2 * kVbmiBlocks, tf + i * tstride, tbytes);
    }
    idx = ends[0], tf = ends[0] + 2 * kVbmiBlocks;
    stride = tstride = sizeof(ends[0]);
  }
  transpose64<64>(idx, stride, keys);
  transpose64<64>(idx + 64, stride, keys + 64);
  if (!p.t4) {
    transpose64<64>(tf, tstride, u);
    return;
  }
  __m512i bytes[32];  // block 2 i in the low nibble of byte i, 2 i + 1 in the high one
  transpose64<32>(tf, tstride, bytes);
  const __m512i low = _mm512_set1_epi8(15);
  for (int i = 0; i < 32; ++i) {
    u[2 * i] = _mm512_and_si512(bytes[i], low);
    u[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes[i], 4), low);
  }
}

// Columns [c0, c0 + 64 T) (T <= kVbmiSpan tiles of 64) against every row of U, in steps of
// 64 blocks. Steps outer: U's planes are read from memory once a span, not once a tile.
// acc: the sums between steps (m x 64 T floats).
HNLQ_VBMI void span_vbmi(const LutCall& p, int64_t c0, int64_t T, float* acc) {
  const __m512 q = _mm512_set1_ps(static_cast<float>(p.q));
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m512 steps_lo = _mm512_loadu_ps(p.steps), steps_hi = _mm512_loadu_ps(p.steps + 16);
  const __m512i zero = _mm512_setzero_si512(), big = _mm512_set1_epi32(31);
  const int64_t width = kVbmiColumns * T;
  std::fill(acc, acc + p.m * width, 0.0f);
  __m512i keys[2 * kVbmiBlocks], u[kVbmiBlocks];
  for (int64_t k0 = 0; k0 < p.nb; k0 += kVbmiBlocks) {
    const int64_t count = std::min(kVbmiBlocks, p.nb - k0);
    for (int64_t tile = 0; tile < T; ++tile) {
      step_keys(p, c0 + kVbmiColumns * tile, k0, keys, u);
      for (int64_t e = 0; e < count; ++e) {
        __m512 s[4];  // the block's steps, as widen's f
        __m512i w[4];
        widen(u[e], zero, zero, zero, w);
        for (int j = 0; j < 4; ++j)
          s[j] = _mm512_mask_blend_ps(_mm512_cmpgt_epu32_mask(w[j], big),
                                      _mm512_permutex2var_ps(steps_lo, w[j], steps_hi), nan);
        const int64_t k = k0 + e;
        for (int64_t r = 0; r < p.m; ++r) {
          const uint8_t* planes = p.planes + (r * p.nb + k) * 1024;
          __m512i t[4][4];
          for (int i = 0; i < 4; ++i)
            for (int h = 0; h < 4; ++h) t[i][h] = _mm512_load_si512(planes + 256 * i + 64 * h);
          __m512 g0[4], g1[4];
          lookup_level(t, keys[2 * e], g0);
          lookup_level(t, keys[2 * e + 1], g1);
          const __m512 off = _mm512_set1_ps(p.E ? p.E[r * p.nb + k] : 0.0f);
          float* a = acc + r * width + kVbmiColumns * tile;
          for (int j = 0; j < 4; ++j) {
            __m512 v = _mm512_add_ps(g0[j], _mm512_mul_ps(q, g1[j]));
            if (p.E) v = _mm512_sub_ps(v, off);
            _mm512_storeu_ps(a + 16 * j, _mm512_fmadd_ps(s[j], v, _mm512_loadu_ps(a + 16 * j)));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t tile = 0; tile < T; ++tile)
      for (int j = 0; j < 4; ++j)
        for (int L = 0; L < 4; ++L)
          for (int i = 0; i < 4; ++i)  // lane 4 L + i of sum j: column 16 L + 4 j + i
            p.y[r * p.n + c0 + kVbmiColumns * tile + 16 * L + 4 * j + i] =
                acc[r * width + kVbmiColumns * tile + 16 * j + 4 * L + i];
}
#endif

// One call's column tiles, claimed until none is left.
void run(LutCall& p) {
#ifdef HNLQ_X86
  // int32 offsets into a row of U
  const bool wide = p.isa >= kAvx512 && !p.u16 && p.M == 2 && p.Q <= 256 &&
                    p.nb * p.Q < std::numeric_limits<int32_t>::max();
#else
  const bool wide = false;
#endif
#ifdef HNLQ_X86
  std::unique_ptr<float[]> acc;
#endif
  for (int64_t t; (t = p.next.fetch_add(1)) < p.tiles;) {
#ifdef HNLQ_X86
    if (t < p.vbmi_spans) {
      if (!acc) acc.reset(new float[p.m * kVbmiColumns * kVbmiSpan]);
      span_vbmi(p, t * kVbmiColumns * kVbmiSpan,
                std::min(kVbmiSpan, p.vbmi_tiles - t * kVbmiSpan), acc.get());
      continue;
    }
#endif
    const int64_t c0 = p.vbmi_tiles * kVbmiColumns + (t - p.vbmi_spans) * kColumnTile;
    const int64_t c1 = std::min(p.n, c0 + kColumnTile);
    for (int64_t r = 0; r < p.m; ++r) {
#ifdef HNLQ_X86
      if (wide) {
        tile_avx512(p, r, c0, c1);
        continue;
      }
#endif
      for (int64_t c = c0; c < c1; ++c)
        p.y[r * p.n + c] = p.u16 ? column_rest<uint16_t>(p, r, c, 0)
                                 : column_rest<uint8_t>(p, r, c, 0);
    }
  }
}

ffi::Error LutMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> U, ffi::Buffer<ffi::F32> E,
                         ffi::AnyBuffer idx, ffi::Buffer<ffi::U8> tfield,
                         ffi::Buffer<ffi::F32> steps,
                         ffi::ResultBuffer<ffi::F32> y, int64_t q, int64_t t_bits) {
  const auto ud = U.dimensions(), ed = E.dimensions(), id = idx.dimensions();
  const auto td = tfield.dimensions(), yd = y->dimensions();
  const bool u16 = idx.element_type() == ffi::DataType::U16;
  ffi::Error e = check(u16 || idx.element_type() == ffi::DataType::U8, kName,
                       "idx must be u8/u16");
  if (e.failure()) return e;
  e = check(ud.size() == 3 && id.size() == 3 && td.size() == 2 && yd.size() == 2 &&
                ed.size() >= 1,
            kName, "ranks: U [m, nb, Q], idx [n, nb, M], tfield [n, tb], y [m, n]");
  if (e.failure()) return e;
  auto call = std::make_shared<LutCall>();
  LutCall& p = *call;
  p.m = ud[0]; p.nb = ud[1]; p.Q = ud[2]; p.n = id[0]; p.M = id[2]; p.q = q; p.u16 = u16;
  p.t4 = t_bits == 4;
  p.tb = p.t4 ? (p.nb + 1) / 2 : p.nb;
  const bool offsets = E.element_count() != 0;
  e = check(t_bits == 4 || t_bits == 8, kName, "t_bits must be 4 or 8");
  if (e.failure()) return e;
  e = check(id[1] == p.nb && td[0] == p.n && td[1] == p.tb && yd[0] == p.m && yd[1] == p.n &&
                p.M >= 1 && q >= 2 && p.Q >= 1 && steps.element_count() == 256 &&
                (!offsets || (ed.size() == 2 && ed[0] == p.m && ed[1] == p.nb)),
            kName, "shapes of U, E, idx, tfield, steps and y disagree");
  if (e.failure()) return e;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.U = U.typed_data(); p.E = offsets ? E.typed_data() : nullptr; p.idx = idx.untyped_data();
  p.tf = tfield.typed_data(); p.steps = steps.typed_data(); p.y = y->typed_data();
  p.isa = active_isa();
  struct alignas(64) Line { uint8_t b[64]; };
  // U's planes (1 KiB a table) in this thread's buffer, kept up to kKeptPlanes between calls:
  // a fresh one each call cost as much as the sums (the pages mapped and zeroed anew)
  thread_local std::vector<Line> planes;
  constexpr size_t kKeptPlanes = (size_t{16} << 20) / sizeof(Line);
#ifdef HNLQ_X86
  if (vbmi_applies(p)) {
    planes.resize(p.m * p.nb * 16);
    uint8_t* out = reinterpret_cast<uint8_t*>(planes.data());
    for (int64_t t = 0; t < p.m * p.nb; ++t) planes_of(p.U + t * p.Q, p.Q, out + t * 1024);
    p.planes = out;
    p.vbmi_tiles = p.n / kVbmiColumns;
    p.vbmi_spans = (p.vbmi_tiles + kVbmiSpan - 1) / kVbmiSpan;
  }
#endif
  const int64_t rest = p.n - p.vbmi_tiles * kVbmiColumns;
  p.tiles = p.vbmi_spans + (rest + kColumnTile - 1) / kColumnTile;
  p.work = run;
  run_on_pool(pool, call, p.m * p.n * p.nb * 4);  // ~4 weights' work a block and row
  if (planes.capacity() > kKeptPlanes) {  // a large batch's tables: not held for good
    planes.clear();
    planes.shrink_to_fit();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HnlqLutMatmul, LutMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // U
                                  .Arg<ffi::Buffer<ffi::F32>>()  // E
                                  .Arg<ffi::AnyBuffer>()         // idx
                                  .Arg<ffi::Buffer<ffi::U8>>()   // tfield
                                  .Arg<ffi::Buffer<ffi::F32>>()  // steps
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int64_t>("q")
                                  .Attr<int64_t>("t_bits"));
