// y[R, N] float32 = x[R, K] float32 @ w[K, N], the weight in "strips" of 64 output columns, stored
// as bfloat16 or float32. Two uses:
// * bfloat16 weights, for the few rows of a decode step (R up to MAX_ROWS), where XLA:CPU converts
//   the bfloat16 weight to float32 element by element, far slower than it reads a float32 one
//   (1 x [576, 49152]: 47 ms against 3.2 ms). Here the weight streams through once at its size, 2
//   bytes a weight, and each weight becomes a float32 with one integer instruction per 16 of them.
// * float32 weights, for any number of rows: XLA:CPU's float32 dot falls well short of this CPU's
//   float32 rate at the few rows of a decode step (bench/RESULTS.md, "Offline throughput: jaxserve
//   generate vs transformers"), where a 6 x 64 register tile of sums over one strip at a time keeps
//   the FMA units busy; the same tile serves a prompt chunk's rows, the strip read again from cache
//   for each 6 rows.
//
// The weight, as `pack_bf16` / `pack_f32` in __init__.py lay it out for this kernel ("packed"):
//   [S, K, kStrip]   S = ceil(N / kStrip) strips of kStrip output columns (the last one
//                    zero-padded), a strip's K rows of 64 weights contiguous.
// float32: a row of a strip is its 64 columns in order. bfloat16: each half of 32 columns h*32 +
// [0, 32) interleaved: element 2i of the half is column h*32 + i, element 2i + 1 column h*32 + 16 +
// i. A 64-byte load then holds 16 lanes of 32 bits whose low halves are 16 consecutive columns and
// high halves the next 16; a shift left by 16 and a mask of the high halves are the two vectors of
// float32 weights.
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
#include <string>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "these kernels need AVX-512 (F, BW)"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kStrip = 64;    // output columns per strip: 4 vectors of 16 lanes
constexpr int kMaxRows = 6;   // rows of x per pass over a strip: 24 sums + 4 weight vectors in 32 registers
// Less work than this (the weight's bytes times the passes over each strip): the caller's thread
// only. One thread reads 576 x 576 bfloat16 (663 KB) in ~14 us at one row; a second thread gained
// nothing measurable there (on a 2-core machine shared with other work: a rough threshold, not tuned).
constexpr int64_t kParallelBytes = 1 << 20;
constexpr int64_t kPrefetchRows = 8;  // a strip's weights are prefetched this many rows of it ahead

// The two weight formats: a row of a strip as 4 vectors of float32 weights.
struct Bf16Weights {
  using Element = uint16_t;
  static constexpr int kRowBytes = kStrip * 2;
  static inline void Load(const Element* at, __m512 v[4]) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512i first = _mm512_loadu_si512(at), second = _mm512_loadu_si512(at + 32);
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(first, 16));
    v[1] = _mm512_castsi512_ps(_mm512_and_si512(first, high));
    v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(second, 16));
    v[3] = _mm512_castsi512_ps(_mm512_and_si512(second, high));
  }
};

struct F32Weights {
  using Element = float;
  static constexpr int kRowBytes = kStrip * 4;
  static inline void Load(const Element* at, __m512 v[4]) {
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(at + 16 * c);
  }
};

template <typename Format>
struct Problem {
  const float* x;                         // [R, K]
  const typename Format::Element* w;      // the layer's packed weight: [S, K, kStrip]
  float* y;                               // [R, N]
  int64_t rows, k, n;
};

// Rows [row0, row0 + kRows) of y at the columns of strip `strip`.
template <typename Format, int kRows>
void StripRows(const Problem<Format>& p, int64_t strip, int64_t row0) {
  const int64_t col = strip * kStrip;
  const typename Format::Element* w = p.w + strip * p.k * kStrip;
  const float* x[kRows];
  for (int r = 0; r < kRows; ++r) x[r] = p.x + (row0 + r) * p.k;
  __m512 acc[kRows][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();

  for (int64_t i = 0; i < p.k; ++i) {
    const typename Format::Element* at = w + i * kStrip;
    const char* ahead = reinterpret_cast<const char*>(at) + kPrefetchRows * Format::kRowBytes;
    for (int line = 0; line < Format::kRowBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    __m512 v[4];
    Format::Load(at, v);
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
template <typename Format>
void Strip(const Problem<Format>& p, int64_t strip, int64_t row0, int64_t row1) {
  int64_t row = row0;
  for (; row + kMaxRows <= row1; row += kMaxRows) StripRows<Format, kMaxRows>(p, strip, row);
  switch (row1 - row) {
    case 1: StripRows<Format, 1>(p, strip, row); break;
    case 2: StripRows<Format, 2>(p, strip, row); break;
    case 3: StripRows<Format, 3>(p, strip, row); break;
    case 4: StripRows<Format, 4>(p, strip, row); break;
    case 5: StripRows<Format, 5>(p, strip, row); break;
    default: break;
  }
}

template <typename Format, ffi::DataType kType>
ffi::Error StripMatmul(const char* name, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kType> packed,
                       ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions(), wd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4) || yd.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x and y must be 2-D, packed 3-D (4-D stacked), layer one index");
  // A stacked weight ([L, S, K, kStrip]): the layer's slice, read in place.
  const int64_t layers = wd.size() == 4 ? wd[0] : 1, at = wd.size() - 3;
  const int64_t rows = xd[0], k = xd[1], strips = wd[at], n = yd[1];
  if (wd[at + 1] != k || wd[at + 2] != kStrip || strips != (n + kStrip - 1) / kStrip || yd[0] != rows)
    return ffi::Error::InvalidArgument(std::string(name) + ": inconsistent shapes");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument(std::string(name) + ": layer index outside the stacked weight");

  const int64_t layer_weights = strips * k * kStrip;
  Problem<Format> p;
  p.x = x.typed_data();
  p.w = reinterpret_cast<const typename Format::Element*>(packed.typed_data()) + index * layer_weights;
  p.y = y->typed_data();
  p.rows = rows;
  p.k = k;
  p.n = n;

  // Tasks: strips; with fewer strips than a few per thread and more than one pass of rows, each
  // strip's passes of rows too, so that every thread gets a share of a small weight's many rows.
  // Another thread only for work large enough to repay waking it: the weight's bytes times its
  // passes over each strip.
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t weight_bytes = layer_weights * (Format::kRowBytes / kStrip);
  const int64_t threads = weight_bytes * passes >= kParallelBytes ? pool.num_threads() : 1;
  const int64_t parts = threads > 1 && strips < 4 * threads ? passes : 1;
  const int64_t rows_per_part = ((rows + parts - 1) / parts + kMaxRows - 1) / kMaxRows * kMaxRows;
  jaxserve::ParallelFor(pool, threads, strips * parts, [&p, parts, rows_per_part](int64_t task) {
    const int64_t row0 = (task % parts) * rows_per_part;
    if (row0 < p.rows) Strip(p, task / parts, row0, std::min(p.rows, row0 + rows_per_part));
  });
  return ffi::Error::Success();
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> packed,
                      ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return StripMatmul<Bf16Weights, ffi::BF16>("bf16_matmul", pool, x, packed, layer, y);
}

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> packed,
                     ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return StripMatmul<F32Weights, ffi::F32>("f32_matmul", pool, x, packed, layer, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveF32Matmul, F32Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
