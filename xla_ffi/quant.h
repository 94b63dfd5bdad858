// Weight-quantized matrix multiplication for the decode step: y = x W^T with W kept in llama.cpp's
// 32-element block formats (DESIGN.md section 6, "Quantized weights").
//
// XLA:CPU has no fast mixed int8 x f32 dot (it materialises an f32 copy of an int8 weight first),
// so decode reads the quantized blocks here. The activation rows are quantized once per call to
// int8 blocks with an f32 scale (and the block's exact f32 sum, used by the weights' offset
// term), and every block product is an integer dot: AVX2 `maddubs`/`madd` (the sign trick for
// signed weights) with one FMA per block by the product of the two scales; a scalar fallback does
// the same integer arithmetic. Several output rows share each activation load, and rows are split
// over a thread pool.
//
// Block layouts (identical to ggml's, so GGUF tensors are used as stored):
//   Q8_0: f16 d, int8 q[32]                  w_j = d q_j                           34 bytes
//   Q4_0: f16 d, u8 nib[16]                  w_j = d (nib_j - 8)                   18 bytes
//   Q4_1: f16 d, f16 m, u8 nib[16]           w_j = d nib_j + m                     20 bytes
// where nib_j is the low nibble of byte j for j < 16 and the high nibble of byte j - 16 after.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_QUANT_H_
#define PIGJAX_XLA_FFI_QUANT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define PIGJAX_QUANT_X86 1
#include <immintrin.h>
#endif

namespace pigjax::quant {

constexpr int kBlock = 32;

enum class Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int kNumFormats = 3;

inline int BlockBytes(Format f) {
  switch (f) {
    case Format::kQ8_0: return 34;
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
  }
  return 0;
}

inline const char* FormatName(Format f) {
  switch (f) {
    case Format::kQ8_0: return "q8_0";
    case Format::kQ4_0: return "q4_0";
    case Format::kQ4_1: return "q4_1";
  }
  return "?";
}

// One quantized activation block, x_j ~ d (256 q_j + r_j), and s = sum_j x_j exactly (in f32).
// q is the int8 quantization of x with scale 256 d = max|x| / 127; r (the "low" byte) quantizes
// what q leaves (at most half a step) 256 times finer. With r the block products are exact to
// about 16 bits of the activation (the float32 result of the dequantized weights, to rounding);
// without it (r = 0, 8-bit activations, as llama.cpp does) they cost one integer dot less.
struct ActBlock {
  float d;
  float s;
  int8_t q[kBlock];
  int8_t r[kBlock];
};

// IEEE half -> float (for the scalar path and for tests; the AVX2 path uses F16C).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToFloat(h);
}

// The weight of block `blk` as (d, offset coefficient c, signed codes): every format is
// sum_j w_j x_j = d * sum_j code_j x_j + c * sum_j x_j with code = q, c = 0 (Q8_0);
// code = nibble - 8, c = 0 (Q4_0); code = nibble - 8, c = m + 8 d (Q4_1). Centred codes keep the
// offset term small, so it does not cancel most of the product (which would magnify the
// activations' rounding errors).
inline void UnpackScalar(Format f, const uint8_t* blk, float* d, float* c, int32_t* code) {
  *d = LoadHalf(blk);
  if (f == Format::kQ8_0) {
    *c = 0.f;
    for (int j = 0; j < kBlock; ++j) code[j] = static_cast<int8_t>(blk[2 + j]);
    return;
  }
  const uint8_t* nib = blk + (f == Format::kQ4_1 ? 4 : 2);
  *c = f == Format::kQ4_1 ? LoadHalf(blk + 2) + 8.f * *d : 0.f;
  for (int j = 0; j < 16; ++j) {
    code[j] = (nib[j] & 0xF) - 8;
    code[j + 16] = (nib[j] >> 4) - 8;
  }
}

namespace scalar {

// Quantizes k (a multiple of 32) floats into k / 32 blocks: d = max|x| / 127, q = round(x / d)
// (nearest, ties to even, as the AVX2 conversion does). Non-finite inputs give a non-finite d and
// so a non-finite result, rather than a silently wrong finite one.
inline void QuantizeRow(const float* x, int64_t k, bool low, ActBlock* out) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f, s = 0.f;
    for (int j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      s += xb[j];
    }
    if (std::isnan(s)) amax = s;
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int j = 0; j < kBlock; ++j) {
      const float q = std::nearbyint(xb[j] * id);
      out[b].q[j] = static_cast<int8_t>(q);
      // The remainder in steps of d / 256: |x id - q| <= 1/2, so |r| <= 128 (clamped to 127).
      out[b].r[j] = low ? static_cast<int8_t>(std::clamp(
                              std::nearbyint((xb[j] * id - q) * 256.f), -127.f, 127.f))
                        : 0;
    }
    out[b].d = d / 256.f;
    out[b].s = s;
  }
}

// y[m * ldy + n] for rows n in [n0, n1) and batch rows m in [0, M).
inline void MatMulRows(Format f, bool /*low: r is 0 without it*/, const uint8_t* w, int64_t nb,
                       const ActBlock* xq, int64_t M, int64_t n0, int64_t n1, float* y,
                       int64_t ldy) {
  const int bytes = BlockBytes(f);
  int32_t code[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        float d, c;
        UnpackScalar(f, w + (n * nb + b) * bytes, &d, &c, code);
        const ActBlock& a = xq[m * nb + b];
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += code[j] * (256 * a.q[j] + a.r[j]);
        acc += d * a.d * static_cast<float>(dot) + c * a.s;
      }
      y[m * ldy + n] = acc;
    }
  }
}

}  // namespace scalar

#ifdef PIGJAX_QUANT_X86
namespace avx2 {

#define PIGJAX_QUANT_AVX2 __attribute__((target("avx2,fma,f16c")))

PIGJAX_QUANT_AVX2 inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

PIGJAX_QUANT_AVX2 inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 32 int32 lanes (4 vectors) -> 32 int8 (saturating; packs interleave 128-bit lanes and the
// permute undoes it).
PIGJAX_QUANT_AVX2 inline __m256i PackInt8(const __m256i* q) {
  const __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23),
                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

PIGJAX_QUANT_AVX2 inline void QuantizeRow(const float* x, int64_t k, bool low, ActBlock* out) {
  const __m256 sign_mask = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
      sum = _mm256_add_ps(sum, v[i]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax_s = _mm_cvtss_f32(m4);
    const float s = HSum(sum);
    if (std::isnan(s)) amax_s = s;  // max_ps drops NaNs; keep them visible (see scalar)
    const float d = amax_s / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m256 idv = _mm256_set1_ps(id), k256 = _mm256_set1_ps(256.f);
    const __m256 lo_max = _mm256_set1_ps(127.f), lo_min = _mm256_set1_ps(-127.f);
    __m256i q[4], r[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 scaled = _mm256_mul_ps(v[i], idv);
      const __m256 qf = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(qf);
      const __m256 rf = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(scaled, qf), k256),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r[i] = low ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rf, lo_min), lo_max))
                 : _mm256_setzero_si256();
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q), PackInt8(q));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].r), PackInt8(r));
    out[b].d = d / 256.f;
    out[b].s = s;
  }
}

// The 32 signed codes of a block as bytes (see UnpackScalar).
template <Format F>
PIGJAX_QUANT_AVX2 inline __m256i Codes(const uint8_t* blk) {
  if constexpr (F == Format::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i raw =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == Format::kQ4_1 ? 4 : 2)));
    const __m256i both =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    return _mm256_sub_epi8(both, _mm256_set1_epi8(8));
  }
}

// sum_j code_j x_j as 8 int32 lanes (x int8).
template <Format F>
PIGJAX_QUANT_AVX2 inline __m256i Dot8(__m256i codes, __m256i x) {
  // maddubs takes unsigned x signed: |w| times x with w's sign moved onto x.
  const __m256i p16 =
      _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(x, codes));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// sum_j code_j (256 q_j + r_j) as 8 float lanes; kLow = false skips r (8-bit activations).
template <Format F, bool kLow>
PIGJAX_QUANT_AVX2 inline __m256 BlockDot(__m256i codes, const ActBlock& a) {
  __m256i dot = _mm256_slli_epi32(
      Dot8<F>(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q))), 8);
  if constexpr (kLow) {
    dot = _mm256_add_epi32(
        dot, Dot8<F>(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.r))));
  }
  return _mm256_cvtepi32_ps(dot);
}

// Rows [n0, n1): four rows per pass share each activation block load.
template <Format F, bool kLow>
PIGJAX_QUANT_AVX2 void MatMulRowsT(const uint8_t* w, int64_t nb, const ActBlock* xq, int64_t M,
                                   int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int bytes = F == Format::kQ8_0 ? 34 : F == Format::kQ4_0 ? 18 : 20;
  constexpr int R = 4;
  const int64_t row_bytes = nb * bytes;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const ActBlock* xm = xq + m * nb;
      __m256 acc[R];
      float off[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), off[r] = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const float xd = xm[b].d, xs = xm[b].s;
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = wr + r * row_bytes + b * bytes;
          const float d = Half(blk);
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd), BlockDot<F, kLow>(Codes<F>(blk), xm[b]),
                                   acc[r]);
          if constexpr (F == Format::kQ4_1) off[r] += (Half(blk + 2) + 8.f * d) * xs;
        }
      }
      for (int r = 0; r < R; ++r) y[m * ldy + n + r] = HSum(acc[r]) + off[r];
    }
  }
  for (; n < n1; ++n) {  // the last rows one at a time
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const ActBlock* xm = xq + m * nb;
      __m256 acc = _mm256_setzero_ps();
      float off = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wr + b * bytes;
        const float d = Half(blk);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xm[b].d), BlockDot<F, kLow>(Codes<F>(blk), xm[b]),
                              acc);
        if constexpr (F == Format::kQ4_1) off += (Half(blk + 2) + 8.f * d) * xm[b].s;
      }
      y[m * ldy + n] = HSum(acc) + off;
    }
  }
}

template <bool kLow>
inline void MatMulRowsL(Format f, const uint8_t* w, int64_t nb, const ActBlock* xq, int64_t M,
                        int64_t n0, int64_t n1, float* y, int64_t ldy) {
  switch (f) {
    case Format::kQ8_0: return MatMulRowsT<Format::kQ8_0, kLow>(w, nb, xq, M, n0, n1, y, ldy);
    case Format::kQ4_0: return MatMulRowsT<Format::kQ4_0, kLow>(w, nb, xq, M, n0, n1, y, ldy);
    case Format::kQ4_1: return MatMulRowsT<Format::kQ4_1, kLow>(w, nb, xq, M, n0, n1, y, ldy);
  }
}

inline void MatMulRows(Format f, bool low, const uint8_t* w, int64_t nb, const ActBlock* xq,
                       int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (low) return MatMulRowsL<true>(f, w, nb, xq, M, n0, n1, y, ldy);
  return MatMulRowsL<false>(f, w, nb, xq, M, n0, n1, y, ldy);
}

}  // namespace avx2
#endif  // PIGJAX_QUANT_X86

struct QuantOps {
  const char* isa;
  // Quantizes one activation row of k floats (low: also the remainder byte r).
  void (*quantize_row)(const float* x, int64_t k, bool low, ActBlock* out);
  // y[m * ldy + n] for weight rows n in [n0, n1) and activation rows m in [0, M).
  void (*matmul_rows)(Format f, bool low, const uint8_t* w, int64_t nb, const ActBlock* xq,
                      int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy);
};

// AVX2+FMA+F16C when the CPU has them, else the scalar fallback; PIGJAX_KERNELS=scalar forces
// the fallback (as for the attend kernel's GetVecOps).
inline const QuantOps& GetQuantOps() {
  static const QuantOps scalar_ops{"scalar", &scalar::QuantizeRow, &scalar::MatMulRows};
#ifdef PIGJAX_QUANT_X86
  static const QuantOps avx2_ops{"avx2", &avx2::QuantizeRow, &avx2::MatMulRows};
  static const bool has_avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  const char* force = std::getenv("PIGJAX_KERNELS");
  if (has_avx2 && !(force && std::strcmp(force, "scalar") == 0)) return avx2_ops;
#endif
  return scalar_ops;
}

}  // namespace pigjax::quant

#endif  // PIGJAX_XLA_FFI_QUANT_H_
