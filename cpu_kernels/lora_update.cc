// The multi-LoRA update on the CPU, each row through its own adapter only (the segmented form of
// Punica's BGMV): the same inputs and result as pallas_kernels.reference.lora_update for float32,
//   x       float32 [T, K]
//   a       float32 [L, S, K, R] (or [S, K, R]: one layer)   slot 0 the zero adapter
//   b       float32 [L, S, R, N] (or [S, R, N])
//   slots   int32 [T]: each row's slot in [0, S); a row on slot 0 gets zeros and costs nothing
//   layer   int32 [1]: the layer of a stacked a and b, read in place (0 for unstacked ones)
//   y       float32 [T, N] = (x[t] @ a[layer, slots[t]]) @ b[layer, slots[t]]
//
// The rows are grouped by slot (a counting sort), then two passes over the slots that hold rows:
//   shrink  h[t] = x[t] @ A[slot] for the rows of a slot, up to kShrinkRows rows per pass over A
//           (each 16-column vector of a row of A loaded once for all of them), one task per slot;
//   expand  y[t] = h[t] @ B[slot], a task per range of output strips (kStrip columns) over every
//           slot, up to kExpandRows rows per pass over a strip of B.
// Each row's sums run in one fixed order (over K, then over R), so a result does not depend on
// the other rows, on the slots' order or on the thread count. The XLA one-hot form instead
// multiplies every row by every slot's A and B; this reads each used slot's matrices once and
// does a slot's FLOPs for its own rows only. Tasks are shared among the caller and the XLA CPU
// client's intra-op threads when the matrices read are large enough (kParallelBytes).
//
// No instruction set beyond AVX-512F (the library's other kernels need VNNI: the same build).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int kStrip = 64;        // output columns per expand strip: 4 vectors
constexpr int kShrinkRows = 8;    // rows per pass over a slot's A
constexpr int kExpandRows = 4;    // rows per pass over a strip of B (16 accumulators)
// A and B are prefetched this far ahead of their loads (A 4 KiB, B a row's next 4 strips): the
// slab is read from memory, not cache, and the hardware's prefetch alone left the loads waiting
// (SmolLM2's seven projections of a layer, 4 slots, a slab 10x the last-level cache: 320-360 us
// without, 255 us with).
constexpr int64_t kPrefetchFloats = 1024;
constexpr int64_t kPrefetchStrips = 4;
constexpr int kTasksPerThread = 4;  // expand tasks per thread: a little slack for an uneven share
// Smaller reads of A and B: the caller's thread only. The update reads each used slot's matrices
// once, at memory speed: a second thread saved little on an idle machine and cost more on a busy
// one (SmolLM2's 30 layers, 4 slots of rank 16, 32 rows, at most 540 KiB a call: single-threaded
// calls took 10% longer alone, but a decode step with two threads 8% longer under other processes'
// load, its minimum 1.30x the base step's instead of 1.18x). Prefill-sized calls, compute-bound,
// gained nothing from the second thread on the busy machine either (a layer's seven updates of
// 256-2048 rows, 4 slots: 1.1-9 ms single-threaded, the same with two; XLA's one-hot form 3-21 ms).
constexpr int64_t kParallelBytes = int64_t(1) << 20;

inline __mmask16 Lanes(int64_t count) {
  return static_cast<__mmask16>(count >= kLanes ? 0xFFFF : (1u << std::max<int64_t>(count, 0)) - 1);
}

struct Problem {
  const float* x;        // [T, K]
  const float* a;        // this layer's [S, K, R]
  const float* b;        // this layer's [S, R, N]
  float* y;              // [T, N]
  int64_t k, r, n, r_padded;
  std::vector<int32_t> order;   // rows sorted by slot (stable)
  std::vector<int64_t> begin;   // [S + 1]: slot s's rows are order[begin[s], begin[s + 1])
  std::vector<int32_t> used;    // the slots other than 0 that hold rows
  std::vector<float> h;         // [T, r_padded]: the shrunk rows, at their place in `order`

  // h of rows order[first, first + kRows), all on slot `slot`: a pass over A[slot] per 16 columns.
  template <int kRows>
  void ShrinkRows(int64_t slot, int64_t first) {
    const float* a_s = a + slot * k * r;
    const float* xr[kRows];
    for (int i = 0; i < kRows; ++i) xr[i] = x + order[first + i] * k;
    for (int64_t c = 0; c < r; c += kLanes) {
      const __mmask16 m = Lanes(r - c);
      __m512 acc[kRows];
      for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t kk = 0; kk < k; ++kk) {
        _mm_prefetch(reinterpret_cast<const char*>(a_s + kk * r + c + kPrefetchFloats), _MM_HINT_T0);
        const __m512 av = _mm512_maskz_loadu_ps(m, a_s + kk * r + c);
        for (int i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i][kk]), av, acc[i]);
      }
      for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(&h[(first + i) * r_padded + c], acc[i]);
    }
  }

  void Shrink(int64_t slot) {
    int64_t row = begin[slot];
    const int64_t end = begin[slot + 1];
    for (; row + kShrinkRows <= end; row += kShrinkRows) ShrinkRows<kShrinkRows>(slot, row);
    switch (end - row) {
      case 1: ShrinkRows<1>(slot, row); break;
      case 2: ShrinkRows<2>(slot, row); break;
      case 3: ShrinkRows<3>(slot, row); break;
      case 4: ShrinkRows<4>(slot, row); break;
      case 5: ShrinkRows<5>(slot, row); break;
      case 6: ShrinkRows<6>(slot, row); break;
      case 7: ShrinkRows<7>(slot, row); break;
      default: break;
    }
  }

  // y of rows order[first, first + kRows) (slot `slot`) at the columns of strip `strip`.
  template <int kRows>
  void ExpandRows(int64_t slot, int64_t strip, int64_t first) {
    constexpr int kVectors = kStrip / kLanes;
    const int64_t col = strip * kStrip;
    const float* b_s = b + slot * r * n + col;
    __mmask16 m[kVectors];
    for (int j = 0; j < kVectors; ++j) m[j] = Lanes(n - col - j * kLanes);
    __m512 acc[kRows][kVectors];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kVectors; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t rr = 0; rr < r; ++rr) {
      for (int j = 0; j < kVectors; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(b_s + rr * n + kPrefetchStrips * kStrip + j * kLanes), _MM_HINT_T0);
      __m512 bv[kVectors];
      for (int j = 0; j < kVectors; ++j) bv[j] = _mm512_maskz_loadu_ps(m[j], b_s + rr * n + j * kLanes);
      for (int i = 0; i < kRows; ++i) {
        const __m512 hv = _mm512_set1_ps(h[(first + i) * r_padded + rr]);
        for (int j = 0; j < kVectors; ++j) acc[i][j] = _mm512_fmadd_ps(hv, bv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < kRows; ++i) {
      float* out = y + order[first + i] * n + col;
      for (int j = 0; j < kVectors; ++j) _mm512_mask_storeu_ps(out + j * kLanes, m[j], acc[i][j]);
    }
  }

  void Expand(int64_t slot, int64_t strip) {
    int64_t row = begin[slot];
    const int64_t end = begin[slot + 1];
    for (; row + kExpandRows <= end; row += kExpandRows) ExpandRows<kExpandRows>(slot, strip, row);
    switch (end - row) {
      case 1: ExpandRows<1>(slot, strip, row); break;
      case 2: ExpandRows<2>(slot, strip, row); break;
      case 3: ExpandRows<3>(slot, strip, row); break;
      default: break;
    }
  }
};

ffi::Error LoraUpdate(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                      ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> layer,
                      ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || (ad.size() != 3 && ad.size() != 4) || bd.size() != ad.size() ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument("lora_update: x and y must be 2-D, a and b 3-D (4-D stacked), layer one index");
  const int64_t at = ad.size() - 3, layers = ad.size() == 4 ? ad[0] : 1;
  const int64_t rows = xd[0], num_slots = ad[at], k = ad[at + 1], r = ad[at + 2], n = bd[at + 2];
  if (ad[at + 1] != xd[1] || bd[at] != num_slots || bd[at + 1] != r || (at == 1 && bd[0] != layers) ||
      yd[0] != rows || yd[1] != n || slots.element_count() != rows || num_slots < 1)
    return ffi::Error::InvalidArgument("lora_update: inconsistent shapes");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("lora_update: layer index outside the stacked slab");

  Problem p;
  p.x = x.typed_data();
  p.a = a.typed_data() + index * num_slots * k * r;
  p.b = b.typed_data() + index * num_slots * r * n;
  p.y = y->typed_data();
  p.k = k;
  p.r = r;
  p.n = n;
  p.r_padded = (r + kLanes - 1) / kLanes * kLanes;
  // The rows grouped by slot.
  const int32_t* slot_of = slots.typed_data();
  std::vector<int64_t> count(num_slots, 0);
  for (int64_t t = 0; t < rows; ++t) {
    if (slot_of[t] < 0 || slot_of[t] >= num_slots)
      return ffi::Error::InvalidArgument("lora_update: a row's slot is outside the slab");
    ++count[slot_of[t]];
  }
  p.begin.assign(num_slots + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s) p.begin[s + 1] = p.begin[s] + count[s];
  p.order.resize(rows);
  std::vector<int64_t> next(p.begin.begin(), p.begin.end() - 1);
  for (int64_t t = 0; t < rows; ++t) p.order[next[slot_of[t]]++] = static_cast<int32_t>(t);
  for (int64_t s = 1; s < num_slots; ++s)
    if (count[s] > 0) p.used.push_back(static_cast<int32_t>(s));
  // Rows on slot 0 (and every row when no adapter is used): zeros.
  for (int64_t i = p.begin[0]; i < p.begin[1]; ++i) std::fill_n(p.y + p.order[i] * n, n, 0.f);
  if (p.used.empty()) return ffi::Error::Success();
  p.h.resize(rows * p.r_padded);

  const int64_t bytes = static_cast<int64_t>(p.used.size()) * r * (k + n) * sizeof(float);
  const int64_t threads = bytes >= kParallelBytes ? pool.num_threads() : 1;
  const int64_t used = p.used.size();
  jaxserve::ParallelFor(pool, threads, used, [&p](int64_t i) { p.Shrink(p.used[i]); });
  const int64_t strips = (n + kStrip - 1) / kStrip;
  const int64_t tasks = std::min(strips, std::max<int64_t>(1, threads * kTasksPerThread));
  jaxserve::ParallelFor(pool, threads, tasks, [&p, strips, tasks](int64_t task) {
    const int64_t first = task * strips / tasks, last = (task + 1) * strips / tasks;
    for (const int32_t slot : p.used)
      for (int64_t strip = first; strip < last; ++strip) p.Expand(slot, strip);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLoraUpdate, LoraUpdate,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
