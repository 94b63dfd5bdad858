// Kernels of the "proxy" pool estimator (the jnp twin is pigjax/estimators.py):
// every pool key has a per-channel quantized copy of its centred key (the index); a query scores
// every key on the index, reads the top ceil(fraction * n) keys exactly, and estimates the
// softmax mass of the rest from their proxy scores with the pool's mean V as their value.
//
// Pure C++: no XLA, no nanobind. Scalar and AVX2+FMA versions behind the same run-time choice as
// the other kernels (cpu_features.h `UseAvx2`; PIGJAX_KERNELS=scalar forces the scalar ones).
#ifndef PIGJAX_XLA_FFI_PROXY_H_
#define PIGJAX_XLA_FFI_PROXY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla_ffi/cpu_features.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/softmax.h"
#include "xla_ffi/vec_ops.h"

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

// The query side of the scan (estimators.query_weights): w_e = scale * q_e * step_e rounded to
// int8 on a power-of-two grid, wq_e = clamp(round(w_e * 2^(7 - x)), -127, 127) where
// max_e |w_e| = f * 2^x, f in [0.5, 1) (frexp), and the scan's scores are
//   raw_t = 2^(x - 7) * sum_e wq_e * code_e(t)
// an exact integer sum scaled by a power of two: bit for bit the reference's, whatever the order
// of the sum. The bias scale * (q . lo + q . mu) is the same for every token of a head, so it is
// left out of the ranking and added to the tail's log-sum-exp only. Writes wq in the index's
// channel order (bits <= 4: group g's bytes 8g..8g+7 hold channels 16g..16g+7 and bytes
// padded/2 + 8g.. channels 16g+8..16g+15, matching the low and high nibbles of the codes; else
// channel order), padding 0, and returns the scale 2^(x - 7).
inline float QuantizeQueryWeights(const ProxyLayout& l, const float* w, int8_t* wq) {
  float m = 0.f;
  for (int64_t e = 0; e < l.d; ++e) m = std::max(m, std::fabs(w[e]));
  int x = 0;
  std::frexp(m, &x);
  const float inv = std::ldexp(1.f, 7 - x);
  std::fill(wq, wq + l.padded, int8_t{0});
  for (int64_t e = 0; e < l.d; ++e) {
    const int8_t v = static_cast<int8_t>(std::clamp(std::nearbyint(w[e] * inv), -127.f, 127.f));
    if (l.bits <= 4) {
      const int64_t g = e / 16, j = e % 16;
      wq[(j < 8 ? 0 : l.padded / 2) + 8 * g + (j & 7)] = v;
    } else {
      wq[e] = v;
    }
  }
  return std::ldexp(1.f, x - 7);
}

// Scores of tokens [t0, t1) for `heads` query heads that share this index:
//   out[h * out_stride + t] = sw[h] * sum_e wq[h * padded + e] * code_e(t)
// (wq, sw from QuantizeQueryWeights; the sum is exact in int32).
namespace scalar {
inline int32_t ProxyDot(const ProxyLayout& l, const uint8_t* c, const int8_t* wq) {
  int32_t s = 0;
  if (l.bits <= 4) {
    const int64_t half = l.padded / 2;
    for (int64_t j = 0; j < half; ++j) {
      s += (c[j] & 0xf) * wq[j] + (c[j] >> 4) * wq[half + j];
    }
  } else {
    for (int64_t e = 0; e < l.padded; ++e) s += c[e] * wq[e];
  }
  return s;
}

inline void ProxyScores(const ProxyLayout& l, const uint8_t* codes, int64_t t0, int64_t t1,
                        const int8_t* wq, const float* sw, int heads, float* out,
                        int64_t out_stride) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* c = codes + t * l.bytes;
    for (int h = 0; h < heads; ++h) {
      out[h * out_stride + t] = sw[h] * static_cast<float>(ProxyDot(l, c, wq + h * l.padded));
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

// One token's codes (bits <= 4) times one head's int8 weights: the low and high nibbles of its
// code bytes are two runs of unsigned bytes (channels 16g..16g+7 and 16g+8..16g+15 of each
// group), multiplied with the matching weights by maddubs (pairs of products summed to int16, at
// most 2 * 15 * 127 each, two of them added), then madd with ones to int32. Returns eight int32
// lanes whose sum is the dot. 32 code bytes (64 channels) per 256-bit step, 8 per 128-bit step.
PIGJAX_AVX2 inline __m256i NibbleDot(const uint8_t* c, const int8_t* w, int64_t half,
                                     int64_t wide) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (int64_t j = 0; j < wide; j += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j));
    const __m256i lo = _mm256_and_si256(b, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    const __m256i wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j));
    const __m256i wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + half + j));
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, wl), _mm256_maddubs_epi16(hi, wh));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  }
  if (wide == half) return acc;
  const __m128i low4x = _mm_set1_epi8(0x0f), onesx = _mm_set1_epi16(1);
  __m128i accx = _mm_setzero_si128();
  for (int64_t j = wide; j < half; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + j));
    const __m128i lo = _mm_and_si128(b, low4x);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4x);
    const __m128i wl = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j));
    const __m128i wh = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + half + j));
    const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(lo, wl), _mm_maddubs_epi16(hi, wh));
    accx = _mm_add_epi32(accx, _mm_madd_epi16(p, onesx));
  }
  return _mm256_add_epi32(acc, _mm256_set_m128i(_mm_setzero_si128(), accx));
}

// Eight tokens' int32 lane vectors -> their eight sums, in token order (an hadd tree, then the
// two 128-bit halves added).
PIGJAX_AVX2 inline __m256i Sum8x8(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4,
                                  __m256i v5, __m256i v6, __m256i v7) {
  const __m256i a0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  const __m256i a4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a0123, a4567, 0x20),
                          _mm256_permute2x128_si256(a0123, a4567, 0x31));
}

// bits <= 4: per block of eight tokens and per head, eight NibbleDots reduced by Sum8x8 and
// scaled by the head's power of two; the codes of a block stay in L1 across its heads.
PIGJAX_AVX2 inline void ProxyScoresNibbles(const ProxyLayout& l, const uint8_t* codes, int64_t t0,
                                           int64_t t1, const int8_t* wq, const float* sw,
                                           int heads, float* out, int64_t out_stride) {
  const int64_t half = l.padded / 2, wide = half / 32 * 32, tb = l.bytes;
  int64_t t = t0;
  if (half == 32) {  // head_dim 33..64: one 256-bit step per token, weights kept in registers
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (; t + 8 <= t1; t += 8) {
      const uint8_t* c = codes + t * tb;
      __m256i lo[8], hi[8];
      for (int j = 0; j < 8; ++j) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 32));
        lo[j] = _mm256_and_si256(b, low4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      }
      for (int h = 0; h < heads; ++h) {
        const int8_t* w = wq + h * l.padded;
        const __m256i wl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256i wh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
        __m256i v[8];
        for (int j = 0; j < 8; ++j) {
          v[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[j], wl),
                                                    _mm256_maddubs_epi16(hi[j], wh)), ones);
        }
        const __m256i sum = Sum8x8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
        _mm256_storeu_ps(out + h * out_stride + t,
                         _mm256_mul_ps(_mm256_set1_ps(sw[h]), _mm256_cvtepi32_ps(sum)));
      }
    }
  }
  for (; t + 8 <= t1; t += 8) {
    const uint8_t* c = codes + t * tb;
    for (int h = 0; h < heads; ++h) {
      const int8_t* w = wq + h * l.padded;
      const __m256i sum = Sum8x8(
          NibbleDot(c, w, half, wide), NibbleDot(c + tb, w, half, wide),
          NibbleDot(c + 2 * tb, w, half, wide), NibbleDot(c + 3 * tb, w, half, wide),
          NibbleDot(c + 4 * tb, w, half, wide), NibbleDot(c + 5 * tb, w, half, wide),
          NibbleDot(c + 6 * tb, w, half, wide), NibbleDot(c + 7 * tb, w, half, wide));
      _mm256_storeu_ps(out + h * out_stride + t,
                       _mm256_mul_ps(_mm256_set1_ps(sw[h]), _mm256_cvtepi32_ps(sum)));
    }
  }
  for (; t < t1; ++t) {  // the last < 8 tokens, one at a time
    const uint8_t* c = codes + t * tb;
    for (int h = 0; h < heads; ++h) {
      const __m256i v = NibbleDot(c, wq + h * l.padded, half, wide);
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1));
      out[h * out_stride + t] = sw[h] * static_cast<float>(_mm_cvtsi128_si32(s1));
    }
  }
}

// bits 5..8 (a byte per channel): the scalar sum, compiled for AVX2 so that it vectorises.
PIGJAX_AVX2 inline void ProxyScoresBytes(const ProxyLayout& l, const uint8_t* codes, int64_t t0,
                                         int64_t t1, const int8_t* wq, const float* sw, int heads,
                                         float* out, int64_t out_stride) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* c = codes + t * l.bytes;
    for (int h = 0; h < heads; ++h) {
      const int8_t* w = wq + h * l.padded;
      int32_t s = 0;
      for (int64_t e = 0; e < l.padded; ++e) s += int32_t{c[e]} * int32_t{w[e]};
      out[h * out_stride + t] = sw[h] * static_cast<float>(s);
    }
  }
}

PIGJAX_AVX2 inline void ProxyScores(const ProxyLayout& l, const uint8_t* codes, int64_t t0,
                                    int64_t t1, const int8_t* wq, const float* sw, int heads,
                                    float* out, int64_t out_stride) {
  if (l.bits > 4) return ProxyScoresBytes(l, codes, t0, t1, wq, sw, heads, out, out_stride);
  ProxyScoresNibbles(l, codes, t0, t1, wq, sw, heads, out, out_stride);
}

// One pass over s[0, n) against threshold t: the ids (and, with kScores, the scores) of s >= t
// are compressed, ascending, into ids (and kept); the others' exp(s - t) are summed into *z.
// Returns the count; writes up to 8 entries past it.
template <bool kScores>
PIGJAX_AVX2 inline int64_t CompressAtThreshold(const float* s, int64_t n, float t, int32_t* ids,
                                               float* kept, float* z) {
  static const BitPositions table;
  const __m256 vt = _mm256_set1_ps(t);
  __m256 vz = _mm256_setzero_ps();
  int64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    const __m256 keep = _mm256_cmp_ps(x, vt, _CMP_GE_OQ);
    // Kept scores are >= t, so exp(min(s - t, 0)) never overflows; they are masked out.
    const __m256 e = Exp8(_mm256_min_ps(_mm256_sub_ps(x, vt), _mm256_setzero_ps()));
    vz = _mm256_add_ps(vz, _mm256_andnot_ps(keep, e));
    // Stored whether or not any is kept: a branch on it would mispredict in a quarter of blocks.
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_ps(keep));
    const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(table.pos[bits]));
    if constexpr (kScores) _mm256_storeu_ps(kept + count, _mm256_permutevar8x32_ps(x, p));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids + count),
                        _mm256_add_epi32(p, _mm256_set1_epi32(static_cast<int32_t>(i))));
    count += __builtin_popcount(bits);
  }
  float zs = HSum(vz);
  for (; i < n; ++i) {
    const bool keep = s[i] >= t;
    ids[count] = static_cast<int32_t>(i);
    if constexpr (kScores) kept[count] = s[i];
    count += keep;
    if (!keep) zs += std::exp(s[i] - t);
  }
  *z = zs;
  return count;
}

PIGJAX_AVX2 inline int64_t SplitAtThreshold(const float* s, int64_t n, float tau, int32_t* sel,
                                            float* z) {
  return CompressAtThreshold<false>(s, n, tau, sel, nullptr, z);
}
}  // namespace avx2
#endif  // PIGJAX_X86

// k_keep = ceil(fraction * n) in float32, clamped to [min(n, 1), n]: estimators.keep_count.
inline int64_t ProxyKeepCount(float fraction, int64_t n) {
  const int64_t k = static_cast<int64_t>(std::ceil(fraction * static_cast<float>(n)));
  return std::clamp<int64_t>(k, std::min<int64_t>(n, 1), n);
}

// From this many scores on, KthLargest and avx2::SelectTop take the sampled threshold; below it a
// selection over all the scores. Low enough that a 4k context (a pool of 4028) takes the sampled
// path: a threshold of 4096 would cost it nine nth_elements over 4k scores per sparse layer.
constexpr int64_t kSampleMinScores = 1024;

// The (r + 1)-th largest of v[0, m) (0 <= r < m): exactly the value std::nth_element finds, in
// a few linear passes instead of its data-dependent branches (at 128k its two calls per head
// would be more than half of the proxy's selection). The range [min, max] is cut into kRankBins
// equal bins; x -> bin is monotone, so a higher bin holds only larger values, and the bin holding
// rank r is found by counting from the top; nth_element then runs over that bin's values alone.
// Below kRankMinValues values nth_element alone is faster (the bins cost a fixed 4 KiB).
// v is not modified; tmp has room for m floats.
constexpr int kRankBins = 1024;
constexpr int64_t kRankMinValues = 2048;
inline float LargestAt(const float* v, int64_t m, int64_t r, float* tmp) {
  auto select_all = [&] {
    std::copy(v, v + m, tmp);
    std::nth_element(tmp, tmp + r, tmp + m, std::greater<float>());
    return tmp[r];
  };
  if (m < kRankMinValues) return select_all();
  float lo = v[0], hi = v[0];
  for (int64_t i = 1; i < m; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  // One value, or a range too narrow to divide or too wide for a float: no bins.
  const float range = hi - lo, scale = static_cast<float>(kRankBins) / range;
  if (!(range > 0.f) || !std::isfinite(range) || !std::isfinite(scale)) return select_all();
  auto bin = [&](float x) {
    return std::min(kRankBins - 1, static_cast<int>((x - lo) * scale));
  };
  int32_t hist[kRankBins] = {};
  for (int64_t i = 0; i < m; ++i) hist[bin(v[i])] += 1;
  int b = kRankBins - 1;
  int64_t above = 0;  // values in the bins above b
  while (above + hist[b] <= r) above += hist[b--];
  int64_t c = 0;
  for (int64_t i = 0; i < m; ++i) {
    tmp[c] = v[i];
    c += bin(v[i]) == b;
  }
  std::nth_element(tmp, tmp + (r - above), tmp + c, std::greater<float>());
  return tmp[r - above];
}

// KthLargest's threshold from every 16th score: sample rank a quarter above k's expected rank
// (plus a margin), which usually keeps 1.25 k + 64 of n. Uses buf[0, n / 8).
inline float SampleThreshold(const float* s, int64_t n, int64_t k, std::vector<float>& buf) {
  constexpr int64_t kStride = 16;
  const int64_t m = n / kStride;
  if (buf.size() < size_t(n)) buf.resize(n);
  for (int64_t j = 0; j < m; ++j) buf[j] = s[j * kStride];
  const int64_t r = std::min(m - 1, k / kStride + k / (4 * kStride) + 4);
  return LargestAt(buf.data(), m, r, buf.data() + m);
}

// The k-th largest of s[0, n) (1 <= k <= n). Below kSampleMinScores scores, or for large k, a
// selection over all of them; otherwise a threshold from a strided sample first filters the
// scores down to a few more than k (one vectorisable pass), and the selection runs over those.
// The result is exact either way: a sample threshold that keeps fewer than k falls back.
inline float KthLargest(const float* s, int64_t n, int64_t k, std::vector<float>& buf) {
  buf.resize(2 * n);
  if (n >= kSampleMinScores && k * 8 <= n) {
    const float theta = SampleThreshold(s, n, k, buf);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      buf[kept] = s[i];
      kept += s[i] >= theta;
    }
    if (kept >= k) return LargestAt(buf.data(), kept, k - 1, buf.data() + kept);
  }
  return LargestAt(s, n, k - 1, buf.data());
}

// Selection and tail sum of one head: keeps (ascending, into sel; returns the count) the ids
// with s >= tau, tau the k-th largest of s[0, n), and returns tau and z = sum of exp(s - tau)
// over the others. Writes up to kScanSlack ids past the last kept one.
namespace scalar {
inline int64_t SelectTop(const float* s, int64_t n, int64_t k, std::vector<float>& buf,
                         std::vector<int32_t>& ids, int32_t* sel, float* tau, float* z) {
  (void)ids;
  *tau = KthLargest(s, n, k, buf);
  return SplitAtThreshold(s, n, *tau, sel, z);
}
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {
// One pass instead of three (KthLargest's filter, then the split's exp and compress): with the
// sample threshold theta, the scores >= theta and their ids are compressed into buf / ids while
// the others' exp(s - theta) are summed; tau is then selected among the few kept, and the kept
// ones below tau join the tail: z = exp(theta - tau) * sum_{s < theta} exp(s - theta) +
// sum_{theta <= s < tau} exp(s - tau). The same result as the scalar path up to float rounding
// of z. Falls back to it when the sample threshold keeps fewer than k.
PIGJAX_AVX2 inline int64_t SelectTop(const float* s, int64_t n, int64_t k,
                                     std::vector<float>& buf, std::vector<int32_t>& ids,
                                     int32_t* sel, float* tau, float* z) {
  if (n < kSampleMinScores || k * 8 > n) {
    *tau = KthLargest(s, n, k, buf);
    return SplitAtThreshold(s, n, *tau, sel, z);
  }
  const float theta = SampleThreshold(s, n, k, buf);
  ids.resize(n + 8);
  float* vb = buf.data();
  int32_t* ib = ids.data();
  float z_lo = 0.f;
  const int64_t kept = CompressAtThreshold<true>(s, n, theta, ib, vb, &z_lo);
  if (kept < k) {
    *tau = KthLargest(s, n, k, buf);
    return SplitAtThreshold(s, n, *tau, sel, z);
  }
  // tau among the kept (scratch for the selection placed after them).
  buf.resize(std::max<int64_t>(n, 2 * kept + 8));
  vb = buf.data();
  const float t = LargestAt(vb, kept, k - 1, vb + kept);
  float zs = z_lo * std::exp(theta - t);
  int64_t count = 0;
  for (int64_t j = 0; j < kept; ++j) {
    const bool keep = vb[j] >= t;
    sel[count] = ib[j];
    count += keep;
    if (!keep) zs += std::exp(vb[j] - t);
  }
  *tau = t;
  *z = zs;
  return count;
}
}  // namespace avx2
#endif  // PIGJAX_X86

struct ProxyOps {
  const char* isa;
  void (*scores)(const ProxyLayout&, const uint8_t*, int64_t, int64_t, const int8_t*,
                 const float*, int, float*, int64_t);
  int64_t (*select)(const float*, int64_t, int64_t, std::vector<float>&, std::vector<int32_t>&,
                    int32_t*, float*, float*);
};

inline const ProxyOps& GetProxyOps() {
  static const ProxyOps scalar_ops{"scalar", &scalar::ProxyScores, &scalar::SelectTop};
#ifdef PIGJAX_X86
  static const ProxyOps avx2_ops{"avx2", &avx2::ProxyScores, &avx2::SelectTop};
  if (UseAvx2()) return avx2_ops;
#endif
  return scalar_ops;
}

// Exact attention over the rows cand[0..count): the running (o, m, z) of AccumulateSoftmax
// without importance weights: s = scale * q . k with raw keys (docs/design.md, "The algorithm",
// step 2).
template <typename T>
void AccumulateExact(const VecOps& ops, const float* q, int64_t d, const PoolView& pool,
                     const int32_t* cand, int64_t count, float scale, float* scratch, float* o,
                     float& m, float& z) {
  const char* rows = pool.rows;
  const int64_t rb = pool.row_bytes, ahead_n = PrefetchAhead();
  auto key = [&](int64_t i) { return reinterpret_cast<const T*>(rows + i * rb); };
  float* s = scratch;  // [kChunk]
  AccumulateSoftmax<T>(ops, d, pool, cand, count, s, o, m, z, nullptr,
                       [&](int64_t c0, int64_t nc, bool) {
    float mc = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < nc; ++j) {
      const int64_t c = c0 + j;
      if (c + ahead_n < count) PrefetchLines(rows + cand[c + ahead_n] * rb, rb);
      const int64_t i = cand[c];
      s[j] = pool.k_scale(i) * ops.Dot(q, key(i), d) * scale;
      mc = std::max(mc, s[j]);
    }
    return mc;
  });
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_PROXY_H_
