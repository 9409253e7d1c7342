// y[R, N] = x[R, K] @ w[K, N] for an int8 or int4 weight quantized in groups along K, in 8-bit
// integer dot products (AVX-512 VNNI), as llama.cpp multiplies its quantized blocks: the rows of x
// are quantized to int8 per block of kBlock inputs, and each instruction multiplies 64 weight
// codes by 64 activation codes, so the weight bytes are read once at memory speed instead of
// being converted to float one by one.
//
// The weight, as `pack` in __init__.py lays it out for this kernel ("packed"):
//   uint8 [S, K / 4, kStrip, 4]   int8 weights: u = q + 128 for input 4i + t of column c
//   uint8 [S, K / 8, kStrip, 4]   int4 weights: low nibble input 8i + t, high nibble 8i + 4 + t
// where S = ceil(N / kStrip) strips of kStrip output columns (the last one zero-padded), so one
// strip's codes are contiguous and a 64-byte load holds 4 inputs of 16 columns: the operand of
// one VNNI instruction (16 int32 lanes, each the sum of 4 byte products).
// scale, zero: float16 [S, G, kStrip] (zero absent: has_zero = 0), G groups of K / G inputs, in
// strips as the codes (a strip's scales contiguous too). A stacked weight has a leading layer
// axis on all three ([L, S, ...]) and the call multiplies by layer `layer` of it (an int32
// operand, so a layer scan passes its index instead of a slice, which XLA would copy). Every weight is
//   w = u * scale + offset,  offset = scale * offset_scale + zero
// (offset_scale: -128 for symmetric int8, -8 for symmetric int4, 0 with a zero point).
//
// Per group, with x_i ~ dx_b * xq_i in block b:  sum_i w_i x_i ~ scale * sum_b dx_b * (integer
// dot of u and xq over block b) + offset * sum_b dx_b * (sum of xq over block b): exactly the
// product of the weight with the quantized x (the offset term with the same x as the codes',
// so that the level shift in offset, 128 for int8, cancels instead of scaling x's rounding).
// Strips are shared among the caller and the XLA CPU client's intra-op threads when the weight
// is large enough (kParallelBytes).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "these kernels need AVX-512 with VNNI (BW, VNNI)"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kStrip = 64;  // output columns per strip: 4 vectors of 16 lanes
constexpr int kBlock = 32;  // inputs per activation scale
constexpr int kMaxRows = 4; // rows of x per pass over a strip (more: the strip again, from cache)
constexpr int kMaxDecodeRows = 64;  // more rows (a prompt chunk): the prompt tiles, in row blocks
constexpr int kTileRows = 6;        // rows of a prompt tile
constexpr int64_t kRowsPerTask = 48;  // rows of a prompt chunk's task (and of its quantization's)
constexpr int64_t kParallelBytes = 384 << 10;  // smaller weights: the caller's thread only
// int4 codes are prefetched this far ahead of the loads: the strips of one call are one sequence
// in memory, but the hardware's prefetch alone left the int4 loop waiting on them (SmolLM2's 210
// int4 matmuls of a token: 2.8 ms without, 2.2 ms with; int8, which computes less per byte, no
// faster with it).
constexpr int64_t kPrefetchBytes = 1024;

struct Problem {
  const int32_t* xq;      // [R, K / 4]: x quantized to int8, 4 inputs per int32
  const float* dx;        // [R, K / kBlock]: the scale of each block of xq
  const float* xsum;      // [R, G]: the sum of the quantized x over each group
  const uint8_t* w;       // packed codes, see above
  const uint16_t* scale;  // float16 [S, G, kStrip]
  const uint16_t* zero;   // float16 [S, G, kStrip] or nullptr
  float* y;               // [R, N]
  int64_t rows, k, n, groups, group;
  bool int4;
  float offset_scale;
};

inline __m512 HalfToFloat(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Rows [row0, row0 + kRows) of y at the columns of vectors [vec0, vec0 + kVectors) of a strip.
template <int kRows, int kVectors>
void StripPart(const Problem& p, int64_t strip, int64_t row0, int vec0) {
  const int64_t col = strip * kStrip + vec0 * 16;
  __mmask16 valid[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const int64_t left = std::clamp<int64_t>(p.n - col - v * 16, 0, 16);
    valid[v] = static_cast<__mmask16>((1u << left) - 1);
  }
  const int64_t quads = p.k / 4;  // 4-input steps per column
  const uint8_t* strip_codes = p.w + strip * (p.int4 ? quads / 2 : quads) * kStrip * 4;
  const int32_t* xq[kRows];
  const float* dx[kRows];
  for (int r = 0; r < kRows; ++r) {
    xq[r] = p.xq + (row0 + r) * quads;
    dx[r] = p.dx + (row0 + r) * (p.k / kBlock);
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows][kVectors];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();

  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 group_acc[kRows][kVectors];
    for (auto& row : group_acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t block = g * p.group / kBlock; block < (g + 1) * p.group / kBlock; ++block) {
      __m512i dots[kRows][kVectors];
      for (auto& row : dots)
        for (auto& d : row) d = _mm512_setzero_si512();
      const int64_t quad0 = block * (kBlock / 4);  // the block's first 4-input step
      if (p.int4) {
        for (int64_t pair = quad0 / 2; pair < (quad0 + kBlock / 4) / 2; ++pair) {
          const uint8_t* codes = strip_codes + (pair * kStrip + vec0 * 16) * 4;
          for (int v = 0; v < kVectors; ++v) {
            _mm_prefetch(reinterpret_cast<const char*>(codes + v * 64 + kPrefetchBytes), _MM_HINT_T0);
            const __m512i raw = _mm512_loadu_si512(codes + v * 64);
            const __m512i first = _mm512_and_si512(raw, low_nibbles);
            const __m512i second = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low_nibbles);
            for (int r = 0; r < kRows; ++r) {
              dots[r][v] = _mm512_dpbusd_epi32(dots[r][v], first, _mm512_set1_epi32(xq[r][2 * pair]));
              dots[r][v] = _mm512_dpbusd_epi32(dots[r][v], second, _mm512_set1_epi32(xq[r][2 * pair + 1]));
            }
          }
        }
      } else {
        for (int64_t quad = quad0; quad < quad0 + kBlock / 4; ++quad) {
          const uint8_t* codes = strip_codes + (quad * kStrip + vec0 * 16) * 4;
          for (int v = 0; v < kVectors; ++v) {
            const __m512i u = _mm512_loadu_si512(codes + v * 64);
            for (int r = 0; r < kRows; ++r)
              dots[r][v] = _mm512_dpbusd_epi32(dots[r][v], u, _mm512_set1_epi32(xq[r][quad]));
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const __m512 block_scale = _mm512_set1_ps(dx[r][block]);
        for (int v = 0; v < kVectors; ++v)
          group_acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][v]), block_scale, group_acc[r][v]);
      }
    }
    for (int v = 0; v < kVectors; ++v) {
      const int64_t at = (strip * p.groups + g) * kStrip + (vec0 + v) * 16;
      const __m512 scale = HalfToFloat(p.scale + at);
      __m512 offset = _mm512_mul_ps(scale, _mm512_set1_ps(p.offset_scale));
      if (p.zero != nullptr) offset = _mm512_add_ps(offset, HalfToFloat(p.zero + at));
      for (int r = 0; r < kRows; ++r) {
        const __m512 x_sum = _mm512_set1_ps(p.xsum[(row0 + r) * p.groups + g]);
        acc[r][v] = _mm512_fmadd_ps(group_acc[r][v], scale, _mm512_fmadd_ps(offset, x_sum, acc[r][v]));
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVectors; ++v)
      _mm512_mask_storeu_ps(p.y + (row0 + r) * p.n + col + v * 16, valid[v], acc[r][v]);
}

// The whole strip for kRows rows: as many vectors at a time as the registers hold.
template <int kRows>
void StripRows(const Problem& p, int64_t strip, int64_t row0) {
  constexpr int kVectors = kRows == 1 ? 4 : kRows == 2 ? 2 : 1;
  for (int vec0 = 0; vec0 < kStrip / 16; vec0 += kVectors) StripPart<kRows, kVectors>(p, strip, row0, vec0);
}

// Rows [row0, row_end) of a strip: kMaxRows at a time (a decode step's few rows), the rest one
// to three.
void Strip(const Problem& p, int64_t strip, int64_t row0, int64_t row_end) {
  int64_t row = row0;
  for (; row + kMaxRows <= row_end; row += kMaxRows) StripRows<kMaxRows>(p, strip, row);
  switch (row_end - row) {
    case 1: StripRows<1>(p, strip, row); break;
    case 2: StripRows<2>(p, strip, row); break;
    case 3: StripRows<3>(p, strip, row); break;
    default: break;
  }
}

// A prompt chunk's rows [row0, row_end) of a strip: kTileRows at a time over half the strip's
// columns (a 6 x 32 tile: 12 integer and 12 float accumulators, each weight load used by 6 rows
// and each broadcast of x by 2 vectors), where the decode tiles above reload the weights for
// every 4 rows.
void PromptStrip(const Problem& p, int64_t strip, int64_t row0, int64_t row_end) {
  int64_t row = row0;
  for (; row + kTileRows <= row_end; row += kTileRows)
    for (int vec0 = 0; vec0 < kStrip / 16; vec0 += 2) StripPart<kTileRows, 2>(p, strip, row, vec0);
  Strip(p, strip, row, row_end);
}

// Quantizes rows [row0, row_end) of x to int8 per block of kBlock inputs (symmetric, rounded to
// nearest even as std::nearbyint): the codes, each block's scale and each group's sum of
// scale * codes.
void QuantizeRows(const float* x, int64_t k, int64_t groups, int64_t row0, int64_t row_end, int8_t* xq,
                  float* dx, float* xsum) {
  const int64_t blocks = k / kBlock, blocks_per_group = blocks / groups;
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = row0; r < row_end; ++r) {
    std::fill(xsum + r * groups, xsum + (r + 1) * groups, 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + r * k + b * kBlock;
      const __m512 lo = _mm512_loadu_ps(in), hi = _mm512_loadu_ps(in + 16);
      const float top = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_and_ps(lo, sign_off), _mm512_and_ps(hi, sign_off)));
      const float step = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
      const __m512 scale = _mm512_set1_ps(inverse);
      const __m512i lo_codes = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));
      const __m512i hi_codes = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + b * kBlock), _mm512_cvtepi32_epi8(lo_codes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + b * kBlock + 16), _mm512_cvtepi32_epi8(hi_codes));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo_codes, hi_codes));
      dx[r * blocks + b] = step;
      xsum[r * groups + b / blocks_per_group] += step * static_cast<float>(sum);
    }
  }
}

// One weight of a call, checked against x's [rows, k]: its codes, scales and zeros at layer
// `index` of their stack, and its result y [rows, n], into p's weight fields.
ffi::Error SetWeight(Problem& p, int64_t rows, int64_t k, int64_t index, ffi::Buffer<ffi::U8> packed,
                     ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero, ffi::Result<ffi::Buffer<ffi::F32>> y,
                     int64_t bits, int64_t has_zero, float offset_scale) {
  const auto sd = scale.dimensions(), yd = y->dimensions();
  if ((sd.size() != 3 && sd.size() != 4) || yd.size() != 2)
    return ffi::Error::InvalidArgument("quantized_matmul: y must be 2-D, scale 3-D (4-D stacked)");
  // A stacked weight ([L, ...] codes, scales and zeros): the layer's slice, read in place.
  const int64_t layers = sd.size() == 4 ? sd[0] : 1, at = sd.size() - 3;
  const int64_t strips = sd[at], groups = sd[at + 1], n = yd[1];
  const int64_t layer_codes = strips * kStrip * (bits == 4 ? k / 2 : k), layer_scales = strips * groups * kStrip;
  if ((bits != 8 && bits != 4) || groups <= 0 || k % groups != 0 || (k / groups) % kBlock != 0 ||
      sd[at + 2] != kStrip || strips != (n + kStrip - 1) / kStrip || yd[0] != rows ||
      (has_zero && zero.element_count() != scale.element_count()) || packed.element_count() != layers * layer_codes)
    return ffi::Error::InvalidArgument("quantized_matmul: inconsistent shapes");
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("quantized_matmul: layer index outside the stacked weight");
  p.w = packed.typed_data() + index * layer_codes;
  p.scale = reinterpret_cast<const uint16_t*>(scale.typed_data()) + index * layer_scales;
  p.zero = has_zero ? reinterpret_cast<const uint16_t*>(zero.typed_data()) + index * layer_scales : nullptr;
  p.y = y->typed_data();
  p.rows = rows;
  p.k = k;
  p.n = n;
  p.groups = groups;
  p.group = k / groups;
  p.int4 = bits == 4;
  p.offset_scale = offset_scale;
  return ffi::Error::Success();
}

// y_i = x @ w_i for the weights `problems` (SetWeight's, one groups count): x quantized once,
// then the strips of all the weights shared among the threads as one list of tasks.
ffi::Error Multiply(ffi::ThreadPool pool, const float* x, std::vector<Problem>& problems) {
  const int64_t rows = problems[0].rows, k = problems[0].k, groups = problems[0].groups;
  int64_t strips = 0, codes = 0;
  std::vector<int64_t> first_strip;  // problems[i]'s strips are [first_strip[i], first_strip[i + 1])
  for (const Problem& p : problems) {
    if (p.groups != groups)
      return ffi::Error::InvalidArgument("quantized_matmul: the weights of one call need one groups count");
    first_strip.push_back(strips);
    strips += (p.n + kStrip - 1) / kStrip;
    codes += (p.n + kStrip - 1) / kStrip * kStrip * (p.int4 ? k / 2 : k);
  }
  first_strip.push_back(strips);

  // The rows of x in int8 per block of kBlock inputs, and their sums per group; a prompt
  // chunk's rows on all the threads.
  const int64_t blocks = k / kBlock;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> dx(rows * blocks), xsum(rows * groups);
  const int64_t row_blocks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t quantize_threads = rows > kMaxDecodeRows ? pool.num_threads() : 1;
  jaxserve::ParallelFor(pool, quantize_threads, row_blocks, [&](int64_t block) {
    QuantizeRows(x, k, groups, block * kRowsPerTask, std::min(rows, (block + 1) * kRowsPerTask), xq.data(),
                 dx.data(), xsum.data());
  });
  for (Problem& p : problems) {
    p.xq = reinterpret_cast<const int32_t*>(xq.data());
    p.dx = dx.data();
    p.xsum = xsum.data();
  }
  // Strip s of the call: which weight's, and which of its strips.
  const auto locate = [&](int64_t s) {
    const int64_t i = std::upper_bound(first_strip.begin(), first_strip.end(), s) - first_strip.begin() - 1;
    return std::pair<const Problem&, int64_t>(problems[i], s - first_strip[i]);
  };

  // Another thread of XLA's pool only for weights large enough to repay waking it (a small one
  // runs faster on the caller alone: SmolLM2 576 x 576 int8: 12.8 us alone, 21.6 us with a second
  // thread). A decode step's rows: one task per strip; a prompt chunk's: per strip and block of
  // kRowsPerTask rows, in prompt tiles.
  const int64_t threads = codes >= kParallelBytes || rows > kMaxDecodeRows ? pool.num_threads() : 1;
  if (rows <= kMaxDecodeRows) {
    jaxserve::ParallelFor(pool, threads, strips, [&](int64_t s) {
      const auto [p, strip] = locate(s);
      Strip(p, strip, 0, p.rows);
    });
  } else {
    jaxserve::ParallelFor(pool, threads, strips * row_blocks, [&](int64_t task) {
      const auto [p, strip] = locate(task / row_blocks);
      const int64_t row0 = task % row_blocks * kRowsPerTask;
      PromptStrip(p, strip, row0, std::min(p.rows, row0 + kRowsPerTask));
    });
  }
  return ffi::Error::Success();
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> packed,
                           ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> zero, ffi::Buffer<ffi::S32> layer,
                           ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bits, int64_t has_zero,
                           float offset_scale) {
  if (x.dimensions().size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("quantized_matmul: x must be 2-D, layer one index");
  std::vector<Problem> problems(1);
  const ffi::Error set = SetWeight(problems[0], x.dimensions()[0], x.dimensions()[1], layer.typed_data()[0], packed,
                                   scale, zero, y, bits, has_zero, offset_scale);
  if (set.failure()) return set;
  return Multiply(pool, x.typed_data(), problems);
}

// Several weights over one x (a layer's q, k and v projections): x, layer, then each weight's
// codes, scales and zeros; each weight's y. One format (bits, has_zero, offset_scale) for all.
ffi::Error QuantizedMatmulGroup(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                                ffi::RemainingArgs weights, ffi::RemainingRets ys, int64_t bits, int64_t has_zero,
                                float offset_scale) {
  if (x.dimensions().size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("quantized_matmul: x must be 2-D, layer one index");
  if (ys.size() == 0 || weights.size() != 3 * ys.size())
    return ffi::Error::InvalidArgument("quantized_matmul: a group takes codes, scales and zeros for each result");
  std::vector<Problem> problems(ys.size());
  for (size_t i = 0; i < ys.size(); ++i) {
    const auto packed = weights.get<ffi::Buffer<ffi::U8>>(3 * i);
    const auto scale = weights.get<ffi::Buffer<ffi::F16>>(3 * i + 1);
    const auto zero = weights.get<ffi::Buffer<ffi::F16>>(3 * i + 2);
    const auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (packed.has_error() || scale.has_error() || zero.has_error() || y.has_error())
      return ffi::Error::InvalidArgument("quantized_matmul: a group's operands are uint8 codes, float16 scales and zeros, float32 results");
    const ffi::Error set = SetWeight(problems[i], x.dimensions()[0], x.dimensions()[1], layer.typed_data()[0],
                                     *packed, *scale, *zero, *y, bits, has_zero, offset_scale);
    if (set.failure()) return set;
  }
  return Multiply(pool, x.typed_data(), problems);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("has_zero")
                                  .Attr<float>("offset_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmulGroup, QuantizedMatmulGroup,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("has_zero")
                                  .Attr<float>("offset_scale"));
