// Causal attention of a ragged batch of prompt-chunk queries over the paged KV cache on the CPU,
// the chunk's own K/V already written. Same inputs and results as
// pallas_kernels.xla_paged.ragged_paged_attention for float32 caches:
//   q                float32 [T, Hq, D]
//   k, v pages       float32 [P, page_size, Hkv, D]
//   block_table      int32 [S, W]: the pages of each sequence, in order
//   seq_lens         int32 [S]: 0 for a padding row (its queries give zeros)
//   query_start_loc  int32 [S + 1], non-decreasing: sequence i's queries are the tokens
//                    [query_start_loc[i], query_start_loc[i + 1]), the last of its seq_len
//                    tokens (query j at position seq_len - query_len + j)
//   window           int32 [1]: sliding window (<= 0: none); a query at position p sees the keys
//                    at k with p - window < k <= p
//   key_limit        int32 [T] (JaxserveRaggedPrefillAttentionKeyLimit only): the highest key
//                    position each query sees, for bidirectional attention among an image's
//                    tokens: a query at p sees the keys k <= max(p, key_limit) below its seq_len
//                    (the window's rule on p - k unchanged); the plain handler is causal
//   scale, soft_cap (attributes): scores = soft_cap * tanh(scale * q.k / soft_cap), or
//                    scale * q.k with soft_cap 0
//   out              float32 [T, Hq, D]; tokens of no sequence (past query_start_loc[S]) zeros
// Query heads h read KV head h / (Hq / Hkv).
//
// Work: each (sequence, KV head, block of kQueryBlock queries) is one task; its rows are the
// block's queries times the group's query heads (query-major), padded to vectors of 16 rows. The queries are kept transposed ([D][M], scaled), so that the scores of a key are
// a broadcast of each key element times vectors of 16 rows (FMAs with no horizontal sums), and
// the online softmax runs down the lanes (a running max, sum per row). Keys come kKeyBlock at a
// time straight from their pages, each K and V element loaded once per task for all its rows;
// the keys read stop at the block's last query (causal; with key limits, at the block's largest
// limit) and start at its first query's window. A key block that every query of the task sees
// whole (below its first query, inside the window) skips the mask.
// Then the weighted values are added into the rows' sums [M][D] in register tiles. A task writes
// only its own rows of out, so results do not depend on the thread count or the order of tasks.
//
// bf16 (attribute, nonzero; with AVX-512 BF16): the products in bfloat16, twice float32's rate,
// for a model whose prompt matmuls are bfloat16 or int8 anyway: the scaled queries, the keys and
// values, and the softmax weights rounded to bfloat16 (to nearest even) in pairs (two
// dimensions, or two keys, to a 32-bit word), each vdpbf16ps adding a pair's two products to
// float32 sums. The keys and values are converted once a call, before the tasks (each is read by
// every later query block); the softmax stays float32, its weights from a cheaper exp (ExpBf16,
// well inside the bfloat16 rounding that follows). Built without the instructions, the attribute
// is ignored (float32 products).

#if !defined(__AVX512F__)
#error "prefill_attention.cc needs AVX-512 (compiled with -march=native on such a CPU)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
constexpr int64_t kQueryBlock = 32;  // queries per task
constexpr int64_t kKeyBlock = 32;    // keys per softmax step (a multiple of kKeyTile)
constexpr int kKeyTile = 4;          // keys per register tile of the scores
constexpr int kRowVectors = 4;       // row vectors per register tile of the scores
constexpr int kValueRows = 4;        // rows per register tile of the weighted values
constexpr int kValueVectors = 4;     // head_dim vectors per register tile of the weighted values
constexpr int64_t kMaxDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp of 16 floats <= 0 (-inf included), within about an ulp of std::exp (paged_attention.cc's).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// exp of 16 floats <= 0 within 7.5e-5 relative error (a cubic on the reduced argument), for softmax
// weights rounded to bfloat16 anyway (2^-9 relative); -inf gives a NaN-free 0 through the clamp.
inline __m512 ExpBf16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.16566729f), r, _mm512_set1_ps(0.50496162f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.00016417f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.99992812f));
  return _mm512_scalef_ps(p, n);
}

struct Block {  // one task's queries: tokens [first, last) of sequence s
  int64_t s, first, last;
};

struct Problem {
  const float *q, *k, *v;
  const int32_t *block_table, *seq_lens, *query_start_loc;
  const int32_t* key_limit = nullptr;  // [tokens], or null: causal
  float* out;
  int64_t tokens, q_heads, kv_heads, dim, page_size, table_width;
  int32_t window;
  float scale, soft_cap;
  bool bf16 = false;  // products in bfloat16 (AVX-512 BF16), sums in float32
  std::vector<Block> blocks;
  std::vector<float> zeros;  // a key of zeros for the key tiles' padding
  // bf16: each (sequence, KV head)'s keys from `lo` (even) to its length, converted once a call
  // (ConvertChunk) for all the tasks that read them: keys2 [n][dim_padded / 2] as pairs of
  // dimensions, values2 [n / 2][dim_padded] as pairs of keys (2i, 2i + 1 from lo), zeros past the
  // sequence's length (n: the keys rounded up to kKeyBlock, and one kKeyBlock more).
  struct ConvertedKeys {
    int64_t lo = 0, chunks = 0;
    uint32_t *keys2 = nullptr, *values2 = nullptr;
  };
  std::vector<ConvertedKeys> converted;  // [sequences * kv_heads]
  std::vector<uint32_t> converted_words;

  int64_t group() const { return q_heads / kv_heads; }
  int64_t QueryLen(int64_t s) const { return query_start_loc[s + 1] - query_start_loc[s]; }
  // Position of token t of sequence s.
  int64_t Position(int64_t s, int64_t t) const { return seq_lens[s] - QueryLen(s) + (t - query_start_loc[s]); }
  const float* Key(const float* pages, int64_t s, int64_t pos, int64_t head) const {
    const int64_t page = block_table[s * table_width + pos / page_size];
    return pages + ((page * page_size + pos % page_size) * kv_heads + head) * dim;
  }

  // scores[t][m] += q_t[m] . key_t for kRows vectors of rows from m0, keys t0 .. t0 + kKeyTile.
  template <int kRows>
  void ScoreTile(const float* qt, int64_t rows, const float* const* keys, int64_t m0, float* scores) const {
    __m512 acc[kKeyTile][kRows];
    for (int t = 0; t < kKeyTile; ++t)
      for (int r = 0; r < kRows; ++r) acc[t][r] = _mm512_setzero_ps();
    const float *k0 = keys[0], *k1 = keys[1], *k2 = keys[2], *k3 = keys[3];
    for (int64_t d = 0; d < dim; ++d) {
      const float* row = qt + d * rows + m0;
      __m512 qv[kRows];
      for (int r = 0; r < kRows; ++r) qv[r] = _mm512_loadu_ps(row + r * kLanes);
      const __m512 b0 = _mm512_set1_ps(k0[d]), b1 = _mm512_set1_ps(k1[d]), b2 = _mm512_set1_ps(k2[d]),
                   b3 = _mm512_set1_ps(k3[d]);
      for (int r = 0; r < kRows; ++r) {
        acc[0][r] = _mm512_fmadd_ps(qv[r], b0, acc[0][r]);
        acc[1][r] = _mm512_fmadd_ps(qv[r], b1, acc[1][r]);
        acc[2][r] = _mm512_fmadd_ps(qv[r], b2, acc[2][r]);
        acc[3][r] = _mm512_fmadd_ps(qv[r], b3, acc[3][r]);
      }
    }
    for (int t = 0; t < kKeyTile; ++t)
      for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(scores + t * rows + m0 + r * kLanes, acc[t][r]);
  }

  // acc[m][d] = acc[m][d] * keep[m] + sum_t weights[t][m] value_t[d] for kValueRows rows from m0
  // and kVectors vectors of d from d0.
  template <int kVectors>
  void ValueTile(const float* weights, int64_t rows, const float* keep, const float* const* values, int64_t count,
                 int64_t m0, int64_t d0, int64_t dim_padded, float* acc) const {
    __mmask16 masks[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      const int64_t left = dim - (d0 + j * kLanes);
      masks[j] = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(left, 0)) - 1);
    }
    __m512 o[kValueRows][kVectors];
    for (int r = 0; r < kValueRows; ++r) {
      const __m512 kv = _mm512_set1_ps(keep[m0 + r]);
      for (int j = 0; j < kVectors; ++j)
        o[r][j] = _mm512_mul_ps(kv, _mm512_loadu_ps(acc + (m0 + r) * dim_padded + d0 + j * kLanes));
    }
    for (int64_t t = 0; t < count; ++t) {
      __m512 value[kVectors];
      for (int j = 0; j < kVectors; ++j) value[j] = _mm512_maskz_loadu_ps(masks[j], values[t] + d0 + j * kLanes);
      for (int r = 0; r < kValueRows; ++r) {
        const __m512 w = _mm512_set1_ps(weights[t * rows + m0 + r]);
        for (int j = 0; j < kVectors; ++j) o[r][j] = _mm512_fmadd_ps(w, value[j], o[r][j]);
      }
    }
    for (int r = 0; r < kValueRows; ++r)
      for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(acc + (m0 + r) * dim_padded + d0 + j * kLanes, o[r][j]);
  }

#if defined(__AVX512BF16__)
  // ScoreTile in bfloat16 pairs: qt2 [pairs][rows] holds each row's queries two dimensions to a
  // 32-bit word, keys[t] a key's [pairs]; one dpbf16ps adds two dimensions' products of 16 rows.
  template <int kRows>
  void ScoreTileBf16(const uint32_t* qt2, int64_t rows, const uint32_t* const* keys, int64_t m0,
                     float* scores) const {
    __m512 acc[kKeyTile][kRows];
    for (int t = 0; t < kKeyTile; ++t)
      for (int r = 0; r < kRows; ++r) acc[t][r] = _mm512_setzero_ps();
    const uint32_t *k0 = keys[0], *k1 = keys[1], *k2 = keys[2], *k3 = keys[3];
    for (int64_t j = 0, pairs = (dim + 1) / 2; j < pairs; ++j) {
      const uint32_t* row = qt2 + j * rows + m0;
      __m512bh qv[kRows];
      for (int r = 0; r < kRows; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(row + r * kLanes);
      const __m512bh b0 = (__m512bh)_mm512_set1_epi32(k0[j]), b1 = (__m512bh)_mm512_set1_epi32(k1[j]),
                     b2 = (__m512bh)_mm512_set1_epi32(k2[j]), b3 = (__m512bh)_mm512_set1_epi32(k3[j]);
      for (int r = 0; r < kRows; ++r) {
        acc[0][r] = _mm512_dpbf16_ps(acc[0][r], qv[r], b0);
        acc[1][r] = _mm512_dpbf16_ps(acc[1][r], qv[r], b1);
        acc[2][r] = _mm512_dpbf16_ps(acc[2][r], qv[r], b2);
        acc[3][r] = _mm512_dpbf16_ps(acc[3][r], qv[r], b3);
      }
    }
    for (int t = 0; t < kKeyTile; ++t)
      for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(scores + t * rows + m0 + r * kLanes, acc[t][r]);
  }

  // ValueTile in bfloat16 pairs of keys: weights2 [pairs][rows] holds the weights of keys 2i and
  // 2i + 1 of each row in one word, values2 [pairs][dim_padded] their values at each dimension.
  template <int kVectors>
  void ValueTileBf16(const uint32_t* weights2, int64_t rows, const float* keep, const uint32_t* values2,
                     int64_t pairs, int64_t m0, int64_t d0, int64_t dim_padded, float* acc) const {
    __m512 o[kValueRows][kVectors];
    for (int r = 0; r < kValueRows; ++r) {
      const __m512 kv = _mm512_set1_ps(keep[m0 + r]);
      for (int j = 0; j < kVectors; ++j)
        o[r][j] = _mm512_mul_ps(kv, _mm512_loadu_ps(acc + (m0 + r) * dim_padded + d0 + j * kLanes));
    }
    for (int64_t i = 0; i < pairs; ++i) {
      __m512bh value[kVectors];
      for (int j = 0; j < kVectors; ++j)
        value[j] = (__m512bh)_mm512_loadu_si512(values2 + i * dim_padded + d0 + j * kLanes);
      for (int r = 0; r < kValueRows; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(weights2[i * rows + m0 + r]);
        for (int j = 0; j < kVectors; ++j) o[r][j] = _mm512_dpbf16_ps(o[r][j], w, value[j]);
      }
    }
    for (int r = 0; r < kValueRows; ++r)
      for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(acc + (m0 + r) * dim_padded + d0 + j * kLanes, o[r][j]);
  }

  // 16 floats rounded to bfloat16 (to nearest even) in the low halves of 16 words; `high` in the
  // high halves: one pair to a word.
  static __m512i PairBf16(__m512 low, __m512 high) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(low));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(high));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }

  // A key block's keys as bfloat16 pairs [padded][dim_padded / 2] and values as pairs of keys
  // [padded / 2][dim_padded] (keys past `count`: zeros).
  void KeyBlockBf16(const float* const* key_ptrs, const float* const* value_ptrs, int64_t padded,
                    int64_t dim_padded, uint32_t* keys2, uint32_t* values2) const {
    for (int64_t t = 0; t < padded; ++t)
      for (int64_t d = 0; d < dim_padded; d += 2 * kLanes) {
        const __mmask16 m0 = Mask(d), m1 = Mask(d + kLanes);
        const __m512 a = _mm512_maskz_loadu_ps(m0, key_ptrs[t] + d), b = _mm512_maskz_loadu_ps(m1, key_ptrs[t] + d + kLanes);
        // 32 dimensions -> 16 words of pairs: even dimensions low, odd high.
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        const __m512i words = PairBf16(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
        const int64_t left = std::min<int64_t>(kLanes, (dim_padded - d) / 2);
        _mm512_mask_storeu_epi32(keys2 + t * (dim_padded / 2) + d / 2, static_cast<__mmask16>((1u << left) - 1), words);
      }
    for (int64_t t = 0; t < padded; t += 2)
      for (int64_t d = 0; d < dim_padded; d += kLanes) {
        const __mmask16 m = Mask(d);
        const __m512 first = _mm512_maskz_loadu_ps(m, value_ptrs[t] + d);
        const __m512 second = _mm512_maskz_loadu_ps(m, value_ptrs[t + 1] + d);
        _mm512_storeu_si512(values2 + (t / 2) * dim_padded + d, PairBf16(first, second));
      }
  }

  // Sizes `converted` for the sequences with queries (blocks built) and allocates its words.
  void PrepareConverted(int64_t sequences) {
    const int64_t dim_padded = (dim + kLanes - 1) / kLanes * kLanes;
    converted.assign(sequences * kv_heads, ConvertedKeys());
    std::vector<int64_t> offsets(sequences, -1);
    int64_t words = 0;
    for (const Block& block : blocks) {
      if (offsets[block.s] >= 0) continue;  // sized at the sequence's first block
      const int64_t first_pos = Position(block.s, query_start_loc[block.s]);
      const int64_t lo = (window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0) & ~int64_t{1};
      const int64_t chunks = (seq_lens[block.s] - lo + kKeyBlock - 1) / kKeyBlock;
      offsets[block.s] = words;
      for (int64_t h = 0; h < kv_heads; ++h) converted[block.s * kv_heads + h] = {lo, chunks, nullptr, nullptr};
      words += kv_heads * (chunks + 1) * kKeyBlock * dim_padded;  // keys2 and values2: half each
    }
    converted_words.assign(words, 0);
    for (int64_t s = 0; s < sequences; ++s)
      for (int64_t h = 0; offsets[s] >= 0 && h < kv_heads; ++h) {
        ConvertedKeys& c = converted[s * kv_heads + h];
        const int64_t half = (c.chunks + 1) * kKeyBlock * dim_padded / 2;
        c.keys2 = converted_words.data() + offsets[s] + 2 * h * half;
        c.values2 = c.keys2 + half;
      }
  }

  // Converts chunk `chunk` (kKeyBlock keys) of converted[index]'s keys and values.
  void ConvertChunk(int64_t index, int64_t chunk) {
    const ConvertedKeys& c = converted[index];
    const int64_t s = index / kv_heads, head = index % kv_heads, first = c.lo + chunk * kKeyBlock;
    const int64_t dim_padded = (dim + kLanes - 1) / kLanes * kLanes;
    const float* key_ptrs[kKeyBlock];
    const float* value_ptrs[kKeyBlock];
    for (int64_t t = 0; t < kKeyBlock; ++t) {
      const bool real = first + t < seq_lens[s];
      key_ptrs[t] = real ? Key(k, s, first + t, head) : zeros.data();
      value_ptrs[t] = real ? Key(v, s, first + t, head) : zeros.data();
    }
    KeyBlockBf16(key_ptrs, value_ptrs, kKeyBlock, dim_padded, c.keys2 + chunk * kKeyBlock * (dim_padded / 2),
                 c.values2 + chunk * (kKeyBlock / 2) * dim_padded);
  }
#endif

  // The lanes of dimensions [d, d + 16) below dim.
  __mmask16 Mask(int64_t d) const {
    const int64_t left = std::clamp<int64_t>(dim - d, 0, kLanes);
    return static_cast<__mmask16>((1u << left) - 1);
  }

  // tile(std::integral_constant<int, R>(), m) over row vectors [0, row_vectors): runs of
  // kRowVectors, then 2, then 1 (a score tile's rows).
  template <typename Tile>
  static void ForRowVectors(int64_t row_vectors, Tile tile) {
    int64_t m = 0;
    for (; m + kRowVectors <= row_vectors; m += kRowVectors) tile(std::integral_constant<int, kRowVectors>(), m);
    for (; m + 2 <= row_vectors; m += 2) tile(std::integral_constant<int, 2>(), m);
    for (; m < row_vectors; ++m) tile(std::integral_constant<int, 1>(), m);
  }

  // tile(std::integral_constant<int, V>(), d0) over [0, dim_padded): kValueVectors vectors of
  // head_dim at a time, then the 1 to 3 left (a value tile's columns).
  template <typename Tile>
  static void ForValueVectors(int64_t dim_padded, Tile tile) {
    int64_t d0 = 0;
    for (; d0 + kValueVectors * kLanes <= dim_padded; d0 += kValueVectors * kLanes)
      tile(std::integral_constant<int, kValueVectors>(), d0);
    const int64_t left = (dim_padded - d0) / kLanes;
    if (left == 3) tile(std::integral_constant<int, 3>(), d0);
    if (left == 2) tile(std::integral_constant<int, 2>(), d0);
    if (left == 1) tile(std::integral_constant<int, 1>(), d0);
  }

  void Task(int64_t task) {
    const Block& block = blocks[task / kv_heads];
    const int64_t head = task % kv_heads, s = block.s, g = group();
    const int64_t queries = block.last - block.first;
    // Row m = i * g + h: query i, query head h; padded to whole vectors (a short chunk, as a
    // 1-token query, fills only the vectors it needs).
    const int64_t rows = (queries * g + kLanes - 1) / kLanes * kLanes;
    const int64_t row_vectors = rows / kLanes;
    const int64_t dim_padded = (dim + kLanes - 1) / kLanes * kLanes;
    const int64_t first_pos = Position(s, block.first), last_pos = Position(s, block.last - 1);
    int64_t key_first = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;

    std::vector<float> qt(dim * rows, 0.f), acc(rows * dim_padded, 0.f), scores(kKeyBlock * rows);
    std::vector<float> row_max(rows, kNegInf), row_sum(rows, 0.f), keep(rows);
    // Rows past the block's queries: a position no key reaches (they see nothing). limits[m]: the
    // highest key row m sees (its position, or its key limit, below the sequence's length).
    std::vector<int32_t> positions(rows, std::numeric_limits<int32_t>::min());
    std::vector<int32_t> limits(rows, std::numeric_limits<int32_t>::min());
    int64_t top_limit = last_pos;
    for (int64_t i = 0; i < queries; ++i) {
      int64_t limit = first_pos + i;
      if (key_limit != nullptr)
        limit = std::min<int64_t>(std::max<int64_t>(limit, key_limit[block.first + i]), seq_lens[s] - 1);
      top_limit = std::max(top_limit, limit);
      for (int64_t h = 0; h < g; ++h) {
        const int64_t m = i * g + h;
        positions[m] = static_cast<int32_t>(first_pos + i);
        limits[m] = static_cast<int32_t>(limit);
        const float* query = q + ((block.first + i) * q_heads + head * g + h) * dim;
        for (int64_t d = 0; d < dim; ++d) qt[d * rows + m] = query[d] * scale;
      }
    }
#if defined(__AVX512BF16__)
    // bfloat16: the scaled queries two dimensions to a word, [pairs][rows]; the keys and values
    // converted before the tasks (from an even key: the blocks start at a pair), the weights in
    // pairs of keys.
    const int64_t pairs = (dim + 1) / 2;
    std::vector<uint32_t> qt2, weights2;
    const ConvertedKeys* kv2 = bf16 ? &converted[s * kv_heads + head] : nullptr;
    if (bf16) {
      qt2.assign(pairs * rows, 0);
      for (int64_t j = 0; j < pairs; ++j)
        for (int64_t m = 0; m < rows; m += kLanes) {
          const __m512 even = _mm512_loadu_ps(qt.data() + 2 * j * rows + m);
          const __m512 odd = 2 * j + 1 < dim ? _mm512_loadu_ps(qt.data() + (2 * j + 1) * rows + m) : _mm512_setzero_ps();
          _mm512_storeu_si512(qt2.data() + j * rows + m, PairBf16(even, odd));
        }
      weights2.assign(kKeyBlock / 2 * rows, 0);
      key_first = kv2->lo + ((key_first - kv2->lo) & ~int64_t{1});  // a key before the window: masked
    }
#endif
    // The keys any of the block's queries sees: [key_first, key_last).
    const int64_t key_last = std::min<int64_t>(top_limit + 1, seq_lens[s]);

    const float* key_ptrs[kKeyBlock];
    const float* value_ptrs[kKeyBlock];
    const __m512i window_v = _mm512_set1_epi32(window > 0 ? window : std::numeric_limits<int32_t>::max());
    for (int64_t start = key_first; start < key_last; start += kKeyBlock) {
      const int64_t count = std::min<int64_t>(kKeyBlock, key_last - start);
      const int64_t padded = (count + kKeyTile - 1) / kKeyTile * kKeyTile;
      // Every key of the block visible to every row: no mask (rows past the queries then get
      // weights too, but are never written out).
      const bool all_visible = start + count - 1 <= first_pos && (window <= 0 || last_pos - start < window);
#if defined(__AVX512BF16__)
      const uint32_t* keys2 = bf16 ? kv2->keys2 + (start - kv2->lo) * (dim_padded / 2) : nullptr;
      const uint32_t* values2 = bf16 ? kv2->values2 + (start - kv2->lo) / 2 * dim_padded : nullptr;
#endif
      for (int64_t t = 0; t < padded && !bf16; ++t) {
        key_ptrs[t] = t < count ? Key(k, s, start + t, head) : zeros.data();
        value_ptrs[t] = t < count ? Key(v, s, start + t, head) : zeros.data();
      }
      // Scores [padded][rows].
      for (int64_t t = 0; t < padded; t += kKeyTile) {
        float* tile_scores = scores.data() + t * rows;
#if defined(__AVX512BF16__)
        const uint32_t* tile_keys[kKeyTile];  // the tile's keys in bfloat16 pairs
        for (int u = 0; u < kKeyTile && bf16; ++u) tile_keys[u] = keys2 + (t + u) * (dim_padded / 2);
#endif
        ForRowVectors(row_vectors, [&](auto vectors, int64_t m) {
          constexpr int kRows = decltype(vectors)::value;
#if defined(__AVX512BF16__)
          if (bf16) return ScoreTileBf16<kRows>(qt2.data(), rows, tile_keys, m * kLanes, tile_scores);
#endif
          ScoreTile<kRows>(qt.data(), rows, key_ptrs + t, m * kLanes, tile_scores);
        });
      }
      // Online softmax down the lanes: the weights replace the scores, keep[m] rescales the sums.
      for (int64_t m = 0; m < rows; m += kLanes) {
        const __m512i pos = _mm512_loadu_si512(positions.data() + m);
        const __m512i lim = _mm512_loadu_si512(limits.data() + m);
        __mmask16 visible[kKeyBlock];
        __m512 top = _mm512_loadu_ps(row_max.data() + m);
        const __m512 old_max = top;
        for (int64_t t = 0; t < count; ++t) {
          const __m512i key_pos = _mm512_set1_epi32(static_cast<int32_t>(start + t));
          // key_pos <= limit and pos - key_pos < window (limit INT32_MIN for rows with no query:
          // never; limit = pos without key limits: causal).
          visible[t] = all_visible ? __mmask16(0xFFFF)
                                   : _mm512_cmple_epi32_mask(key_pos, lim) &
                                         _mm512_cmplt_epi32_mask(_mm512_sub_epi32(pos, key_pos), window_v);
          float* sc = scores.data() + t * rows + m;
          __m512 score = _mm512_loadu_ps(sc);
          if (soft_cap > 0.f) {
            alignas(64) float lanes[kLanes];
            _mm512_store_ps(lanes, score);
            for (float& x : lanes) x = soft_cap * std::tanh(x / soft_cap);
            score = _mm512_load_ps(lanes);
          }
          if (!all_visible) score = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), visible[t], score);
          if (!all_visible || soft_cap > 0.f) _mm512_storeu_ps(sc, score);
          top = _mm512_max_ps(top, score);
        }
        // Lanes that have seen no key keep -inf; they subtract 0 instead (their weights are 0).
        const __mmask16 finite = _mm512_cmp_ps_mask(top, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
        const __m512 safe = _mm512_maskz_mov_ps(finite, top);
        const __mmask16 had = _mm512_cmp_ps_mask(old_max, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
        const __m512 rescale = _mm512_maskz_mov_ps(had, Exp(_mm512_sub_ps(old_max, safe)));
        __m512 total = _mm512_mul_ps(_mm512_loadu_ps(row_sum.data() + m), rescale);
#if defined(__AVX512BF16__)
        if (bf16) {  // the weights of keys 2i and 2i + 1 straight into their pairs
          for (int64_t i = 0; 2 * i < count; ++i) {
            const float* sc = scores.data() + 2 * i * rows + m;
            const __m512 first = _mm512_maskz_mov_ps(visible[2 * i], ExpBf16(_mm512_sub_ps(_mm512_loadu_ps(sc), safe)));
            const __m512 second = 2 * i + 1 < count ? _mm512_maskz_mov_ps(visible[2 * i + 1],
                                                                           ExpBf16(_mm512_sub_ps(_mm512_loadu_ps(sc + rows), safe)))
                                                    : _mm512_setzero_ps();
            total = _mm512_add_ps(total, _mm512_add_ps(first, second));
            _mm512_storeu_si512(weights2.data() + i * rows + m, PairBf16(first, second));
          }
        }
#endif
        for (int64_t t = 0; t < count && !bf16; ++t) {
          float* sc = scores.data() + t * rows + m;
          const __m512 weight = _mm512_maskz_mov_ps(visible[t], Exp(_mm512_sub_ps(_mm512_loadu_ps(sc), safe)));
          _mm512_storeu_ps(sc, weight);
          total = _mm512_add_ps(total, weight);
        }
        _mm512_storeu_ps(row_sum.data() + m, total);
        _mm512_storeu_ps(row_max.data() + m, top);
        _mm512_storeu_ps(keep.data() + m, rescale);
      }
      // acc = acc * keep + weights . values
#if defined(__AVX512BF16__)
      const int64_t key_pairs = (count + 1) / 2;
#endif
      for (int64_t m = 0; m < rows; m += kValueRows)
        ForValueVectors(dim_padded, [&](auto vectors, int64_t d0) {
          constexpr int kVectors = decltype(vectors)::value;
#if defined(__AVX512BF16__)
          if (bf16)
            return ValueTileBf16<kVectors>(weights2.data(), rows, keep.data(), values2, key_pairs, m, d0,
                                           dim_padded, acc.data());
#endif
          ValueTile<kVectors>(scores.data(), rows, keep.data(), value_ptrs, count, m, d0, dim_padded, acc.data());
        });
    }
    for (int64_t i = 0; i < queries; ++i)
      for (int64_t h = 0; h < g; ++h) {
        const int64_t m = i * g + h;
        float* o = out + ((block.first + i) * q_heads + head * g + h) * dim;
        const float inverse = row_sum[m] > 0.f ? 1.f / row_sum[m] : 0.f;
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[m * dim_padded + d] * inverse;
      }
  }
};

// key_limit: [tokens] or null (causal).
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
               ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
               ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window, const int32_t* key_limit,
               ffi::Result<ffi::Buffer<ffi::F32>> out, float scale, float soft_cap, int64_t bf16) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || k_pages.element_count() != v_pages.element_count() ||
      seq_lens.element_count() != td[0] || query_start_loc.element_count() != td[0] + 1 || kd[3] != qd[2] ||
      qd[1] % kd[2] != 0 || window.element_count() != 1)
    return ffi::Error::InvalidArgument("ragged_prefill_attention: inconsistent shapes");
  if (qd[2] < 1 || qd[2] > kMaxDim)
    return ffi::Error::InvalidArgument("ragged_prefill_attention: head_dim must be 1 to 256");
  Problem p;
  p.q = q.typed_data();
  p.k = k_pages.typed_data();
  p.v = v_pages.typed_data();
  p.block_table = block_table.typed_data();
  p.seq_lens = seq_lens.typed_data();
  p.query_start_loc = query_start_loc.typed_data();
  p.key_limit = key_limit;
  p.out = out->typed_data();
  p.tokens = qd[0];
  p.q_heads = qd[1];
  p.dim = qd[2];
  p.page_size = kd[1];
  p.kv_heads = kd[2];
  p.table_width = td[1];
  p.window = window.typed_data()[0];
  p.scale = scale;
  p.soft_cap = soft_cap;
#if defined(__AVX512BF16__)
  p.bf16 = bf16 != 0;
#endif
  p.zeros.assign(kMaxDim, 0.f);
  std::fill(p.out, p.out + out->element_count(), 0.f);
  const int64_t seqs = td[0];
  for (int64_t s = 0; s < seqs; ++s)
    if (p.query_start_loc[s + 1] < p.query_start_loc[s])
      return ffi::Error::InvalidArgument("ragged_prefill_attention: query_start_loc decreases");
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t first = p.query_start_loc[s], last = p.query_start_loc[s + 1], len = p.seq_lens[s];
    if (len <= 0 || last <= first) continue;  // a padding row, or no queries
    if (first < 0 || last > p.tokens)
      return ffi::Error::InvalidArgument("ragged_prefill_attention: query_start_loc outside the tokens");
    if (len > p.table_width * p.page_size)
      return ffi::Error::InvalidArgument("ragged_prefill_attention: a sequence length exceeds its block table");
    for (int64_t i = 0; i * p.page_size < len; ++i) {  // the pages read: no read outside the cache
      const int64_t page = p.block_table[s * p.table_width + i];
      if (page < 0 || page >= kd[0])
        return ffi::Error::InvalidArgument("ragged_prefill_attention: a block table names a page outside the cache");
    }
    // The last blocks first: they see the most keys, so the long tasks start early.
    for (int64_t end = last; end > first; end -= kQueryBlock)
      p.blocks.push_back({s, std::max(first, end - kQueryBlock), end});
  }
#if defined(__AVX512BF16__)
  if (p.bf16) {  // the keys and values in bfloat16 pairs, once for all tasks
    p.PrepareConverted(seqs);
    std::vector<std::pair<int64_t, int64_t>> chunks;  // (sequence * kv_heads + head, chunk)
    for (int64_t i = 0; i < static_cast<int64_t>(p.converted.size()); ++i)
      for (int64_t c = 0; p.converted[i].keys2 != nullptr && c < p.converted[i].chunks; ++c) chunks.push_back({i, c});
    jaxserve::ParallelFor(pool, pool.num_threads(), static_cast<int64_t>(chunks.size()),
                          [&p, &chunks](int64_t i) { p.ConvertChunk(chunks[i].first, chunks[i].second); });
  }
#endif
  const int64_t tasks = static_cast<int64_t>(p.blocks.size()) * p.kv_heads;
  jaxserve::ParallelFor(pool, pool.num_threads(), tasks, [&p](int64_t t) { p.Task(t); });
  return ffi::Error::Success();
}

ffi::Error RaggedPrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                                  ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_table,
                                  ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                                  ffi::Buffer<ffi::S32> window, ffi::Result<ffi::Buffer<ffi::F32>> out, float scale,
                                  float soft_cap, int64_t bf16) {
  return Run(pool, q, k_pages, v_pages, block_table, seq_lens, query_start_loc, window, nullptr, out, scale,
             soft_cap, bf16);
}

ffi::Error RaggedPrefillAttentionKeyLimit(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                          ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                                          ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> seq_lens,
                                          ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window,
                                          ffi::Buffer<ffi::S32> key_limit, ffi::Result<ffi::Buffer<ffi::F32>> out,
                                          float scale, float soft_cap, int64_t bf16) {
  if (q.dimensions().size() != 3 || key_limit.element_count() != q.dimensions()[0])
    return ffi::Error::InvalidArgument("ragged_prefill_attention: key_limit is not one value a token");
  return Run(pool, q, k_pages, v_pages, block_table, seq_lens, query_start_loc, window, key_limit.typed_data(), out,
             scale, soft_cap, bf16);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPrefillAttention, RaggedPrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("bf16"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPrefillAttentionKeyLimit, RaggedPrefillAttentionKeyLimit,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("bf16"));
