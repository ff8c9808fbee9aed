// hnlq_decode: the dense weight W_hat[N, K] (float32) of a weight's codes.
//
// The CPU twin of hq.decode's XLA path for a weight's codes (implementation="native"): the
// same values bit for bit (decode_rows.h decodes as the reference does, operation by
// operation), at memory speed, for code that needs the dense weight once, e.g. a large batch's
// product, which a float GEMM then computes faster than decoding inside it.
//
// Inputs: the codes' arguments (decode_rows.h). Output w f32[N, K] (rounded to bfloat16 values
// with bf16, as the product with bfloat16 activations reads them).

#include "decode_rows.h"

namespace {

using namespace hnlq;  // NOLINT: this file's kernel is built from decode_rows.h's parts

constexpr int64_t kTileWeights = 1 << 14;  // weights per task (rows of one tile)

#ifdef HNLQ_X86
// Row r's whole steps of 64 blocks by coordinate planes (kVbmi, kPairs codes): decode_step's
// weights (finish_avx512's: the reference's bits), each group of 16 blocks' four coordinate
// registers interleaved back into block order (a 4 x 4 transpose of floats, then of 128-bit
// lanes). Returns the first block not decoded.
HNLQ_VBMI int64_t row_planes(const Problem& p, int64_t r, const PlaneConsts& c, float* out) {
  const RowConsts512 k = row_consts512_of<4>(p, r);
  const int64_t steps = p.K / 256;
  for (int64_t g = 0; g < steps; ++g, out += 256) {
    PlaneStep st;
    decode_step<false>(p, r, g, c, k, st);
    for (int h = 0; h < 4; ++h) {  // lane l of v[i][h]: coordinate i of block 16h + l
      const __m512 t0 = _mm512_unpacklo_ps(st.v[0][h], st.v[1][h]);
      const __m512 t1 = _mm512_unpackhi_ps(st.v[0][h], st.v[1][h]);
      const __m512 t2 = _mm512_unpacklo_ps(st.v[2][h], st.v[3][h]);
      const __m512 t3 = _mm512_unpackhi_ps(st.v[2][h], st.v[3][h]);
      // u_m's 128-bit lane j: block 4j + m of the group, coordinates 0..3
      const __m512 u0 = _mm512_shuffle_ps(t0, t2, 0x44), u1 = _mm512_shuffle_ps(t0, t2, 0xEE);
      const __m512 u2 = _mm512_shuffle_ps(t1, t3, 0x44), u3 = _mm512_shuffle_ps(t1, t3, 0xEE);
      const __m512 v0 = _mm512_shuffle_f32x4(u0, u1, 0x44), v1 = _mm512_shuffle_f32x4(u2, u3, 0x44);
      const __m512 v2 = _mm512_shuffle_f32x4(u0, u1, 0xEE), v3 = _mm512_shuffle_f32x4(u2, u3, 0xEE);
      float* o = out + 64 * h;
      _mm512_storeu_ps(o, _mm512_shuffle_f32x4(v0, v1, 0x88));       // blocks 0..3
      _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(v0, v1, 0xDD));  // blocks 4..7
      _mm512_storeu_ps(o + 32, _mm512_shuffle_f32x4(v2, v3, 0x88));  // blocks 8..11
      _mm512_storeu_ps(o + 48, _mm512_shuffle_f32x4(v2, v3, 0xDD));  // blocks 12..15
    }
  }
  return 64 * steps;
}
#endif

// One call's row tiles: whole blocks inside K straight into the output row (by planes first
// where they apply), a block that K cuts through a buffer.
template <typename Index, int D, int Isa>
struct Decode {
  static void run(Shared& call) {
    const Problem& p = call.p;
    const int64_t d = D > 0 ? D : p.d;
    const int64_t rows = std::max<int64_t>(1, kTileWeights / p.K);
    const int64_t whole = p.K / d;
    float tail[8];
#ifdef HNLQ_X86
    PlaneConsts planes{};  // (set where the planes apply)
    if constexpr (Isa == kVbmi && D == 4) {
      if (p.mode == kPairs) planes = plane_consts(p);
    }
#endif
    for (int64_t t; (t = call.next.fetch_add(1)) < call.tiles;) {
      for (int64_t r = t * rows; r < std::min(p.N, (t + 1) * rows); ++r) {
        float* out = p.y + r * p.K;
#ifdef HNLQ_X86
        int64_t j = 0;  // (even: pairs_avx2 starts at an even block)
        if constexpr (Isa == kVbmi && D == 4) {
          if (p.mode == kPairs) j = row_planes(p, r, planes, out);
        }
        if constexpr (Isa >= kAvx2 && D > 0)  // the same bits on every level
          decode_row_avx2<Index, D>(p, r, j, whole, out + j * D);
        else
#endif
          decode_row<Index, D>(p, r, 0, whole, out);
        if (whole < p.nb) {
          decode_row<Index, D>(p, r, whole, whole + 1, tail);
          std::copy(tail, tail + (p.K - whole * d), out + whole * d);
        }
      }
    }
  }
};

constexpr char kName[] = "hnlq_decode";

// w[N, K] of checked codes (call->p set but for the output).
void decode(const std::shared_ptr<Shared>& call, float* w,
            const std::function<void(const std::shared_ptr<Shared>&, int64_t)>& run) {
  Problem& p = call->p;
  if (p.N == 0 || p.K == 0) return;
  p.y = w;
  const int64_t rows = std::max<int64_t>(1, kTileWeights / p.K);
  call->tiles = (p.N + rows - 1) / rows;
  call->work = dispatch<Decode>;
  run(call, p.N * p.K);
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer index, ffi::Buffer<ffi::U8> tfield,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S8> codebook,
                      ffi::Buffer<ffi::F32> pow2, ffi::Buffer<ffi::F32> dither,
                      ffi::ResultBuffer<ffi::F32> w, float beta, float cart, int64_t q,
                      int64_t qd, bool t4, bool bf16, int64_t mode) {
  const auto wd = w->dimensions();
  ffi::Error e = check(wd.size() == 2, kName, "rank: w [N, K]");
  if (e.failure()) return e;
  auto call = std::make_shared<Shared>();
  e = parse_codes(kName, index, tfield, scale, codebook, pow2, dither,
                  Attrs{beta, cart, q, qd, t4, bf16, mode}, wd[1], *call);
  if (e.failure()) return e;
  e = check(wd[0] == call->p.N, kName, "shapes of codes and w disagree");
  if (e.failure()) return e;
  decode(call, w->typed_data(), [&](const std::shared_ptr<Shared>& c, int64_t work) {
    run_on_pool(pool, c, work);
  });
  return ffi::Error::Success();
}

}  // namespace

std::string hnlq::decode_direct(const CodesView& v, const Attrs& a, int64_t K, float* w,
                                int64_t threads) {
  auto call = std::make_shared<Shared>();
  const ffi::Error e = set_codes(kName, v, a, K, *call);
  if (e.failure()) return e.message();
  decode(call, w, [&](const std::shared_ptr<Shared>& c, int64_t work) {
    run_on_threads(threads, c, work);
  });
  return "";
}

// The operands: the codes (decode_rows.h); the result w; the codes' attributes.
XLA_FFI_DEFINE_HANDLER_SYMBOL(HnlqDecode, DecodeImpl,
    hnlq::bind_attrs(hnlq::bind_codes(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                         .Ret<ffi::Buffer<ffi::F32>>()));
