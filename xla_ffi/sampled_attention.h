// MagicPIG's importance-weighted attention over a query's candidates (docs/design.md, "The
// algorithm", steps 6-8): gather each candidate's K row, score it with its sampling probability
// (collision_prob.h), and accumulate the V rows with the online softmax (softmax.h).
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_SAMPLED_ATTENTION_H_
#define PIGJAX_XLA_FFI_SAMPLED_ATTENTION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "xla_ffi/collision_prob.h"
#include "xla_ffi/cpu_features.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/softmax.h"
#include "xla_ffi/vec_ops.h"

namespace pigjax {

namespace scalar {
// *qk = k_scale * (q . k) and *norm = |k_scale * k - mu| of one row's key k.
template <typename T>
void DotNorm(const float* q, const float* mu, const T* k, int64_t d, float k_scale, float* qk,
             float* norm) {
  float dot = 0.f, nn = 0.f;
  for (int64_t e = 0; e < d; ++e) {
    const float x = ToF32(k[e]);
    dot += q[e] * x;
    const float c = x * k_scale - mu[e];
    nn += c * c;
  }
  *qk = k_scale * dot;
  *norm = std::sqrt(nn);
}
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {
// The score phase's gather, for d % 8 == 0: qk[j] = k_scale * (q . k) and norm[j] =
// |k_scale * k - mu| of candidate cc[j]'s key, both from one pass over the row, which is
// prefetched `ahead` candidates early (while j + ahead < avail, the candidates left in cc).
template <typename T>
PIGJAX_AVX2 void GatherDotNorms(const float* q, int64_t d, const PoolView& pool,
                                const int32_t* cc, int64_t nc, int64_t avail, int64_t ahead,
                                float* qk, float* norm) {
  const char* rows = pool.rows;
  const int64_t rb = pool.row_bytes;
  const float* mu = pool.mu;
  for (int64_t j = 0; j < nc; ++j) {
    if (j + ahead < avail) {
      PrefetchLines(rows + int64_t{cc[j + ahead]} * rb, rb);
      if (pool.scales) __builtin_prefetch(pool.scales + 2 * int64_t{cc[j + ahead]}, 0, 3);
    }
    const int64_t i = cc[j];
    const T* k = reinterpret_cast<const T*>(rows + i * rb);
    const float ks = pool.k_scale(i);
    const __m256 vks = Set(ks);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, n0 = a0, n1 = a0;
    int64_t e = 0;
    for (; e + 16 <= d; e += 16) {
      const __m256 x0 = Load8(k + e), x1 = Load8(k + e + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), x0, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), x1, a1);
      const __m256 c0 = _mm256_fmsub_ps(x0, vks, _mm256_loadu_ps(mu + e));
      const __m256 c1 = _mm256_fmsub_ps(x1, vks, _mm256_loadu_ps(mu + e + 8));
      n0 = _mm256_fmadd_ps(c0, c0, n0);
      n1 = _mm256_fmadd_ps(c1, c1, n1);
    }
    if (e < d) {  // d % 16 == 8
      const __m256 x0 = Load8(k + e);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), x0, a0);
      const __m256 c0 = _mm256_fmsub_ps(x0, vks, _mm256_loadu_ps(mu + e));
      n0 = _mm256_fmadd_ps(c0, c0, n0);
    }
    // Both horizontal sums in one tree: lanes (dot, norm^2, dot, norm^2).
    const __m256 h = _mm256_hadd_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(n0, n1));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    t = _mm_hadd_ps(t, t);
    qk[j] = ks * _mm_cvtss_f32(t);
    norm[j] = std::sqrt(_mm_cvtss_f32(_mm_movehdup_ps(t)));
  }
}
}  // namespace avx2
#endif  // PIGJAX_X86

// Adds candidates `cand[0..count)` to a running softmax-weighted sum for one query (o, m, z as
// AccumulateSoftmax), each scored s = q.k / sqrt(D) - log u(cos). `scratch`: >= kAttentionScratch
// floats. Raw keys in the logits (centred keys only in the cosine; docs/design.md, "The
// algorithm", step 2). split_ns (optional, profiling): += wall time of the score and the softmax
// phases.
template <typename T>
void AccumulateAttention(const VecOps& ops, const float* q, int64_t d, const PoolView& pool,
                         const int32_t* cand, int64_t count, const LogCollisionTable& log_u,
                         float* scratch, float* o, float& m, float& z,
                         uint64_t* split_ns = nullptr) {
  if (count == 0) return;  // (an empty pool has no mean key to read)
  const char* rows = pool.rows;
  const int64_t rb = pool.row_bytes, ahead_n = PrefetchAhead();
  auto key = [&](int64_t i) { return reinterpret_cast<const T*>(rows + i * rb); };
  const ScoreParams params{ops.Dot(q, pool.mu, d), std::sqrt(ops.Dot(q, q, d)),
                           1.f / std::sqrt(static_cast<float>(d))};
  float* s = scratch;              // [kChunk]: q.k, then scores, then weights
  float* norm = scratch + kChunk;  // [kChunk]
  AccumulateSoftmax<T>(ops, d, pool, cand, count, s, o, m, z, split_ns,
                       [&](int64_t c0, int64_t nc, [[maybe_unused]] bool vectorized) {
    const int32_t* cc = cand + c0;
#ifdef PIGJAX_X86
    if (vectorized) {
      avx2::GatherDotNorms<T>(q, d, pool, cc, nc, count - c0, ahead_n, s, norm);
    } else
#endif
    {
      for (int64_t j = 0; j < nc; ++j) {
        if (c0 + j + ahead_n < count) PrefetchLines(rows + cc[j + ahead_n] * rb, rb);
        scalar::DotNorm(q, pool.mu, key(cc[j]), d, pool.k_scale(cc[j]), &s[j], &norm[j]);
      }
    }
    return ops.scores(s, norm, nc, params, log_u, s);
  });
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_SAMPLED_ATTENTION_H_
