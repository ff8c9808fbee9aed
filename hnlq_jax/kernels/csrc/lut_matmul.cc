// hnlq_lut_matmul: the lookup-table product's sums, y[m, n] = sum_k s[n, k] (sum_j q^j
// U[m, k, idx[n, k, j]] - E[m, k]), with s[n, k] = steps[u[n, k]] (NaN where an index is
// >= Q: an invalid block, as the reference's valid_blocks).
//
// The CPU twin of hnlq_jax.lut's _gather_matmul, which both lookup-table products end in: the
// one-sided one (U[m, k, b] = <r(b), x_mk>, the tables of real activations: weight-only
// quantization, implementation="lut") and the two-sided one (U[m, k, b] = s^A_mk <c^A_mk,
// r(b)>, from the exact integer table of codebook inner products). Per block and level one
// lookup and an add; per block one multiply by its step. Each task owns a tile of columns n
// (weight rows) and sums them against every row m, 16 blocks a register with AVX-512 gathers
// (U's row m stays in L2 across the tile), else a block at a time.
//
// Inputs: U f32[m, nb, Q]; E f32[m, nb] or f32[0] (no offsets); idx u8|u16[n, nb, M]; u
// u8[n, nb] (the blocks' T field values); steps f32[256] (beta 2^(alpha T) by u, NaN where u
// is not valid). Attribute q. Output y f32[m, n].

#include "decode_rows.h"

namespace {

using namespace hnlq;  // NOLINT: Tasks, run_on_pool and the Isa levels

constexpr int64_t kColumnTile = 8;  // columns n per task
constexpr char kName[] = "hnlq_lut_matmul";

struct LutCall : Tasks {
  const float* U;
  const float* E;  // nullptr: no offsets
  const void* idx;
  const uint8_t* u;
  const float* steps;
  float* y;
  int64_t m, n, nb, Q, M, q;
  bool u16;
  int isa;
  void (*work)(LutCall&) = nullptr;
};

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
    const float s = bad ? std::numeric_limits<float>::quiet_NaN() : p.steps[p.u[c * p.nb + k]];
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
      const __m512i t = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.u + (c0 + c) * p.nb + k)));
      const __m512 s = _mm512_mask_blend_ps(ok, nan, _mm512_i32gather_ps(t, p.steps, 4));
      acc[c] = _mm512_fmadd_ps(s, v, acc[c]);
    }
  }
  for (int64_t c = 0; c < c1 - c0; ++c)
    p.y[r * p.n + c0 + c] = hsum512(acc[c]) + column_rest<uint8_t>(p, r, c0 + c, k);
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
  for (int64_t t; (t = p.next.fetch_add(1)) < p.tiles;) {
    const int64_t c0 = t * kColumnTile, c1 = std::min(p.n, c0 + kColumnTile);
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
                         ffi::AnyBuffer idx, ffi::Buffer<ffi::U8> u, ffi::Buffer<ffi::F32> steps,
                         ffi::ResultBuffer<ffi::F32> y, int64_t q) {
  const auto ud = U.dimensions(), ed = E.dimensions(), id = idx.dimensions();
  const auto td = u.dimensions(), yd = y->dimensions();
  const bool u16 = idx.element_type() == ffi::DataType::U16;
  ffi::Error e = check(u16 || idx.element_type() == ffi::DataType::U8, kName,
                       "idx must be u8/u16");
  if (e.failure()) return e;
  e = check(ud.size() == 3 && id.size() == 3 && td.size() == 2 && yd.size() == 2 &&
                ed.size() >= 1,
            kName, "ranks: U [m, nb, Q], idx [n, nb, M], u [n, nb], y [m, n]");
  if (e.failure()) return e;
  auto call = std::make_shared<LutCall>();
  LutCall& p = *call;
  p.m = ud[0]; p.nb = ud[1]; p.Q = ud[2]; p.n = id[0]; p.M = id[2]; p.q = q; p.u16 = u16;
  const bool offsets = E.element_count() != 0;
  e = check(id[1] == p.nb && td[0] == p.n && td[1] == p.nb && yd[0] == p.m && yd[1] == p.n &&
                p.M >= 1 && q >= 2 && p.Q >= 1 && steps.element_count() == 256 &&
                (!offsets || (ed.size() == 2 && ed[0] == p.m && ed[1] == p.nb)),
            kName, "shapes of U, E, idx, u, steps and y disagree");
  if (e.failure()) return e;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.U = U.typed_data(); p.E = offsets ? E.typed_data() : nullptr; p.idx = idx.untyped_data();
  p.u = u.typed_data(); p.steps = steps.typed_data(); p.y = y->typed_data();
  p.isa = active_isa();
  p.tiles = (p.n + kColumnTile - 1) / kColumnTile;
  p.work = run;
  run_on_pool(pool, call, p.m * p.n * p.nb * 4);  // ~4 weights' work a block and row
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HnlqLutMatmul, LutMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // U
                                  .Arg<ffi::Buffer<ffi::F32>>()  // E
                                  .Arg<ffi::AnyBuffer>()         // idx
                                  .Arg<ffi::Buffer<ffi::U8>>()   // u
                                  .Arg<ffi::Buffer<ffi::F32>>()  // steps
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int64_t>("q"));
