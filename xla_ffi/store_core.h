// What a host store shares with the estimator it runs (estimators.h): its configuration and
// vector primitives, the pools' rows, the worker threads with their scratch and counters, and the
// attend's per query head buffers and pieces. Store (store.h) owns one and holds its lock through
// every call that reaches it.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_STORE_CORE_H_
#define PIGJAX_XLA_FFI_STORE_CORE_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "xla_ffi/operands.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/softmax.h"
#include "xla_ffi/store_config.h"
#include "xla_ffi/thread_pool.h"
#include "xla_ffi/vec_ops.h"

namespace pigjax {

// Kernel counters (nanoseconds and counts), summed over calls and workers. Phases per query
// head (wall time of the worker): lookup (bucket walk, collision marks, scan for candidates),
// score (gather K rows, q.k, log u), softmax (exp, gather V rows, accumulate). The proxy
// estimator: lookup = the index scan, score = the top-k selection and tail sum, softmax = the
// exact attention over the selected rows. Bytes are what
// the kernel must read: ids walked, and per candidate its K and V row (and an int8 row's scales).
struct Profile {
  uint64_t attend_calls = 0, attend_ns = 0, insert_calls = 0, insert_ns = 0;
  uint64_t lookup_ns = 0, score_ns = 0, softmax_ns = 0;
  uint64_t heads = 0, ids_walked = 0, candidates = 0, bytes = 0;
#ifdef PIGJAX_PROFILE
  // The distinct candidates of the query heads that share a kv head (per batch row), summed:
  // the rows a gather shared by those heads would read, against `candidates`. A reverted
  // experiment's counter, compiled in only with -DPIGJAX_PROFILE=ON (MagicPigEstimator).
  uint64_t distinct_candidates = 0;
#endif
  // Candidates by where they lie in the pool: bin b counts ids in [b n / kBins, (b + 1) n / kBins)
  // (oldest tokens first), to see which part of a long context the collisions come from.
  static constexpr int kBins = 16;
  std::array<uint64_t, kBins> candidate_bins{};
  // The store's thread pool calls that ran in parallel, and their time before a second worker
  // joined.
  uint64_t parallel_calls = 0, alone_ns = 0;
  void Add(const Profile& o) {
    attend_calls += o.attend_calls, attend_ns += o.attend_ns, insert_calls += o.insert_calls;
    insert_ns += o.insert_ns, lookup_ns += o.lookup_ns, score_ns += o.score_ns;
    softmax_ns += o.softmax_ns, heads += o.heads, ids_walked += o.ids_walked;
    candidates += o.candidates, bytes += o.bytes;
#ifdef PIGJAX_PROFILE
    distinct_candidates += o.distinct_candidates;
#endif
    for (int b = 0; b < kBins; ++b) candidate_bins[b] += o.candidate_bins[b];
  }
};

// Below this many (pool token x query head) pairs an attend runs on the calling thread: waking
// the pool's threads costs tens of microseconds, more than such a call takes on one core.
constexpr int64_t kMinParallelWork = 32768;

// The shape of one checked attend call, as the store hands it to the estimator. Query head
// i < items is head i % hq of batch row i / hq, and reads kv head (i % hq) / group.
struct AttendPlan {
  int64_t items = 0, hq = 0, group = 0;
  int64_t max_n = 0;         // the largest pool of the call's slots
  bool inline_only = false;  // run every phase on the calling thread (see Store::Attend)
};

struct StoreCore {
  // `shared`: the pool to run on instead of one of the store's own (see Store).
  StoreCore(const StoreConfig& c, ThreadPool* shared)
      : cfg(c),
        ops(GetVecOps()),
        own_workers_(shared ? nullptr : std::make_unique<ThreadPool>(ResolveThreads(c.threads))),
        workers_(shared ? *shared : *own_workers_),
        pools_(size_t(c.num_layers) * c.num_slots * c.num_kv_heads) {
    scratch.resize(workers_.size());
  }

  int num_threads() const { return workers_.size(); }
  size_t num_pools() const { return pools_.size(); }

  // Pools are numbered (layer, slot, kv head), the estimator's index alike.
  size_t PoolIndex(int64_t layer, int64_t slot, int64_t kvh) const {
    return (size_t(layer) * cfg.num_slots + slot) * cfg.num_kv_heads + kvh;
  }
  HeadPool& Pool(size_t i) { return pools_[i]; }
  HeadPool& Pool(int64_t layer, int64_t slot, int64_t kvh) {
    return pools_[PoolIndex(layer, slot, kvh)];
  }
  // The pool query head i of an attend reads.
  size_t ItemPool(const AttendArgs& a, const AttendPlan& plan, int64_t i) const {
    return PoolIndex(a.layer, a.slots[i / plan.hq], (i % plan.hq) / plan.group);
  }
  PoolView View(const HeadPool& p) const {
    return PoolView{p.rows.data(), RowBytes(cfg.head_dim, DTypeSize(cfg.dtype)),
                    p.scales.empty() ? nullptr : p.scales.data(), p.mu.data(), p.n};
  }

  // Query head i of the attend's q, as float32, into q [D].
  void QueryAsF32(const AttendArgs& a, int64_t i, float* q) const {
    const int64_t d = cfg.head_dim;
    for (int64_t e = 0; e < d; ++e) {
      q[e] = a.q_dtype == DType::kF32 ? static_cast<const float*>(a.q)[i * d + e]
                                      : ToF32(static_cast<const bf16*>(a.q)[i * d + e]);
    }
  }

  // The attend's buffers every estimator uses: each worker's chunk scores, each query head's
  // f32 query and its row list (room for its pool's every row, since the branch-free scans
  // write past the last). Throws std::bad_alloc.
  void ReserveAttend(const AttendArgs& a, const AttendPlan& plan) {
    for (auto& s : scratch) s.score.resize(kAttentionScratch);
    if (item_cand.size() < size_t(plan.items)) item_cand.resize(plan.items);
    for (int64_t i = 0; i < plan.items; ++i) {
      const int64_t n = Pool(a.layer, a.slots[i / plan.hq], 0).n;
      if (item_cand[i].size() < size_t(n + kScanSlack)) item_cand[i].resize(n + kScanSlack);
    }
    item_q.resize(plan.items * cfg.head_dim);
  }

  // workers_.ParallelFor, counting (when profiling) the parallel calls and their time before a
  // second worker joined.
  void ParallelFor(int64_t n, const ThreadPool::Task& task, bool inline_only = false) {
    const ThreadPool::CallStats call = workers_.ParallelFor(n, task, inline_only);
    if (profiling && call.parallel) {
      prof.parallel_calls += 1;
      prof.alone_ns += call.alone_ns;
    }
  }
  // ParallelFor as Pieces::Run calls it.
  auto PieceFor(bool inline_only) {
    return [this, inline_only](int64_t n, const ThreadPool::Task& task) {
      ParallelFor(n, task, inline_only);
    };
  }

  uint64_t Bytes() const {
    uint64_t b = 0;
    for (const auto& p : pools_) b += p.Bytes();
    for (const auto& s : scratch) b += 4 * s.score.capacity();
    for (const auto& c : item_cand) b += 4 * c.capacity();
    return b + 4 * item_q.capacity() + pieces.Bytes();
  }

  const StoreConfig cfg;
  const VecOps& ops;
  struct Scratch {
    std::vector<float> score;  // [kAttentionScratch]
    Profile prof;
  };
  std::vector<Scratch> scratch;  // per worker
  bool profiling = false;
  Profile prof;  // call-level counters (wall time of whole calls)
  // Attend: per query head its f32 query [items, D] and rows (candidates, or the selection);
  // the pieces of those rows with their partial softmax sums.
  std::vector<std::vector<int32_t>> item_cand;
  std::vector<float> item_q;
  Pieces pieces;

 private:
  std::unique_ptr<ThreadPool> own_workers_;  // null when running on a shared pool
  ThreadPool& workers_;
  std::vector<HeadPool> pools_;
};

// The hooks of the estimator interface (estimators.h) that an estimator may leave out: it derives
// from this and hides what it needs (static dispatch: there is nothing virtual).
struct EstimatorDefaults {
  // Its settings of StoreConfig, checked after the geometry: none.
  static std::string CheckConfig(const StoreConfig&) { return ""; }
  // Insert, after every pool's rows and index are in: nothing more.
  void FinishInsert(StoreCore&, const InsertArgs&, const std::vector<int64_t>&) {}
  // Profiling counters taken after the attend's clock stopped: none.
  void ProfileAfterAttend(StoreCore&, const AttendArgs&, const AttendPlan&) {}
};

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_STORE_CORE_H_
