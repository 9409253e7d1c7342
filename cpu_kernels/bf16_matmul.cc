// y[R, N] float32 = x[R, K] float32 @ w[K, N] bfloat16, for the few rows of a decode step (R up
// to MAX_ROWS), where XLA:CPU converts the bfloat16 weight to float32 element by element, far
// slower than it reads a float32 one (1 x [576, 49152]: 47 ms against 3.2 ms). Here the weight
// streams through once at its size, 2 bytes a weight, and each weight becomes a float32 with one
// integer instruction per 16 of them.
//
// The weight, as `pack_bf16` in __init__.py lays it out for this kernel ("packed"):
//   bfloat16 [S, K, kStrip]   S = ceil(N / kStrip) strips of kStrip output columns (the last one
//                             zero-padded), a strip's K rows of 64 weights contiguous,
// and within a row of a strip, each half of 32 columns h*32 + [0, 32) interleaved: element 2i of
// the half is column h*32 + i, element 2i + 1 column h*32 + 16 + i. A 64-byte load then holds 16
// lanes of 32 bits whose low halves are 16 consecutive columns and high halves the next 16; a
// shift left by 16 and a mask of the high halves are the two vectors of float32 weights.
// A stacked weight has a leading layer axis ([L, S, K, kStrip]) and the call multiplies by layer
// `layer` of it (an int32 operand, so a layer scan passes its index instead of a slice, which XLA
// would copy).
//
// Accuracy: a bfloat16 is the top half of a float32, so the widening is exact; x stays float32 and
// every product is a float32 FMA into float32 sums (one sum per row and column, its K terms in
// order): the error of float32 accumulation only, as x @ w.astype(float32), and a row's result
// the same to the bit whatever the other rows (at one row the weight's bytes, not the latency of
// one chain of FMAs per output, bound the loop: split sums gained nothing). vdpbf16ps, which
// rounds x to bfloat16 (3 significant digits), was slower here on Sapphire Rapids, one thread,
// 576 x 1536 from cache: 45 against 75 GMAC/s at 8 and 64 rows (20% faster at one row only).
//
// Strips (and, for few strips and many rows, groups of rows of a strip) are shared among the
// caller and the XLA CPU client's intra-op threads when the work is large enough.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "these kernels need AVX-512 (F, BW)"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kStrip = 64;    // output columns per strip: 4 vectors of 16 lanes
constexpr int kMaxRows = 6;   // rows of x per pass over a strip: 24 sums + 4 weight vectors in 32 registers
// Less weight than this (its bytes times the passes over each strip): the caller's thread only.
// One thread reads 576 x 576 (663 KB) in ~14 us at one row; a second thread gained nothing
// measurable there (on a 2-core machine shared with other work: a rough threshold, not tuned).
constexpr int64_t kParallelBytes = 1 << 20;
constexpr int64_t kPrefetchBytes = 1024;       // the strip's weights are prefetched this far ahead

struct Problem {
  const float* x;      // [R, K]
  const uint32_t* w;   // the layer's packed weight: [S, K, kStrip / 2] pairs of bfloat16
  float* y;            // [R, N]
  int64_t rows, k, n;
};

// Rows [row0, row0 + kRows) of y at the columns of strip `strip`.
template <int kRows>
void StripRows(const Problem& p, int64_t strip, int64_t row0) {
  const int64_t col = strip * kStrip;
  const uint32_t* w = p.w + strip * p.k * (kStrip / 2);
  const float* x[kRows];
  for (int r = 0; r < kRows; ++r) x[r] = p.x + (row0 + r) * p.k;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[kRows][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();

  for (int64_t i = 0; i < p.k; ++i) {
    const uint32_t* at = w + i * (kStrip / 2);
    _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512i first = _mm512_loadu_si512(at), second = _mm512_loadu_si512(at + 16);
    const __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(first, 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(first, high)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(second, 16)),
                         _mm512_castsi512_ps(_mm512_and_si512(second, high))};
    for (int r = 0; r < kRows; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r][i]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(v[c], xr, acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) {
      const int64_t left = std::clamp<int64_t>(p.n - col - c * 16, 0, 16);
      _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + col + c * 16, static_cast<__mmask16>((1u << left) - 1),
                            acc[r][c]);
    }
}

// Rows [row0, row1) of a strip, kMaxRows at a time (the strip read again, from cache, per pass).
void Strip(const Problem& p, int64_t strip, int64_t row0, int64_t row1) {
  int64_t row = row0;
  for (; row + kMaxRows <= row1; row += kMaxRows) StripRows<kMaxRows>(p, strip, row);
  switch (row1 - row) {
    case 1: StripRows<1>(p, strip, row); break;
    case 2: StripRows<2>(p, strip, row); break;
    case 3: StripRows<3>(p, strip, row); break;
    case 4: StripRows<4>(p, strip, row); break;
    case 5: StripRows<5>(p, strip, row); break;
    default: break;
  }
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> packed,
                      ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions(), wd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4) || yd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("bf16_matmul: x and y must be 2-D, packed 3-D (4-D stacked), layer one index");
  // A stacked weight ([L, S, K, kStrip]): the layer's slice, read in place.
  const int64_t layers = wd.size() == 4 ? wd[0] : 1, at = wd.size() - 3;
  const int64_t rows = xd[0], k = xd[1], strips = wd[at], n = yd[1];
  if (wd[at + 1] != k || wd[at + 2] != kStrip || strips != (n + kStrip - 1) / kStrip || yd[0] != rows)
    return ffi::Error::InvalidArgument("bf16_matmul: inconsistent shapes");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("bf16_matmul: layer index outside the stacked weight");

  const int64_t layer_weights = strips * k * kStrip;
  Problem p;
  p.x = x.typed_data();
  p.w = reinterpret_cast<const uint32_t*>(packed.typed_data() + index * layer_weights);
  p.y = y->typed_data();
  p.rows = rows;
  p.k = k;
  p.n = n;

  // Tasks: strips; with fewer strips than a few per thread and more than one pass of rows, each
  // strip's passes of rows too, so that every thread gets a share of a small weight's many rows.
  // Another thread only for work large enough to repay waking it: the weight's bytes times its
  // passes over each strip.
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t threads = layer_weights * 2 * passes >= kParallelBytes ? pool.num_threads() : 1;
  const int64_t parts = threads > 1 && strips < 4 * threads ? passes : 1;
  const int64_t rows_per_part = ((rows + parts - 1) / parts + kMaxRows - 1) / kMaxRows * kMaxRows;
  jaxserve::ParallelFor(pool, threads, strips * parts, [&p, parts, rows_per_part](int64_t task) {
    const int64_t row0 = (task % parts) * rows_per_part;
    if (row0 < p.rows) Strip(p, task / parts, row0, std::min(p.rows, row0 + rows_per_part));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
