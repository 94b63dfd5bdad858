// The host KV store: MagicPIG's pool of sampled tokens, with its LSH tables, for every sparse
// layer, batch slot and KV head (docs/design.md, "The algorithm" and "The host store").
//
// Pure C++: no XLA, no nanobind, so a CPU and a (future) CUDA FFI registration share it. Errors
// are returned as message strings (empty = success); nothing here reads out of range for any
// operand, because every index is checked before any work starts.
#ifndef PIGJAX_XLA_FFI_STORE_H_
#define PIGJAX_XLA_FFI_STORE_H_

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla_ffi/errors.h"
#include "xla_ffi/lsh_tables.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/proxy.h"
#include "xla_ffi/sampled_attention.h"
#include "xla_ffi/softmax.h"
#include "xla_ffi/thread_pool.h"
#include "xla_ffi/vec_ops.h"

namespace pigjax {

// The pool estimator a store runs (config.ESTIMATORS): the paper's LSH sampling, or the proxy
// index + exact top rows + mean-V tail (proxy.h, pigjax/estimators.py).
enum class Estimator { kMagicPig, kProxy };

struct StoreConfig {
  int num_layers = 0;    // sparse layers
  int num_slots = 0;     // batch slots
  int num_kv_heads = 0;
  int head_dim = 0;
  int num_bits = 0;      // K
  int num_tables = 0;    // L
  int64_t capacity = 0;  // max pool tokens per (layer, slot)
  DType dtype = DType::kBf16;
  int threads = 0;       // 0 = std::thread::hardware_concurrency()
  Estimator estimator = Estimator::kMagicPig;
  // Proxy only (the tables are not built; codes operands have 0 tables):
  int proxy_bits = 4;           // bits per channel of the index, 1..8
  float proxy_fraction = 0.03f;  // rows read exactly: ceil(fraction * pool)
  bool proxy_tail = true;       // estimate the unread rows ("mean") or drop them ("none")
};

// Code columns the insert and attend operands carry: one per table, none for the proxy.
inline int64_t CodeColumns(const StoreConfig& c) {
  return c.estimator == Estimator::kProxy ? 0 : c.num_tables;
}

// Most worker threads a store may have. More than this buys nothing on any current host (the
// kernels are memory-bound) and only risks running out of address space for thread stacks.
constexpr int kMaxThreads = 256;
// Largest worst-case store size accepted (1 PiB): far above any machine, far below 2^64, so a
// geometry whose size product would wrap around is rejected instead of allocating too little.
constexpr uint64_t kMaxStoreBytes = uint64_t{1} << 50;

inline int ResolveThreads(int threads) {
  if (threads > 0) return threads;
  return std::clamp<int>(static_cast<int>(std::thread::hardware_concurrency()), 1, kMaxThreads);
}

// Bytes of the per-worker scratch (collision bitsets, candidate ids, scores, query, bucket
// counts; an upper bound: the bitsets take 2 bits per token, counted as a byte).
// Cannot overflow: capacity < 2^31, head_dim < 2^31, num_bits <= 24.
// The proxy adds a selection buffer of capacity floats.
inline uint64_t ScratchBytes(const StoreConfig& c) {
  return uint64_t(c.capacity) * (c.estimator == Estimator::kProxy ? 9 : 5) +
         uint64_t(kAttentionScratch + c.head_dim) * 4 + ((uint64_t{1} << c.num_bits) + 1) * 4;
}

struct HeadPool;

// Worst case (every (layer, slot) pool full, plus per-thread scratch and the pool directory) into
// *out; false if the product does not fit in 64 bits. Every factor is checked: a geometry such as
// 2^21 layers x 2^21 slots x 2^22 heads wraps to 0 in unchecked arithmetic.
inline bool CheckedEstimateBytes(const StoreConfig& c, uint64_t* out);

// Empty string if the configuration is usable, else a sentence saying what is wrong.
inline std::string CheckConfig(const StoreConfig& c) {
  if (c.num_layers < 1) return Str("num_layers must be >= 1, got ", c.num_layers, ".");
  if (c.num_slots < 1) return Str("num_slots must be >= 1, got ", c.num_slots, ".");
  if (c.num_kv_heads < 1) return Str("num_kv_heads must be >= 1, got ", c.num_kv_heads, ".");
  if (c.head_dim < 1) return Str("head_dim must be >= 1, got ", c.head_dim, ".");
  if (c.num_bits < 1 || c.num_bits > 24) {
    return Str("num_bits must be in [1, 24] (tables have 2^num_bits buckets), got ", c.num_bits,
               ".");
  }
  if (c.num_tables < 2) {
    return Str("num_tables must be >= 2 (a candidate collides in at least 2 tables), got ",
               c.num_tables, ".");
  }
  if (c.capacity < 1 || c.capacity > int64_t{0x7fffffff}) {
    return Str("capacity must be in [1, 2^31 - 1] tokens, got ", c.capacity, ".");
  }
  if (c.estimator == Estimator::kProxy) {
    if (c.proxy_bits < 1 || c.proxy_bits > 8) {
      return Str("proxy_bits must be in [1, 8], got ", c.proxy_bits, ".");
    }
    if (!(c.proxy_fraction > 0.f && c.proxy_fraction <= 1.f)) {
      return Str("proxy_fraction must be in (0, 1], got ", c.proxy_fraction, ".");
    }
  }
  if (c.threads < 0 || c.threads > kMaxThreads) {
    return Str("threads must be in [0, ", kMaxThreads, "] (0 = all hardware threads, here ",
               ResolveThreads(0), "), got ", c.threads, ".");
  }
  uint64_t bytes = 0;
  if (!CheckedEstimateBytes(c, &bytes) || bytes > kMaxStoreBytes) {
    return Str("the store geometry (", c.num_layers, " layers x ", c.num_slots, " slots x ",
               c.num_kv_heads, " kv heads x ", c.capacity, " tokens x head_dim ", c.head_dim,
               ", ", c.num_tables, " tables) needs ",
               bytes > kMaxStoreBytes ? Str(bytes, " bytes") : std::string("more than 2^64 bytes"),
               ", above the limit of 2^50 bytes (1 PiB); lower one of these.");
  }
  return "";
}

// Worst-case bytes of a configuration that passed CheckConfig.
inline uint64_t EstimateBytes(const StoreConfig& c) {
  uint64_t bytes = 0;
  CheckedEstimateBytes(c, &bytes);
  return bytes;
}

// One (layer, slot, kv head) pool. Buffers grow geometrically up to the capacity.
struct HeadPool {
  int64_t n = 0;
  std::vector<char, RowAllocator<char>> rows;  // [n] rows: K [D], V [D] of the store dtype
  std::vector<float> scales;              // int8 rows only: [n, 2] K and V scales
  std::vector<float> mu;                  // [D]
  std::vector<TableSegment> segments;     // the LSH tables, a segment per 2^16 tokens
  // Proxy estimator only (then there are no table segments): the index and its statistics, set
  // by the pool's first insert and kept for every later one (appended keys are coded with them,
  // clamped: estimators.quantize_with_stats), and the sum of V for the tail's mean V.
  std::vector<uint8_t> codes;             // [n, ProxyLayout::bytes]
  std::vector<float> lo, step;            // [D]
  std::vector<double> v_sum;              // [D]

  uint64_t Bytes() const {
    uint64_t b = rows.capacity() + 4 * (scales.capacity() + mu.capacity()) + codes.capacity() +
                 4 * (lo.capacity() + step.capacity()) + 8 * v_sum.capacity();
    for (const auto& seg : segments) {
      b += 4 * seg.offsets.capacity();
      b += 2 * seg.ids.capacity();
    }
    return b;
  }
  void Clear() { *this = HeadPool(); }
};

inline bool CheckedEstimateBytes(const StoreConfig& c, uint64_t* out) {
  bool ok = true;  // false once any step overflows; later steps then keep it false
  auto mul = [&ok](uint64_t x, uint64_t y) {
    uint64_t r = 0;
    ok = ok && !__builtin_mul_overflow(x, y, &r);
    return r;
  };
  auto add = [&ok](uint64_t x, uint64_t y) {
    uint64_t r = 0;
    ok = ok && !__builtin_add_overflow(x, y, &r);
    return r;
  };
  const uint64_t cap = c.capacity, d = c.head_dim, tables = c.num_tables;
  const uint64_t buckets = (uint64_t{1} << c.num_bits) + 1;
  const uint64_t segments = (cap + kSegmentTokens - 1) / kSegmentTokens;
  // Per (layer, slot, kv head): rows of K + V (and two f32 scales per int8 row); mu (f32); per
  // table segment and table CSR offsets, and 16-bit ids. RowBytes cannot overflow: head_dim <
  // 2^31 and elements are <= 4 bytes.
  const uint64_t row_bytes = static_cast<uint64_t>(TokenBytes(int64_t{c.head_dim}, c.dtype));
  const uint64_t index = c.estimator == Estimator::kProxy
                             ? add(mul(cap, uint64_t(ProxyLayout(c.proxy_bits, c.head_dim).bytes)),
                                   d * 16)
                             : mul(tables, add(mul(segments, buckets * 4), cap * 2));
  const uint64_t per_head = add(add(mul(cap, row_bytes), d * 4), index);
  const uint64_t pools = mul(mul(uint64_t(c.num_layers), uint64_t(c.num_slots)),
                             uint64_t(c.num_kv_heads));
  const uint64_t total = add(add(mul(per_head, pools), mul(pools, sizeof(HeadPool))),
                             mul(ScratchBytes(c), uint64_t(ResolveThreads(c.threads))));
  *out = ok ? total : 0;
  return ok;
}

template <typename V>
void GrowTo(V& vec, size_t need, size_t limit) {
  if (need > vec.capacity()) vec.reserve(std::min(limit, std::max(need, 2 * vec.capacity())));
  vec.resize(need);
}

// Operands of an insert. Shapes are as received, validated by Store::Insert.
struct InsertArgs {
  int64_t layer = 0;
  const int32_t* slots = nullptr;  // [B]
  int64_t slots_size = 0;
  const void* k = nullptr;  // [B, Hkv, T, D]
  const void* v = nullptr;
  DType k_dtype = DType::kF32, v_dtype = DType::kF32;
  std::array<int64_t, 4> k_shape{}, v_shape{};
  const int32_t* codes = nullptr;  // [B, Hkv, T, L]
  std::array<int64_t, 4> codes_shape{};
  const int32_t* lengths = nullptr;  // [B]
  int64_t lengths_size = 0;
  const float* mu = nullptr;  // [B, Hkv, D]
  std::array<int64_t, 3> mu_shape{};
  int32_t* new_sizes = nullptr;  // [B]
  int64_t new_sizes_size = 0;
};

struct AttendArgs {
  int64_t layer = 0;
  const int32_t* slots = nullptr;  // [B]
  int64_t slots_size = 0;
  const void* q = nullptr;  // [B, Hq, D]
  DType q_dtype = DType::kF32;
  std::array<int64_t, 3> q_shape{};
  const int32_t* codes = nullptr;  // [B, Hq, L]
  std::array<int64_t, 3> codes_shape{};
  float* o = nullptr;  // [B, Hq, D]
  std::array<int64_t, 3> o_shape{};
  float* lse = nullptr;  // [B, Hq]
  std::array<int64_t, 2> lse_shape{};
  int32_t* count = nullptr;  // [B, Hq]
  std::array<int64_t, 2> count_shape{};
};

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
  // The distinct candidates of the query heads that share a kv head (per batch row), summed:
  // the rows a gather shared by those heads would read, against `candidates`.
  uint64_t distinct_candidates = 0;
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
    candidates += o.candidates, bytes += o.bytes, distinct_candidates += o.distinct_candidates;
    for (int b = 0; b < kBins; ++b) candidate_bins[b] += o.candidate_bins[b];
  }
};

// Below this many (pool token x query head) pairs an attend runs on the calling thread: waking
// the pool's threads costs tens of microseconds, more than such a call takes on one core.
constexpr int64_t kMinParallelWork = 32768;

class Store {
 public:
  // Throws std::invalid_argument for a configuration CheckConfig rejects, std::runtime_error if
  // the worker threads cannot be started. `shared`: a pool to run on instead of one of its own
  // (the process's compute pool, so that the quantized matmuls and the store's calls of a
  // decode step find the same workers awake; ffi.cc passes it when c.threads is 0); it must
  // outlive the store.
  explicit Store(const StoreConfig& c, ThreadPool* shared = nullptr)
      : cfg_(Checked(c)),
        ops_(GetVecOps()),
        proxy_ops_(GetProxyOps()),
        layout_(c.proxy_bits, c.head_dim),
        log_u_(c.num_bits, c.num_tables),
        own_workers_(shared ? nullptr : std::make_unique<ThreadPool>(ResolveThreads(c.threads))),
        workers_(shared ? *shared : *own_workers_),
        pools_(size_t(c.num_layers) * c.num_slots * c.num_kv_heads),
        scratch_(workers_.size()) {
    for (auto& s : scratch_) s.bucket.resize((size_t{1} << c.num_bits) + 1);
  }

  const StoreConfig& config() const { return cfg_; }
  const char* isa() const { return ops_.isa; }
  int num_threads() const { return workers_.size(); }

  std::string CheckLayer(int64_t layer) const {
    if (layer < 0 || layer >= cfg_.num_layers) {
      return Str("layer ", layer, " is out of range: the store has ", cfg_.num_layers,
                 " sparse layers (0..", cfg_.num_layers - 1, ").");
    }
    return "";
  }
  std::string CheckSlot(int64_t slot) const {
    if (slot < 0 || slot >= cfg_.num_slots) {
      return Str("slot ", slot, " is out of range: the store has ", cfg_.num_slots, " slots (0..",
                 cfg_.num_slots - 1, ").");
    }
    return "";
  }

  // Empties `slot` in every layer and frees its memory. The caller checks the slot.
  void Reset(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      for (int h = 0; h < cfg_.num_kv_heads; ++h) Pool(l, slot, h).Clear();
    }
  }

  int64_t NumTokens(int layer, int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    return Pool(layer, slot, 0).n;
  }

  uint64_t MemoryBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t b = 0;
    for (const auto& p : pools_) b += p.Bytes();
    for (const auto& s : scratch_) b += s.Bytes();
    for (const auto& c : item_cand_) b += 4 * c.capacity();
    b += 4 * (item_q_.capacity() + item_w_.capacity() + item_sw_.capacity() +
              item_bias_.capacity() + item_tail_.capacity() + score_.capacity()) +
         item_wq_.capacity() + pieces_.Bytes();
    return b;
  }

  std::string Insert(const InsertArgs& a);
  std::string Attend(const AttendArgs& a);

  // Optional kernel timing counters (off by default; a steady_clock read per phase per head).
  void SetProfiling(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    profiling_ = on;
    prof_ = Profile();
    for (auto& s : scratch_) s.prof = Profile();
  }
  // Counters summed over workers since profiling was switched on.
  Profile GetProfile() {
    std::lock_guard<std::mutex> lock(mu_);
    Profile p = prof_;
    for (const auto& s : scratch_) p.Add(s.prof);
    return p;
  }

 private:
  static const StoreConfig& Checked(const StoreConfig& c) {
    if (auto e = CheckConfig(c); !e.empty()) throw std::invalid_argument(e);
    return c;
  }

  struct Scratch {
    CollisionCounter counter;
    std::vector<float> score;
    std::vector<int32_t> bucket;  // [2^K + 1]
    std::vector<float> select;    // proxy: the selection's scores [>= pool]
    std::vector<int32_t> select_ids;  // proxy: the selection's ids [pool + 8]
    Profile prof;
    uint64_t Bytes() const {
      return counter.Bytes() + 4 * (score.capacity() + bucket.capacity() +
                                            select.capacity() + select_ids.capacity());
    }
  };

  // workers_.ParallelFor, counting (when profiling) the parallel calls and their time before a
  // second worker joined.
  void ParallelFor(int64_t n, const ThreadPool::Task& task, bool inline_only = false) {
    const ThreadPool::CallStats call = workers_.ParallelFor(n, task, inline_only);
    if (profiling_ && call.parallel) {
      prof_.parallel_calls += 1;
      prof_.alone_ns += call.alone_ns;
    }
  }

  // ParallelFor as Pieces::Run calls it.
  auto PieceFor(bool inline_only) {
    return [this, inline_only](int64_t n, const ThreadPool::Task& task) {
      ParallelFor(n, task, inline_only);
    };
  }

  HeadPool& Pool(int64_t layer, int64_t slot, int64_t kvh) {
    return pools_[(size_t(layer) * cfg_.num_slots + slot) * cfg_.num_kv_heads + kvh];
  }
  PoolView View(const HeadPool& p) const {
    return PoolView{p.rows.data(), RowBytes(cfg_.head_dim, DTypeSize(cfg_.dtype)),
                    p.scales.empty() ? nullptr : p.scales.data(), p.mu.data(), p.n};
  }
  template <typename T>
  void CopyTokens(const InsertArgs& a, int64_t b, int64_t kvh, HeadPool& p, int64_t len);
  void AppendToTable(const InsertArgs& a, int64_t b, int64_t kvh, int t, int64_t n0, int64_t len,
                     Scratch& s);
  void IndexTokens(const InsertArgs& a, int64_t b, int64_t kvh, HeadPool& p, int64_t len);
  std::string AttendProxy(const AttendArgs& a, bool inline_only);

  // Profiling: the distinct ids among the (ascending) candidates of query heads g0..g0 + group.
  // They are 73-75% of the candidates at 32k-128k, yet reading those rows once for all the heads
  // gains nothing: in the heads' order, the shared rows are cache hits already (BENCHMARKS.md,
  // "Levers measured").
  uint64_t DistinctCandidates(const int32_t* count, int64_t g0, int64_t group) const {
    std::vector<int64_t> pos(group, 0);
    uint64_t n = 0;
    for (;;) {
      int32_t lo = std::numeric_limits<int32_t>::max();
      for (int64_t h = 0; h < group; ++h) {
        if (pos[h] < count[g0 + h]) lo = std::min(lo, item_cand_[g0 + h][pos[h]]);
      }
      if (lo == std::numeric_limits<int32_t>::max()) return n;
      n += 1;
      for (int64_t h = 0; h < group; ++h) {
        if (pos[h] < count[g0 + h] && item_cand_[g0 + h][pos[h]] == lo) pos[h] += 1;
      }
    }
  }

  // Attend (see Attend): per query head its f32 query and candidates; the pieces of candidates
  // with their partial softmax sums.
  std::vector<std::vector<int32_t>> item_cand_;
  std::vector<float> item_q_;
  Pieces pieces_;
  // Proxy attend: per query head the scan's int8 weights [padded] and their scale, the bias, its
  // tail's lse, and the proxy scores of every pool token ([items, max pool]); item_w_ is the
  // float weights of one head before rounding [padded].
  std::vector<float> item_w_, item_sw_, item_bias_, item_tail_, score_;
  std::vector<int8_t> item_wq_;

  std::mutex mu_;  // one call at a time: calls mutate pools and share the scratch
  bool profiling_ = false;
  Profile prof_;  // call-level counters (wall time of whole calls)
  const StoreConfig cfg_;
  const VecOps& ops_;
  const ProxyOps& proxy_ops_;
  const ProxyLayout layout_;
  const LogCollisionTable log_u_;
  std::unique_ptr<ThreadPool> own_workers_;  // null when running on a shared pool
  ThreadPool& workers_;
  std::vector<HeadPool> pools_;
  std::vector<Scratch> scratch_;
};

// ---------------------------------------------------------------------------------------------
// Insert: append tokens to the pools and extend the tables with a counting sort.

template <typename T>
void Store::CopyTokens(const InsertArgs& a, int64_t b, int64_t kvh, HeadPool& p, int64_t len) {
  const int64_t d = cfg_.head_dim, hkv = cfg_.num_kv_heads, tt = a.k_shape[2];
  const int64_t n0 = p.n, n1 = n0 + len, limit = cfg_.capacity;
  const int64_t rb = RowBytes(d, sizeof(T));
  GrowTo(p.rows, n1 * rb, limit * rb);
  if constexpr (std::is_same_v<T, int8_t>) GrowTo(p.scales, 2 * n1, 2 * limit);
  if (cfg_.estimator == Estimator::kProxy) {
    // The index was centred on the first insert's mu: later keys must be centred on it too.
    if (n0 == 0) p.mu.assign(a.mu + (b * hkv + kvh) * d, a.mu + (b * hkv + kvh + 1) * d);
    IndexTokens(a, b, kvh, p, len);
  } else {
    p.mu.assign(a.mu + (b * hkv + kvh) * d, a.mu + (b * hkv + kvh + 1) * d);
    // Allocate here, so that the table pass cannot fail.
    p.segments.resize(std::max<size_t>(p.segments.size(), (n1 + kSegmentTokens - 1) / kSegmentTokens));
    for (int64_t s = n0 / kSegmentTokens; s * kSegmentTokens < n1; ++s) {
      TableSegment& seg = p.segments[s];
      if (seg.offsets.empty()) {
        seg.offsets.assign(size_t(cfg_.num_tables) * ((size_t{1} << cfg_.num_bits) + 1), 0);
      }
      const int64_t first = s * kSegmentTokens;
      const int64_t need = std::min(n1 - first, kSegmentTokens);
      if (need > seg.stride) {  // room for every table at once, geometrically
        const int64_t room = std::min(std::min(limit - first, kSegmentTokens),
                                      std::max(need, 2 * seg.stride));
        decltype(seg.ids) grown(size_t(cfg_.num_tables) * room);
        for (int64_t t = 0; t < cfg_.num_tables; ++t) {
          std::copy(seg.table(t), seg.table(t) + seg.stride, grown.data() + t * room);
        }
        seg.ids.swap(grown);
        seg.stride = room;
      }
    }
  }

  std::vector<float> kf(d), vf(d);
  const int64_t src0 = (b * hkv + kvh) * tt * d;
  auto read = [&](const void* x, DType t, int64_t s) {
    return t == DType::kF32 ? static_cast<const float*>(x)[s]
                            : ToF32(static_cast<const bf16*>(x)[s]);
  };
  // Stores x [D] as T; returns the row's scale (1 unless int8).
  auto put = [&](const float* x, T* out) -> float {
    if constexpr (std::is_same_v<T, int8_t>) {
      float amax = 0.f;
      for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(x[e]));
      // Products with reciprocals, not divisions, exactly as lsh.quantize_int8_rows (XLA:CPU
      // turns its divisions into such products); nearbyint rounds ties to even, as jnp.round.
      const float scale = amax > 0.f ? amax * (1.f / 127.f) : 1.f, inv = 1.f / scale;
      for (int64_t e = 0; e < d; ++e) {
        out[e] = static_cast<int8_t>(std::clamp(std::nearbyint(x[e] * inv), -127.f, 127.f));
      }
      return scale;
    } else {
      for (int64_t e = 0; e < d; ++e) out[e] = FromF32<T>(x[e]);
      return 1.f;
    }
  };
  for (int64_t j = 0; j < len; ++j) {
    T* kr = reinterpret_cast<T*>(p.rows.data() + (n0 + j) * rb);
    for (int64_t e = 0; e < d; ++e) {
      kf[e] = read(a.k, a.k_dtype, src0 + j * d + e);
      vf[e] = read(a.v, a.v_dtype, src0 + j * d + e);
    }
    const float k_scale = put(kf.data(), kr), v_scale = put(vf.data(), kr + d);
    if constexpr (std::is_same_v<T, int8_t>) {
      p.scales[2 * (n0 + j)] = k_scale;
      p.scales[2 * (n0 + j) + 1] = v_scale;
    }
  }
}

// Table t of (b, kvh), per segment the new tokens reach: new offsets = old offsets + running
// counts of the new codes; old ids of each bucket slide right in place (last bucket first, so
// nothing is overwritten), then the new ids fill the gaps. Ids stay sorted within each bucket.
inline void Store::AppendToTable(const InsertArgs& a, int64_t b, int64_t kvh, int t, int64_t n0,
                                 int64_t len, Scratch& s) {
  HeadPool& p = Pool(a.layer, a.slots[b], kvh);
  const int64_t nb = int64_t{1} << cfg_.num_bits, tt = a.k_shape[2], nt = cfg_.num_tables;
  int32_t* cnt = s.bucket.data();
  for (int64_t j0 = 0; j0 < len;) {
    const int64_t seg_index = (n0 + j0) / kSegmentTokens;
    const int64_t first = (n0 + j0) - seg_index * kSegmentTokens;  // within the segment
    const int64_t run = std::min(len - j0, kSegmentTokens - first);
    TableSegment& seg = p.segments[seg_index];
    int32_t* off = seg.offsets.data() + t * (nb + 1);
    uint16_t* ids = seg.table(t);
    const int32_t* codes = a.codes + ((b * cfg_.num_kv_heads + kvh) * tt + j0) * nt + t;
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

// Non-finite inputs: insert and attend reject a NaN or +-Inf in k, v, mu or q with an error that
// names the operand and the first bad index, before anything is changed. A NaN key would make
// its norm, its collision probability and every score that uses it NaN; silently dropping it (or
// returning o = 0 for a NaN query) would hide a broken model. Checking costs one read of the
// operand: nothing beside the K/V copy of an insert, and D floats per query head in an attend.

// Index of the first NaN or +-Inf in x[0, n) of dtype t, or -1. Tests the exponent bits. t is an
// operand dtype (float32 or bfloat16; int8 is only ever a storage dtype, and always finite). The
// check runs on the operands, before any int8 quantization, so it applies to every store dtype.
inline int64_t FirstNonFinite(const void* x, DType t, int64_t n) {
  const char* p = static_cast<const char*>(x);
  if (t == DType::kI8) return -1;
  if (t == DType::kF32) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, p + 4 * i, 4);
      if ((u & 0x7f800000u) == 0x7f800000u) return i;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t u;
      std::memcpy(&u, p + 2 * i, 2);
      if ((u & 0x7f80u) == 0x7f80u) return i;
    }
  }
  return -1;
}

inline float ElementAsF32(const void* x, DType t, int64_t i) {
  return t == DType::kF32 ? static_cast<const float*>(x)[i]
                          : ToF32(static_cast<const bf16*>(x)[i]);
}

inline std::string Store::Insert(const InsertArgs& a) {
  const StoreConfig& c = cfg_;
  if (auto e = CheckLayer(a.layer); !e.empty()) return "store_insert: " + e;
  const int64_t bsz = a.slots_size, tt = a.k_shape[2];
  const std::array<int64_t, 4> want_kv{bsz, c.num_kv_heads, tt, c.head_dim};
  if (a.k_shape != want_kv) {
    return Str("store_insert: k has shape ", ShapeStr(a.k_shape), " but expected ",
               ShapeStr(want_kv), " ([batch, num_kv_heads, tokens, head_dim] of the store).");
  }
  if (a.v_shape != a.k_shape) {
    return Str("store_insert: v has shape ", ShapeStr(a.v_shape), " but k has shape ",
               ShapeStr(a.k_shape), ".");
  }
  const int64_t nt = CodeColumns(c);
  const std::array<int64_t, 4> want_codes{bsz, c.num_kv_heads, tt, nt};
  if (a.codes_shape != want_codes) {
    return Str("store_insert: codes has shape ", ShapeStr(a.codes_shape), " but expected ",
               ShapeStr(want_codes), " ([batch, num_kv_heads, tokens, num_tables]",
               nt == 0 ? "; the proxy estimator's store takes no codes" : "", ").");
  }
  const std::array<int64_t, 3> want_mu{bsz, c.num_kv_heads, c.head_dim};
  if (a.mu_shape != want_mu) {
    return Str("store_insert: mu has shape ", ShapeStr(a.mu_shape), " but expected ",
               ShapeStr(want_mu), ".");
  }
  if (a.lengths_size != bsz || a.new_sizes_size != bsz) {
    return Str("store_insert: lengths has ", a.lengths_size, " entries and the result ",
               a.new_sizes_size, " but slots has ", bsz, ".");
  }
  const int64_t nb = int64_t{1} << c.num_bits;
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t b = 0; b < bsz; ++b) {
    if (auto e = CheckSlot(a.slots[b]); !e.empty()) return Str("store_insert: row ", b, ": ", e);
    for (int64_t b2 = 0; b2 < b; ++b2) {
      if (a.slots[b2] == a.slots[b]) {
        return Str("store_insert: slot ", a.slots[b], " appears twice in slots (rows ", b2,
                   " and ", b, "); insert each slot at most once per call.");
      }
    }
    const int64_t len = a.lengths[b];
    if (len < 0 || len > tt) {
      return Str("store_insert: lengths[", b, "] = ", len, " is outside [0, ", tt, "].");
    }
    const int64_t n = Pool(a.layer, a.slots[b], 0).n;
    if (n + len > c.capacity) {
      return Str("store_insert: capacity exceeded: layer ", a.layer, " slot ", a.slots[b],
                 " holds ", n, " tokens and ", len, " more would exceed the capacity of ",
                 c.capacity, " tokens.");
    }
    for (int64_t h = 0; h < c.num_kv_heads; ++h) {
      const int32_t* codes = a.codes + (b * c.num_kv_heads + h) * tt * nt;
      for (int64_t j = 0; j < len * nt; ++j) {
        if (codes[j] < 0 || codes[j] >= nb) {
          return Str("store_insert: code ", codes[j], " (row ", b, ", kv head ", h, ", token ",
                     j / nt, ", table ", j % nt, ") is outside [0, 2^", c.num_bits, ").");
        }
      }
      // Only the first len tokens are read; the rest of the row may hold anything.
      const int64_t row0 = (b * c.num_kv_heads + h) * tt * c.head_dim;
      for (int which = 0; which < 2; ++which) {
        const void* x = which == 0 ? a.k : a.v;
        const DType t = which == 0 ? a.k_dtype : a.v_dtype;
        const char* at = static_cast<const char*>(x) + row0 * DTypeSize(t);
        if (const int64_t bad = FirstNonFinite(at, t, len * c.head_dim); bad >= 0) {
          return NonFiniteError("store_insert", which == 0 ? "k" : "v", a.k_shape, row0 + bad,
                                ElementAsF32(x, t, row0 + bad));
        }
      }
      const int64_t mu0 = (b * c.num_kv_heads + h) * c.head_dim;
      const int64_t bad_mu = len > 0 ? FirstNonFinite(a.mu + mu0, DType::kF32, c.head_dim) : -1;
      if (bad_mu >= 0) {
        return NonFiniteError("store_insert", "mu", a.mu_shape, mu0 + bad_mu, a.mu[mu0 + bad_mu]);
      }
    }
  }

  const uint64_t call_t0 = profiling_ ? NowNs() : 0;
  // Pass 1, per (row, kv head): copy K/V (int8: scales), mean; allocate. Pass 2, per table: CSR
  // append.
  // Pools are only marked longer once both passes succeeded.
  const int64_t hkv = c.num_kv_heads;
  std::vector<int64_t> n0(bsz);
  for (int64_t b = 0; b < bsz; ++b) n0[b] = Pool(a.layer, a.slots[b], 0).n;
  try {
    ParallelFor(bsz * hkv, [&](int64_t i, int) {
      const int64_t b = i / hkv, h = i % hkv, len = a.lengths[b];
      if (len == 0) return;
      HeadPool& p = Pool(a.layer, a.slots[b], h);
      if (c.dtype == DType::kF32) {
        CopyTokens<float>(a, b, h, p, len);
      } else if (c.dtype == DType::kBf16) {
        CopyTokens<bf16>(a, b, h, p, len);
      } else {
        CopyTokens<int8_t>(a, b, h, p, len);
      }
    });
  } catch (const std::bad_alloc&) {
    return Str("store_insert: out of host memory while growing layer ", a.layer, "'s pools.");
  }
  ParallelFor(bsz * hkv * nt, [&](int64_t i, int w) {
    const int64_t b = i / (hkv * c.num_tables), h = (i / c.num_tables) % hkv;
    const int t = static_cast<int>(i % c.num_tables);
    if (a.lengths[b] > 0) AppendToTable(a, b, h, t, n0[b], a.lengths[b], scratch_[w]);
  });
  for (int64_t b = 0; b < bsz; ++b) {
    for (int64_t h = 0; h < hkv; ++h) Pool(a.layer, a.slots[b], h).n = n0[b] + a.lengths[b];
    a.new_sizes[b] = static_cast<int32_t>(n0[b] + a.lengths[b]);
  }
  if (profiling_) {
    prof_.insert_calls += 1;
    prof_.insert_ns += NowNs() - call_t0;
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Attend: candidates by >= 2 collisions, then importance-weighted attention, per (row, q head).

inline std::string Store::Attend(const AttendArgs& a) {
  const StoreConfig& c = cfg_;
  if (auto e = CheckLayer(a.layer); !e.empty()) return "store_attend: " + e;
  const int64_t bsz = a.slots_size, hq = a.q_shape[1], d = c.head_dim;
  if (a.q_shape[0] != bsz || a.q_shape[2] != d || hq < 1 || hq % c.num_kv_heads != 0) {
    return Str("store_attend: q has shape ", ShapeStr(a.q_shape), " but expected [", bsz,
               ", a multiple of ", c.num_kv_heads, " query heads, ", d,
               "] ([batch, num_q_heads, head_dim]).");
  }
  const int64_t nt = CodeColumns(c);
  const std::array<int64_t, 3> want_codes{bsz, hq, nt};
  if (a.codes_shape != want_codes) {
    return Str("store_attend: q_codes has shape ", ShapeStr(a.codes_shape), " but expected ",
               ShapeStr(want_codes), " ([batch, num_q_heads, num_tables]",
               nt == 0 ? "; the proxy estimator's store takes no codes" : "", ").");
  }
  const std::array<int64_t, 2> want_bh{bsz, hq};
  if (a.o_shape != a.q_shape || a.lse_shape != want_bh || a.count_shape != want_bh) {
    return "store_attend: result shapes do not match q.";
  }
  const int64_t nb = int64_t{1} << c.num_bits;
  for (int64_t i = 0; i < bsz * hq * nt; ++i) {
    if (a.codes[i] < 0 || a.codes[i] >= nb) {
      return Str("store_attend: query code ", a.codes[i], " (row ", i / (hq * nt), ", head ",
                 (i / nt) % hq, ", table ", i % nt, ") is outside [0, 2^", c.num_bits, ").");
    }
  }
  if (const int64_t bad = FirstNonFinite(a.q, a.q_dtype, bsz * hq * d); bad >= 0) {
    return NonFiniteError("store_attend", "q", a.q_shape, bad, ElementAsF32(a.q, a.q_dtype, bad));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const bool prof = profiling_;
  const uint64_t call_t0 = prof ? NowNs() : 0;
  int64_t max_n = 0, work = 0;
  for (int64_t b = 0; b < bsz; ++b) {
    if (auto e = CheckSlot(a.slots[b]); !e.empty()) return Str("store_attend: row ", b, ": ", e);
    const int64_t n = Pool(a.layer, a.slots[b], 0).n;
    max_n = std::max(max_n, n);
    work += n * hq;
  }
  const int64_t items = bsz * hq;
  // Whether the pool's threads help depends on the whole call; how a head is computed does not.
  // Every head runs the same steps (lookup, pieces of kPieceCandidates, log-sum-exp merge in
  // piece order) whichever thread runs them, so a row's output is bitwise independent of the
  // other rows of the call (a serving batch must not change a request's tokens).
  const bool inline_only = work < kMinParallelWork || workers_.size() < 2;
  if (c.estimator == Estimator::kProxy) {
    const std::string e = AttendProxy(a, inline_only);
    if (prof) {
      prof_.attend_calls += 1;
      prof_.attend_ns += NowNs() - call_t0;
    }
    return e;
  }
  try {
    for (auto& s : scratch_) {
      s.counter.Reserve(max_n);
      s.score.resize(kAttentionScratch);
    }
    // Candidate buffers; the branch-free scan writes past the last candidate.
    if (item_cand_.size() < size_t(items)) item_cand_.resize(items);
    for (int64_t i = 0; i < items; ++i) {
      const int64_t n = Pool(a.layer, a.slots[i / hq], 0).n;
      if (item_cand_[i].size() < size_t(n + kScanSlack)) item_cand_[i].resize(n + kScanSlack);
    }
    item_q_.resize(items * d);
  } catch (const std::bad_alloc&) {
    return "store_attend: out of host memory for the lookup scratch.";
  }

  const int64_t group = hq / c.num_kv_heads;
  auto pool_of = [&](int64_t i) -> HeadPool& { return Pool(a.layer, a.slots[i / hq], (i % hq) / group); };
  // Query i as f32 into q; its candidates into cand (ascending), returning the count.
  auto lookup = [&](int64_t i, Scratch& s, float* q, int32_t* cand) -> int64_t {
    HeadPool& p = pool_of(i);
    if (p.n == 0) {  // no tables yet
      a.count[i] = 0;
      return 0;
    }
    for (int64_t e = 0; e < d; ++e) {
      q[e] = a.q_dtype == DType::kF32 ? static_cast<const float*>(a.q)[i * d + e]
                                      : ToF32(static_cast<const bf16*>(a.q)[i * d + e]);
    }
    const int32_t* qcodes = a.codes + i * c.num_tables;
    const uint64_t t0 = prof ? NowNs() : 0;
    const int64_t count = CollectCandidates(p.segments, qcodes, c.num_bits, c.num_tables, p.n,
                                            s.counter, cand);
    if (prof) {
      s.prof.lookup_ns += NowNs() - t0;
      uint64_t walked = 0;
      for (const TableSegment& seg : p.segments) {
        for (int t = 0; t < c.num_tables; ++t) {
          const int32_t* off = seg.offsets.data() + t * (nb + 1);
          walked += off[qcodes[t] + 1] - off[qcodes[t]];
        }
      }
      s.prof.heads += 1;
      s.prof.ids_walked += walked;
      s.prof.candidates += count;
      s.prof.bytes += walked * 2 + count * TokenBytes(d, c.dtype);
      // cand is ascending: walk the bins' lower bounds (ceil(b n / kBins)) instead of one
      // 64-bit division per candidate (1.7 M per profiled step at 128k, inside the attend's clock).
      int64_t bin = 0;
      auto lower = [&](int64_t b) { return (b * p.n + Profile::kBins - 1) / Profile::kBins; };
      for (int64_t j = 0; j < count; ++j) {
        while (bin + 1 < Profile::kBins && cand[j] >= lower(bin + 1)) ++bin;
        s.prof.candidate_bins[bin] += 1;
      }
    }
    a.count[i] = static_cast<int32_t>(count);
    return count;
  };
  // Adds cand[0..count) of query i to (o, m, z).
  auto accumulate = [&](int64_t i, Scratch& s, const float* q, const int32_t* cand, int64_t count,
                        float* o, float& m, float& z) {
    HeadPool& p = pool_of(i);
    const PoolView view = View(p);
    uint64_t split_ns[2] = {0, 0};
    uint64_t* sp = prof ? split_ns : nullptr;
    if (c.dtype == DType::kF32) {
      AccumulateAttention<float>(ops_, q, d, view, cand, count, log_u_, s.score.data(), o, m, z, sp);
    } else if (c.dtype == DType::kBf16) {
      AccumulateAttention<bf16>(ops_, q, d, view, cand, count, log_u_, s.score.data(), o, m, z, sp);
    } else {
      AccumulateAttention<int8_t>(ops_, q, d, view, cand, count, log_u_, s.score.data(), o, m, z,
                                  sp);
    }
    s.prof.score_ns += split_ns[0];
    s.prof.softmax_ns += split_ns[1];
  };

  // Two phases, so that two workers share nine query heads evenly: all lookups, then the
  // candidates of every head in pieces of kPieceCandidates, each its own partial softmax
  // (o, m, z), merged per head by log-sum-exp at the end. One queue for both, so that no worker
  // waits at the barrier for the last lookup, gains nothing beyond noise (BENCHMARKS.md, "Levers
  // measured").
  ParallelFor(items, [&](int64_t i, int w) {
    lookup(i, scratch_[w], item_q_.data() + i * d, item_cand_[i].data());
  }, inline_only);
  pieces_.Cut(a.count, items, d);
  pieces_.Run(PieceFor(inline_only), [&](const Pieces::Piece& pc, int w, float* o, float& m,
                                         float& z) {
    accumulate(pc.item, scratch_[w], item_q_.data() + pc.item * d,
               item_cand_[pc.item].data() + pc.begin, pc.end - pc.begin, o, m, z);
  });
  for (int64_t i = 0, j = 0; i < items; ++i) j = pieces_.Merge(i, j, a.o + i * d, &a.lse[i]);
  if (prof) {
    prof_.attend_calls += 1;
    prof_.attend_ns += NowNs() - call_t0;
    // (After the clock: a serial merge of the heads' candidate lists, not part of the attend.)
    for (int64_t g0 = 0; g0 < items; g0 += group) {
      prof_.distinct_candidates += DistinctCandidates(a.count, g0, group);
    }
  }
  return "";
}

}  // namespace pigjax

#include "xla_ffi/store_proxy.h"

#endif  // PIGJAX_XLA_FFI_STORE_H_
