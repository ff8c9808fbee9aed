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

// One call's row tiles: whole blocks inside K straight into the output row, a block that K
// cuts through a buffer.
template <typename Index, int D, int Isa>
struct Decode {
  static void run(Shared& call) {
    const Problem& p = call.p;
    const int64_t d = D > 0 ? D : p.d;
    const int64_t rows = std::max<int64_t>(1, kTileWeights / p.K);
    const int64_t whole = p.K / d;
    float tail[8];
    for (int64_t t; (t = call.next.fetch_add(1)) < call.tiles;) {
      for (int64_t r = t * rows; r < std::min(p.N, (t + 1) * rows); ++r) {
        float* out = p.y + r * p.K;
#ifdef HNLQ_X86
        if constexpr (Isa >= kAvx2 && D > 0)  // the same bits on every level
          decode_row_avx2<Index, D>(p, r, 0, whole, out);
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
