// Dense decode attention on the host: G queries per KV head over the filled prefix of a cache.
//
// XLA:CPU runs one decode query against the cache as a chain of small ops per key block (a
// dynamic slice, a matrix-vector dot on its thread pool, a masked softmax, another dot), and at
// 4k tokens that chain, not the memory traffic, was most of the SmolLM2 decode step. Here each
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

#include "xla_ffi/kernels.h"
#include "xla_ffi/thread_pool.h"

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
// of exp(s - m)) and acc (sum of exp(s - m) v), laid out [G][2 + D].
template <typename T>
void ChunkPartial(const VecOps& ops, const float* q_GD, int64_t group, const T* k_SD,
                  const T* v_SD, int64_t d, int64_t t0, int64_t t1, float* scores, float* out) {
  const int64_t n = t1 - t0;
  // Scores row-major over rows (each K row is loaded once and serves all G heads), stored [g][t].
  for (int64_t t = 0; t < n; ++t) {
    const T* k = k_SD + (t0 + t) * d;
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
    const T* v = v_SD + (t0 + t) * d;
    for (int64_t g = 0; g < group; ++g) ops.Axpy(scores[g * n + t], v, out + g * (2 + d) + 2, d);
  }
}

#ifdef PIGJAX_X86
// kernels.h undefines its PIGJAX_DECODE_AVX2 at the end of its avx2 namespace; this header has its own.
#define PIGJAX_DECODE_AVX2 __attribute__((target("avx2,fma")))
namespace avx2 {
using pigjax::avx2::Load8;

// Eight dot products in one vector: lane j = the horizontal sum of a[j] (the classic hadd tree).
PIGJAX_DECODE_AVX2 inline __m256 HSum8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// scores[t] = q . k_t for rows t of k_SD (row stride d, d % 8 == 0), eight rows per pass so one
// hadd tree replaces eight horizontal sums.
template <typename T>
PIGJAX_DECODE_AVX2 void Scores(const float* q, const T* k_SD, int64_t d, int64_t n, float* scores) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, Load8(k_SD + (t + j) * d + i), acc[j]);
    }
    _mm256_storeu_ps(scores + t, HSum8(acc));
  }
  for (; t < n; ++t) scores[t] = pigjax::avx2::Dot(q, k_SD + t * d, d);
}

// out[0:8*NV] += sum_t w[t] v_t[0:8*NV]: the NV accumulators stay in registers across the rows.
template <int NV, typename T>
PIGJAX_DECODE_AVX2 void WeightedSum(const float* w, const T* v, int64_t d, int64_t n, float* out) {
  __m256 acc[NV];
  for (int s = 0; s < NV; ++s) acc[s] = _mm256_loadu_ps(out + 8 * s);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 wt = _mm256_set1_ps(w[t]);
    for (int s = 0; s < NV; ++s) acc[s] = _mm256_fmadd_ps(wt, Load8(v + t * d + 8 * s), acc[s]);
  }
  for (int s = 0; s < NV; ++s) _mm256_storeu_ps(out + 8 * s, acc[s]);
}

template <typename T>
PIGJAX_DECODE_AVX2 void WeightedSumRows(const float* w, const T* v_SD, int64_t d, int64_t n, float* out) {
  for (int64_t i = 0; i < d; i += 64) {  // 64 lanes (8 registers) at a time
    const T* v = v_SD + i;
    switch (std::min<int64_t>(d - i, 64) / 8) {
      case 8: WeightedSum<8>(w, v, d, n, out + i); break;
      case 7: WeightedSum<7>(w, v, d, n, out + i); break;
      case 6: WeightedSum<6>(w, v, d, n, out + i); break;
      case 5: WeightedSum<5>(w, v, d, n, out + i); break;
      case 4: WeightedSum<4>(w, v, d, n, out + i); break;
      case 3: WeightedSum<3>(w, v, d, n, out + i); break;
      case 2: WeightedSum<2>(w, v, d, n, out + i); break;
      default: WeightedSum<1>(w, v, d, n, out + i); break;
    }
  }
}

// ChunkPartial (below) for d % 8 == 0: per query head, scores of eight rows at a time and the
// weighted V sum in registers; the chunk's K and V (at most 128 KiB) stay in L2 across the G
// heads that share them.
template <typename T>
PIGJAX_DECODE_AVX2 void ChunkPartial(const float* q_GD, int64_t group, const T* k_SD, const T* v_SD,
                              int64_t d, int64_t t0, int64_t t1, float* scores, float* out) {
  const int64_t n = t1 - t0;
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    Scores(q_GD + g * d, k_SD + t0 * d, d, n, s);
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m = pigjax::avx2::HMax(mv);
    for (; t < n; ++t) m = std::max(m, s[t]);
    float* o = out + g * (2 + d);
    o[0] = m;
    o[1] = pigjax::avx2::ExpSum(s, n, m);
    std::fill(o + 2, o + 2 + d, 0.0f);
    WeightedSumRows(s, v_SD + t0 * d, d, n, o + 2);
  }
}
}  // namespace avx2
#undef PIGJAX_DECODE_AVX2
#endif  // PIGJAX_X86

// o_BHD[b, k * G + g] = softmax(q . K[b, k, :len_b] / sqrt(D)) V[b, k, :len_b], and lse_BH its
// log-sum-exp (of the scaled scores). A slot with len_b == 0 gets o = 0, lse = -inf (as the jnp
// reference `attention.attend_with_lse` does when nothing is visible). Lengths are clamped to
// [0, max_len] by the caller.
template <typename T>
void Attend(const VecOps& ops, ThreadPool& pool, const Shape& sh, const float* q_BHD,
            const T* k_BKSD, const T* v_BKSD, const int32_t* len_B, float* o_BHD, float* lse_BH) {
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
#ifdef PIGJAX_X86
        if (vectorized) {
          avx2::ChunkPartial(q, G, k_BKSD + bk * S * D, v_BKSD + bk * S * D, D, t0, t1,
                             scores.data(), out);
          return;
        }
#endif
        ChunkPartial(ops, q, G, k_BKSD + bk * S * D, v_BKSD + bk * S * D, D, t0, t1,
                     scores.data(), out);
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
