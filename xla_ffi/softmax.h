// The online softmax over pool rows that every estimator attends with, and the pieces an attend
// cuts each query head's rows into (docs/design.md, "The host store", "Attend"): the rows of a
// piece are scored (the estimator's part), weighed by exp(s - m) and their V rows summed; the
// pieces' partial sums (o, m, z) are merged per head by log-sum-exp in piece order.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_SOFTMAX_H_
#define PIGJAX_XLA_FFI_SOFTMAX_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "xla_ffi/cpu_features.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/vec_ops.h"

namespace pigjax {

// Rows are processed in chunks: gather K rows and score the chunk, then exp and accumulate its V
// rows, rescaling the running sum when the maximum grows (as in flash attention). A chunk's V
// rows are prefetched together with its K rows, so they are in cache by the time the chunk's
// second half needs them.
constexpr int64_t kChunk = 64;
// How many candidates ahead the gather prefetches: rows are scattered over the pool, so each is
// a cache miss unless requested early (about a DRAM latency's worth of work ahead).
constexpr int64_t kPrefetchAhead = 16;
// Scratch floats an attention over rows needs (a chunk's scores and its norms).
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

// Adds rows cand[0..count) of one query to its running softmax-weighted sum: o[D] holds
// sum_c w_c v_c with w_c = exp(s_c - m), z = sum_c w_c, m the largest score so far (start from
// o = 0, z = 0, m = -inf). Per chunk, `score(c0, nc, vectorized)` writes the scores of rows
// cand[c0, c0 + nc) into s[0, nc) and returns their maximum; `vectorized` says whether the AVX2
// row kernels apply (they need whole 8-lane vectors per row; other head dims and
// PIGJAX_KERNELS=scalar take the primitive-by-primitive path). s: >= kChunk floats. split_ns
// (optional, profiling): += wall time of the score and the softmax phases.
template <typename T, typename ScoreChunk>
void AccumulateSoftmax(const VecOps& ops, int64_t d, const PoolView& pool, const int32_t* cand,
                       int64_t count, float* s, float* o, float& m, float& z, uint64_t* split_ns,
                       ScoreChunk score) {
  const char* rows = pool.rows;
  const int64_t rb = pool.row_bytes;
  auto key = [&](int64_t i) { return reinterpret_cast<const T*>(rows + i * rb); };
  const bool vectorized = std::strcmp(ops.isa, "avx2") == 0 && d % 8 == 0;
  for (int64_t c0 = 0; c0 < count; c0 += kChunk) {
    const int64_t nc = std::min(kChunk, count - c0);
    const int32_t* cc = cand + c0;
    const uint64_t t0 = split_ns ? NowNs() : 0;
    const float mc = score(c0, nc, vectorized);
    const uint64_t t1 = split_ns ? NowNs() : 0;
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
      const uint64_t t2 = NowNs();
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

// Rows per piece of the two-phase attend: large enough that a piece's fixed costs (two dots, one
// merge of D floats) vanish, small enough that nine heads make many pieces.
constexpr int64_t kPieceCandidates = 512;

// The pieces of one attend call. Every query head's rows are cut the same way whatever worker
// runs them, and merged in piece order, so a head's output does not depend on the other heads
// of the call (a serving batch must not change a request's tokens; docs/design.md, "Threading").
class Pieces {
 public:
  struct Piece {
    int64_t item, begin, end;  // query head, and its rows [begin, end)
  };

  // Cuts rows [0, count[i]) of every query head i < items into pieces of kPieceCandidates (heads
  // in order, each head's pieces in order) and zeroes their partial sums.
  void Cut(const int32_t* count, int64_t items, int64_t d) {
    d_ = d;
    pieces_.clear();
    for (int64_t i = 0; i < items; ++i) {
      for (int64_t c0 = 0; c0 < count[i]; c0 += kPieceCandidates) {
        pieces_.push_back({i, c0, std::min<int64_t>(count[i], c0 + kPieceCandidates)});
      }
    }
    const int64_t np = static_cast<int64_t>(pieces_.size());
    o_.assign(np * d, 0.f);
    mz_.assign(2 * np, 0.f);
  }

  // Runs acc(piece, worker, o [D], m, z) for every piece, from m = -inf and z = 0, through
  // parallel_for(n, task) (the store's thread pool), and keeps each piece's (o, m, z).
  template <typename ParallelFor, typename Accumulate>
  void Run(ParallelFor&& parallel_for, Accumulate&& acc) {
    parallel_for(static_cast<int64_t>(pieces_.size()), [&](int64_t j, int w) {
      const Piece& pc = pieces_[j];
      float m = -std::numeric_limits<float>::infinity(), z = 0.f;
      acc(pc, w, o_.data() + j * d_, m, z);
      mz_[2 * j] = m;
      mz_[2 * j + 1] = z;
    });
  }

  // o [D] and *lse of query head `item` from its pieces, which start at piece `first`, merged by
  // log-sum-exp in piece order. Returns the index of the next head's first piece.
  int64_t Merge(int64_t item, int64_t first, float* o, float* lse) const {
    const int64_t d = d_, np = static_cast<int64_t>(pieces_.size());
    int64_t end = first;
    while (end < np && pieces_[end].item == item) ++end;
    std::fill(o, o + d, 0.f);
    float m = -std::numeric_limits<float>::infinity(), z = 0.f;
    for (int64_t k = first; k < end; ++k) m = std::max(m, mz_[2 * k]);
    for (int64_t k = first; k < end; ++k) {
      const float r = std::exp(mz_[2 * k] - m);
      z += r * mz_[2 * k + 1];
      for (int64_t e = 0; e < d; ++e) o[e] += r * o_[k * d + e];
    }
    FinishAttention(o, d, m, z, lse);
    return end;
  }

  uint64_t Bytes() const { return 4 * (o_.capacity() + mz_.capacity()); }

 private:
  int64_t d_ = 0;
  std::vector<Piece> pieces_;
  std::vector<float> o_, mz_;  // per piece: o [D]; m and z
};

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_SOFTMAX_H_
