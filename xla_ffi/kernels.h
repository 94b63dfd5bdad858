// Numerical kernels of MagicPIG's sampled attention (docs/design.md, "The algorithm", steps 5-8).
//
// Pure C++: no XLA, no nanobind. Vector primitives come in a scalar version and an AVX2+FMA
// version selected at run time (`GetVecOps`), so the library never requires AVX512 and never
// executes an instruction the CPU lacks.
#ifndef PIGJAX_XLA_FFI_KERNELS_H_
#define PIGJAX_XLA_FFI_KERNELS_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define PIGJAX_X86 1
#include <immintrin.h>
#endif

namespace pigjax {

inline uint64_t NowNsKernel() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// bfloat16 as its raw bits; a distinct type so it cannot be confused with an integer.
struct bf16 {
  uint16_t bits;
};

inline float ToF32(float x) { return x; }
inline float ToF32(int8_t x) { return static_cast<float>(x); }
inline float ToF32(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as jnp's float32 -> bfloat16 cast does; NaN stays NaN.
inline bf16 ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

template <typename T> T FromF32(float x);
template <> inline float FromF32<float>(float x) { return x; }
template <> inline bf16 FromF32<bf16>(float x) { return ToBf16(x); }

// ---------------------------------------------------------------------------------------------
// Sampling probability (step 6).

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

// ---------------------------------------------------------------------------------------------
// Vector primitives, each in a scalar and an AVX2+FMA version:
//   Dot(q, k), Axpy(w, v, o)      q, o in f32; k, v rows in f32 or bf16.
//   Scores(qk, norms, ...) -> max  s = q.k / sqrt(D) - log u(cos) for a chunk of candidates.
//   ExpSum(s, n, m) -> sum         s = exp(s - m) in place.
//   LogUs(cos, n, table, out)      out = log u(cos) (for tests; Scores inlines it).

// Branch-free id extractions (the proxy's selection) write up to this many ids past the last hit.
constexpr int64_t kScanSlack = 8;

// Per-query constants of the score (docs/design.md, "The algorithm", steps 6-7).
struct ScoreParams {
  float q_mu;    // q . mu: the centred-key cosine is (q.k - q.mu) / (|q| |k - mu|)
  float q_norm;  // |q|
  float scale;   // 1 / sqrt(D)
};

namespace scalar {
template <typename T>
float Dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
  for (int64_t i = 0; i < d; ++i) s += q[i] * ToF32(k[i]);
  return s;
}
template <typename T>
void Axpy(float w, const T* v, float* o, int64_t d) {
  for (int64_t i = 0; i < d; ++i) o[i] += w * ToF32(v[i]);
}
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
inline float ExpSum(float* s, int64_t n, float m) {
  float z = 0.f;
  for (int64_t c = 0; c < n; ++c) z += (s[c] = std::exp(s[c] - m));
  return z;
}
inline void LogUs(const float* cos, int64_t n, const LogCollisionTable& log_u, float* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = log_u(cos[c]);
}
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {
#define PIGJAX_AVX2 __attribute__((target("avx2,fma")))

PIGJAX_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
PIGJAX_AVX2 inline __m256 Load8(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
PIGJAX_AVX2 inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
PIGJAX_AVX2 inline __m256 Set(float x) { return _mm256_set1_ps(x); }
PIGJAX_AVX2 inline float HSum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
PIGJAX_AVX2 inline float HMax(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <typename T>
PIGJAX_AVX2 float Dot(const float* q, const T* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(Load8(q + i), Load8(k + i), a0);
    a1 = _mm256_fmadd_ps(Load8(q + i + 8), Load8(k + i + 8), a1);
  }
  for (; i + 8 <= d; i += 8) a0 = _mm256_fmadd_ps(Load8(q + i), Load8(k + i), a0);
  float s = HSum(_mm256_add_ps(a0, a1));
  for (; i < d; ++i) s += q[i] * ToF32(k[i]);
  return s;
}
template <typename T>
PIGJAX_AVX2 void Axpy(float w, const T* v, float* o, int64_t d) {
  const __m256 ww = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(ww, Load8(v + i), Load8(o + i)));
  }
  for (; i < d; ++i) o[i] += w * ToF32(v[i]);
}

// Elementary functions in float32, 8 lanes, to about 1 ulp: the classic Cephes polynomials
// (S. L. Moshier's single-precision acosf/asinf, logf and expf), written out for AVX2.

// acos(x) for x in [-1, 1]. |x| <= 1/2: pi/2 - asin(x); |x| > 1/2: acos(|x|) = 2 asin(r) with
// r = sqrt((1 - |x|) / 2), and acos(-|x|) = pi - acos(|x|).
PIGJAX_AVX2 inline __m256 Acos8(__m256 x) {
  const __m256 sign = Set(-0.f), half = Set(0.5f);
  const __m256 a = _mm256_andnot_ps(sign, x);
  const __m256 big = _mm256_cmp_ps(a, half, _CMP_GT_OQ);
  const __m256 zb = _mm256_mul_ps(half, _mm256_sub_ps(Set(1.f), a));
  const __m256 t = _mm256_blendv_ps(a, _mm256_sqrt_ps(zb), big);
  const __m256 z = _mm256_blendv_ps(_mm256_mul_ps(a, a), zb, big);
  __m256 poly = _mm256_fmadd_ps(Set(4.2163199048e-2f), z, Set(2.4181311049e-2f));
  poly = _mm256_fmadd_ps(poly, z, Set(4.5470025998e-2f));
  poly = _mm256_fmadd_ps(poly, z, Set(7.4953002686e-2f));
  poly = _mm256_fmadd_ps(poly, z, Set(1.6666752422e-1f));
  const __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(t, z), poly, t);  // asin(t)
  const __m256 pi = Set(static_cast<float>(M_PI));
  const __m256 small = _mm256_sub_ps(Set(static_cast<float>(M_PI_2)),
                                     _mm256_or_ps(r, _mm256_and_ps(sign, x)));
  const __m256 r2 = _mm256_add_ps(r, r);
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(small, _mm256_blendv_ps(r2, _mm256_sub_ps(pi, r2), neg), big);
}

// log(x) for finite x > 0 (normal): x = m 2^e with m in [sqrt(1/2), sqrt(2)).
PIGJAX_AVX2 inline __m256 Log8(__m256 x) {
  const __m256i xi = _mm256_castps_si256(x);
  const __m256i ei = _mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, Set(1.41421356237f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, Set(0.5f)), big);
  const __m256 e = _mm256_add_ps(_mm256_cvtepi32_ps(ei), _mm256_and_ps(big, Set(1.f)));
  const __m256 f = _mm256_sub_ps(m, Set(1.f));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 poly = _mm256_fmadd_ps(Set(7.0376836292e-2f), f, Set(-1.1514610310e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(1.1676998740e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(-1.2420140846e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(1.4249322787e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(-1.6668057665e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(2.0000714765e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(-2.4999993993e-1f));
  poly = _mm256_fmadd_ps(poly, f, Set(3.3333331174e-1f));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(poly, f), z);
  y = _mm256_fmadd_ps(e, Set(-2.12194440e-4f), y);  // log 2 = 0.693359375 - 2.12194440e-4
  y = _mm256_fnmadd_ps(Set(0.5f), z, y);
  return _mm256_fmadd_ps(e, Set(0.693359375f), _mm256_add_ps(f, y));
}

// exp(x) for x <= 0; below -87.3 (where float32 exp leaves the normal range) it returns
// exp(-87.3) ~ 1e-38 instead of a subnormal or 0, which no softmax sum can notice.
PIGJAX_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, Set(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, Set(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, Set(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, Set(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 poly = _mm256_fmadd_ps(Set(1.9875691500e-4f), x, Set(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, x, Set(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, x, Set(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, x, Set(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, x, Set(5.0000001201e-1f));
  const __m256 y = _mm256_fmadd_ps(poly, z, _mm256_add_ps(x, Set(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

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

PIGJAX_AVX2 inline float ExpSum(float* s, int64_t n, float m) {
  __m256 z = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 w = Exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), Set(m)));
    _mm256_storeu_ps(s + c, w);
    z = _mm256_add_ps(z, w);
  }
  float zs = HSum(z);
  for (; c < n; ++c) zs += (s[c] = std::exp(s[c] - m));
  return zs;
}

// Positions of the set bits of every byte value, padded with zeros: a scan stores all 8 and
// advances by the popcount, so extracting hits needs no branch (at a 5-15% hit rate a branch per
// hit or per byte would mispredict constantly).
struct BitPositions {
  alignas(32) int32_t pos[256][8];
  BitPositions() {
    for (int b = 0; b < 256; ++b) {
      int k = 0;
      for (int j = 0; j < 8; ++j) pos[b][j] = 0;
      for (int j = 0; j < 8; ++j) {
        if (b >> j & 1) pos[b][k++] = j;
      }
    }
  }
};

// Eight dot products in one vector: lane j = the horizontal sum of a[j] (the classic hadd tree).
PIGJAX_AVX2 inline __m256 HSum8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// Row kernels for head dims that are a multiple of 8, over n rows found by `row(t)` (a const T*
// to a row's d elements): cache rows (decode_attention.h) or the pool's candidate rows
// (AccumulateAttention).

// out[t] = q . row(t), eight rows per pass so that one hadd tree replaces eight horizontal sums.
template <typename T, typename RowAt>
PIGJAX_AVX2 void RowDots(const float* q, int64_t d, int64_t n, RowAt row, float* out) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const T* r[8];
    for (int j = 0; j < 8; ++j) r[j] = row(t + j);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, Load8(r[j] + i), acc[j]);
    }
    _mm256_storeu_ps(out + t, HSum8(acc));
  }
  for (; t < n; ++t) out[t] = Dot(q, row(t), d);
}

// out[0:8*NV] += sum_t w[t] row(t)[0:8*NV]: the NV accumulators stay in registers across rows.
template <int NV, typename T, typename RowAt>
PIGJAX_AVX2 void WeightedSum(const float* w, int64_t n, RowAt row, float* out) {
  __m256 acc[NV];
  for (int s = 0; s < NV; ++s) acc[s] = _mm256_loadu_ps(out + 8 * s);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 wt = _mm256_set1_ps(w[t]);
    const T* v = row(t);
    for (int s = 0; s < NV; ++s) acc[s] = _mm256_fmadd_ps(wt, Load8(v + 8 * s), acc[s]);
  }
  for (int s = 0; s < NV; ++s) _mm256_storeu_ps(out + 8 * s, acc[s]);
}

// out[0:d] += sum_t w[t] row(t)[0:d], 64 lanes (8 registers) at a time.
template <typename T, typename RowAt>
PIGJAX_AVX2 void WeightedRows(const float* w, int64_t d, int64_t n, RowAt row, float* out) {
  for (int64_t i = 0; i < d; i += 64) {
    auto part = [&](int64_t t) { return row(t) + i; };
    switch (std::min<int64_t>(d - i, 64) / 8) {
      case 8: WeightedSum<8, T>(w, n, part, out + i); break;
      case 7: WeightedSum<7, T>(w, n, part, out + i); break;
      case 6: WeightedSum<6, T>(w, n, part, out + i); break;
      case 5: WeightedSum<5, T>(w, n, part, out + i); break;
      case 4: WeightedSum<4, T>(w, n, part, out + i); break;
      case 3: WeightedSum<3, T>(w, n, part, out + i); break;
      case 2: WeightedSum<2, T>(w, n, part, out + i); break;
      default: WeightedSum<1, T>(w, n, part, out + i); break;
    }
  }
}
#undef PIGJAX_AVX2
}  // namespace avx2
#endif  // PIGJAX_X86

struct VecOps {
  const char* isa;
  float (*dot_f32)(const float*, const float*, int64_t);
  float (*dot_bf16)(const float*, const bf16*, int64_t);
  void (*axpy_f32)(float, const float*, float*, int64_t);
  void (*axpy_bf16)(float, const bf16*, float*, int64_t);
  float (*dot_i8)(const float*, const int8_t*, int64_t);
  void (*axpy_i8)(float, const int8_t*, float*, int64_t);
  float (*scores)(const float*, const float*, int64_t, const ScoreParams&,
                  const LogCollisionTable&, float*);
  float (*exp_sum)(float*, int64_t, float);
  void (*log_us)(const float*, int64_t, const LogCollisionTable&, float*);

  float Dot(const float* q, const float* k, int64_t d) const { return dot_f32(q, k, d); }
  float Dot(const float* q, const bf16* k, int64_t d) const { return dot_bf16(q, k, d); }
  void Axpy(float w, const float* v, float* o, int64_t d) const { axpy_f32(w, v, o, d); }
  void Axpy(float w, const bf16* v, float* o, int64_t d) const { axpy_bf16(w, v, o, d); }
  float Dot(const float* q, const int8_t* k, int64_t d) const { return dot_i8(q, k, d); }
  void Axpy(float w, const int8_t* v, float* o, int64_t d) const { axpy_i8(w, v, o, d); }
};

inline VecOps ScalarVecOps() {
  return VecOps{"scalar", &scalar::Dot<float>, &scalar::Dot<bf16>, &scalar::Axpy<float>,
                &scalar::Axpy<bf16>, &scalar::Dot<int8_t>, &scalar::Axpy<int8_t>,
                &scalar::Scores, &scalar::ExpSum, &scalar::LogUs};
}

// Whether to run the AVX2+FMA kernels: the CPU has them and PIGJAX_KERNELS=scalar is not set in
// the environment (it forces the portable fallback, for tests and for comparing the two).
inline bool UseAvx2() {
#ifdef PIGJAX_X86
  static const bool has_avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  const char* force = std::getenv("PIGJAX_KERNELS");
  return has_avx2 && !(force && std::strcmp(force, "scalar") == 0);
#else
  return false;
#endif
}

// The best primitives this CPU supports (see UseAvx2).
inline const VecOps& GetVecOps() {
  static const VecOps scalar_ops = ScalarVecOps();
#ifdef PIGJAX_X86
  static const VecOps avx2_ops{"avx2", &avx2::Dot<float>, &avx2::Dot<bf16>, &avx2::Axpy<float>,
                               &avx2::Axpy<bf16>, &avx2::Dot<int8_t>, &avx2::Axpy<int8_t>,
                               &avx2::Scores, &avx2::ExpSum,
                               &avx2::LogUs};
  if (UseAvx2()) return avx2_ops;
#endif
  return scalar_ops;
}

// ---------------------------------------------------------------------------------------------
// Candidate collection (step 5).

// Per-worker scratch of the lookup: a byte per pool token counting the query's buckets that hold
// it, and a buffer the buckets' ids are first copied into. Copying first lets the bucket reads
// (a few lines each, at random places of a large table) overlap each other as plain loads,
// instead of stalling the counting loop one table at a time: in a micro-benchmark at 32k tokens
// (84 pools of 150 tables, ~13k ids walked per query) a lookup took 31-33 us with the counting
// done on the tables themselves (two bitsets, once and twice) and 21-22 us copied first, then
// counted in bytes (4 us of that is the counting; the bitsets' two read-modify-writes per id took
// twice as long). The counts are zero between queries: the final scan clears what it reads.
struct CollisionCounter {
  std::vector<uint8_t> count;  // [>= pool size, rounded up to 16], all zero between queries
  std::vector<uint16_t> walk;  // copied bucket ids of a segment, up to kWalkIds

  static constexpr int64_t kWalkIds = int64_t{1} << 15;  // 64 KiB: stays in L2
  void Reserve(int64_t n) {
    const size_t padded = size_t((n + 15) / 16 * 16);
    if (count.size() < padded) count.resize(padded, 0);
    if (walk.size() < size_t(kWalkIds)) walk.resize(kWalkIds);
  }
  uint64_t Bytes() const { return count.capacity() + 2 * walk.capacity(); }
};

// The tables of a pool come in segments of kSegmentTokens consecutive tokens, each with its own
// bucket offsets, so that a token id within its segment fits 16 bits: half the bytes of int32 ids
// in memory (the tables are most of a pool: 150 x 2 bytes per token against a 256-byte bf16 row)
// and half the cache lines a lookup walks. An append only touches the last segment.
constexpr int64_t kSegmentTokens = int64_t{1} << 16;
// Alignment of a pool's rows: rows of a multiple of 64 bytes then start on cache lines.
constexpr size_t kRowAlign = 64;

// std::allocator for the pool rows and table ids, on kRowAlign-byte boundaries (malloc gives
// 16: a large block sits 16 bytes past a page start, and a 256-byte row would then touch five
// lines). On Linux, blocks of 2 MiB and more are fresh 2 MiB-aligned mappings advised as huge
// pages (THP "madvise" or "always"): the gather touches a random row of a GB-sized pool per
// candidate and the lookup a random bucket of each table, and with 4 KiB pages nearly every one
// is a TLB miss as well as a cache miss. (malloc would hand back heap memory already faulted in
// 4 KiB pages, which the advice does not convert.)
// PIGJAX_HUGE_PAGES=0 in the environment leaves the huge-page advice out (to measure it).
inline bool HugePagesWanted() {
  static const bool wanted = [] {
    const char* e = std::getenv("PIGJAX_HUGE_PAGES");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return wanted;
}

template <typename T>
struct RowAllocator {
  using value_type = T;
  static constexpr size_t kHuge = size_t{2} << 20;
  RowAllocator() = default;
  template <typename U>
  RowAllocator(const RowAllocator<U>&) {}
  static size_t RoundUp(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
#if defined(__linux__)
    if (bytes >= kHuge) {
      const size_t size = RoundUp(bytes, kHuge);
      char* raw = static_cast<char*>(mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      if (raw == MAP_FAILED) throw std::bad_alloc();
      char* p = reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(raw), kHuge));
      if (p > raw) munmap(raw, p - raw);
      if (raw + kHuge > p) munmap(p + size, raw + kHuge - p);
      if (HugePagesWanted()) madvise(p, size, MADV_HUGEPAGE);  // advice: no THP, no effect
      return reinterpret_cast<T*>(p);
    }
#endif
    return static_cast<T*>(::operator new(bytes, std::align_val_t(kRowAlign)));
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
#if defined(__linux__)
    if (bytes >= kHuge) {
      munmap(p, RoundUp(bytes, kHuge));
      return;
    }
#endif
    ::operator delete(p, std::align_val_t(kRowAlign));
  }
  template <typename U>
  bool operator==(const RowAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const RowAllocator<U>&) const { return false; }
};

struct TableSegment {
  std::vector<int32_t> offsets;  // [L, 2^K + 1]: bucket starts per table
  std::vector<uint16_t, RowAllocator<uint16_t>> ids;  // [L, stride]: ids - segment start, by bucket
  int64_t stride = 0;            // ids room per table (grown for all tables at once)
  const uint16_t* table(int64_t t) const { return ids.data() + t * stride; }
  uint16_t* table(int64_t t) { return ids.data() + t * stride; }
};

// Adds 1 to the count of each of ids[0, len), relative to `count`.
inline void CountIds(const uint16_t* ids, int64_t len, uint8_t* count) {
  for (int64_t j = 0; j < len; ++j) count[ids[j]] += 1;
}

// Writes the ids i < n with count[i] >= 2, ascending, into cand and returns how many; clears
// count[0, n rounded up to 16). Scalar: writes up to one id past the last candidate.
inline int64_t TakeCollided(uint8_t* count, int64_t n, int32_t* cand) {
  int64_t c = 0;
#ifdef PIGJAX_X86
  // SSE2 (every x86-64): 16 counts per compare; count >= 2 <=> min(count, 2) == 2 (unsigned).
  const __m128i two = _mm_set1_epi8(2), zero = _mm_setzero_si128();
  for (int64_t i = 0; i < n; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(count + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(count + i), zero);
    uint32_t m = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(v, two), two)));
    for (; m; m &= m - 1) cand[c++] = static_cast<int32_t>(i + __builtin_ctz(m));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    cand[c] = static_cast<int32_t>(i);
    c += count[i] >= 2;
    count[i] = 0;
  }
  std::fill(count + n, count + (n + 15) / 16 * 16, uint8_t{0});
#endif
  return c;
}

// Requests a bucket's ids (up to 16 cache lines) ahead of its copy. A bucket is a few lines
// somewhere in a large table: left to the hardware prefetcher, each line would be a DRAM miss.
inline void PrefetchBucket(const uint16_t* row, int32_t begin, int32_t end) {
  const char* p = reinterpret_cast<const char*>(row + begin);
  const char* stop = reinterpret_cast<const char*>(row + std::min(end, begin + 16 * 32));
  for (; p < stop; p += 64) __builtin_prefetch(p, 0, 3);
}

// Tables per pass over a segment: a token's count after a pass is at most 2 + 253 = 255 (counts
// are clamped to 2 between passes), so it never wraps in its byte.
constexpr int kTablesPerPass = 253;

// Counts, for each token of one segment, the query's buckets that hold it. `count` points at the
// segment's first token; `codes`: the query's L codes, already checked to lie in [0, 2^K).
inline void CountSegment(const TableSegment& seg, int64_t seg_tokens, const int32_t* codes,
                         int num_bits, int num_tables, uint8_t* count, uint16_t* walk) {
  const int64_t stride = (int64_t{1} << num_bits) + 1;
  constexpr int kAhead = 16;
  constexpr int64_t kWalk = CollisionCounter::kWalkIds;
  int32_t begin[kTablesPerPass], end[kTablesPerPass];
  for (int t0 = 0; t0 < num_tables; t0 += kTablesPerPass) {
    if (t0 > 0) {
      for (int64_t i = 0; i < seg_tokens; ++i) count[i] = std::min<uint8_t>(count[i], 2);
    }
    const int nt = std::min(num_tables - t0, kTablesPerPass);
    // Each table's bucket is elsewhere in memory (a miss per table): read all bucket bounds
    // first (independent loads that overlap), then copy the buckets with the next ones
    // prefetched, and count from the copy.
    for (int t = 0; t < nt; ++t) {
      const int32_t* off = seg.offsets.data() + (t0 + t) * stride + codes[t0 + t];
      begin[t] = off[0];
      end[t] = off[1];
    }
    for (int t = 0; t < std::min(nt, kAhead); ++t) {
      PrefetchBucket(seg.table(t0 + t), begin[t], end[t]);
    }
    int64_t pos = 0;
    for (int t = 0; t < nt; ++t) {
      if (t + kAhead < nt) {
        PrefetchBucket(seg.table(t0 + t + kAhead), begin[t + kAhead], end[t + kAhead]);
      }
      const uint16_t* ids = seg.table(t0 + t) + begin[t];
      const int64_t len = end[t] - begin[t];
      if (pos + len > kWalk) {
        CountIds(walk, pos, count);
        pos = 0;
      }
      if (len > kWalk) {  // a bucket larger than the buffer: count it in place
        CountIds(ids, len, count);
        continue;
      }
      std::memcpy(walk + pos, ids, sizeof(uint16_t) * len);
      pos += len;
    }
    CountIds(walk, pos, count);
  }
}

// Writes to `cand`, in ascending order, every pool token (id < n) that shares the query's code in
// at least 2 tables; returns the count. Ascending ids make the later K/V gathers walk memory
// forwards. The caller has reserved the counter for n and `cand` for n + kScanSlack ids.
// `segments`: the pool's table segments (segment s holds tokens from s * kSegmentTokens).
inline int64_t CollectCandidates(const std::vector<TableSegment>& segments, const int32_t* codes,
                                 int num_bits, int num_tables, int64_t n,
                                 CollisionCounter& counter, int32_t* cand) {
  // (Segments past the pool's tokens may exist: allocated by an insert that then failed.)
  const size_t used = std::min(segments.size(), size_t((n + kSegmentTokens - 1) / kSegmentTokens));
  for (size_t s = 0; s < used; ++s) {
    const int64_t first = int64_t(s) * kSegmentTokens;
    CountSegment(segments[s], std::min(kSegmentTokens, n - first), codes, num_bits, num_tables,
                 counter.count.data() + first, counter.walk.data());
  }
  return TakeCollided(counter.count.data(), n, cand);
}

// ---------------------------------------------------------------------------------------------
// Importance-weighted attention over the candidates (steps 6-8).

// One pool token is one row: its K then its V (docs/design.md, "The host store"), a candidate
// being one contiguous gather. Rows hold nothing else: at head_dim 64 a bfloat16 row is 256 bytes,
// four whole cache lines of a 64-byte-aligned pool (a 16-byte header of |k - mu| and the scales
// would make it 272 bytes, five lines: the gather is bound by lines in flight, not by bytes).
// |k - mu| is recomputed from the row while the dot product reads it. int8 rows hold
// round(x / scale), scale = max |x| / 127, with the K and V scales of row i in a side array
// (scales[2i], [2i+1]); float32 and bfloat16 rows have no scales (1).
inline int64_t RowBytes(int64_t d, int64_t elem_bytes) {
  return (2 * d * elem_bytes + 15) / 16 * 16;
}
struct PoolView {
  const char* rows;     // [n] rows of row_bytes: K [D] of T, V [D] of T
  int64_t row_bytes;
  const float* scales;  // int8 rows: [n, 2] K and V scales; null for float rows (scale 1)
  const float* mu;      // [D]
  int64_t n;

  float k_scale(int64_t i) const { return scales ? scales[2 * i] : 1.f; }
  // w[j] *= the V scale of row cc[j], for j < nc (nothing for float rows).
  void ScaleByV(const int32_t* cc, int64_t nc, float* w) const {
    if (scales) {
      for (int64_t j = 0; j < nc; ++j) w[j] *= scales[2 * int64_t{cc[j]} + 1];
    }
  }
};

// Candidates are processed in chunks: gather K rows and score the chunk (vectorised log u),
// then exp and accumulate its V rows, rescaling the running sum when the maximum grows (as in
// flash attention). A chunk's V rows are prefetched together with its K rows, so they are in
// cache by the time the chunk's second half needs them.
constexpr int64_t kChunk = 64;
// How many candidates ahead the gather prefetches: rows are scattered over the pool, so each is
// a cache miss unless requested early (about a DRAM latency's worth of work ahead).
constexpr int64_t kPrefetchAhead = 16;
// Scratch floats AccumulateAttention needs.
constexpr int64_t kAttentionScratch = 2 * kChunk;

// Every cache line of [p, p + bytes).
inline void PrefetchLines(const char* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < end; a += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
  }
}

inline int64_t PrefetchAhead() {
  static const int64_t ahead = [] {
    const char* e = std::getenv("PIGJAX_PREFETCH_AHEAD");
    return e ? std::max(1, std::atoi(e)) : kPrefetchAhead;
  }();
  return ahead;
}

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
#define PIGJAX_AVX2 __attribute__((target("avx2,fma")))
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
#undef PIGJAX_AVX2
}  // namespace avx2
#endif  // PIGJAX_X86

// Adds candidates `cand[0..count)` to a running softmax-weighted sum for one query: o[D] holds
// sum_c w_c v_c with w_c = exp(s_c - m), z = sum_c w_c, m the largest score so far (start from
// o = 0, z = 0, m = -inf). `scratch`: >= kAttentionScratch floats. Raw keys in the logits
// (centred keys only in the cosine; docs/design.md, "The algorithm", step 2). split_ns (optional,
// profiling): += wall time of the score and the softmax phases.
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
  // The AVX2 chunk kernels need whole 8-lane vectors per row; other head dims (and
  // PIGJAX_KERNELS=scalar) take the primitive-by-primitive path.
  [[maybe_unused]] const bool vectorized = std::strcmp(ops.isa, "avx2") == 0 && d % 8 == 0;
  for (int64_t c0 = 0; c0 < count; c0 += kChunk) {
    const int64_t nc = std::min(kChunk, count - c0);
    const int32_t* cc = cand + c0;
    const uint64_t t0 = split_ns ? NowNsKernel() : 0;
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
    const float mc = ops.scores(s, norm, nc, params, log_u, s);
    const uint64_t t1 = split_ns ? NowNsKernel() : 0;
    if (mc > m) {
      if (z > 0.f) {
        const float r = std::exp(m - mc);
        z *= r;
        for (int64_t e = 0; e < d; ++e) o[e] *= r;
      }
      m = mc;
    }
    z += ops.exp_sum(s, nc, m);
    pool.ScaleByV(cc, nc, s);
#ifdef PIGJAX_X86
    if (vectorized) {
      avx2::WeightedRows<T>(s, d, nc, [&](int64_t j) { return key(cc[j]) + d; }, o);
    } else
#endif
    {
      for (int64_t j = 0; j < nc; ++j) ops.Axpy(s[j], key(cc[j]) + d, o, d);
    }
    if (split_ns) {
      const uint64_t t2 = NowNsKernel();
      split_ns[0] += t1 - t0;
      split_ns[1] += t2 - t1;
    }
  }
}

// o[D] /= z and *lse = m + log z; an empty sum gives o = 0 and lse = -inf.
inline void FinishAttention(float* o, int64_t d, float m, float z, float* lse) {
  if (!(z > 0.f)) {
    std::fill(o, o + d, 0.f);
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const float inv_z = 1.f / z;
  for (int64_t j = 0; j < d; ++j) o[j] *= inv_z;
  *lse = m + std::log(z);
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_KERNELS_H_
