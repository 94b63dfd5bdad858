// The layout of a host store's pool (docs/design.md, "The host store"): one row per token, its K
// then its V in the store dtype, 64-byte aligned, with an int8 row's scales beside; the view the
// kernels read it through; and the allocator of its large blocks.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_POOL_H_
#define PIGJAX_XLA_FFI_POOL_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla_ffi/simd.h"

namespace pigjax {

// Host K/V storage. kI8: int8 with one float scale per K row and per V row (in a side array of
// the pool).
enum class DType { kF32, kBf16, kI8 };

inline const char* DTypeName(DType t) {
  return t == DType::kF32 ? "float32" : t == DType::kBf16 ? "bfloat16" : "int8";
}
inline int64_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : t == DType::kBf16 ? 2 : 1; }


// One pool token is one row: its K then its V (docs/design.md, "The host store"), a candidate
// being one contiguous gather. Rows hold nothing else: at head_dim 64 a bfloat16 row is 256 bytes,
// four whole cache lines of a 64-byte-aligned pool (a 16-byte header of |k - mu| and the scales
// would make it 272 bytes, five lines: the gather is bound by lines in flight, not by bytes).
// |k - mu| is recomputed from the row while the dot product reads it. int8 rows hold
// round(x / scale), scale = max |x| / 127, with the K and V scales of row i in a side array
// (scales[2i], [2i+1]); float32 and bfloat16 rows have no scales (1).
inline int64_t RowBytes(int64_t d, int64_t elem_bytes) {
  return (2 * d * elem_bytes + 15) / 16 * 16;
}
// Host bytes of one pool token's K/V: its row, and an int8 row's two f32 scales.
inline int64_t TokenBytes(int64_t d, DType t) {
  return RowBytes(d, DTypeSize(t)) + (t == DType::kI8 ? 8 : 0);
}

struct PoolView {
  const char* rows;     // [n] rows of row_bytes: K [D] of T, V [D] of T
  int64_t row_bytes;
  const float* scales;  // int8 rows: [n, 2] K and V scales; null for float rows (scale 1)
  const float* mu;      // [D]
  int64_t n;

  float k_scale(int64_t i) const { return scales ? scales[2 * i] : 1.f; }
  // w[j] *= the V scale of row cc[j], for j < nc (nothing for float rows).
  void ScaleByV(const int32_t* cc, int64_t nc, float* w) const {
    if (scales) {
      for (int64_t j = 0; j < nc; ++j) w[j] *= scales[2 * int64_t{cc[j]} + 1];
    }
  }
};

// Row lists (a query head's candidates, the proxy's selection) are ascending int32 ids of a pool.
// Branch-free id extractions write up to this many ids past the last one.
constexpr int64_t kScanSlack = 8;

// Alignment of a pool's rows: rows of a multiple of 64 bytes then start on cache lines.
constexpr size_t kRowAlign = 64;

// std::allocator for the pool rows and table ids, on kRowAlign-byte boundaries (malloc gives
// 16: a large block sits 16 bytes past a page start, and a 256-byte row would then touch five
// lines). On Linux, blocks of 2 MiB and more are fresh 2 MiB-aligned mappings advised as huge
// pages (THP "madvise" or "always"): the gather touches a random row of a GB-sized pool per
// candidate and the lookup a random bucket of each table, and with 4 KiB pages nearly every one
// is a TLB miss as well as a cache miss. (malloc would hand back heap memory already faulted in
// 4 KiB pages, which the advice does not convert.)
// PIGJAX_HUGE_PAGES=0 in the environment leaves the huge-page advice out (to measure it).
inline bool HugePagesWanted() {
  static const bool wanted = [] {
    const char* e = std::getenv("PIGJAX_HUGE_PAGES");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return wanted;
}

template <typename T>
struct RowAllocator {
  using value_type = T;
  static constexpr size_t kHuge = size_t{2} << 20;
  RowAllocator() = default;
  template <typename U>
  RowAllocator(const RowAllocator<U>&) {}
  static size_t RoundUp(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
#if defined(__linux__)
    if (bytes >= kHuge) {
      const size_t size = RoundUp(bytes, kHuge);
      char* raw = static_cast<char*>(mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE,
                                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      if (raw == MAP_FAILED) throw std::bad_alloc();
      char* p = reinterpret_cast<char*>(RoundUp(reinterpret_cast<uintptr_t>(raw), kHuge));
      if (p > raw) munmap(raw, p - raw);
      if (raw + kHuge > p) munmap(p + size, raw + kHuge - p);
      if (HugePagesWanted()) madvise(p, size, MADV_HUGEPAGE);  // advice: no THP, no effect
      return reinterpret_cast<T*>(p);
    }
#endif
    return static_cast<T*>(::operator new(bytes, std::align_val_t(kRowAlign)));
  }
  void deallocate(T* p, size_t n) {
    const size_t bytes = n * sizeof(T);
#if defined(__linux__)
    if (bytes >= kHuge) {
      munmap(p, RoundUp(bytes, kHuge));
      return;
    }
#endif
    ::operator delete(p, std::align_val_t(kRowAlign));
  }
  template <typename U>
  bool operator==(const RowAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const RowAllocator<U>&) const { return false; }
};

// One (layer, slot, kv head) pool: its rows and its mean key. The estimator keeps the pool's
// index beside it (estimators.h). Buffers grow geometrically up to the capacity (GrowTo).
struct HeadPool {
  int64_t n = 0;
  std::vector<char, RowAllocator<char>> rows;  // [n] rows: K [D], V [D] of the store dtype
  std::vector<float> scales;                   // int8 rows only: [n, 2] K and V scales
  std::vector<float> mu;                       // [D]

  uint64_t Bytes() const { return rows.capacity() + 4 * (scales.capacity() + mu.capacity()); }
  void Clear() { *this = HeadPool(); }
};

// Resizes vec to `need`, reserving geometrically (twice the capacity) but never past `limit`.
template <typename V>
void GrowTo(V& vec, size_t need, size_t limit) {
  if (need > vec.capacity()) vec.reserve(std::min(limit, std::max(need, 2 * vec.capacity())));
  vec.resize(need);
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_POOL_H_
