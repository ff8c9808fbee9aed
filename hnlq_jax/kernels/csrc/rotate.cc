// hnlq_rotate: y = x R (or x R^T) of hnlq_jax.incoherence.Rotation, row by row.
//
// R = diag(s) (H_{2^k} / 2^(k/2) (Kronecker) B_m) on rows of n = 2^k m values, each viewed as
// [2^k, m]. The CPU twin of the XLA path of Rotation.apply / inverse, its operations in its
// order: x R = signs, k butterfly stages (a + b, a - b), one scale 2^(-k/2), then the mixer
// (each m-vector times B); x R^T the same steps reversed (B^T first, signs last). Float32;
// the mixer's sums run over j ascending (XLA's dot may sum in another order: the two agree
// within float32 rounding, and bit for bit when m = 1).
//
// Inputs x f32[R, n], s f32[n], B f32[m, m]; output y f32[R, n]; attributes k, m, inverse.

#include <cmath>
#include <cstring>

#include "common.h"

namespace {

using hnlq::check;

constexpr char kName[] = "hnlq_rotate";
constexpr int64_t kTileValues = 1 << 14;  // values a task rotates (whole rows)

struct Rotate : hnlq::Tasks {
  const float *x, *s;
  std::vector<float> Bp;  // B = c Bp (B^T for an inverse), rows padded to 16 chunks(m) floats
  float c;                // 1, or |B_jc| where all are equal (Bp then holds signs: signs)
  bool signs;
  float* y;
  int64_t R, n, k, m, rows;  // rows: a tile's
  bool inverse;
  void (*work)(Rotate&) = nullptr;
};

// Vectors of W floats (GCC's vector extension: one instruction each where the instruction set
// has that width, several where it has not), unaligned.
// (Typedefs: GCC drops vector_size in an alias template. The functions taking and returning
// them are always inlined: no call crosses an ABI, so its warning about them is moot.)
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Floats1;
typedef float Floats4 __attribute__((vector_size(16), aligned(4)));
typedef float Floats8 __attribute__((vector_size(32), aligned(4)));
typedef float Floats16 __attribute__((vector_size(64), aligned(4)));
template <int W> struct VectorOf;
template <> struct VectorOf<1> { using type = Floats1; };
template <> struct VectorOf<4> { using type = Floats4; };
template <> struct VectorOf<8> { using type = Floats8; };
template <> struct VectorOf<16> { using type = Floats16; };
template <int W>
using Floats = typename VectorOf<W>::type;

template <int W>
[[gnu::always_inline]] inline Floats<W> load(const float* p) {
  Floats<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W>
[[gnu::always_inline]] inline void store(float* p, const Floats<W>& v) {
  std::memcpy(p, &v, sizeof v);
}

// One pass over v[total] of one butterfly stage (Two false: spans lo, hi become lo + hi, lo - hi)
// or two (four spans a, b, c, d become (a + b) + (c + d), (a - b) + (c - d), (a + b) - (c + d),
// (a - b) - (c - d): the sums of the two stages), W values at a time (W divides span).
template <bool Two, int W>
[[gnu::always_inline]] inline void pass_of(float* v, int64_t total, int64_t span) {
  using V = Floats<W>;
  for (int64_t a = 0; a < total; a += (Two ? 4 : 2) * span) {
    float* p0 = v + a;
    float* p1 = p0 + span;
    for (int64_t t = 0; t < span; t += W) {
      const V a0 = load<W>(p0 + t), a1 = load<W>(p1 + t);
      const V s0 = a0 + a1, d0 = a0 - a1;
      if constexpr (Two) {
        float* p2 = p1 + span;
        float* p3 = p2 + span;
        const V a2 = load<W>(p2 + t), a3 = load<W>(p3 + t);
        const V s1 = a2 + a3, d1 = a2 - a3;
        store<W>(p0 + t, s0 + s1);
        store<W>(p1 + t, d0 + d1);
        store<W>(p2 + t, s0 - s1);
        store<W>(p3 + t, d0 - d1);
      } else {
        store<W>(p0 + t, s0);
        store<W>(p1 + t, d0);
      }
    }
  }
}

// pass_of with the widest vectors that divide the span (spans are m 2^j: 12, 24, 48, ...).
template <bool Two>
[[gnu::always_inline]] inline void pass(float* v, int64_t total, int64_t span) {
  if (span % 16 == 0) return pass_of<Two, 16>(v, total, span);
  if (span % 8 == 0) return pass_of<Two, 8>(v, total, span);
  if (span % 4 == 0) return pass_of<Two, 4>(v, total, span);
  pass_of<Two, 1>(v, total, span);
}

// The normalized Walsh-Hadamard transform over the 2^k axis of v[2^k, m]: stage j adds and
// subtracts the m-vectors 2^j apart; the pairs' spans of 2^j m values are contiguous.
template <int M>
[[gnu::always_inline]] inline void butterflies(float* v, int64_t k, int64_t m) {
  if constexpr (M > 0) m = M;
  const int64_t rows = int64_t{1} << k;
  int64_t j = 0;
  if (M == 1 && k >= 3) {  // stages 0-2 (spans 1, 2, 4) within blocks of 8, in registers
    for (int64_t a = 0; a < rows; a += 8) {
      float* b = v + a;
      float e[8];
      for (int i = 0; i < 8; i += 2) e[i] = b[i] + b[i + 1], e[i + 1] = b[i] - b[i + 1];
      float f[8];
      for (int i = 0; i < 8; i += 4)
        for (int t = 0; t < 2; ++t) f[i + t] = e[i + t] + e[i + t + 2],
                                    f[i + t + 2] = e[i + t] - e[i + t + 2];
      for (int t = 0; t < 4; ++t) b[t] = f[t] + f[t + 4], b[t + 4] = f[t] - f[t + 4];
    }
    j = 3;
  }
  // Stages j and j + 1 in one pass (the same sums), half the passes over the row; an odd last
  // stage alone.
  for (; j + 1 < k; j += 2) pass<true>(v, rows * m, m << j);
  for (; j < k; ++j) pass<false>(v, rows * m, m << j);
  if (k == 0) return;
  const float scale = static_cast<float>(std::pow(2.0, -0.5 * static_cast<double>(k)));
  for (int64_t t = 0; t < rows * m; ++t) v[t] *= scale;
}

// Vectors of 16 floats a mixer row takes, padded with zeros (M: 12 -> 1, 20 -> 2).
constexpr int64_t chunks(int64_t m) { return (m + 15) / 16; }

// v[groups, M] <- v S for a matrix S of entries +-1 (Sp: its rows padded to 16 chunks(M)
// floats): each output m-vector a sum of broadcast values times S's rows, the sums over j
// ascending. Every product is exact, so a fused multiply-add (allowed here, and only here:
// the FMA of an AVX-512 or FMA3 CPU, one instruction where a product and an add take two) gives
// the bits of the product and the add on any CPU.
template <int M>
__attribute__((target_clones("avx512f", "fma", "default"), optimize("fp-contract=fast")))
void mix_signs(float* v, const float* Sp, int64_t groups) {
  constexpr int64_t C = chunks(M);
  Floats16 rows[M * C];  // in registers where the instruction set has enough
  for (int64_t i = 0; i < M * C; ++i) rows[i] = load<16>(Sp + 16 * i);
  for (int64_t g = 0; g < groups; ++g) {
    float* out = v + g * M;
    Floats16 acc[C] = {};
    for (int64_t j = 0; j < M; ++j)
      for (int64_t c = 0; c < C; ++c) acc[c] += out[j] * rows[j * C + c];
    std::memcpy(out, acc, M * sizeof(float));
  }
}

// v[2^k, m] <- v B (B^T for an inverse is passed as B): each m-vector times the mixer, the
// sums over j ascending (a product and an add each, or where the product is exact an FMA of
// the same bits). With B = c S (signs: c > 0, Bp: S's rows padded to 16 chunks(m) floats,
// entries +-1 for the Paley mixers), v is first multiplied by c: v_j B_jc = +-(v_j c) exactly,
// the same bits. With a size of its own (M > 1) and signs, mix_signs; otherwise one value at
// a time, into buffer (m floats).
template <int M>
[[gnu::always_inline]] inline void mix(float* v, const float* Bp, float c, bool signs,
                                       int64_t k, int64_t m, float* buffer) {
  if constexpr (M > 0) m = M;
  const int64_t groups = int64_t{1} << k;
  if (signs)
    for (int64_t t = 0; t < groups * m; ++t) v[t] *= c;
  if constexpr (M > 1) {
    if (signs) return mix_signs<M>(v, Bp, groups);
  }
  const int64_t w = 16 * chunks(m);
  for (int64_t g = 0; g < groups; ++g) {
    float* row = v + g * m;
    for (int64_t i = 0; i < m; ++i) buffer[i] = 0.0f;
    for (int64_t j = 0; j < m; ++j) {
      const float vj = row[j];
      for (int64_t i = 0; i < m; ++i) buffer[i] += vj * Bp[j * w + i];
    }
    std::copy(buffer, buffer + m, row);
  }
}

// The rows of the tiles this thread claims, for a mixer of size M (0: any size). Inlined (as
// the steps above) into each instruction set's clone below, so that it is compiled for it.
template <int M>
[[gnu::always_inline]] inline void run_rows(Rotate& call) {
  const int64_t n = call.n, k = call.k, m = call.m;
  const float* B = call.Bp.data();
  std::vector<float> buffer(m);
  for (int64_t t; (t = call.next.fetch_add(1)) < call.tiles;) {
    for (int64_t r = t * call.rows; r < std::min(call.R, (t + 1) * call.rows); ++r) {
      const float* x = call.x + r * n;
      float* y = call.y + r * n;
      if (call.inverse) {
        if (y != x) std::copy(x, x + n, y);
        if (m > 1) mix<M>(y, B, call.c, call.signs, k, m, buffer.data());
        butterflies<M>(y, k, m);
        for (int64_t i = 0; i < n; ++i) y[i] *= call.s[i];
      } else {
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] * call.s[i];
        butterflies<M>(y, k, m);
        if (m > 1) mix<M>(y, B, call.c, call.signs, k, m, buffer.data());
      }
    }
  }
}

// With AVX-512 or AVX2 where the CPU has them (the same operations in the same order, so the
// same bits).
template <int M>
__attribute__((target_clones("avx512f", "avx2", "default"))) void run_clones(Rotate& call) {
  run_rows<M>(call);
}

void run(Rotate& call) {
  switch (call.m) {  // the mixers of common layer widths: 384, 768, ... (12), 5120 (20)
    case 1: return run_clones<1>(call);
    case 12: return run_clones<12>(call);
    case 20: return run_clones<20>(call);
    default: return run_clones<0>(call);
  }
}

ffi::Error set_up(Rotate& call, int64_t R, int64_t n, int64_t sn, int64_t bm, int64_t bn,
                  int64_t k, int64_t m) {
  ffi::Error e = check(k >= 0 && k < 62 && m >= 1 && (m << k) == n && sn == n && bm == m &&
                           bn == m, kName, "shapes: x [R, n = 2^k m], s [n], B [m, m]");
  if (e.failure()) return e;
  call.R = R; call.n = n; call.k = k; call.m = m;
  call.rows = std::max<int64_t>(1, kTileValues / std::max<int64_t>(n, 1));
  call.tiles = (R + call.rows - 1) / call.rows;
  call.work = run;
  return ffi::Error::Success();
}

// The operands of a checked call; the mixer (B^T for an inverse) as c Bp, its rows padded for
// mix: Bp its signs where all its entries are +-c (a Paley mixer), else B itself (c = 1).
void set_operands(Rotate& call, const float* x, const float* s, const float* B, float* y,
                  bool inverse) {
  call.x = x; call.s = s; call.y = y; call.inverse = inverse;
  const int64_t m = call.m, w = 16 * chunks(m);
  const float c = std::fabs(B[0]);
  call.signs = c > 0.0f && std::all_of(B, B + m * m, [c](float b) { return std::fabs(b) == c; });
  call.c = call.signs ? c : 1.0f;
  call.Bp.assign(m * w, 0.0f);
  for (int64_t j = 0; j < m; ++j)
    for (int64_t i = 0; i < m; ++i) {
      const float b = inverse ? B[i * m + j] : B[j * m + i];
      call.Bp[j * w + i] = call.signs ? (b > 0.0f ? 1.0f : -1.0f) : b;
    }
}

ffi::Error RotateImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> s,
                      ffi::Buffer<ffi::F32> B, ffi::ResultBuffer<ffi::F32> y, int64_t k,
                      int64_t m, bool inverse) {
  const auto xd = x.dimensions(), bd = B.dimensions(), yd = y->dimensions();
  ffi::Error e = check(xd.size() == 2 && bd.size() == 2 && yd.size() == 2 && xd[0] == yd[0] &&
                           xd[1] == yd[1], kName, "ranks: x [R, n], B [m, m], y [R, n]");
  if (e.failure()) return e;
  auto call = std::make_shared<Rotate>();
  e = set_up(*call, xd[0], xd[1], static_cast<int64_t>(s.element_count()), bd[0], bd[1], k, m);
  if (e.failure()) return e;
  set_operands(*call, x.typed_data(), s.typed_data(), B.typed_data(), y->typed_data(),
               inverse);
  hnlq::run_on_pool(pool, call, call->R * call->n);
  return ffi::Error::Success();
}

}  // namespace

std::string hnlq::rotate_direct(const float* x, int64_t R, int64_t n, const float* s,
                                const float* B, int64_t k, int64_t m, bool inverse, float* y,
                                int64_t threads) {
  auto call = std::make_shared<Rotate>();
  const ffi::Error e = set_up(*call, R, n, n, m, m, k, m);
  if (e.failure()) return e.message();
  set_operands(*call, x, s, B, y, inverse);
  run_on_threads(threads, call, R * n);
  return "";
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HnlqRotate, RotateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // s
                                  .Arg<ffi::Buffer<ffi::F32>>()  // B
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("m")
                                  .Attr<bool>("inverse"));
