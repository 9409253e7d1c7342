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
// products with the chunk's keys in runs of up to 16 keys of a page, an online softmax (running
// max, sum, rescaled output) with the run's weights in one vector exp, every key and value read
// once for all the query heads the registers hold, straight from its page, the next run's
// prefetched meanwhile (without it the loads' waits were half the time: SmolLM2's 30 layers at a
// ~500-token context, 1.2 ms instead of 0.6). The chunks of a sequence are merged in order
// afterwards, so a result does not depend on the thread count or on the other rows. Tasks are
// shared among the caller and the XLA CPU client's intra-op threads.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunkTokens = 128;  // keys per task
constexpr int kLanes = 16;
constexpr int kMaxVectors = 16;  // head_dim up to 256
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline __mmask16 Tail(int64_t count) { return static_cast<__mmask16>((1u << count) - 1); }

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

// exp of 16 floats <= 0 (-inf included), within about an ulp of std::exp: 2^n e^r with
// |r| <= ln 2 / 2 and e^r by Cephes' expf polynomial (below e^-104: 0 or a denormal).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
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

  // One task, for a head_dim of kVectors vectors (the last one `dim - 16 (kVectors - 1)` lanes).
  // Its query heads go kHeads at a time (as many as the registers hold), each key and
  // value read once for them: over runs of up to 16 keys of a page, the scores, then the softmax
  // weights in one vector exp, then the weighted values added to the heads' sums in registers.
  template <int kVectors>
  void Task(int64_t task) {
    constexpr int kHeads = std::max(1, 12 / kVectors);  // queries and sums in 24 of the 32 registers
    const int64_t chunk = task % chunks, head = (task / chunks) % kv_heads, s = task / (chunks * kv_heads);
    const int64_t g = group();
    int64_t first, last;
    Keys(s, &first, &last);
    first = std::max(first, chunk * kChunkTokens);
    last = std::min(last, (chunk + 1) * kChunkTokens);
    const __mmask16 tail = Tail(dim - kLanes * (kVectors - 1));
    auto lanes = [tail](int j) -> __mmask16 { return j + 1 < kVectors ? 0xFFFF : tail; };
    const int64_t token_stride = kv_heads * dim;
    const __m512 scale_v = _mm512_set1_ps(scale);
    // The run of keys from `start`: up to 16 of one page, within [first, last) (count 0: none).
    struct Run {
      int count = 0;
      const float *keys = nullptr, *values = nullptr;
    };
    auto run_at = [&](int64_t start) {
      Run run;
      if (start >= last) return run;
      const int64_t page = block_table[s * table_width + start / page_size], offset = start % page_size;
      run.count = static_cast<int>(std::min<int64_t>({page_size - offset, last - start, kLanes}));
      run.keys = k + ((page * page_size + offset) * kv_heads + head) * dim;
      run.values = v + ((page * page_size + offset) * kv_heads + head) * dim;
      return run;
    };
    for (int64_t h0 = 0; h0 < g; h0 += kHeads) {
      const int heads = static_cast<int>(std::min<int64_t>(kHeads, g - h0));
      __m512 qv[kHeads][kVectors], ov[kHeads][kVectors];
      float run_max[kHeads], run_sum[kHeads];
      for (int h = 0; h < kHeads; ++h) {
        const float* query = q + (s * q_heads + head * g + h0 + std::min(h, heads - 1)) * dim;
        for (int j = 0; j < kVectors; ++j) {
          qv[h][j] = _mm512_mul_ps(scale_v, _mm512_maskz_loadu_ps(lanes(j), query + j * kLanes));
          ov[h][j] = _mm512_setzero_ps();
        }
        run_max[h] = kNegInf;
        run_sum[h] = 0.f;
      }
      int64_t start = first;
      for (Run run = run_at(start); run.count > 0;) {
        const int count = run.count;
        const float *keys = run.keys, *values = run.values;
        start += count;
        const Run next = run_at(start);  // its keys and values on their way into the cache meanwhile
        alignas(64) float scores[kHeads][kLanes];
        for (int t = 0; t < count; ++t) {
          if (t < next.count)
            for (int64_t line = 0; line < dim; line += kLanes) {
              _mm_prefetch(reinterpret_cast<const char*>(next.keys + t * token_stride + line), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(next.values + t * token_stride + line), _MM_HINT_T0);
            }
          __m512 key[kVectors];
          for (int j = 0; j < kVectors; ++j) key[j] = _mm512_maskz_loadu_ps(lanes(j), keys + t * token_stride + j * kLanes);
          for (int h = 0; h < kHeads; ++h) {
            if (h >= heads) break;
            __m512 dot = _mm512_mul_ps(qv[h][0], key[0]);
            for (int j = 1; j < kVectors; ++j) dot = _mm512_fmadd_ps(qv[h][j], key[j], dot);
            scores[h][t] = _mm512_reduce_add_ps(dot);
          }
        }
        const __mmask16 keys_in = Tail(count);
        for (int h = 0; h < kHeads; ++h) {
          if (h >= heads) break;
          if (soft_cap > 0.f)
            for (int t = 0; t < count; ++t) scores[h][t] = soft_cap * std::tanh(scores[h][t] / soft_cap);
          const __m512 score_v = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), keys_in, scores[h]);
          const float new_max = std::max(run_max[h], _mm512_reduce_max_ps(score_v));
          const float keep = run_max[h] == kNegInf ? 0.f : std::exp(run_max[h] - new_max);
          const __m512 weights = _mm512_maskz_mov_ps(keys_in, Exp(_mm512_sub_ps(score_v, _mm512_set1_ps(new_max))));
          run_sum[h] = run_sum[h] * keep + _mm512_reduce_add_ps(weights);
          run_max[h] = new_max;
          _mm512_store_ps(scores[h], weights);
          const __m512 keep_v = _mm512_set1_ps(keep);
          for (int j = 0; j < kVectors; ++j) ov[h][j] = _mm512_mul_ps(ov[h][j], keep_v);
        }
        for (int t = 0; t < count; ++t) {
          __m512 value[kVectors];
          for (int j = 0; j < kVectors; ++j) value[j] = _mm512_maskz_loadu_ps(lanes(j), values + t * token_stride + j * kLanes);
          for (int h = 0; h < kHeads; ++h) {
            if (h >= heads) break;
            const __m512 weight = _mm512_set1_ps(scores[h][t]);
            for (int j = 0; j < kVectors; ++j) ov[h][j] = _mm512_fmadd_ps(weight, value[j], ov[h][j]);
          }
        }
        run = next;
      }
      for (int h = 0; h < heads; ++h) {
        const int64_t at = task * g + h0 + h;
        max[at] = run_max[h];
        sum[at] = run_sum[h];
        for (int j = 0; j < kVectors; ++j) _mm512_mask_storeu_ps(&acc[at * dim + j * kLanes], lanes(j), ov[h][j]);
      }
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

template <int kVectors>
void RunTasks(ffi::ThreadPool& pool, Problem& p, int64_t tasks) {
  jaxserve::ParallelFor(pool, pool.num_threads(), tasks, [&p](int64_t t) { p.Task<kVectors>(t); });
}

using Runner = void (*)(ffi::ThreadPool&, Problem&, int64_t);

template <int... kIndex>
constexpr std::array<Runner, sizeof...(kIndex)> Runners(std::integer_sequence<int, kIndex...>) {
  return {&RunTasks<kIndex + 1>...};
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                                ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_table,
                                ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> window,
                                ffi::Result<ffi::Buffer<ffi::F32>> out, float scale, float soft_cap) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || k_pages.element_count() != v_pages.element_count() ||
      td[0] != qd[0] || seq_lens.element_count() != qd[0] || kd[3] != qd[2] || qd[1] % kd[2] != 0 ||
      window.element_count() != 1)
    return ffi::Error::InvalidArgument("paged_decode_attention: inconsistent shapes");
  if (qd[2] < 1 || qd[2] > kLanes * kMaxVectors)
    return ffi::Error::InvalidArgument("paged_decode_attention: head_dim must be 1 to 256");
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
  static constexpr auto runners = Runners(std::make_integer_sequence<int, kMaxVectors>());
  runners[(p.dim + kLanes - 1) / kLanes - 1](pool, p, tasks);
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
