// The paper's pool estimator ("magicpig"; docs/design.md, "The algorithm", steps 5-8): at insert,
// the keys' SimHash codes extend the pool's LSH tables (lsh_tables.h); at attend, a query head's
// candidates are the rows that share its code in at least two tables, attended with importance
// weights 1 / u (sampled_attention.h). The jnp twin is pigjax/estimators/simhash.py.
//
// One estimator behind the interface of estimators.h. Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_ESTIMATOR_MAGICPIG_H_
#define PIGJAX_XLA_FFI_ESTIMATOR_MAGICPIG_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "xla_ffi/collision_prob.h"
#include "xla_ffi/lsh_tables.h"
#include "xla_ffi/operands.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/sampled_attention.h"
#include "xla_ffi/softmax.h"
#include "xla_ffi/store_config.h"
#include "xla_ffi/store_core.h"

namespace pigjax {

class MagicPigEstimator : public EstimatorDefaults {
 public:
  static constexpr const char* kName = "magicpig";
  // A pool's LSH tables: a segment per 2^16 tokens.
  using Index = std::vector<TableSegment>;

  // One code column per table.
  static int64_t CodeColumns(const StoreConfig& c) { return c.num_tables; }
  // Per table segment and table: CSR offsets; per token and table: a 16-bit id.
  static uint64_t IndexBytes(const StoreConfig& c, CheckedSize& s) {
    const uint64_t cap = c.capacity, tables = c.num_tables;
    const uint64_t buckets = (uint64_t{1} << c.num_bits) + 1;
    const uint64_t segments = (cap + kSegmentTokens - 1) / kSegmentTokens;
    return s.Mul(tables, s.Add(s.Mul(segments, buckets * 4), cap * 2));
  }
  // Per worker: a collision count byte per pool token and the bucket counts of a table append.
  // Cannot overflow: capacity < 2^31, num_bits <= 24.
  static uint64_t ScratchBytes(const StoreConfig& c) {
    return uint64_t(c.capacity) + ((uint64_t{1} << c.num_bits) + 1) * 4;
  }

  MagicPigEstimator(const StoreConfig& c, size_t num_pools, int workers)
      : log_u_(c.num_bits, c.num_tables), index_(num_pools), workers_(workers) {
    for (auto& w : workers_) w.bucket.resize((size_t{1} << c.num_bits) + 1);
  }

  uint64_t Bytes() const {
    uint64_t b = 0;
    for (const Index& segments : index_) {
      for (const auto& seg : segments) {
        b += 4 * seg.offsets.capacity();
        b += 2 * seg.ids.capacity();
      }
    }
    for (const auto& w : workers_) b += w.counter.Bytes() + 4 * w.bucket.capacity();
    return b;
  }
  void Clear(size_t pool) { index_[pool] = Index(); }

  // The mean key of this insert (every insert brings the pool's current one), and room in the
  // tables for the new tokens, so that the table pass cannot fail.
  void Append(StoreCore& s, const InsertArgs& a, int64_t b, int64_t kvh, size_t pool,
              HeadPool& p, int64_t len) {
    const StoreConfig& c = s.cfg;
    const int64_t d = c.head_dim, hkv = c.num_kv_heads;
    const int64_t n0 = p.n, n1 = n0 + len, limit = c.capacity;
    p.mu.assign(a.mu + (b * hkv + kvh) * d, a.mu + (b * hkv + kvh + 1) * d);
    Index& segments = index_[pool];
    segments.resize(std::max<size_t>(segments.size(), (n1 + kSegmentTokens - 1) / kSegmentTokens));
    for (int64_t sg = n0 / kSegmentTokens; sg * kSegmentTokens < n1; ++sg) {
      TableSegment& seg = segments[sg];
      if (seg.offsets.empty()) {
        seg.offsets.assign(size_t(c.num_tables) * ((size_t{1} << c.num_bits) + 1), 0);
      }
      const int64_t first = sg * kSegmentTokens;
      const int64_t need = std::min(n1 - first, kSegmentTokens);
      if (need > seg.stride) {  // room for every table at once, geometrically
        const int64_t room = std::min(std::min(limit - first, kSegmentTokens),
                                      std::max(need, 2 * seg.stride));
        decltype(seg.ids) grown(size_t(c.num_tables) * room);
        for (int64_t t = 0; t < c.num_tables; ++t) {
          std::copy(seg.table(t), seg.table(t) + seg.stride, grown.data() + t * room);
        }
        seg.ids.swap(grown);
        seg.stride = room;
      }
    }
  }

  // The table pass: per (row, kv head, table), the new tokens' ids into their buckets.
  void FinishInsert(StoreCore& s, const InsertArgs& a, const std::vector<int64_t>& n0) {
    const int64_t hkv = s.cfg.num_kv_heads, nt = s.cfg.num_tables;
    s.ParallelFor(a.slots_size * hkv * nt, [&](int64_t i, int w) {
      const int64_t b = i / (hkv * nt), h = (i / nt) % hkv;
      const int t = static_cast<int>(i % nt);
      if (a.lengths[b] > 0) AppendToTable(s, a, b, h, t, n0[b], a.lengths[b], workers_[w]);
    });
  }

  std::string Attend(StoreCore& s, const AttendArgs& a, const AttendPlan& plan);

#ifdef PIGJAX_PROFILE
  // Profiling: the distinct candidates of the query heads that share a kv head.
  void ProfileAfterAttend(StoreCore& s, const AttendArgs& a, const AttendPlan& plan) {
    for (int64_t g0 = 0; g0 < plan.items; g0 += plan.group) {
      s.prof.distinct_candidates += DistinctCandidates(s, a.count, g0, plan.group);
    }
  }
#endif

 private:
  struct Worker {
    CollisionCounter counter;     // the lookup's counts
    std::vector<int32_t> bucket;  // [2^K + 1]: an append's bucket counts
  };

  void AppendToTable(StoreCore& s, const InsertArgs& a, int64_t b, int64_t kvh, int t,
                     int64_t n0, int64_t len, Worker& w);

#ifdef PIGJAX_PROFILE
  // The distinct ids among the (ascending) candidates of query heads g0..g0 + group. They are
  // 73-75% of the candidates at 32k-128k, yet reading those rows once for all the heads gains
  // nothing: in the heads' order, the shared rows are cache hits already (BENCHMARKS.md, "Levers
  // measured").
  static uint64_t DistinctCandidates(const StoreCore& s, const int32_t* count, int64_t g0,
                                     int64_t group) {
    std::vector<int64_t> pos(group, 0);
    uint64_t n = 0;
    for (;;) {
      int32_t lo = std::numeric_limits<int32_t>::max();
      for (int64_t h = 0; h < group; ++h) {
        if (pos[h] < count[g0 + h]) lo = std::min(lo, s.item_cand[g0 + h][pos[h]]);
      }
      if (lo == std::numeric_limits<int32_t>::max()) return n;
      n += 1;
      for (int64_t h = 0; h < group; ++h) {
        if (pos[h] < count[g0 + h] && s.item_cand[g0 + h][pos[h]] == lo) pos[h] += 1;
      }
    }
  }
#endif  // PIGJAX_PROFILE

  const LogCollisionTable log_u_;
  std::vector<Index> index_;     // per pool (StoreCore::PoolIndex)
  std::vector<Worker> workers_;  // per worker
};

// Table t of (b, kvh), per segment the new tokens reach: new offsets = old offsets + running
// counts of the new codes; old ids of each bucket slide right in place (last bucket first, so
// nothing is overwritten), then the new ids fill the gaps. Ids stay sorted within each bucket.
inline void MagicPigEstimator::AppendToTable(StoreCore& s, const InsertArgs& a, int64_t b,
                                             int64_t kvh, int t, int64_t n0, int64_t len,
                                             Worker& w) {
  Index& segments = index_[s.PoolIndex(a.layer, a.slots[b], kvh)];
  const int64_t nb = int64_t{1} << s.cfg.num_bits, tt = a.k_shape[2], nt = s.cfg.num_tables;
  int32_t* cnt = w.bucket.data();
  for (int64_t j0 = 0; j0 < len;) {
    const int64_t seg_index = (n0 + j0) / kSegmentTokens;
    const int64_t first = (n0 + j0) - seg_index * kSegmentTokens;  // within the segment
    const int64_t run = std::min(len - j0, kSegmentTokens - first);
    TableSegment& seg = segments[seg_index];
    int32_t* off = seg.offsets.data() + t * (nb + 1);
    uint16_t* ids = seg.table(t);
    const int32_t* codes = a.codes + ((b * s.cfg.num_kv_heads + kvh) * tt + j0) * nt + t;
    std::fill(cnt, cnt + nb + 1, 0);
    for (int64_t j = 0; j < run; ++j) ++cnt[codes[j * nt]];
    // cnt[x] becomes the number of new tokens in buckets < x.
    int32_t total = 0;
    for (int64_t x = 0; x <= nb; ++x) {
      const int32_t c = cnt[x];
      cnt[x] = total;
      total += c;
    }
    for (int64_t x = nb - 1; x >= 0; --x) {
      const int32_t old_start = off[x], old_len = off[x + 1] - off[x];
      if (old_len > 0 && cnt[x] > 0) {
        std::memmove(ids + old_start + cnt[x], ids + old_start, sizeof(uint16_t) * old_len);
      }
    }
    for (int64_t x = 0; x <= nb; ++x) off[x] += cnt[x];
    // The next free position in bucket x is the end of its old ids: new off[x+1] - new tokens in x.
    for (int64_t x = 0; x < nb; ++x) cnt[x] = off[x + 1] - (cnt[x + 1] - cnt[x]);
    for (int64_t j = 0; j < run; ++j) ids[cnt[codes[j * nt]]++] = static_cast<uint16_t>(first + j);
    j0 += run;
  }
}

// Candidates by >= 2 collisions, then importance-weighted attention, per (row, q head), in two
// phases (docs/design.md, "Threading"): all lookups, then the candidates of every head in pieces,
// each its own partial softmax, merged per head by log-sum-exp at the end. One queue for both,
// so that no worker waits at the barrier for the last lookup, gains nothing beyond noise
// (BENCHMARKS.md, "Levers measured").
inline std::string MagicPigEstimator::Attend(StoreCore& s, const AttendArgs& a,
                                             const AttendPlan& plan) {
  const StoreConfig& c = s.cfg;
  const int64_t d = c.head_dim, items = plan.items;
  const int64_t nb = int64_t{1} << c.num_bits;
  const bool prof = s.profiling;
  try {
    for (auto& w : workers_) w.counter.Reserve(plan.max_n);
    s.ReserveAttend(a, plan);
  } catch (const std::bad_alloc&) {
    return "store_attend: out of host memory for the lookup scratch.";
  }

  // Query i as f32 into q; its candidates into cand (ascending), returning the count.
  auto lookup = [&](int64_t i, int w, float* q, int32_t* cand) -> int64_t {
    const size_t pi = s.ItemPool(a, plan, i);
    const HeadPool& p = s.Pool(pi);
    if (p.n == 0) {  // no tables yet
      a.count[i] = 0;
      return 0;
    }
    s.QueryAsF32(a, i, q);
    const int32_t* qcodes = a.codes + i * c.num_tables;
    const uint64_t t0 = prof ? NowNs() : 0;
    const int64_t count = CollectCandidates(index_[pi], qcodes, c.num_bits, c.num_tables, p.n,
                                            workers_[w].counter, cand);
    if (prof) {
      Profile& pr = s.scratch[w].prof;
      pr.lookup_ns += NowNs() - t0;
      uint64_t walked = 0;
      for (const TableSegment& seg : index_[pi]) {
        for (int t = 0; t < c.num_tables; ++t) {
          const int32_t* off = seg.offsets.data() + t * (nb + 1);
          walked += off[qcodes[t] + 1] - off[qcodes[t]];
        }
      }
      pr.heads += 1;
      pr.ids_walked += walked;
      pr.candidates += count;
      pr.bytes += walked * 2 + count * TokenBytes(d, c.dtype);
      // cand is ascending: walk the bins' lower bounds (ceil(b n / kBins)) instead of one
      // 64-bit division per candidate (1.7 M per profiled step at 128k, inside the attend's clock).
      int64_t bin = 0;
      auto lower = [&](int64_t b) { return (b * p.n + Profile::kBins - 1) / Profile::kBins; };
      for (int64_t j = 0; j < count; ++j) {
        while (bin + 1 < Profile::kBins && cand[j] >= lower(bin + 1)) ++bin;
        pr.candidate_bins[bin] += 1;
      }
    }
    a.count[i] = static_cast<int32_t>(count);
    return count;
  };
  // Adds cand[0..count) of query i to (o, m, z).
  auto accumulate = [&](int64_t i, int w, const float* q, const int32_t* cand, int64_t count,
                        float* o, float& m, float& z) {
    const PoolView view = s.View(s.Pool(s.ItemPool(a, plan, i)));
    float* sc = s.scratch[w].score.data();
    uint64_t split_ns[2] = {0, 0};
    uint64_t* sp = prof ? split_ns : nullptr;
    if (c.dtype == DType::kF32) {
      AccumulateAttention<float>(s.ops, q, d, view, cand, count, log_u_, sc, o, m, z, sp);
    } else if (c.dtype == DType::kBf16) {
      AccumulateAttention<bf16>(s.ops, q, d, view, cand, count, log_u_, sc, o, m, z, sp);
    } else {
      AccumulateAttention<int8_t>(s.ops, q, d, view, cand, count, log_u_, sc, o, m, z, sp);
    }
    s.scratch[w].prof.score_ns += split_ns[0];
    s.scratch[w].prof.softmax_ns += split_ns[1];
  };

  s.ParallelFor(items, [&](int64_t i, int w) {
    lookup(i, w, s.item_q.data() + i * d, s.item_cand[i].data());
  }, plan.inline_only);
  s.pieces.Cut(a.count, items, d);
  s.pieces.Run(s.PieceFor(plan.inline_only), [&](const Pieces::Piece& pc, int w, float* o,
                                                 float& m, float& z) {
    accumulate(pc.item, w, s.item_q.data() + pc.item * d,
               s.item_cand[pc.item].data() + pc.begin, pc.end - pc.begin, o, m, z);
  });
  for (int64_t i = 0, j = 0; i < items; ++i) j = s.pieces.Merge(i, j, a.o + i * d, &a.lse[i]);
  return "";
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_ESTIMATOR_MAGICPIG_H_
