// Kernels of the "proxy" pool estimator (issue 12; the jnp twin is pigjax/estimators.py):
// every pool key has a per-channel quantized copy of its centred key (the index); a query scores
// every key on the index, reads the top ceil(fraction * n) keys exactly, and estimates the
// softmax mass of the rest from their proxy scores with the pool's mean V as their value.
//
// Pure C++: no XLA, no nanobind. Scalar and AVX2+FMA versions behind the same run-time choice as
// kernels.h (`UseAvx2`, PIGJAX_KERNELS=scalar forces the scalar ones).
#ifndef PIGJAX_XLA_FFI_PROXY_H_
#define PIGJAX_XLA_FFI_PROXY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla_ffi/kernels.h"

namespace pigjax {

// Index layout. bits <= 4: channels in groups of 16, 8 bytes a group; byte j holds channel j in
// its low nibble and channel j + 8 in its high nibble, so one 8-byte load unpacks to two runs of
// 8 consecutive channels (two AVX2 lanes of floats) with an and, a shift and two widenings.
// bits 5..8: one byte per channel, groups of 8. Channels past head_dim are padding (code 0,
// weight 0), so a token's codes are `ProxyCodeBytes` bytes and the scan needs no tail loop.
struct ProxyLayout {
  int bits;
  int64_t d;       // head_dim
  int64_t padded;  // channels including padding
  int64_t bytes;   // index bytes per token

  ProxyLayout(int bits_, int64_t d_) : bits(bits_), d(d_) {
    const int64_t group = bits <= 4 ? 16 : 8;
    padded = (d + group - 1) / group * group;
    bytes = bits <= 4 ? padded / 2 : padded;
  }
  float levels() const { return static_cast<float>((1 << bits) - 1); }
};

// Codes of one centred key into out[layout.bytes]: code_e = clamp(round((kc_e - lo_e) *
// inv_step_e), 0, levels), inv_step = 1 / step, rounding ties to even (nearbyint in the default
// mode), exactly the float32 operations of estimators.quantize_with_stats.
inline void PackProxyCodes(const ProxyLayout& l, const float* kc, const float* lo,
                           const float* inv_step, uint8_t* out) {
  const float levels = l.levels();
  auto code = [&](int64_t e) -> uint8_t {
    if (e >= l.d) return 0;
    const float c = std::nearbyint((kc[e] - lo[e]) * inv_step[e]);
    return static_cast<uint8_t>(std::clamp(c, 0.f, levels));
  };
  if (l.bits <= 4) {
    for (int64_t g = 0; g < l.padded / 16; ++g) {
      for (int j = 0; j < 8; ++j) {
        out[8 * g + j] = static_cast<uint8_t>(code(16 * g + j) | (code(16 * g + j + 8) << 4));
      }
    }
  } else {
    for (int64_t e = 0; e < l.padded; ++e) out[e] = code(e);
  }
}

// Code of channel e of a packed token (for tests and the scalar scan).
inline int ProxyCode(const ProxyLayout& l, const uint8_t* codes, int64_t e) {
  if (l.bits > 4) return codes[e];
  const int64_t g = e / 16, j = e % 16;
  const uint8_t b = codes[8 * g + (j & 7)];
  return j < 8 ? (b & 0xf) : (b >> 4);
}

// Proxy scores of tokens [t0, t1) for `heads` query heads that share this index:
//   out[h * out_stride + t] = bias[h] + sum_e w[h * padded + e] * code_e(t)
// where w = scale * q * step (0 on padding) and bias = scale * (q . lo + q . mu), which is
// scale * (q . (lo + code * step) + q . mu): the reference's q . deq(k~) + q . mu, regrouped.
namespace scalar {
inline void ProxyScores(const ProxyLayout& l, const uint8_t* codes, int64_t t0, int64_t t1,
                        const float* w, const float* bias, int heads, float* out,
                        int64_t out_stride) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* c = codes + t * l.bytes;
    for (int h = 0; h < heads; ++h) {
      const float* wh = w + h * l.padded;
      float s = 0.f;
      for (int64_t e = 0; e < l.padded; ++e) s += wh[e] * static_cast<float>(ProxyCode(l, c, e));
      out[h * out_stride + t] = bias[h] + s;
    }
  }
}

// Keeps ids with s >= tau (ascending, into sel; returns the count) and returns, through z, the
// sum of exp(s - tau) over the others (the tail's softmax mass relative to tau). Writes up to
// kScanSlack ids past the last kept one.
inline int64_t SplitAtThreshold(const float* s, int64_t n, float tau, int32_t* sel, float* z) {
  int64_t count = 0;
  float zs = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = s[i] >= tau;
    sel[count] = static_cast<int32_t>(i);
    count += keep;
    if (!keep) zs += std::exp(s[i] - tau);
  }
  *z = zs;
  return count;
}
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {
#define PIGJAX_AVX2 __attribute__((target("avx2,fma")))

// NH query heads (1..4) of one kv head and two tokens per iteration: each token's codes are
// unpacked once, each weight vector loaded once for both tokens, and the 2 x NH accumulators stay
// in registers (NH is a template parameter, so the head loops unroll).
template <int NH>
PIGJAX_AVX2 inline void ProxyScoresHeads(const ProxyLayout& l, const uint8_t* codes, int64_t t0,
                                         int64_t t1, const float* w, const float* bias,
                                         float* out, int64_t out_stride) {
  const __m128i low4 = _mm_set1_epi8(0x0f);
  auto unpack16 = [&](const uint8_t* p, __m256& lo, __m256& hi) PIGJAX_AVX2 {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, low4)));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low4)));
  };
  auto unpack8 = [&](const uint8_t* p) PIGJAX_AVX2 {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2) {
    const uint8_t* c0 = codes + t * l.bytes;
    const uint8_t* c1 = c0 + l.bytes;
    __m256 a0[NH], a1[NH];
    for (int h = 0; h < NH; ++h) a0[h] = a1[h] = _mm256_setzero_ps();
    if (l.bits <= 4) {
      for (int64_t g = 0; g < l.padded / 16; ++g) {
        __m256 lo0, hi0, lo1, hi1;
        unpack16(c0 + 8 * g, lo0, hi0);
        unpack16(c1 + 8 * g, lo1, hi1);
        for (int h = 0; h < NH; ++h) {
          const __m256 wl = _mm256_loadu_ps(w + h * l.padded + 16 * g);
          const __m256 wh = _mm256_loadu_ps(w + h * l.padded + 16 * g + 8);
          a0[h] = _mm256_fmadd_ps(wh, hi0, _mm256_fmadd_ps(wl, lo0, a0[h]));
          a1[h] = _mm256_fmadd_ps(wh, hi1, _mm256_fmadd_ps(wl, lo1, a1[h]));
        }
      }
    } else {
      for (int64_t g = 0; g < l.padded / 8; ++g) {
        const __m256 x0 = unpack8(c0 + 8 * g), x1 = unpack8(c1 + 8 * g);
        for (int h = 0; h < NH; ++h) {
          const __m256 wv = _mm256_loadu_ps(w + h * l.padded + 8 * g);
          a0[h] = _mm256_fmadd_ps(wv, x0, a0[h]);
          a1[h] = _mm256_fmadd_ps(wv, x1, a1[h]);
        }
      }
    }
    for (int h = 0; h < NH; ++h) {
      out[h * out_stride + t] = bias[h] + HSum(a0[h]);
      out[h * out_stride + t + 1] = bias[h] + HSum(a1[h]);
    }
  }
  if (t < t1) scalar::ProxyScores(l, codes, t, t1, w, bias, NH, out, out_stride);
}

PIGJAX_AVX2 inline void ProxyScores(const ProxyLayout& l, const uint8_t* codes, int64_t t0,
                                    int64_t t1, const float* w, const float* bias, int heads,
                                    float* out, int64_t out_stride) {
  for (int h0 = 0; h0 < heads;) {
    const int nh = std::min(4, heads - h0);
    const float* wh = w + h0 * l.padded;
    float* oh = out + h0 * out_stride;
    switch (nh) {
      case 4: ProxyScoresHeads<4>(l, codes, t0, t1, wh, bias + h0, oh, out_stride); break;
      case 3: ProxyScoresHeads<3>(l, codes, t0, t1, wh, bias + h0, oh, out_stride); break;
      case 2: ProxyScoresHeads<2>(l, codes, t0, t1, wh, bias + h0, oh, out_stride); break;
      default: ProxyScoresHeads<1>(l, codes, t0, t1, wh, bias + h0, oh, out_stride); break;
    }
    h0 += nh;
  }
}

PIGJAX_AVX2 inline int64_t SplitAtThreshold(const float* s, int64_t n, float tau, int32_t* sel,
                                            float* z) {
  static const BitPositions table;
  const __m256 vt = _mm256_set1_ps(tau);
  __m256 vz = _mm256_setzero_ps();
  int64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    const __m256 keep = _mm256_cmp_ps(x, vt, _CMP_GE_OQ);
    // Kept scores are >= tau, so exp(min(s - tau, 0)) never overflows; they are masked out.
    const __m256 e = Exp8(_mm256_min_ps(_mm256_sub_ps(x, vt), _mm256_setzero_ps()));
    vz = _mm256_add_ps(vz, _mm256_andnot_ps(keep, e));
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_ps(keep));
    const __m256i p = _mm256_add_epi32(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(table.pos[bits])),
        _mm256_set1_epi32(static_cast<int32_t>(i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sel + count), p);
    count += __builtin_popcount(bits);
  }
  float zs = HSum(vz);
  for (; i < n; ++i) {
    const bool keep = s[i] >= tau;
    sel[count] = static_cast<int32_t>(i);
    count += keep;
    if (!keep) zs += std::exp(s[i] - tau);
  }
  *z = zs;
  return count;
}
#undef PIGJAX_AVX2
}  // namespace avx2
#endif  // PIGJAX_X86

struct ProxyOps {
  const char* isa;
  void (*scores)(const ProxyLayout&, const uint8_t*, int64_t, int64_t, const float*,
                 const float*, int, float*, int64_t);
  int64_t (*split)(const float*, int64_t, float, int32_t*, float*);
};

inline const ProxyOps& GetProxyOps() {
  static const ProxyOps scalar_ops{"scalar", &scalar::ProxyScores, &scalar::SplitAtThreshold};
#ifdef PIGJAX_X86
  static const ProxyOps avx2_ops{"avx2", &avx2::ProxyScores, &avx2::SplitAtThreshold};
  if (UseAvx2()) return avx2_ops;
#endif
  return scalar_ops;
}

// k_keep = ceil(fraction * n) in float32, clamped to [min(n, 1), n]: estimators.keep_count.
inline int64_t ProxyKeepCount(float fraction, int64_t n) {
  const int64_t k = static_cast<int64_t>(std::ceil(fraction * static_cast<float>(n)));
  return std::clamp<int64_t>(k, std::min<int64_t>(n, 1), n);
}

// The k-th largest of s[0, n) (1 <= k <= n). Below a few thousand scores, or for large k, a
// selection over a copy; otherwise a threshold from a strided sample first filters the scores
// down to a few more than k (one vectorisable pass), and the selection runs over those. The
// result is exact either way: a sample threshold that keeps fewer than k falls back.
inline float KthLargest(const float* s, int64_t n, int64_t k, std::vector<float>& buf) {
  constexpr int64_t kStride = 16;
  auto select = [&](int64_t m) {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.begin() + m, std::greater<float>());
    return buf[k - 1];
  };
  buf.resize(n);
  if (n >= 4096 && k * 8 <= n) {
    const int64_t m = n / kStride;
    for (int64_t j = 0; j < m; ++j) buf[j] = s[j * kStride];
    // Sample rank a quarter above k's expected rank (plus a margin): usually keeps 1.25 k + 64.
    const int64_t r = std::min(m - 1, k / kStride + k / (4 * kStride) + 4);
    std::nth_element(buf.begin(), buf.begin() + r, buf.begin() + m, std::greater<float>());
    const float theta = buf[r];
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      buf[kept] = s[i];
      kept += s[i] >= theta;
    }
    if (kept >= k) return select(kept);
  }
  std::copy(s, s + n, buf.begin());
  return select(n);
}

// Exact attention over the rows cand[0..count): the running (o, m, z) of AccumulateAttention
// without importance weights: s = scale * q . k with raw keys (DESIGN.md step 2).
template <typename T>
void AccumulateExact(const VecOps& ops, const float* q, int64_t d, const PoolView& pool,
                     const int32_t* cand, int64_t count, float scale, float* scratch, float* o,
                     float& m, float& z) {
  const char* rows = pool.rows;
  const int64_t rb = pool.row_bytes, ahead_n = PrefetchAhead();
  auto header = [&](int64_t i) { return reinterpret_cast<const RowHeader*>(rows + i * rb); };
  auto key = [&](int64_t i) { return reinterpret_cast<const T*>(rows + i * rb + kRowHeaderBytes); };
  float* s = scratch;  // [kChunk]
  for (int64_t c0 = 0; c0 < count; c0 += kChunk) {
    const int64_t nc = std::min(kChunk, count - c0);
    float mc = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c = c0 + j;
      if (c + ahead_n < count) PrefetchLines(rows + cand[c + ahead_n] * rb, rb);
      const int64_t i = cand[c];
      s[j] = header(i)->k_scale * ops.Dot(q, key(i), d) * scale;
      mc = std::max(mc, s[j]);
    }
    if (mc > m) {
      if (z > 0.f) {
        const float r = std::exp(m - mc);
        z *= r;
        for (int64_t e = 0; e < d; ++e) o[e] *= r;
      }
      m = mc;
    }
    z += ops.exp_sum(s, nc, m);
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t i = cand[c0 + j];
      ops.Axpy(s[j] * header(i)->v_scale, key(i) + d, o, d);
    }
  }
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_PROXY_H_
