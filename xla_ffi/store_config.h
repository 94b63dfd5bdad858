// A host store's configuration, its checks and its worst-case memory (docs/design.md, "The host
// store"). The estimator's part of each (its settings, its index and scratch bytes) comes from the
// estimator type E (estimators.h), which picks it by name.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_STORE_CONFIG_H_
#define PIGJAX_XLA_FFI_STORE_CONFIG_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>

#include "xla_ffi/errors.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/softmax.h"

namespace pigjax {

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
  // The pool estimator, by name (estimators.h; config.ESTIMATORS in Python).
  std::string estimator = "magicpig";
  // Proxy only (the tables are not built; codes operands have 0 tables):
  int proxy_bits = 4;           // bits per channel of the index, 1..8
  float proxy_fraction = 0.03f;  // rows read exactly: ceil(fraction * pool)
  bool proxy_tail = true;       // estimate the unread rows ("mean") or drop them ("none")
};

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

// Products and sums of a worst-case size: once any step overflows 64 bits, ok is false and stays
// so. Every factor is checked: a geometry such as 2^21 layers x 2^21 slots x 2^22 heads wraps to
// 0 in unchecked arithmetic.
struct CheckedSize {
  bool ok = true;
  uint64_t Mul(uint64_t x, uint64_t y) {
    uint64_t r = 0;
    ok = ok && !__builtin_mul_overflow(x, y, &r);
    return r;
  }
  uint64_t Add(uint64_t x, uint64_t y) {
    uint64_t r = 0;
    ok = ok && !__builtin_add_overflow(x, y, &r);
    return r;
  }
};

// Bytes of the per-worker scratch every store has, whatever its estimator: a query head's row
// list (4 bytes per pool token), a chunk's scores and norms, and the query. Cannot overflow:
// capacity < 2^31, head_dim < 2^31.
inline uint64_t StoreScratchBytes(const StoreConfig& c) {
  return uint64_t(c.capacity) * 4 + uint64_t(kAttentionScratch + c.head_dim) * 4;
}

// Worst case of estimator E (every (layer, slot) pool full, plus per-thread scratch and the pool
// directory) into *out; false if it does not fit in 64 bits.
template <typename E>
bool CheckedEstimateBytes(const StoreConfig& c, uint64_t* out) {
  CheckedSize s;
  const uint64_t cap = c.capacity, d = c.head_dim;
  // Per (layer, slot, kv head): rows of K + V (and two f32 scales per int8 row); mu (f32); the
  // estimator's index. TokenBytes cannot overflow: head_dim < 2^31 and elements are <= 4 bytes.
  const uint64_t row_bytes = static_cast<uint64_t>(TokenBytes(int64_t{c.head_dim}, c.dtype));
  const uint64_t per_head = s.Add(s.Add(s.Mul(cap, row_bytes), d * 4), E::IndexBytes(c, s));
  const uint64_t pools = s.Mul(s.Mul(uint64_t(c.num_layers), uint64_t(c.num_slots)),
                               uint64_t(c.num_kv_heads));
  const uint64_t directory = sizeof(HeadPool) + sizeof(typename E::Index);
  const uint64_t scratch = StoreScratchBytes(c) + E::ScratchBytes(c);
  const uint64_t total = s.Add(s.Add(s.Mul(per_head, pools), s.Mul(pools, directory)),
                               s.Mul(scratch, uint64_t(ResolveThreads(c.threads))));
  *out = s.ok ? total : 0;
  return s.ok;
}

// Empty string if the configuration is usable with estimator E, else a sentence saying what is
// wrong.
template <typename E>
std::string CheckConfigFor(const StoreConfig& c) {
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
  if (auto e = E::CheckConfig(c); !e.empty()) return e;
  if (c.threads < 0 || c.threads > kMaxThreads) {
    return Str("threads must be in [0, ", kMaxThreads, "] (0 = all hardware threads, here ",
               ResolveThreads(0), "), got ", c.threads, ".");
  }
  uint64_t bytes = 0;
  if (!CheckedEstimateBytes<E>(c, &bytes) || bytes > kMaxStoreBytes) {
    return Str("the store geometry (", c.num_layers, " layers x ", c.num_slots, " slots x ",
               c.num_kv_heads, " kv heads x ", c.capacity, " tokens x head_dim ", c.head_dim,
               ", ", c.num_tables, " tables) needs ",
               bytes > kMaxStoreBytes ? Str(bytes, " bytes") : std::string("more than 2^64 bytes"),
               ", above the limit of 2^50 bytes (1 PiB); lower one of these.");
  }
  return "";
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_STORE_CONFIG_H_
