// hnlq_decode_matmul: y[B, N] = x[B, K] @ W_hat[N, K]^T with the weight given only by its codes.
//
// The CPU twin of hq.matmul's XLA path (implementation="native"). Each task owns a tile of
// weight rows. For up to kFusedRows rows of x it decodes a register of 8 weights at a time
// straight into the rows' sums; for more it decodes chunk by chunk along K into a small float
// buffer that stays in L1 and multiplies the chunk into every activation row while it is hot.
// The dense weight never exists in memory. Decoding is decode_rows.h's, so the decoded weights
// are the XLA reference's bit for bit (only the sums run in another order); bf16 rounds them
// to bfloat16 when the activations are bfloat16. With AVX2, without dither or bf16, both
// paths sum x * (c * 2^(alpha T)) and multiply each row's sums once by beta * cart * row_scale
// (Dot, row_tile): the decode's three per-weight multiplies become one per row. For row codes
// (beta = 1, cart and the steps powers of two) each term is still x * w_hat exactly.
//
// Inputs: x f32[B, K] and the codes' arguments (decode_rows.h). Output y f32[B, N].

#include <cmath>

#include "decode_rows.h"

namespace {

using namespace hnlq;  // NOLINT: this file's kernel is built from decode_rows.h's parts


constexpr int64_t kRowTile = 8;    // weight rows per task and per pass over x
constexpr int64_t kChunk = 512;    // weights of a row decoded at a time (a multiple of 8)
constexpr int64_t kFusedRows = 4;  // up to this many rows of x: decoded registers go straight
                                   // into the sums (more: through the buffer, 4 x 2 blocking;
                                   // by planes, four rows at a time)

// Whether a call at Isa level `isa` multiplies pair codes by planes (tile_planes).
inline bool planes_apply(const Problem& p, int isa) {
  return isa == kVbmi && p.mode == kPairs;
}

// x'[b, 256 g + 64 i + l] = x[b, 256 g + 4 l + i] for the whole steps of tile_planes (l < 64,
// i < 4); the rest of each row as it is.
void plane_order(const float* x, int64_t B, int64_t K, float* xp) {
  const int64_t planar = K / 256 * 256;
  for (int64_t b = 0; b < B; ++b, x += K, xp += K) {
    for (int64_t g = 0; g < planar; g += 256)
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t l = 0; l < 64; ++l) xp[g + 64 * i + l] = x[g + 4 * l + i];
    std::copy(x + planar, x + K, xp + planar);
  }
}

// What a folded product multiplies row r's sums by.
inline float row_factor(const Problem& p, int64_t r) {
  return p.beta * p.cart * (p.scale ? p.scale[r] : 1.0f);
}

#ifdef HNLQ_X86

// A sink that multiplies decoded registers into NB activation rows' sums. Folded: the sums
// are of x * (c * s), and the row's factor beta * cart * row_scale is applied once, to the
// sums (p.fold: no dither, no bf16 rounding; each term then differs from x * w_hat by float
// rounding only, the NaN of a failed block included; the buffer path folds alike, so that
// both give the same sums); else of x * w_hat, the weights decoded bit for bit (finish_avx2).
template <int NB, bool Fold>
struct Dot {
  const float* x;  // activation row 0 at the first decoded weight
  int64_t K;       // row stride of x
  RowConsts k;
  __m256 acc[NB];
  __attribute__((target("avx2,fma"))) void operator()(int64_t o, __m256i c, __m256 s) {
    const __m256 w = Fold ? _mm256_mul_ps(_mm256_cvtepi32_ps(c), s) : finish_avx2(k, c, s);
    for (int b = 0; b < NB; ++b)
      acc[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + b * K + o), acc[b]);
  }
};

// Small batches (NB rows of x): each weight register is multiplied into the sums as it is
// decoded, with no buffer. Row r's whole registers (those inside K) go this way; the ragged
// end through decode_row and scalar sums. y[b * N + r] = the row's product with x row b.
template <typename Index, int D, int NB, bool Fold>
__attribute__((target("avx2,fma"))) void row_dot_avx2(const Problem& p, int64_t r) {
  Dot<NB, Fold> sink{p.x, p.K, row_consts_of<D>(p, r), {}};
  for (int b = 0; b < NB; ++b) sink.acc[b] = _mm256_setzero_ps();
  const int64_t whole = p.K / 8 * (8 / D);  // blocks in whole registers inside K
  const int64_t j = registers_avx2<Index, D>(p, r, 0, whole, sink);
  float tail[16];
  float sums[NB];
  for (int b = 0; b < NB; ++b) sums[b] = hsum(sink.acc[b]);
  for (int64_t j0 = j; j0 < p.nb; j0 += 16 / D) {
    const int64_t j1 = std::min(p.nb, j0 + 16 / D);
    decode_row<Index, D, Fold>(p, r, j0, j1, tail);
    for (int64_t k = j0 * D; k < std::min(p.K, j1 * D); ++k)
      for (int b = 0; b < NB; ++b) sums[b] += p.x[b * p.K + k] * tail[k - j0 * D];
  }
  for (int b = 0; b < NB; ++b) p.y[b * p.N + r] = Fold ? sums[b] * row_factor(p, r) : sums[b];
}
#endif

#ifdef HNLQ_X86
template <typename Index, int D, bool Fold>
__attribute__((target("avx2,fma"))) void rows_dot(const Problem& p, int64_t r) {
  switch (p.B) {
    case 1: return row_dot_avx2<Index, D, 1, Fold>(p, r);
    case 2: return row_dot_avx2<Index, D, 2, Fold>(p, r);
    case 3: return row_dot_avx2<Index, D, 3, Fold>(p, r);
    default: return row_dot_avx2<Index, D, 4, Fold>(p, r);
  }
}
#endif

#ifdef HNLQ_X86
// The AVX-512 twins (kAvx512) of Dot, row_dot_avx2 and tile_product_avx2: 16 lanes a
// register. Both paths of a product sum a row alike on each level (lanes, then the ragged end
// in order), so that a row's result does not depend on the batch size there either.

template <int NB, bool Fold>
struct Dot512 {
  const float* x;
  int64_t K;
  RowConsts512 k;
  __m512 acc[NB];
  HNLQ_AVX512 void operator()(int64_t o, __m512i c, __m512 s) {
    const __m512 cf = _mm512_cvtepi32_ps(c);
    const __m512 w = Fold ? _mm512_mul_ps(cf, s) : finish_avx512(k, cf, s);
    for (int b = 0; b < NB; ++b)
      acc[b] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + b * K + o), acc[b]);
  }
};

// Row r's sums with NB rows of x from block j0 on, sink.acc holding those of the blocks before
// it; y[(b0 + b) * N + r] = the row's product with x row b0 + b.
template <typename Index, int D, int NB, bool Fold>
HNLQ_AVX512 inline void row_rest512(const Problem& p, int64_t r, int64_t b0, int64_t j0,
                                    Dot512<NB, Fold>& sink) {
  const float* x = p.x + b0 * p.K;
  sink.x = x + j0 * D;
  const int64_t whole = p.K / 16 * (16 / D);  // blocks in whole registers inside K
  const int64_t j = j0 < whole ? registers_avx512<Index, D>(p, r, j0, whole, sink) : j0;
  float tail[16];
  float sums[NB];
  for (int b = 0; b < NB; ++b) sums[b] = hsum512(sink.acc[b]);
  for (int64_t jt = j; jt < p.nb; jt += 16 / D) {
    const int64_t j1 = std::min(p.nb, jt + 16 / D);
    decode_row<Index, D, Fold>(p, r, jt, j1, tail);
    for (int64_t k = jt * D; k < std::min(p.K, j1 * D); ++k)
      for (int b = 0; b < NB; ++b) sums[b] += x[b * p.K + k] * tail[k - jt * D];
  }
  for (int b = 0; b < NB; ++b)
    p.y[(b0 + b) * p.N + r] = Fold ? sums[b] * row_factor(p, r) : sums[b];
}

template <typename Index, int D, int NB, bool Fold>
HNLQ_AVX512 void row_dot_avx512(const Problem& p, int64_t r, int64_t b0) {
  Dot512<NB, Fold> sink{p.x, p.K, row_consts512_of<D>(p, r), {}};
  for (int b = 0; b < NB; ++b) sink.acc[b] = _mm512_setzero_ps();
  row_rest512<Index, D, NB, Fold>(p, r, b0, 0, sink);
}

// kPairs codes with AVX512-VBMI (kVbmi), 64 blocks (256 weights) a step by coordinate planes
// (decode_rows.h's decode_step). Lanes of coordinate i of the step's blocks 16h..16h+15
// meet the activations permuted alike (plane_order). A task decodes the step of each of its
// weight rows once, then multiplies them into every activation row, which it reads once for
// all of them. Folded, a pair of rows sums per block u = sum_i x_i c_i and then s u (s =
// 2^(alpha T): 9 float operations per 16 blocks where pairs_avx512 takes 12, and no table
// read from L2); else x times each weight as finish_avx512 decodes it. One sum a pair of
// rows, in the same order at every batch size.

// A decoded step into one activation row's sum (x: the row at the step in plane order).
template <bool Fold>
HNLQ_AVX512 inline __m512 step_sum(const PlaneStep& st, const __m512 (&x)[4][4], __m512 sum) {
  for (int h = 0; h < 4; ++h) {
    if constexpr (Fold) {
      __m512 u = _mm512_mul_ps(x[0][h], st.v[0][h]);
      for (int i = 1; i < 4; ++i) u = _mm512_fmadd_ps(x[i][h], st.v[i][h], u);
      sum = _mm512_fmadd_ps(u, st.s[h], sum);
    } else {
      for (int i = 0; i < 4; ++i) sum = _mm512_fmadd_ps(st.v[i][h], x[i][h], sum);
    }
  }
  return sum;
}

HNLQ_AVX512 inline void load_step(const float* x, __m512 (&out)[4][4]) {
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 4; ++h) out[i][h] = _mm512_loadu_ps(x + 64 * i + 16 * h);
}

// Weight row r against NB <= 4 activation rows: each step decoded and multiplied at once, the
// sums in registers (the same operations as tile_planes').
template <int NB, bool Fold>
HNLQ_VBMI void row_planes(const Problem& p, int64_t r, const PlaneConsts& c) {
  const RowConsts512 k = row_consts512_of<4>(p, r);
  __m512 sum[NB];
  for (int b = 0; b < NB; ++b) sum[b] = _mm512_setzero_ps();
  const int64_t steps = p.K / 256;
  for (int64_t g = 0; g < steps; ++g) {
    PlaneStep st;
    decode_step<Fold>(p, r, g, c, k, st);
    for (int b = 0; b < NB; ++b) {
      __m512 x[4][4];
      load_step(p.x + b * p.K + 256 * g, x);
      sum[b] = step_sum<Fold>(st, x, sum[b]);
    }
  }
  Dot512<NB, Fold> rest{nullptr, p.K, k, {}};
  for (int b = 0; b < NB; ++b) rest.acc[b] = sum[b];
  row_rest512<uint8_t, 4, NB, Fold>(p, r, 0, 64 * steps, rest);
}

// The blocks after the steps of weight row r, NB activation rows from b0 (sums: their
// steps' sums): as row_rest512, each row's operations those of row_planes.
template <int NB, bool Fold>
HNLQ_AVX512 inline void rest_planes(const Problem& p, int64_t r, const RowConsts512& k,
                                    int64_t b0, const float* sums) {
  Dot512<NB, Fold> rest{nullptr, p.K, k, {}};
  for (int b = 0; b < NB; ++b) rest.acc[b] = _mm512_loadu_ps(sums + 16 * b);
  row_rest512<uint8_t, 4, NB, Fold>(p, r, b0, p.K / 256 * 64, rest);
}

// Weight rows [r0, r0 + R) (R <= kRowTile) against every activation row (acc: R x B
// registers of scratch, as floats).
template <bool Fold>
HNLQ_VBMI void tile_planes(const Problem& p, int64_t r0, int64_t R, float* acc) {
  const PlaneConsts c = plane_consts(p);
  if (p.B <= kFusedRows) {
    for (int64_t r = r0; r < r0 + R; ++r) {
      switch (p.B) {
        case 1: row_planes<1, Fold>(p, r, c); break;
        case 2: row_planes<2, Fold>(p, r, c); break;
        case 3: row_planes<3, Fold>(p, r, c); break;
        default: row_planes<4, Fold>(p, r, c);
      }
    }
    return;
  }
  RowConsts512 k[kRowTile];
  for (int64_t rr = 0; rr < R; ++rr) k[rr] = row_consts512_of<4>(p, r0 + rr);
  std::fill(acc, acc + 16 * R * p.B, 0.0f);
  PlaneStep st[kRowTile];
  const int64_t steps = p.K / 256;  // whole steps inside K
  for (int64_t g = 0; g < steps; ++g) {
    for (int64_t rr = 0; rr < R; ++rr)
      decode_step<Fold>(p, r0 + rr, g, c, k[rr], st[rr]);
    for (int64_t b = 0; b < p.B; ++b) {
      __m512 x[4][4];
      load_step(p.x + b * p.K + 256 * g, x);
      for (int64_t rr = 0; rr < R; ++rr) {
        float* a = acc + 16 * (rr * p.B + b);
        _mm512_storeu_ps(a, step_sum<Fold>(st[rr], x, _mm512_loadu_ps(a)));
      }
    }
  }
  for (int64_t rr = 0; rr < R; ++rr) {  // the blocks after the steps, 4 activation rows a time
    const float* sums = acc + 16 * rr * p.B;
    int64_t b = 0;
    for (; b + 4 <= p.B; b += 4) rest_planes<4, Fold>(p, r0 + rr, k[rr], b, sums + 16 * b);
    switch (p.B - b) {
      case 1: rest_planes<1, Fold>(p, r0 + rr, k[rr], b, sums + 16 * b); break;
      case 2: rest_planes<2, Fold>(p, r0 + rr, k[rr], b, sums + 16 * b); break;
      case 3: rest_planes<3, Fold>(p, r0 + rr, k[rr], b, sums + 16 * b); break;
      default: break;
    }
  }
}

// Row r against activation rows [b0, b0 + min(4, B - b0)).
template <typename Index, int D, bool Fold>
HNLQ_AVX512 void rows_dot512(const Problem& p, int64_t r, int64_t b0) {
  switch (std::min<int64_t>(kFusedRows, p.B - b0)) {
    case 1: return row_dot_avx512<Index, D, 1, Fold>(p, r, b0);
    case 2: return row_dot_avx512<Index, D, 2, Fold>(p, r, b0);
    case 3: return row_dot_avx512<Index, D, 3, Fold>(p, r, b0);
    default: return row_dot_avx512<Index, D, 4, Fold>(p, r, b0);
  }
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
// The same products with AVX2 (W = 8 lanes) and AVX-512 (16): 4 weight rows x 2 activation
// rows in registers. Each (activation row b, weight row r) keeps W lane sums across the
// chunks, lanes[(b * R + r) * W + l], for the whole registers inside K; the ragged end is
// added after the lanes' sum (finish_lanes), exactly as the register path (row_dot_avx2,
// row_rest512) sums a row: so a row's result does not depend on the batch size at any K.

template <int W>
struct Lanes;

template <>
struct Lanes<8> {
  using V = __m256;
  static __attribute__((target("avx2,fma"))) V load(const float* a) { return _mm256_loadu_ps(a); }
  static __attribute__((target("avx2,fma"))) void store(float* a, V v) {
    _mm256_storeu_ps(a, v);
  }
  static __attribute__((target("avx2,fma"))) V fma(V a, V b, V c) {
    return _mm256_fmadd_ps(a, b, c);
  }
  static __attribute__((target("avx2,fma"))) float sum(V v) { return hsum(v); }
};

template <>
struct Lanes<16> {
  using V = __m512;
  static HNLQ_AVX512 V load(const float* a) { return _mm512_loadu_ps(a); }
  static HNLQ_AVX512 void store(float* a, V v) { _mm512_storeu_ps(a, v); }
  static HNLQ_AVX512 V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static HNLQ_AVX512 float sum(V v) { return hsum512(v); }
};

// lanes += the chunk's products (k < len, whole registers only).
template <int W>
inline __attribute__((always_inline)) void tile_lanes(const Problem& p, int64_t k0,
                                                       int64_t len, const float* w,
                                                       int64_t ldw, int64_t R, float* lanes) {
  using L = Lanes<W>;
  const int64_t whole = len / W * W;
  for (int64_t b = 0; b < p.B; b += 2) {
    const bool two = b + 1 < p.B;
    const float* x0 = p.x + b * p.K + k0;
    const float* x1 = two ? x0 + p.K : x0;
    float* l0 = lanes + b * R * W;
    float* l1 = two ? l0 + R * W : l0;  // (one row: read twice, stored once)
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
      const float* w0 = w + r * ldw;
      typename L::V a0[4], a1[4];
      for (int i = 0; i < 4; ++i) {
        a0[i] = L::load(l0 + (r + i) * W);
        a1[i] = L::load(l1 + (r + i) * W);
      }
      for (int64_t k = 0; k < whole; k += W) {
        const typename L::V v0 = L::load(x0 + k), v1 = L::load(x1 + k);
        for (int i = 0; i < 4; ++i) {
          const typename L::V c = L::load(w0 + i * ldw + k);
          a0[i] = L::fma(v0, c, a0[i]);
          a1[i] = L::fma(v1, c, a1[i]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        if (two) L::store(l1 + (r + i) * W, a1[i]);
        L::store(l0 + (r + i) * W, a0[i]);
      }
    }
    for (; r < R; ++r) {  // the last rows of a ragged tile
      const float* wr = w + r * ldw;
      typename L::V a0 = L::load(l0 + r * W), a1 = L::load(l1 + r * W);
      for (int64_t k = 0; k < whole; k += W) {
        const typename L::V c = L::load(wr + k);
        a0 = L::fma(L::load(x0 + k), c, a0);
        a1 = L::fma(L::load(x1 + k), c, a1);
      }
      if (two) L::store(l1 + r * W, a1);
      L::store(l0 + r * W, a0);
    }
  }
}

__attribute__((target("avx2,fma"))) void tile_product_avx2(const Problem& p, int64_t k0,
                                                            int64_t len, const float* w,
                                                            int64_t ldw, int64_t R,
                                                            float* lanes) {
  tile_lanes<8>(p, k0, len, w, ldw, R, lanes);
}

HNLQ_AVX512 void tile_product_avx512(const Problem& p, int64_t k0, int64_t len, const float* w,
                                     int64_t ldw, int64_t R, float* lanes) {
  tile_lanes<16>(p, k0, len, w, ldw, R, lanes);
}

// y of the tile's rows: each lane sum's total, then the ragged end of K in order (its decoded
// weights w[r * ldw + k - k_last], the last chunk's, starting at K's weight k_last), times the
// row's factor where folded: the register path's order and operations.
template <int W>
inline __attribute__((always_inline)) void finish_lanes(const Problem& p, int64_t r0,
                                                         int64_t R, const float* lanes,
                                                         const float* w, int64_t ldw,
                                                         int64_t k_last) {
  const int64_t whole = p.K / W * W;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t r = 0; r < R; ++r) {
      float t = Lanes<W>::sum(Lanes<W>::load(lanes + (b * R + r) * W));
      for (int64_t k = whole; k < p.K; ++k) t += p.x[b * p.K + k] * w[r * ldw + k - k_last];
      p.y[b * p.N + r0 + r] = p.fold ? t * row_factor(p, r0 + r) : t;
    }
}

__attribute__((target("avx2,fma"))) void tile_sums_avx2(const Problem& p, int64_t r0,
                                                         int64_t R, const float* lanes,
                                                         const float* w, int64_t ldw,
                                                         int64_t k_last) {
  finish_lanes<8>(p, r0, R, lanes, w, ldw, k_last);
}

HNLQ_AVX512 void tile_sums_avx512(const Problem& p, int64_t r0, int64_t R, const float* lanes,
                                  const float* w, int64_t ldw, int64_t k_last) {
  finish_lanes<16>(p, r0, R, lanes, w, ldw, k_last);
}
#endif

// One task's products, folded where p.fold says so (row_tile).
template <typename Index, int D, int Isa>
inline __attribute__((always_inline)) void row_tile_once(const Problem& p, int64_t r0,
                                                          int64_t R, float* buf, float* acc) {
  const int64_t d = D > 0 ? D : p.d;
  const int64_t blocks = kChunk / d;  // blocks per chunk; kChunk is a multiple of d
#ifdef HNLQ_X86
  if constexpr (Isa == kVbmi && D == 4) {  // pair codes by planes at every batch size
    if (planes_apply(p, Isa)) {
      p.fold ? tile_planes<true>(p, r0, R, acc) : tile_planes<false>(p, r0, R, acc);
      return;
    }
  }
  if constexpr (Isa >= kAvx2 && (D == 4 || D == 8)) {  // small batches: no buffer
    if (registers_apply<D>(p) && p.B <= kFusedRows) {
      for (int64_t r = r0; r < r0 + R; ++r) {
        if constexpr (Isa >= kAvx512)
          p.fold ? rows_dot512<Index, D, true>(p, r, 0) : rows_dot512<Index, D, false>(p, r, 0);
        else
          p.fold ? rows_dot<Index, D, true>(p, r) : rows_dot<Index, D, false>(p, r);
      }
      return;
    }
  }
#endif
  // acc: the sums of the portable loop (B x R), or the lane sums of AVX2 / AVX-512 (B x R x
  // 16 at most; tile_lanes)
  constexpr int64_t kLanes = Isa >= kAvx512 ? 16 : Isa >= kAvx2 ? 8 : 1;
  std::fill(acc, acc + p.B * R * kLanes, 0.0f);
  int64_t k_last = 0;  // the first weight of the last chunk, whose decoded weights buf holds
  for (int64_t j0 = 0; j0 < p.nb; j0 += blocks) {
    const int64_t j1 = std::min(p.nb, j0 + blocks);
    const int64_t k0 = j0 * d, len = std::min(p.K, j1 * d) - k0;
    if (len <= 0) break;
    k_last = k0;
#ifdef HNLQ_X86
    if constexpr (Isa >= kAvx2) {  // the same decoded bits on both levels, summed as row_dot's
      for (int64_t r = 0; r < R; ++r) {
        float* out = buf + r * kChunk;
        if constexpr (D == 4 || D == 8) {
          if (p.fold)
            decode_row_avx2<Index, D, true>(p, r0 + r, j0, j1, out);
          else
            decode_row_avx2<Index, D>(p, r0 + r, j0, j1, out);
        } else if (p.fold) {
          decode_row<Index, D, true>(p, r0 + r, j0, j1, out);
        } else {
          decode_row<Index, D>(p, r0 + r, j0, j1, out);
        }
      }
      if constexpr (Isa >= kAvx512)
        tile_product_avx512(p, k0, len, buf, kChunk, R, acc);
      else
        tile_product_avx2(p, k0, len, buf, kChunk, R, acc);
      continue;
    }
#endif
    for (int64_t r = 0; r < R; ++r) decode_row<Index, D>(p, r0 + r, j0, j1, buf + r * kChunk);
    tile_product(p, k0, len, buf, kChunk, R, acc);
  }
#ifdef HNLQ_X86
  // With AVX2 or AVX-512 the sums of folded codes are of x * (c * 2^(alpha T)), as on the
  // register path, and summed in its order: a row's result does not depend on the batch size.
  if constexpr (Isa >= kAvx512) {
    tile_sums_avx512(p, r0, R, acc, buf, kChunk, k_last);
    return;
  } else if constexpr (Isa >= kAvx2) {
    tile_sums_avx2(p, r0, R, acc, buf, kChunk, k_last);
    return;
  }
#endif
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t r = 0; r < R; ++r) p.y[b * p.N + r0 + r] = acc[b * R + r];
}

// One task: weight rows [r0, r0 + R) against every activation row. Folded sums are of
// x * (c 2^(alpha T)), the row's factor beta * cart * row_scale applied after them: where they
// overflow (activations near the float range against small row scales, whose products with
// the decoded weights the reference keeps finite) the tile is computed again unfolded, and
// its results that were not finite are taken from there (the finite ones stay: a row's
// result does not depend on the other rows of the batch). A result that is not finite
// either way (a failed block's NaN, an Inf in x) costs the time of a second pass.
template <typename Index, int D, int Isa>
inline __attribute__((always_inline)) void row_tile(const Problem& p, int64_t r0, int64_t R,
                                                     float* buf, float* acc) {
  row_tile_once<Index, D, Isa>(p, r0, R, buf, acc);
  if (!p.fold) return;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t r = r0; r < r0 + R; ++r)
      if (!std::isfinite(p.y[b * p.N + r])) {
        std::vector<float> folded(p.B * R);
        for (int64_t bb = 0; bb < p.B; ++bb)
          std::copy(p.y + bb * p.N + r0, p.y + bb * p.N + r0 + R, folded.begin() + bb * R);
        Problem unfolded = p;
        unfolded.fold = false;
        row_tile_once<Index, D, Isa>(unfolded, r0, R, buf, acc);
        for (int64_t bb = 0; bb < p.B; ++bb)
          for (int64_t rr = 0; rr < R; ++rr)
            if (std::isfinite(folded[bb * R + rr])) p.y[bb * p.N + r0 + rr] = folded[bb * R + rr];
        return;
      }
}

// One call's row tiles, claimed until none is left.
template <typename Index, int D, int Isa>
struct Product {
  static void run(Shared& call) {
    const Problem& p = call.p;
    // acc: the sums of a tile (row_tile_once, tile_planes): B x kRowTile x 16 floats at most
    std::vector<float> buf(kRowTile * kChunk), acc(p.B * kRowTile * 16);
    for (int64_t t; (t = call.next.fetch_add(1)) < call.tiles;) {
      const int64_t r0 = t * kRowTile;
      row_tile<Index, D, Isa>(p, r0, std::min(kRowTile, p.N - r0), buf.data(), acc.data());
    }
  }
};

constexpr char kName[] = "hnlq_decode_matmul";

// y[B, N] of x[B, K] and checked codes (call->p set but for x and y).
void product(const std::shared_ptr<Shared>& call, const float* x, int64_t B, float* y,
             const std::function<void(const std::shared_ptr<Shared>&, int64_t)>& run) {
  Problem& p = call->p;
  p.B = B;
  if (p.B == 0 || p.N == 0) return;
  p.x = x;
  p.y = y;
  if (planes_apply(p, call->isa)) {
    call->xp.resize(p.B * p.K);
    plane_order(x, p.B, p.K, call->xp.data());
    p.x = call->xp.data();
  }
  call->tiles = (p.N + kRowTile - 1) / kRowTile;
  call->work = dispatch<Product>;
  run(call, p.N * p.K * p.B);
}

ffi::Error DecodeMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer index,
                            ffi::Buffer<ffi::U8> tfield, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S8> codebook, ffi::Buffer<ffi::F32> pow2,
                            ffi::Buffer<ffi::F32> dither, ffi::ResultBuffer<ffi::F32> y,
                            float beta, float cart, int64_t q, int64_t qd, bool t4, bool bf16,
                            int64_t mode) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  ffi::Error e = check(xd.size() == 2 && yd.size() == 2, kName, "ranks: x [B, K], y [B, N]");
  if (e.failure()) return e;
  auto call = std::make_shared<Shared>();
  e = parse_codes(kName, index, tfield, scale, codebook, pow2, dither,
                  Attrs{beta, cart, q, qd, t4, bf16, mode}, xd[1], *call);
  if (e.failure()) return e;
  e = check(yd[0] == xd[0] && yd[1] == call->p.N, kName, "shapes of x, codes and y disagree");
  if (e.failure()) return e;
  product(call, x.typed_data(), xd[0], y->typed_data(),
          [&](const std::shared_ptr<Shared>& c, int64_t work) { run_on_pool(pool, c, work); });
  return ffi::Error::Success();
}

}  // namespace

std::string hnlq::decode_matmul_direct(const CodesView& v, const Attrs& a, const float* x,
                                       int64_t B, int64_t K, float* y, int64_t threads) {
  auto call = std::make_shared<Shared>();
  const ffi::Error e = set_codes(kName, v, a, K, *call);
  if (e.failure()) return e.message();
  product(call, x, B, y, [&](const std::shared_ptr<Shared>& c, int64_t work) {
    run_on_threads(threads, c, work);
  });
  return "";
}

// The operands: x, the codes (decode_rows.h); the result y; the codes' attributes.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HnlqDecodeMatmul, DecodeMatmulImpl,
    hnlq::bind_attrs(hnlq::bind_codes(ffi::Ffi::Bind()
                                          .Ctx<ffi::ThreadPool>()
                                          .Arg<ffi::Buffer<ffi::F32>>())  // x
                         .Ret<ffi::Buffer<ffi::F32>>()));
