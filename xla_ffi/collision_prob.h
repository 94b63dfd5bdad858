// MagicPIG's sampling probability and score (docs/design.md, "The algorithm", step 6): log u(cos)
// exactly in double, as an interpolated table for the kernel, and the chunk scores
// s = q.k / sqrt(D) - log u(cos) in a scalar and an AVX2+FMA version:
//   Scores(qk, norms, ...) -> max  s for a chunk of candidates, and its maximum.
//   LogUs(cos, n, table, out)      out = log u(cos) (for tests; Scores inlines it).
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_COLLISION_PROB_H_
#define PIGJAX_XLA_FFI_COLLISION_PROB_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "xla_ffi/cpu_features.h"
#include "xla_ffi/simd.h"

namespace pigjax {

// Floor of u. In exact arithmetic u > 0 for every candidate, but when q and k~ point exactly
// opposite ways p = 0 and u = 0 (and just short of that, P = p^K underflows in float32), and
// -log(u) would be +inf. The floor caps the importance weight of such a token instead. Same value
// as pigjax/lsh.py's U_FLOOR.
constexpr double kMinCollisionProb = 1e-30;

// log u from y = log P = num_bits * log p, in double. u = 1 - (1-P)^L - L P (1-P)^(L-1)
// = 1 - (1-P)^(L-1) (1 + (L-1) P) cancels catastrophically when L P is small, so there u comes
// from its binomial series C(L,2) P^2 (1-P)^(L-2) (1 + sum_{j>=3} ...), as in pigjax/lsh.py.
// Not floored (see LogCollisionProbFromLogP).
inline double LogCollisionProbUnfloored(double y, int num_tables) {
  const double lt = num_tables, big_p = std::exp(y);
  double log_u;
  if (lt * big_p < 0.1) {
    const double ratio = big_p / (1.0 - big_p);
    double term = 1.0, rest = 0.0;
    for (int j = 3; j <= 10 && j <= num_tables; ++j) {
      term *= (lt - j + 1.0) / j * ratio;
      rest += term;
    }
    log_u = std::log(lt * (lt - 1.0) / 2.0) + 2.0 * y + (lt - 2.0) * std::log1p(-big_p) +
            std::log1p(rest);
  } else if (big_p >= 1.0) {
    log_u = 0.0;
  } else {
    log_u = std::log(-std::expm1((lt - 1.0) * std::log1p(-big_p) + std::log1p((lt - 1.0) * big_p)));
  }
  return log_u;
}

inline double LogCollisionProbFromLogP(double y, int num_tables) {
  return std::max(LogCollisionProbUnfloored(y, num_tables), std::log(kMinCollisionProb));
}

// Exact log u(cos) (docs/design.md, "The algorithm", step 6), in double. Slow; the kernel uses
// LogCollisionTable.
inline double LogCollisionProb(double cos, int num_bits, int num_tables) {
  const double p = 1.0 - std::acos(std::min(1.0, std::max(-1.0, cos))) / M_PI;
  if (p <= 0.0) return std::log(kMinCollisionProb);
  return LogCollisionProbFromLogP(num_bits * std::log(p), num_tables);
}

// log u(cos) for one (num_bits, num_tables): float acos and log give y = log P, and log u is
// interpolated linearly in y from a table. log u is smooth in y (for P -> 0 it tends to the line
// log C(L,2) + 2y, used below the table), and with 2^14 intervals on [-40, 0] the interpolation
// error is below 1e-6 for every L (checked for L in 2..1000), i.e. at float32 resolution.
// The table runs from y = 0 down, so the position x = y * (kSize / kLo) is a float product with
// full relative precision wherever y is (no y - kLo, whose rounding near y = 0 would lose the
// bits that place y inside its interval), and the vector version needs no double arithmetic.
// `operator()` is the scalar version; avx2::LogU8 below evaluates 8 at once the same way.
class LogCollisionTable {
 public:
  static constexpr int kSize = 1 << 14;
  static constexpr double kLo = -40.0;                // P = e^-40: far below where L P matters
  static constexpr float kLogFloor = -69.07755279f;  // log(kMinCollisionProb)
  static constexpr float kPerUnitY = static_cast<float>(kSize / kLo);  // intervals per unit of y

  LogCollisionTable(int num_bits, int num_tables)
      : num_bits_(static_cast<float>(num_bits)),
        log_pairs_(static_cast<float>(std::log(num_tables * (num_tables - 1.0) / 2.0))),
        table_(kSize + 1) {
    for (int i = 0; i <= kSize; ++i) {
      // Unfloored: interpolating across the floor's kink would blur it.
      table_[i] = static_cast<float>(LogCollisionProbUnfloored(kLo * double(i) / kSize,
                                                               num_tables));
    }
  }

  float operator()(float cos) const {
    const float p = 1.f - std::acos(std::min(1.f, std::max(-1.f, cos))) / static_cast<float>(M_PI);
    if (!(p > 0.f)) return kLogFloor;
    const float y = num_bits_ * std::log(p);
    const float x = y * kPerUnitY;
    if (!(x <= static_cast<float>(kSize))) return std::max(log_pairs_ + 2.f * y, kLogFloor);
    const int i = std::min(static_cast<int>(x), kSize - 1);
    const float f = x - static_cast<float>(i);
    return std::max(table_[i] + f * (table_[i + 1] - table_[i]), kLogFloor);
  }

  float num_bits() const { return num_bits_; }
  float log_pairs() const { return log_pairs_; }
  const float* data() const { return table_.data(); }

 private:
  float num_bits_, log_pairs_;
  std::vector<float> table_;  // log u at y = kLo * i / kSize
};

// Per-query constants of the score (docs/design.md, "The algorithm", steps 6-7).
struct ScoreParams {
  float q_mu;    // q . mu: the centred-key cosine is (q.k - q.mu) / (|q| |k - mu|)
  float q_norm;  // |q|
  float scale;   // 1 / sqrt(D)
};

namespace scalar {
inline float Score(float qk, float norm, const ScoreParams& p, const LogCollisionTable& log_u) {
  const float denom = p.q_norm * norm;
  // A zero query or a key equal to the mean has no direction: treat it as orthogonal.
  const float cos = denom > 0.f ? (qk - p.q_mu) / denom : 0.f;
  return qk * p.scale - log_u(cos);
}
// s[c] = score of candidate c from its q.k (qk) and |k - mu| (norms); s may alias qk.
inline float Scores(const float* qk, const float* norms, int64_t n, const ScoreParams& p,
                    const LogCollisionTable& log_u, float* s) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < n; ++c) {
    s[c] = Score(qk[c], norms[c], p, log_u);
    m = std::max(m, s[c]);
  }
  return m;
}
inline void LogUs(const float* cos, int64_t n, const LogCollisionTable& log_u, float* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = log_u(cos[c]);
}
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {

// LogCollisionTable::operator() for 8 cosines, the same steps.
PIGJAX_AVX2 inline __m256 LogU8(__m256 cos, const LogCollisionTable& t) {
  using LCT = LogCollisionTable;
  cos = _mm256_min_ps(Set(1.f), _mm256_max_ps(Set(-1.f), cos));
  // Divided, not multiplied by 1/pi: acos(-1) / pi is exactly 1, so p = 0 and cos = -1 floors.
  const __m256 p = _mm256_sub_ps(Set(1.f), _mm256_div_ps(Acos8(cos), Set(static_cast<float>(M_PI))));
  const __m256 valid = _mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_GT_OQ);
  const __m256 y = _mm256_mul_ps(Set(t.num_bits()), Log8(_mm256_blendv_ps(Set(1.f), p, valid)));
  // Below the table: the line log C(L,2) + 2y.
  const __m256 line = _mm256_fmadd_ps(Set(2.f), y, Set(t.log_pairs()));
  // Inside: x = y * size / lo, i = min(floor x, size - 1), f = x - i.
  const __m256 x = _mm256_mul_ps(y, Set(LCT::kPerUnitY));
  const __m256 i = _mm256_min_ps(Set(static_cast<float>(LCT::kSize - 1)),
                                 _mm256_floor_ps(x));
  const __m256 f = _mm256_sub_ps(x, i);
  const __m256i idx = _mm256_cvttps_epi32(i);
  const __m256 a = _mm256_i32gather_ps(t.data(), idx, 4);
  const __m256 b = _mm256_i32gather_ps(t.data() + 1, idx, 4);
  const __m256 inside = _mm256_fmadd_ps(f, _mm256_sub_ps(b, a), a);
  const __m256 below = _mm256_cmp_ps(x, Set(static_cast<float>(LCT::kSize)), _CMP_GT_OQ);
  const __m256 r = _mm256_max_ps(_mm256_blendv_ps(inside, line, below), Set(LCT::kLogFloor));
  return _mm256_blendv_ps(Set(LCT::kLogFloor), r, valid);
}

PIGJAX_AVX2 inline void LogUs(const float* cos, int64_t n, const LogCollisionTable& log_u,
                               float* out) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, LogU8(_mm256_loadu_ps(cos + c), log_u));
  for (; c < n; ++c) out[c] = log_u(cos[c]);
}

PIGJAX_AVX2 inline float Scores(const float* qk, const float* norms, int64_t n,
                                const ScoreParams& p, const LogCollisionTable& log_u, float* s) {
  __m256 vm = Set(-std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 vqk = _mm256_loadu_ps(qk + c);
    const __m256 denom = _mm256_mul_ps(Set(p.q_norm), _mm256_loadu_ps(norms + c));
    const __m256 pos = _mm256_cmp_ps(denom, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 cos = _mm256_and_ps(
        pos, _mm256_div_ps(_mm256_sub_ps(vqk, Set(p.q_mu)), _mm256_blendv_ps(Set(1.f), denom, pos)));
    const __m256 sc = _mm256_fmsub_ps(vqk, Set(p.scale), LogU8(cos, log_u));
    _mm256_storeu_ps(s + c, sc);
    vm = _mm256_max_ps(vm, sc);
  }
  float m = HMax(vm);
  for (; c < n; ++c) {
    s[c] = scalar::Score(qk[c], norms[c], p, log_u);
    m = std::max(m, s[c]);
  }
  return m;
}
}  // namespace avx2
#endif  // PIGJAX_X86

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_COLLISION_PROB_H_
