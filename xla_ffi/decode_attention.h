// Dense decode attention on the host: G queries per KV head over the filled prefix of a cache.
//
// XLA:CPU runs one decode query against the cache as a chain of small ops per key block (a
// dynamic slice, a matrix-vector dot on its thread pool, a masked softmax, another dot), and at
// 4k tokens that chain, not the memory traffic, is most of the SmolLM2 decode step. Here each
// K and V row is read once, for all G query heads that share it, in chunks of rows split over a
// thread pool (flash-decoding: each chunk keeps its own running max, sum and weighted V; the
// chunks are merged by log-sum-exp at the end). Rows past a slot's length are never read.
//
// Pure C++ (no XLA): ffi.cc binds it; tests call it through the FFI handler.
#ifndef PIGJAX_XLA_FFI_DECODE_ATTENTION_H_
#define PIGJAX_XLA_FFI_DECODE_ATTENTION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla_ffi/cpu_features.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/thread_pool.h"
#include "xla_ffi/vec_ops.h"

namespace pigjax::decode {

// Rows per task: 256 rows of K and V at D = 64 in f32 are 128 KiB, a few L2-resident chunks per
// worker, and enough tasks at 1-2k tokens to keep two or more workers busy.
constexpr int64_t kChunkRows = 256;
// Below this many (row, query head) pairs in a call the calling thread does it alone.
constexpr int64_t kMinParallelPairs = 3 * 1024;

struct Shape {
  int64_t batch, kv_heads, group, max_len, head_dim;
};

// One chunk's partial result for its G query heads: m (running max of the scaled scores), l (sum
// of exp(s - m)) and acc (sum of exp(s - m) v), laid out [G][2 + D]. The chunk is n rows,
// row(t) being the cache row of its t-th: [t0, t1) of the cache, or the rows of [t0, t1) that
// a validity mask keeps (masked rows are never read). n == 0 gives (-inf, 0, 0), which the
// merge skips.
inline void EmptyPartials(int64_t group, int64_t d, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + g * (2 + d);
    o[0] = -std::numeric_limits<float>::infinity();
    std::fill(o + 1, o + 2 + d, 0.0f);
  }
}

template <typename T, typename RowOf>
void ChunkPartial(const VecOps& ops, const float* q_GD, int64_t group, const T* k_SD,
                  const T* v_SD, int64_t d, int64_t n, RowOf row, float* scores, float* out) {
  if (n == 0) return EmptyPartials(group, d, out);
  // Scores row-major over rows (each K row is loaded once and serves all G heads), stored [g][t].
  for (int64_t t = 0; t < n; ++t) {
    const T* k = k_SD + row(t) * d;
    for (int64_t g = 0; g < group; ++g) scores[g * n + t] = ops.Dot(q_GD + g * d, k, d);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    float* o = out + g * (2 + d);
    o[0] = m;
    o[1] = ops.exp_sum(s, n, m);  // s becomes the weights exp(s - m)
    std::fill(o + 2, o + 2 + d, 0.0f);
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* v = v_SD + row(t) * d;
    for (int64_t g = 0; g < group; ++g) ops.Axpy(scores[g * n + t], v, out + g * (2 + d) + 2, d);
  }
}

#ifdef PIGJAX_X86
namespace avx2 {
using pigjax::avx2::RowDots;
using pigjax::avx2::WeightedRows;

// ChunkPartial (below) for d % 8 == 0: per query head, scores of eight rows at a time and the
// weighted V sum in registers; the chunk's K and V (at most 128 KiB) stay in L2 across the G
// heads that share them.
template <typename T, typename RowOf>
PIGJAX_AVX2 void ChunkPartial(const float* q_GD, int64_t group, const T* k_SD,
                                     const T* v_SD, int64_t d, int64_t n, RowOf row,
                                     float* scores, float* out) {
  if (n == 0) return EmptyPartials(group, d, out);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    RowDots<T>(q_GD + g * d, d, n, [&](int64_t t) { return k_SD + row(t) * d; }, s);
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m = pigjax::avx2::HMax(mv);
    for (; t < n; ++t) m = std::max(m, s[t]);
    float* o = out + g * (2 + d);
    o[0] = m;
    o[1] = pigjax::avx2::ExpSum(s, n, m);
    std::fill(o + 2, o + 2 + d, 0.0f);
    WeightedRows<T>(s, d, n, [&](int64_t t) { return v_SD + row(t) * d; }, o + 2);
  }
}
}  // namespace avx2
#endif  // PIGJAX_X86

// o_BHD[b, k * G + g] = softmax(q . K[b, k, :len_b] / sqrt(D)) V[b, k, :len_b], and lse_BH its
// log-sum-exp (of the scaled scores). A slot with len_b == 0 gets o = 0, lse = -inf (as the jnp
// reference `attention.attend_with_lse` does when nothing is visible). Lengths are clamped to
// [0, max_len] by the caller. valid_BS (optional, [B, max_len] flags): rows flagged 0 are
// masked out as well and never read (MagicPIG's exact buffer, whose unused entries lie
// between used ones).
template <typename T>
void Attend(const VecOps& ops, ThreadPool& pool, const Shape& sh, const float* q_BHD,
            const T* k_BKSD, const T* v_BKSD, const int32_t* len_B, const int8_t* valid_BS,
            float* o_BHD, float* lse_BH) {
  const int64_t B = sh.batch, K = sh.kv_heads, G = sh.group, S = sh.max_len, D = sh.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Task list: (b, k, chunk) for every filled chunk of every slot and KV head.
  std::vector<int64_t> first_task(B * K + 1, 0);
  int64_t pairs = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t chunks = (len_B[b] + kChunkRows - 1) / kChunkRows;
    for (int64_t k = 0; k < K; ++k) first_task[b * K + k + 1] = first_task[b * K + k] + chunks;
    pairs += static_cast<int64_t>(len_B[b]) * K * G;
  }
  const int64_t tasks = first_task[B * K];
  const int64_t part = G * (2 + D);
  std::vector<float> partial(tasks * part);
  std::vector<float> q_scaled(B * K * G * D);
  for (int64_t i = 0; i < B * K * G * D; ++i) q_scaled[i] = q_BHD[i] * scale;
  // The AVX2 chunk kernel needs whole 8-lane vectors per row; other head dims (and
  // PIGJAX_KERNELS=scalar) take the primitive-by-primitive path.
  [[maybe_unused]] const bool vectorized = std::strcmp(ops.isa, "avx2") == 0 && D % 8 == 0;
  // Which (b, k) a task belongs to: a binary search over first_task.
  pool.ParallelFor(
      tasks,
      [&](int64_t task, int) {
        const int64_t bk = std::upper_bound(first_task.begin(), first_task.end(), task) -
                           first_task.begin() - 1;
        const int64_t b = bk / K, c = task - first_task[bk];
        const int64_t t0 = c * kChunkRows, t1 = std::min<int64_t>(len_B[b], t0 + kChunkRows);
        thread_local std::vector<float> scores;
        scores.resize(G * kChunkRows);
        const float* q = q_scaled.data() + bk * G * D;
        float* out = partial.data() + task * part;
        const T* k = k_BKSD + bk * S * D;
        const T* v = v_BKSD + bk * S * D;
        auto run = [&](int64_t n, auto row) {
#ifdef PIGJAX_X86
          if (vectorized) return avx2::ChunkPartial(q, G, k, v, D, n, row, scores.data(), out);
#endif
          ChunkPartial(ops, q, G, k, v, D, n, row, scores.data(), out);
        };
        if (!valid_BS) return run(t1 - t0, [t0](int64_t t) { return t0 + t; });
        // Masked: only the chunk's valid rows, listed (the others are never read).
        thread_local std::vector<int32_t> kept;
        kept.clear();
        for (int64_t t = t0; t < t1; ++t) {
          if (valid_BS[b * S + t]) kept.push_back(static_cast<int32_t>(t));
        }
        const int32_t* r = kept.data();
        run(static_cast<int64_t>(kept.size()), [r](int64_t t) { return int64_t{r[t]}; });
      },
      /*inline_only=*/pairs < kMinParallelPairs);
  // Merge the chunks of each (b, k, g) by log-sum-exp.
  for (int64_t bk = 0; bk < B * K; ++bk) {
    for (int64_t g = 0; g < G; ++g) {
      float* o = o_BHD + (bk * G + g) * D;
      float& lse = lse_BH[bk * G + g];
      std::fill(o, o + D, 0.0f);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = first_task[bk]; t < first_task[bk + 1]; ++t) {
        m = std::max(m, partial[t * part + g * (2 + D)]);
      }
      if (!(m > -std::numeric_limits<float>::infinity())) {
        lse = -std::numeric_limits<float>::infinity();
        continue;
      }
      float l = 0.0f;
      for (int64_t t = first_task[bk]; t < first_task[bk + 1]; ++t) {
        const float* p = partial.data() + t * part + g * (2 + D);
        const float w = std::exp(p[0] - m);
        l += w * p[1];
        for (int64_t i = 0; i < D; ++i) o[i] += w * p[2 + i];
      }
      for (int64_t i = 0; i < D; ++i) o[i] /= l;
      lse = m + std::log(l);
    }
  }
}

}  // namespace pigjax::decode

#endif  // PIGJAX_XLA_FFI_DECODE_ATTENTION_H_
