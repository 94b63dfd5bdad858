// Vector primitives and row kernels shared by the host kernels (the store's attend, the proxy
// scan, the dense decode attention, the quantized matmul), each in a scalar and an AVX2+FMA
// version; cpu_features.h says which one runs.
//   Dot(q, k), Axpy(w, v, o)      q, o in f32; k, v rows in f32, bf16 or int8.
//   ExpSum(s, n, m) -> sum         s = exp(s - m) in place.
//   RowDots, WeightedRows          (AVX2) n rows at once, for head dims that are a multiple of 8.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_SIMD_H_
#define PIGJAX_XLA_FFI_SIMD_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "xla_ffi/cpu_features.h"

namespace pigjax {

inline uint64_t NowNs() {
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
inline float ExpSum(float* s, int64_t n, float m) {
  float z = 0.f;
  for (int64_t c = 0; c < n; ++c) z += (s[c] = std::exp(s[c] - m));
  return z;
}
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {

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
}  // namespace avx2
#endif  // PIGJAX_X86

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_SIMD_H_
