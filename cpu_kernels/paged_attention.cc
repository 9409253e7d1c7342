// Decode attention over the paged KV cache on the CPU: one query token per sequence, its K/V
// already written. Same inputs and results as pallas_kernels.xla_paged.paged_decode_attention
// for float32 caches:
//   q            float32 [S, Hq, D]
//   k, v pages   float32 [P, page_size, Hkv, D]
//   block_table  int32 [S, W]: the pages of each sequence, in order
//   seq_lens     int32 [S]: 0 for a padding row (its output is zeros)
//   window       int32 [1]: sliding window (<= 0: none); the query at seq_len - 1 sees keys from
//                max(0, seq_len - window) on
//   scale, soft_cap (attributes): scores = soft_cap * tanh(scale * q.k / soft_cap), or
//                scale * q.k with soft_cap 0
//   out          float32 [S, Hq, D]
// Query heads h read KV head h / (Hq / Hkv).
//
// Work: each (sequence, KV head, chunk of kChunkTokens keys) is one task: its query heads' dot
// products with the chunk's keys page by page, an online softmax (running max, sum, rescaled
// output), every key and value read once, straight from its page. The chunks of a sequence are
// merged in order afterwards, so a result does not depend on the thread count or on the other
// rows. Tasks are shared among the caller and the XLA CPU client's intra-op threads.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunkTokens = 128;  // keys per task
constexpr int kLanes = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __mmask16 Tail(int64_t count) { return static_cast<__mmask16>((1u << count) - 1); }

// a . b over d floats.
inline float Dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < d) {
    const __mmask16 m = Tail(d - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y = y * keep + weight * x over d floats.
inline void ScaleAdd(float keep, float weight, const float* x, float* y, int64_t d) {
  const __m512 k = _mm512_set1_ps(keep), w = _mm512_set1_ps(weight);
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(w, _mm512_loadu_ps(x + i), _mm512_mul_ps(k, _mm512_loadu_ps(y + i))));
  if (i < d) {
    const __mmask16 m = Tail(d - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x + i),
                                                    _mm512_mul_ps(k, _mm512_maskz_loadu_ps(m, y + i))));
  }
}

struct Problem {
  const float *q, *k, *v;
  const int32_t *block_table, *seq_lens;
  float* out;
  int64_t seqs, q_heads, kv_heads, dim, page_size, table_width, chunks;
  int32_t window;
  float scale, soft_cap;
  // Per task (sequence, KV head, chunk): for each of its query heads the running max, the sum of
  // the softmax weights and the weighted sum of values [dim].
  std::vector<float> max, sum, acc;

  int64_t group() const { return q_heads / kv_heads; }
  // The keys [first, last) the query of sequence s attends to.
  void Keys(int64_t s, int64_t* first, int64_t* last) const {
    const int64_t len = seq_lens[s];
    *last = len;
    *first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  }

  void Task(int64_t task) {
    const int64_t chunk = task % chunks, head = (task / chunks) % kv_heads, s = task / (chunks * kv_heads);
    const int64_t g = group();
    float* m = &max[task * g];
    float* l = &sum[task * g];
    float* o = &acc[task * g * dim];
    std::fill(m, m + g, kNegInf);
    std::fill(l, l + g, 0.f);
    std::fill(o, o + g * dim, 0.f);
    int64_t first, last;
    Keys(s, &first, &last);
    first = std::max(first, chunk * kChunkTokens);
    last = std::min(last, (chunk + 1) * kChunkTokens);
    const float* queries = q + (s * q_heads + head * g) * dim;
    const int64_t token_stride = kv_heads * dim;
    std::vector<float> scores(g * page_size);
    for (int64_t start = first; start < last;) {  // one page (or the part of it in [first, last))
      const int64_t page = block_table[s * table_width + start / page_size];
      const int64_t offset = start % page_size, count = std::min(page_size - offset, last - start);
      const float* keys = k + ((page * page_size + offset) * kv_heads + head) * dim;
      const float* values = v + ((page * page_size + offset) * kv_heads + head) * dim;
      for (int64_t h = 0; h < g; ++h) {
        float page_max = kNegInf;
        for (int64_t t = 0; t < count; ++t) {
          float score = scale * Dot(queries + h * dim, keys + t * token_stride, dim);
          if (soft_cap > 0.f) score = soft_cap * std::tanh(score / soft_cap);
          scores[h * page_size + t] = score;
          page_max = std::max(page_max, score);
        }
        const float new_max = std::max(m[h], page_max);
        const float keep = m[h] == kNegInf ? 0.f : std::exp(m[h] - new_max);
        float* out_h = o + h * dim;
        l[h] *= keep;
        for (int64_t t = 0; t < count; ++t) {
          const float weight = std::exp(scores[h * page_size + t] - new_max);
          l[h] += weight;
          ScaleAdd(t == 0 ? keep : 1.f, weight, values + t * token_stride, out_h, dim);
        }
        m[h] = new_max;
      }
      start += count;
    }
  }

  // out for sequence s and KV head `head`: its chunks merged in order.
  void Merge(int64_t s, int64_t head) {
    const int64_t g = group();
    for (int64_t h = 0; h < g; ++h) {
      float* out_h = out + (s * q_heads + head * g + h) * dim;
      std::fill(out_h, out_h + dim, 0.f);
      float top = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, max[((s * kv_heads + head) * chunks + c) * g + h]);
      if (top == kNegInf) continue;  // no key: a padding row
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t task = (s * kv_heads + head) * chunks + c;
        if (max[task * g + h] == kNegInf) continue;
        const float weight = std::exp(max[task * g + h] - top);
        total += weight * sum[task * g + h];
        ScaleAdd(1.f, weight, &acc[(task * g + h) * dim], out_h, dim);
      }
      ScaleAdd(1.f / total, 0.f, out_h, out_h, dim);
    }
  }
};

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                                ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_table,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> window,
                                ffi::Result<ffi::Buffer<ffi::F32>> out, float scale, float soft_cap) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || k_pages.element_count() != v_pages.element_count() ||
      td[0] != qd[0] || seq_lens.element_count() != qd[0] || kd[3] != qd[2] || qd[1] % kd[2] != 0 ||
      window.element_count() != 1)
    return ffi::Error::InvalidArgument("paged_decode_attention: inconsistent shapes");
  Problem p;
  p.q = q.typed_data();
  p.k = k_pages.typed_data();
  p.v = v_pages.typed_data();
  p.block_table = block_table.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.out = out->typed_data();
  p.seqs = qd[0];
  p.q_heads = qd[1];
  p.dim = qd[2];
  p.page_size = kd[1];
  p.kv_heads = kd[2];
  p.table_width = td[1];
  p.window = window.typed_data()[0];
  p.scale = scale;
  p.soft_cap = soft_cap;
  int64_t longest = 0;
  for (int64_t s = 0; s < p.seqs; ++s) {
    const int64_t len = p.seq_lens[s];
    if (len < 0 || len > p.table_width * p.page_size)
      return ffi::Error::InvalidArgument("paged_decode_attention: a sequence length exceeds its block table");
    for (int64_t i = 0; i * p.page_size < len; ++i) {  // the pages read: no read outside the cache
      const int64_t page = p.block_table[s * p.table_width + i];
      if (page < 0 || page >= kd[0])
        return ffi::Error::InvalidArgument("paged_decode_attention: a block table names a page outside the cache");
    }
    longest = std::max(longest, len);
  }
  p.chunks = std::max<int64_t>(1, (longest + kChunkTokens - 1) / kChunkTokens);
  const int64_t tasks = p.seqs * p.kv_heads * p.chunks;
  p.max.resize(tasks * p.group());
  p.sum.resize(tasks * p.group());
  p.acc.resize(tasks * p.group() * p.dim);
  jaxserve::ParallelFor(pool, pool.num_threads(), tasks, [&p](int64_t t) { p.Task(t); });
  for (int64_t s = 0; s < p.seqs; ++s)
    for (int64_t head = 0; head < p.kv_heads; ++head) p.Merge(s, head);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap"));
