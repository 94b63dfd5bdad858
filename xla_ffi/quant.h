// Weight-quantized matrix multiplication for the decode step: y = x W^T with W kept in llama.cpp's
// 32-element block formats (docs/design.md, "Quantized weights").
//
// XLA:CPU has no fast mixed int8 x f32 dot (it materialises an f32 copy of an int8 weight first),
// so decode reads the quantized blocks here. The activation rows are quantized once per call to
// blocks of int16 values 256 q + r (q the int8 code, r an int8 remainder; see ActBlock) with an
// f32 scale and the block's exact f32 sum (used by the weights' offset term). Every block product
// is an integer dot: the weight codes widened to int16 and two AVX2 `madd`s, which costs the same
// as llama.cpp's 8-bit `maddubs` + `madd` (on the 2-core Zen machine both are bound by the one
// vector-multiply pipe) while keeping 16 bits of the activation. In the packed layout four
// output rows share each activation load and fold their dots into one vector for a single scale
// multiply (the GGUF layout runs row by row); a scalar fallback does the same integer
// arithmetic; rows are split over a thread pool.
//
// Block layouts (identical to ggml's, so GGUF tensors are used as stored):
//   Q8_0: f16 d, int8 q[32]                  w_j = d q_j                           34 bytes
//   Q4_0: f16 d, u8 nib[16]                  w_j = d (nib_j - 8)                   18 bytes
//   Q4_1: f16 d, f16 m, u8 nib[16]           w_j = d nib_j + m                     20 bytes
// where nib_j is the low nibble of byte j for j < 16 and the high nibble of byte j - 16 after.
//
// Packed layout (`packed`, what the model uses): the same bytes reordered (as llama.cpp's CPU
// backend repacks Q4_0 for its AVX2 kernel). The rows go in groups of four; a group stores its
// blocks in order, each as one "x4 block": the four rows' f16 scales d, for Q4_1 then their four
// f16 minimums m, then the four rows' codes, row after row:
//   Q8_0: d[4] q[4][32]  136 bytes      Q4_0: d[4] nib[4][16]  72 bytes
//   Q4_1: d[4] m[4] nib[4][16]  80 bytes
// A thread then reads one sequential stream, and the four rows' scales are one 8-byte load and
// one conversion (in the GGUF layout they are four 2-byte loads at a row's stride, twice for
// Q4_1: more instructions than the block products of a Q4 row).
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_QUANT_H_
#define PIGJAX_XLA_FFI_QUANT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "xla_ffi/cpu_features.h"
#include "xla_ffi/simd.h"  // the AVX2 horizontal sum and max

namespace pigjax::quant {

constexpr int kBlock = 32;

enum class Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int kNumFormats = 3;

constexpr int BlockBytes(Format f) {
  switch (f) {
    case Format::kQ8_0: return 34;
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
  }
  return 0;
}

// Bytes of a row's block before its codes (d, and m for Q4_1).
constexpr int HeaderBytes(Format f) { return f == Format::kQ4_1 ? 4 : 2; }

// Rows per group of the packed layout.
constexpr int kPackRows = 4;

inline const char* FormatName(Format f) {
  switch (f) {
    case Format::kQ8_0: return "q8_0";
    case Format::kQ4_0: return "q4_0";
    case Format::kQ4_1: return "q4_1";
  }
  return "?";
}

// One quantized activation block: x_j ~ d v_j with v_j = 256 q_j + r_j, and s = sum_j x_j exactly
// (in f32). q is the int8 quantization of x with scale 256 d = max|x| / 127; r (the "low" byte)
// quantizes what q leaves (at most half a step) 256 times finer. With r the block products are
// exact to about 16 bits of the activation (the float32 result of the dequantized weights, to
// rounding); without it (r = 0, 8-bit activations, as llama.cpp does) they round like llama.cpp's.
// v is stored as one int16 (|256 q + r| <= 32639), so a block product is two int16 `madd`s.
// sv = sum_j v_j (exact) turns the packed kernel's products with the raw nibbles into the centred
// products: sum_j (nib_j - 8) v_j = sum_j nib_j v_j - 8 sv.
struct ActBlock {
  float d;
  float s;
  int32_t sv;
  int16_t v[kBlock];
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
// The parts of a block lie at dp (f16 d), mp (f16 m, Q4_1 only) and codes.
inline void UnpackParts(Format f, const uint8_t* dp, const uint8_t* mp, const uint8_t* codes,
                        float* d, float* c, int32_t* code) {
  *d = LoadHalf(dp);
  if (f == Format::kQ8_0) {
    *c = 0.f;
    for (int j = 0; j < kBlock; ++j) code[j] = static_cast<int8_t>(codes[j]);
    return;
  }
  *c = f == Format::kQ4_1 ? LoadHalf(mp) + 8.f * *d : 0.f;
  for (int j = 0; j < 16; ++j) {
    code[j] = (codes[j] & 0xF) - 8;
    code[j + 16] = (codes[j] >> 4) - 8;
  }
}

inline void UnpackScalar(Format f, const uint8_t* blk, float* d, float* c, int32_t* code) {
  UnpackParts(f, blk, blk + 2, blk + HeaderBytes(f), d, c, code);
}

// Row i (0-3) of the x4 block at p (packed layout).
inline void UnpackPacked(Format f, const uint8_t* p, int i, float* d, float* c, int32_t* code) {
  const int code_bytes = BlockBytes(f) - HeaderBytes(f);
  UnpackParts(f, p + 2 * i, p + 2 * kPackRows + 2 * i,
              p + kPackRows * HeaderBytes(f) + i * code_bytes, d, c, code);
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
    int32_t sv = 0;
    for (int j = 0; j < kBlock; ++j) {
      const float q = std::nearbyint(xb[j] * id);
      // The remainder in steps of d / 256: |x id - q| <= 1/2, so |r| <= 128 (clamped to 127).
      const float r =
          low ? std::clamp(std::nearbyint((xb[j] * id - q) * 256.f), -127.f, 127.f) : 0.f;
      out[b].v[j] = static_cast<int16_t>(256.f * q + r);
      sv += out[b].v[j];
    }
    out[b].d = d / 256.f;
    out[b].s = s;
    out[b].sv = sv;
  }
}

// y[m * ldy + n] for rows n in [n0, n1) and batch rows m in [0, M); packed: w in the packed
// layout (n0 a multiple of 4, and n1 too unless it ends the matrix, which then has N % 4 == 0).
inline void MatMulRows(Format f, bool /*low: r is 0 without it*/, bool packed, const uint8_t* w,
                       int64_t nb, const ActBlock* xq, int64_t M, int64_t n0, int64_t n1,
                       float* y, int64_t ldy) {
  const int bytes = BlockBytes(f);
  int32_t code[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        float d, c;
        if (packed) {
          UnpackPacked(f, w + ((n / kPackRows) * nb + b) * kPackRows * bytes,
                       static_cast<int>(n % kPackRows), &d, &c, code);
        } else {
          UnpackScalar(f, w + (n * nb + b) * bytes, &d, &c, code);
        }
        const ActBlock& a = xq[m * nb + b];
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) dot += code[j] * a.v[j];
        acc += d * a.d * static_cast<float>(dot) + c * a.s;
      }
      y[m * ldy + n] = acc;
    }
  }
}

}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {

PIGJAX_AVX2_F16C inline int HSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

PIGJAX_AVX2_F16C inline uint16_t U16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

PIGJAX_AVX2_F16C inline void QuantizeRow(const float* x, int64_t k, bool low, ActBlock* out) {
  const __m256 sign_mask = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
      sum = _mm256_add_ps(sum, v[i]);
    }
    float amax_s = ::pigjax::avx2::HMax(amax);
    const float s = ::pigjax::avx2::HSum(sum);
    if (std::isnan(s)) amax_s = s;  // max_ps drops NaNs; keep them visible (see scalar)
    const float d = amax_s / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const __m256 idv = _mm256_set1_ps(id), k256 = _mm256_set1_ps(256.f);
    const __m256 lo_max = _mm256_set1_ps(127.f), lo_min = _mm256_set1_ps(-127.f);
    __m256i vi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 scaled = _mm256_mul_ps(v[i], idv);
      const __m256 qf = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256 vf = _mm256_mul_ps(qf, k256);
      if (low) {
        const __m256 rf = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(scaled, qf), k256),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        vf = _mm256_add_ps(vf, _mm256_min_ps(_mm256_max_ps(rf, lo_min), lo_max));
      }
      vi[i] = _mm256_cvtps_epi32(vf);
    }
    // packs interleaves 128-bit lanes; the permute restores element order.
    const __m256i v01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(vi[0], vi[1]), 0xD8);
    const __m256i v23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(vi[2], vi[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].v), v01);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].v + 16), v23);
    out[b].d = d / 256.f;
    out[b].s = s;
    out[b].sv = HSum(_mm256_add_epi32(_mm256_add_epi32(vi[0], vi[1]),
                                      _mm256_add_epi32(vi[2], vi[3])));
  }
}

// sum_j code_j v_j of one row's codes as 8 int32 lanes, with the raw nibbles (0..15) for Q4: the
// caller subtracts 8 sv (ActBlock) from the row's sum.
template <Format F>
PIGJAX_AVX2_F16C inline __m256i RawCodesDot(const uint8_t* codes, __m256i x0, __m256i x1) {
  __m256i c0, c1;
  if constexpr (F == Format::kQ8_0) {
    c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
  } else {
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    c0 = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    c1 = _mm256_srli_epi16(bytes, 4);
  }
  return _mm256_add_epi32(_mm256_madd_epi16(c0, x0), _mm256_madd_epi16(c1, x1));
}

// Rows [n0, n1) of the GGUF layout, one row at a time: the general path (any N) for weights the
// model does not pack (`quant.pack` needs N a multiple of 4); the model's weights take
// MatMulPackedT below.
template <Format F>
PIGJAX_AVX2_F16C void MatMulRowsT(const uint8_t* w, int64_t nb, const ActBlock* xq, int64_t M,
                                   int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int bytes = BlockBytes(F);
  const int64_t row_bytes = nb * bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const ActBlock* xm = xq + m * nb;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wr + b * bytes;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm[b].v));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm[b].v + 16));
        const float d = _cvtsh_ss(U16(blk));
        const int32_t dot = HSum(RawCodesDot<F>(blk + HeaderBytes(F), x0, x1)) -
                            (F == Format::kQ8_0 ? 0 : 8 * xm[b].sv);  // centred nibbles
        acc += d * xm[b].d * static_cast<float>(dot);
        if constexpr (F == Format::kQ4_1) acc += (_cvtsh_ss(U16(blk + 2)) + 8.f * d) * xm[b].s;
      }
      y[m * ldy + n] = acc;
    }
  }
}

// The packed layout's rows [n0, n1) (both multiples of 4), one group of four rows per pass: the
// four rows share each activation block load, and their four integer block dots are folded into
// one vector (lanes: rows 0-3, twice) that takes one scale multiply. The group's bytes are one
// stream and its scales one load. No software prefetch: the hardware prefetcher follows the one
// stream (0 to 4 KB ahead measured no faster on the Zen 4 VM).
template <Format F>
PIGJAX_AVX2_F16C void MatMulPackedT(const uint8_t* w, int64_t nb, const ActBlock* xq, int64_t M,
                                     int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int x4_bytes = kPackRows * BlockBytes(F);
  constexpr int header = kPackRows * HeaderBytes(F);
  constexpr int code_bytes = BlockBytes(F) - HeaderBytes(F);
  for (int64_t n = n0; n < n1; n += kPackRows) {
    const uint8_t* group = w + (n / kPackRows) * nb * x4_bytes;
    for (int64_t m = 0; m < M; ++m) {
      const ActBlock* xm = xq + m * nb;
      __m256 acc = _mm256_setzero_ps();
      __m128 off = _mm_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = group + b * x4_bytes;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm[b].v));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm[b].v + 16));
        const uint8_t* codes = blk + header;
        const __m256i d0 = RawCodesDot<F>(codes, x0, x1);
        const __m256i d1 = RawCodesDot<F>(codes + code_bytes, x0, x1);
        const __m256i d2 = RawCodesDot<F>(codes + 2 * code_bytes, x0, x1);
        const __m256i d3 = RawCodesDot<F>(codes + 3 * code_bytes, x0, x1);
        __m256i dots = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
        if constexpr (F != Format::kQ8_0) {
          // Centre the nibbles: -8 sv in the low half's lanes (each row's sum is split over the
          // two halves, which the end adds).
          dots = _mm256_sub_epi32(dots, _mm256_zextsi128_si256(_mm_set1_epi32(8 * xm[b].sv)));
        }
        const __m128 dw =
            _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
        const __m128 scale = _mm_mul_ps(dw, _mm_set1_ps(xm[b].d));
        acc = _mm256_fmadd_ps(_mm256_set_m128(scale, scale), _mm256_cvtepi32_ps(dots), acc);
        if constexpr (F == Format::kQ4_1) {
          const __m128 mw =
              _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 8)));
          off = _mm_fmadd_ps(_mm_fmadd_ps(dw, _mm_set1_ps(8.f), mw), _mm_set1_ps(xm[b].s), off);
        }
      }
      const __m128 out = _mm_add_ps(
          _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)), off);
      alignas(16) float r4[4];
      _mm_store_ps(r4, out);
      for (int r = 0; r < kPackRows; ++r) y[m * ldy + n + r] = r4[r];
    }
  }
}

inline void MatMulRows(Format f, bool /*low: r is 0 without it*/, bool packed, const uint8_t* w,
                       int64_t nb, const ActBlock* xq, int64_t M, int64_t n0, int64_t n1,
                       float* y, int64_t ldy) {
  if (packed) {
    switch (f) {
      case Format::kQ8_0: return MatMulPackedT<Format::kQ8_0>(w, nb, xq, M, n0, n1, y, ldy);
      case Format::kQ4_0: return MatMulPackedT<Format::kQ4_0>(w, nb, xq, M, n0, n1, y, ldy);
      case Format::kQ4_1: return MatMulPackedT<Format::kQ4_1>(w, nb, xq, M, n0, n1, y, ldy);
    }
  }
  switch (f) {
    case Format::kQ8_0: return MatMulRowsT<Format::kQ8_0>(w, nb, xq, M, n0, n1, y, ldy);
    case Format::kQ4_0: return MatMulRowsT<Format::kQ4_0>(w, nb, xq, M, n0, n1, y, ldy);
    case Format::kQ4_1: return MatMulRowsT<Format::kQ4_1>(w, nb, xq, M, n0, n1, y, ldy);
  }
}

}  // namespace avx2
#endif  // PIGJAX_X86

struct QuantOps {
  const char* isa;
  // Quantizes one activation row of k floats (low: also the remainder byte r).
  void (*quantize_row)(const float* x, int64_t k, bool low, ActBlock* out);
  // y[m * ldy + n] for weight rows n in [n0, n1) and activation rows m in [0, M); packed: w in
  // the packed layout (n0 and n1 multiples of 4).
  void (*matmul_rows)(Format f, bool low, bool packed, const uint8_t* w, int64_t nb,
                      const ActBlock* xq, int64_t M, int64_t n0, int64_t n1, float* y,
                      int64_t ldy);
};

// AVX2+FMA+F16C when the CPU has them, else the scalar fallback; PIGJAX_KERNELS=scalar forces
// the fallback (as for the attend kernel's GetVecOps).
inline const QuantOps& GetQuantOps() {
  static const QuantOps scalar_ops{"scalar", &scalar::QuantizeRow, &scalar::MatMulRows};
#ifdef PIGJAX_X86
  static const QuantOps avx2_ops{"avx2", &avx2::QuantizeRow, &avx2::MatMulRows};
  if (UseAvx2F16c()) return avx2_ops;
#endif
  return scalar_ops;
}

}  // namespace pigjax::quant

#endif  // PIGJAX_XLA_FFI_QUANT_H_
