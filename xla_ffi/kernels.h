// Numerical kernels of MagicPIG's sampled attention (DESIGN.md section 1, steps 5-8).
//
// Pure C++: no XLA, no nanobind. Vector primitives come in a scalar version and an AVX2+FMA
// version selected at run time (`GetVecOps`), so the library never requires AVX512 and never
// executes an instruction the CPU lacks.
#ifndef PIGJAX_XLA_FFI_KERNELS_H_
#define PIGJAX_XLA_FFI_KERNELS_H_

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

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

// CPU time of the calling thread (profiling counters: unlike wall time it excludes time the
// thread spent descheduled, so the phase split stays meaningful on a busy machine).
inline uint64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

// bfloat16 as its raw bits; a distinct type so it cannot be confused with an integer.
struct bf16 {
  uint16_t bits;
};

inline float ToF32(float x) { return x; }
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
// Vector primitives: dot(q, k) and o += w * v with q, o in f32 and k, v in f32 or bf16.

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
}  // namespace scalar

#ifdef PIGJAX_X86
namespace avx2 {
#define PIGJAX_AVX2 __attribute__((target("avx2,fma")))

PIGJAX_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
PIGJAX_AVX2 inline __m256 Load8(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
PIGJAX_AVX2 inline float HSum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
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
#undef PIGJAX_AVX2
}  // namespace avx2
#endif  // PIGJAX_X86

struct VecOps {
  const char* isa;
  float (*dot_f32)(const float*, const float*, int64_t);
  float (*dot_bf16)(const float*, const bf16*, int64_t);
  void (*axpy_f32)(float, const float*, float*, int64_t);
  void (*axpy_bf16)(float, const bf16*, float*, int64_t);

  float Dot(const float* q, const float* k, int64_t d) const { return dot_f32(q, k, d); }
  float Dot(const float* q, const bf16* k, int64_t d) const { return dot_bf16(q, k, d); }
  void Axpy(float w, const float* v, float* o, int64_t d) const { axpy_f32(w, v, o, d); }
  void Axpy(float w, const bf16* v, float* o, int64_t d) const { axpy_bf16(w, v, o, d); }
};

inline VecOps ScalarVecOps() {
  return VecOps{"scalar", &scalar::Dot<float>, &scalar::Dot<bf16>, &scalar::Axpy<float>,
                &scalar::Axpy<bf16>};
}

// The best primitives this CPU supports. PIGJAX_KERNELS=scalar in the environment forces the
// portable fallback (for tests and for comparing the two).
inline const VecOps& GetVecOps() {
  static const VecOps scalar_ops = ScalarVecOps();
#ifdef PIGJAX_X86
  static const VecOps avx2_ops{"avx2", &avx2::Dot<float>, &avx2::Dot<bf16>, &avx2::Axpy<float>,
                               &avx2::Axpy<bf16>};
  static const bool has_avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  const char* force = std::getenv("PIGJAX_KERNELS");
  if (has_avx2 && !(force && std::strcmp(force, "scalar") == 0)) return avx2_ops;
#endif
  return scalar_ops;
}

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

// Exact log u(cos) (DESIGN.md step 6), in double. Slow; the kernel uses LogCollisionTable.
inline double LogCollisionProb(double cos, int num_bits, int num_tables) {
  const double p = 1.0 - std::acos(std::min(1.0, std::max(-1.0, cos))) / M_PI;
  if (p <= 0.0) return std::log(kMinCollisionProb);
  return LogCollisionProbFromLogP(num_bits * std::log(p), num_tables);
}

// log u(cos) for one (num_bits, num_tables), about 4x faster than LogCollisionProb: float acos
// and log give y = log P, and log u is interpolated linearly in y from a table. log u is smooth
// in y (for P -> 0 it tends to the line log C(L,2) + 2y, used below the table), and with 2^14
// intervals on [-40, 0] the interpolation error is below 1e-6 for every L (checked for L in
// 2..1000), i.e. at float32 resolution.
class LogCollisionTable {
 public:
  LogCollisionTable(int num_bits, int num_tables)
      : num_bits_(static_cast<float>(num_bits)),
        log_pairs_(static_cast<float>(std::log(num_tables * (num_tables - 1.0) / 2.0))),
        table_(kSize + 1) {
    for (int i = 0; i <= kSize; ++i) {
      // Unfloored: interpolating across the floor's kink would blur it.
      table_[i] = static_cast<float>(LogCollisionProbUnfloored(kLo * (1.0 - double(i) / kSize),
                                                               num_tables));
    }
  }

  float operator()(float cos) const {
    constexpr float kLogFloor = -69.07755279f;  // log(kMinCollisionProb)
    const float p = 1.f - std::acos(std::min(1.f, std::max(-1.f, cos))) / static_cast<float>(M_PI);
    if (!(p > 0.f)) return kLogFloor;
    const float y = num_bits_ * std::log(p);
    if (y < static_cast<float>(kLo)) return std::max(log_pairs_ + 2.f * y, kLogFloor);
    // In double: y + 40 in float would lose the bits that place y inside its interval.
    const double x = (static_cast<double>(y) - kLo) * (kSize / -kLo);
    const int i = std::min(static_cast<int>(x), kSize - 1);
    const float f = static_cast<float>(x - i);
    return std::max(table_[i] + f * (table_[i + 1] - table_[i]), kLogFloor);
  }

 private:
  static constexpr int kSize = 1 << 14;
  static constexpr double kLo = -40.0;  // P = e^-40: far below where L P matters
  float num_bits_, log_pairs_;
  std::vector<float> table_;  // log u at y = kLo * (1 - i / kSize)
};

// ---------------------------------------------------------------------------------------------
// Candidate collection (step 5).

// Per-worker scratch of the lookup: `mark[i]` < epoch means "not seen for this query", == epoch
// "seen once", == epoch + 1 "seen twice or more". Each query advances the epoch by 2. One byte
// per pool token keeps the array cache-resident (128 KiB at 128k tokens; the walk hits it at
// random), at the price of clearing it every 127 queries, which costs far less than one walk.
struct CollisionCounter {
  std::vector<uint8_t> mark;  // [>= pool size]
  uint32_t epoch = 0;

  // New entries start at 0, below every epoch in use.
  void Reserve(int64_t n) {
    if (mark.size() < size_t(n)) mark.resize(n, 0u);
  }
  void NextQuery() {
    if (epoch + 3 > 255) {
      std::fill(mark.begin(), mark.end(), uint8_t{0});  // all of it: stale marks past n look new
      epoch = 0;
    }
    epoch += 2;
  }
};

// Appends to `cand` every pool token that shares the query's code in at least 2 tables; returns
// the count. The caller has reserved the counter for the pool size. `offsets`: [L, 2^K + 1];
// `ids[t][.]`: token ids of table t sorted by bucket; `codes`: the query's L codes, already
// checked to lie in [0, 2^K). Branch-free: whether a token was seen is a coin flip per id, which
// a branch would mispredict half the time.
inline void CountCollisions(const int32_t* row, int32_t j, int32_t end, uint8_t* mark, uint8_t e,
                            uint8_t e1, int32_t* cand, int64_t& count);
constexpr int kMaxTablesOnStack = 256;

template <typename Tables>
int64_t CollectCandidates(const int32_t* offsets, const Tables& ids, const int32_t* codes,
                          int num_bits, int num_tables, CollisionCounter& counter, int32_t* cand) {
  counter.NextQuery();
  const uint8_t e = static_cast<uint8_t>(counter.epoch), e1 = static_cast<uint8_t>(e + 1);
  uint8_t* mark = counter.mark.data();
  const int64_t stride = (int64_t{1} << num_bits) + 1;
  // Each table's bucket is elsewhere in memory (a miss per table): read all bucket bounds first
  // (independent loads that overlap), then walk with the next tables' buckets prefetched.
  constexpr int kAhead = 4;
  int32_t begin[kMaxTablesOnStack], end[kMaxTablesOnStack];
  int64_t count = 0;
  for (int t0 = 0; t0 < num_tables; t0 += kMaxTablesOnStack) {
    const int nt = std::min(num_tables - t0, kMaxTablesOnStack);
    for (int t = 0; t < nt; ++t) {
      const int32_t* off = offsets + (t0 + t) * stride + codes[t0 + t];
      begin[t] = off[0];
      end[t] = off[1];
    }
    for (int t = 0; t < std::min(nt, kAhead); ++t) {
      __builtin_prefetch(ids[t0 + t].data() + begin[t], 0, 3);
    }
    for (int t = 0; t < nt; ++t) {
      if (t + kAhead < nt) {
        const int32_t* r = ids[t0 + t + kAhead].data();
        __builtin_prefetch(r + begin[t + kAhead], 0, 3);
        __builtin_prefetch(r + begin[t + kAhead] + 16, 0, 3);
      }
      CountCollisions(ids[t0 + t].data(), begin[t], end[t], mark, e, e1, cand, count);
    }
  }
  return count;
}

inline void CountCollisions(const int32_t* row, int32_t j, int32_t end, uint8_t* mark, uint8_t e,
                            uint8_t e1, int32_t* cand, int64_t& count) {
    for (; j < end; ++j) {
      const int32_t i = row[j];
      const uint8_t m = mark[i];
      mark[i] = m >= e ? e1 : e;
      cand[count] = i;
      count += (m == e);
    }
}

// ---------------------------------------------------------------------------------------------
// Importance-weighted attention over the candidates (steps 6-8).

struct PoolView {
  const void* k;        // [n, D] of T
  const void* v;        // [n, D] of T
  const float* norms;   // [n]: |k_i - mu|
  const float* mu;      // [D]
  int64_t n;
};

// How many candidates ahead the gather loops prefetch: rows are scattered over the pool, so
// each is a cache miss unless requested early (about a DRAM latency's worth of work ahead).
constexpr int64_t kPrefetchAhead = 8;

template <typename T>
inline void PrefetchRow(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 3);
}

// o[D] and *lse for one query over candidate rows `cand[0..count)`. `score` is scratch of
// size >= count. Raw keys in the logits (centred keys only in the cosine; DESIGN.md step 2).
// Two passes (scores and max, then exp and V): a one-pass online softmax was measured slower,
// as its iterations depend on each other through the running max.
// split_ns (optional, profiling): += the thread CPU time of the score and the softmax pass.
template <typename T>
void SampledAttention(const VecOps& ops, const float* q, int64_t d, const PoolView& pool,
                      const int32_t* cand, int64_t count, const LogCollisionTable& log_u,
                      float* score, float* o, float* lse, uint64_t* split_ns = nullptr) {
  std::fill(o, o + d, 0.f);
  if (count == 0) {
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const uint64_t t0 = split_ns ? ThreadCpuNs() : 0;
  const T* k = static_cast<const T*>(pool.k);
  const T* v = static_cast<const T*>(pool.v);
  const float q_norm = std::sqrt(ops.Dot(q, q, d));
  const float q_mu = ops.Dot(q, pool.mu, d);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < count; ++c) {
    if (c + kPrefetchAhead < count) {
      const int64_t ahead = cand[c + kPrefetchAhead];
      PrefetchRow(k + ahead * d, d);
      __builtin_prefetch(pool.norms + ahead, 0, 3);
    }
    const int64_t i = cand[c];
    const float qk = ops.Dot(q, k + i * d, d);
    const float denom = q_norm * pool.norms[i];
    // A zero query or a key equal to the mean has no direction: treat it as orthogonal.
    const float cos = denom > 0.f ? (qk - q_mu) / denom : 0.f;
    const float s = qk * scale - log_u(cos);
    score[c] = s;
    m = std::max(m, s);
  }
  const uint64_t t1 = split_ns ? ThreadCpuNs() : 0;
  float z = 0.f;
  for (int64_t c = 0; c < count; ++c) {
    if (c + kPrefetchAhead < count) PrefetchRow(v + int64_t{cand[c + kPrefetchAhead]} * d, d);
    const float w = std::exp(score[c] - m);
    z += w;
    ops.Axpy(w, v + static_cast<int64_t>(cand[c]) * d, o, d);
  }
  const float inv_z = 1.f / z;
  for (int64_t j = 0; j < d; ++j) o[j] *= inv_z;
  *lse = m + std::log(z);
  if (split_ns) {
    const uint64_t t2 = ThreadCpuNs();
    split_ns[0] += t1 - t0;
    split_ns[1] += t2 - t1;
  }
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_KERNELS_H_
