// The host KV store: for every sparse layer, batch slot and KV head, a pool of rows (pool.h) and
// the index its estimator builds (estimators.h), with the insert and attend that the FFI handlers
// call (docs/design.md, "The host store"). The store is the same for every estimator: it checks
// the operands, copies the rows, runs the threads and hands each call to the estimator once.
//
// Pure C++: no XLA, no nanobind, so a CPU and a (future) CUDA FFI registration share it. Errors
// are returned as message strings (empty = success); nothing here reads out of range for any
// operand, because every index is checked before any work starts.
#ifndef PIGJAX_XLA_FFI_STORE_H_
#define PIGJAX_XLA_FFI_STORE_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "xla_ffi/errors.h"
#include "xla_ffi/estimators.h"
#include "xla_ffi/operands.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/store_config.h"
#include "xla_ffi/store_core.h"
#include "xla_ffi/thread_pool.h"

namespace pigjax {

class Store {
 public:
  // Throws std::invalid_argument for a configuration CheckConfig rejects, std::runtime_error if
  // the worker threads cannot be started. `shared`: a pool to run on instead of one of its own
  // (the process's compute pool, so that the quantized matmuls and the store's calls of a
  // decode step find the same workers awake; ffi.cc passes it when c.threads is 0); it must
  // outlive the store.
  explicit Store(const StoreConfig& c, ThreadPool* shared = nullptr)
      : core_(Checked(c), shared),
        estimator_(MakeEstimator(core_.cfg, core_.num_pools(), core_.num_threads())),
        code_columns_(CodeColumns(core_.cfg)) {}

  const StoreConfig& config() const { return core_.cfg; }
  const char* isa() const { return core_.ops.isa; }
  int num_threads() const { return core_.num_threads(); }

  std::string CheckLayer(int64_t layer) const {
    const StoreConfig& c = core_.cfg;
    if (layer < 0 || layer >= c.num_layers) {
      return Str("layer ", layer, " is out of range: the store has ", c.num_layers,
                 " sparse layers (0..", c.num_layers - 1, ").");
    }
    return "";
  }
  std::string CheckSlot(int64_t slot) const {
    const StoreConfig& c = core_.cfg;
    if (slot < 0 || slot >= c.num_slots) {
      return Str("slot ", slot, " is out of range: the store has ", c.num_slots, " slots (0..",
                 c.num_slots - 1, ").");
    }
    return "";
  }

  // Empties `slot` in every layer and frees its memory. The caller checks the slot.
  void Reset(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int l = 0; l < core_.cfg.num_layers; ++l) {
      for (int h = 0; h < core_.cfg.num_kv_heads; ++h) {
        const size_t i = core_.PoolIndex(l, slot, h);
        core_.Pool(i).Clear();
        std::visit([i](auto& e) { e.Clear(i); }, estimator_);
      }
    }
  }

  int64_t NumTokens(int layer, int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    return core_.Pool(layer, slot, 0).n;
  }

  uint64_t MemoryBytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return core_.Bytes() + std::visit([](const auto& e) { return e.Bytes(); }, estimator_);
  }

  std::string Insert(const InsertArgs& a);
  std::string Attend(const AttendArgs& a);

  // Optional kernel timing counters (off by default; a steady_clock read per phase per head).
  void SetProfiling(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    core_.profiling = on;
    core_.prof = Profile();
    for (auto& s : core_.scratch) s.prof = Profile();
  }
  // Counters summed over workers since profiling was switched on.
  Profile GetProfile() {
    std::lock_guard<std::mutex> lock(mu_);
    Profile p = core_.prof;
    for (const auto& s : core_.scratch) p.Add(s.prof);
    return p;
  }

 private:
  static const StoreConfig& Checked(const StoreConfig& c) {
    if (auto e = CheckConfig(c); !e.empty()) throw std::invalid_argument(e);
    return c;
  }
  // The note a codes shape error adds when the estimator takes no codes.
  std::string NoCodes(int64_t nt) const {
    return nt == 0 ? Str("; the ", core_.cfg.estimator, " estimator's store takes no codes") : "";
  }

  template <typename E>
  std::string InsertChecked(E& e, const InsertArgs& a);
  template <typename T, typename E>
  void CopyTokens(E& e, const InsertArgs& a, int64_t b, int64_t kvh, int64_t len);

  std::mutex mu_;  // one call at a time: calls mutate pools and share the scratch
  StoreCore core_;
  AnyEstimator estimator_;
  const int64_t code_columns_;  // of the codes operands
};

// ---------------------------------------------------------------------------------------------
// Insert: append tokens to the pools, then the estimator extends its index.

// Pool (b, kvh): its rows grown, the estimator's part (p.mu, the index), then tokens [0, len) of
// the operands copied in as T (int8: with their scales).
template <typename T, typename E>
void Store::CopyTokens(E& est, const InsertArgs& a, int64_t b, int64_t kvh, int64_t len) {
  const StoreConfig& c = core_.cfg;
  const size_t pool = core_.PoolIndex(a.layer, a.slots[b], kvh);
  HeadPool& p = core_.Pool(pool);
  const int64_t d = c.head_dim, hkv = c.num_kv_heads, tt = a.k_shape[2];
  const int64_t n0 = p.n, n1 = n0 + len, limit = c.capacity;
  const int64_t rb = RowBytes(d, sizeof(T));
  GrowTo(p.rows, n1 * rb, limit * rb);
  if constexpr (std::is_same_v<T, int8_t>) GrowTo(p.scales, 2 * n1, 2 * limit);
  est.Append(core_, a, b, kvh, pool, p, len);

  std::vector<float> kf(d), vf(d);
  const int64_t src0 = (b * hkv + kvh) * tt * d;
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
      kf[e] = ElementAsF32(a.k, a.k_dtype, src0 + j * d + e);
      vf[e] = ElementAsF32(a.v, a.v_dtype, src0 + j * d + e);
    }
    const float k_scale = put(kf.data(), kr), v_scale = put(vf.data(), kr + d);
    if constexpr (std::is_same_v<T, int8_t>) {
      p.scales[2 * (n0 + j)] = k_scale;
      p.scales[2 * (n0 + j) + 1] = v_scale;
    }
  }
}

inline std::string Store::Insert(const InsertArgs& a) {
  const StoreConfig& c = core_.cfg;
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
  const int64_t nt = code_columns_;
  const std::array<int64_t, 4> want_codes{bsz, c.num_kv_heads, tt, nt};
  if (a.codes_shape != want_codes) {
    return Str("store_insert: codes has shape ", ShapeStr(a.codes_shape), " but expected ",
               ShapeStr(want_codes), " ([batch, num_kv_heads, tokens, num_tables]",
               NoCodes(nt), ").");
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
    const int64_t n = core_.Pool(a.layer, a.slots[b], 0).n;
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

  return std::visit([&](auto& e) { return InsertChecked(e, a); }, estimator_);
}

// The insert of operands Insert checked, under its lock. Pass 1, per (row, kv head): copy K/V
// (int8: scales), the estimator's mean and index; allocate. Pass 2: the estimator's
// FinishInsert (magicpig: the table appends). Pools are only marked longer once both passes
// succeeded.
template <typename E>
std::string Store::InsertChecked(E& e, const InsertArgs& a) {
  const StoreConfig& c = core_.cfg;
  const int64_t bsz = a.slots_size, hkv = c.num_kv_heads;
  const uint64_t call_t0 = core_.profiling ? NowNs() : 0;
  std::vector<int64_t> n0(bsz);
  for (int64_t b = 0; b < bsz; ++b) n0[b] = core_.Pool(a.layer, a.slots[b], 0).n;
  try {
    core_.ParallelFor(bsz * hkv, [&](int64_t i, int) {
      const int64_t b = i / hkv, h = i % hkv, len = a.lengths[b];
      if (len == 0) return;
      if (c.dtype == DType::kF32) {
        CopyTokens<float>(e, a, b, h, len);
      } else if (c.dtype == DType::kBf16) {
        CopyTokens<bf16>(e, a, b, h, len);
      } else {
        CopyTokens<int8_t>(e, a, b, h, len);
      }
    });
  } catch (const std::bad_alloc&) {
    return Str("store_insert: out of host memory while growing layer ", a.layer, "'s pools.");
  }
  e.FinishInsert(core_, a, n0);
  for (int64_t b = 0; b < bsz; ++b) {
    for (int64_t h = 0; h < hkv; ++h) core_.Pool(a.layer, a.slots[b], h).n = n0[b] + a.lengths[b];
    a.new_sizes[b] = static_cast<int32_t>(n0[b] + a.lengths[b]);
  }
  if (core_.profiling) {
    core_.prof.insert_calls += 1;
    core_.prof.insert_ns += NowNs() - call_t0;
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Attend: the checks, then the estimator's o, lse and count for every (row, q head).

inline std::string Store::Attend(const AttendArgs& a) {
  const StoreConfig& c = core_.cfg;
  if (auto e = CheckLayer(a.layer); !e.empty()) return "store_attend: " + e;
  const int64_t bsz = a.slots_size, hq = a.q_shape[1], d = c.head_dim;
  if (a.q_shape[0] != bsz || a.q_shape[2] != d || hq < 1 || hq % c.num_kv_heads != 0) {
    return Str("store_attend: q has shape ", ShapeStr(a.q_shape), " but expected [", bsz,
               ", a multiple of ", c.num_kv_heads, " query heads, ", d,
               "] ([batch, num_q_heads, head_dim]).");
  }
  const int64_t nt = code_columns_;
  const std::array<int64_t, 3> want_codes{bsz, hq, nt};
  if (a.codes_shape != want_codes) {
    return Str("store_attend: q_codes has shape ", ShapeStr(a.codes_shape), " but expected ",
               ShapeStr(want_codes), " ([batch, num_q_heads, num_tables]",
               NoCodes(nt), ").");
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
  const bool prof = core_.profiling;
  const uint64_t call_t0 = prof ? NowNs() : 0;
  int64_t max_n = 0, work = 0;
  for (int64_t b = 0; b < bsz; ++b) {
    if (auto e = CheckSlot(a.slots[b]); !e.empty()) return Str("store_attend: row ", b, ": ", e);
    const int64_t n = core_.Pool(a.layer, a.slots[b], 0).n;
    max_n = std::max(max_n, n);
    work += n * hq;
  }
  const int64_t items = bsz * hq;
  // Whether the pool's threads help depends on the whole call; how a head is computed does not.
  // Every head runs the same steps (the estimator's, pieces of kPieceCandidates, log-sum-exp
  // merge in piece order) whichever thread runs them, so a row's output is bitwise independent
  // of the other rows of the call (a serving batch must not change a request's tokens).
  const AttendPlan plan{items, hq, hq / c.num_kv_heads, max_n,
                        work < kMinParallelWork || core_.num_threads() < 2};
  const std::string e =
      std::visit([&](auto& est) { return est.Attend(core_, a, plan); }, estimator_);
  if (prof) {
    core_.prof.attend_calls += 1;
    core_.prof.attend_ns += NowNs() - call_t0;
    // (After the clock: counters that cost more than the attend should show.)
    if (e.empty()) {
      std::visit([&](auto& est) { est.ProfileAfterAttend(core_, a, plan); }, estimator_);
    }
  }
  return e;
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_STORE_H_
