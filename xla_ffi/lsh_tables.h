// MagicPIG's LSH tables and candidate collection (docs/design.md, "The algorithm", step 5, and
// "The host store", "Lookup"): per pool and table, CSR bucket offsets and 16-bit token ids in
// segments of 2^16 tokens; a query's candidates are the tokens that share its code in at least
// two tables.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_LSH_TABLES_H_
#define PIGJAX_XLA_FFI_LSH_TABLES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla_ffi/cpu_features.h"
#include "xla_ffi/pool.h"

namespace pigjax {

// Per-worker scratch of the lookup: a byte per pool token counting the query's buckets that hold
// it, and a buffer the buckets' ids are first copied into. Copying first lets the bucket reads
// (a few lines each, at random places of a large table) overlap each other as plain loads,
// instead of stalling the counting loop one table at a time: in a micro-benchmark at 32k tokens
// (84 pools of 150 tables, ~13k ids walked per query) a lookup took 31-33 us with the counting
// done on the tables themselves (two bitsets, once and twice) and 21-22 us copied first, then
// counted in bytes (4 us of that is the counting; the bitsets' two read-modify-writes per id took
// twice as long). The counts are zero between queries: the final scan clears what it reads.
struct CollisionCounter {
  std::vector<uint8_t> count;  // [>= pool size, rounded up to 16], all zero between queries
  std::vector<uint16_t> walk;  // copied bucket ids of a segment, up to kWalkIds

  static constexpr int64_t kWalkIds = int64_t{1} << 15;  // 64 KiB: stays in L2
  void Reserve(int64_t n) {
    const size_t padded = size_t((n + 15) / 16 * 16);
    if (count.size() < padded) count.resize(padded, 0);
    if (walk.size() < size_t(kWalkIds)) walk.resize(kWalkIds);
  }
  uint64_t Bytes() const { return count.capacity() + 2 * walk.capacity(); }
};

// The tables of a pool come in segments of kSegmentTokens consecutive tokens, each with its own
// bucket offsets, so that a token id within its segment fits 16 bits: half the bytes of int32 ids
// in memory (the tables are most of a pool: 150 x 2 bytes per token against a 256-byte bf16 row)
// and half the cache lines a lookup walks. An append only touches the last segment.
constexpr int64_t kSegmentTokens = int64_t{1} << 16;

struct TableSegment {
  std::vector<int32_t> offsets;  // [L, 2^K + 1]: bucket starts per table
  std::vector<uint16_t, RowAllocator<uint16_t>> ids;  // [L, stride]: ids - segment start, by bucket
  int64_t stride = 0;            // ids room per table (grown for all tables at once)
  const uint16_t* table(int64_t t) const { return ids.data() + t * stride; }
  uint16_t* table(int64_t t) { return ids.data() + t * stride; }
};

// Adds 1 to the count of each of ids[0, len), relative to `count`.
inline void CountIds(const uint16_t* ids, int64_t len, uint8_t* count) {
  for (int64_t j = 0; j < len; ++j) count[ids[j]] += 1;
}

// Writes the ids i < n with count[i] >= 2, ascending, into cand and returns how many; clears
// count[0, n rounded up to 16). Scalar: writes up to one id past the last candidate.
inline int64_t TakeCollided(uint8_t* count, int64_t n, int32_t* cand) {
  int64_t c = 0;
#ifdef PIGJAX_X86
  // SSE2 (every x86-64): 16 counts per compare; count >= 2 <=> min(count, 2) == 2 (unsigned).
  const __m128i two = _mm_set1_epi8(2), zero = _mm_setzero_si128();
  for (int64_t i = 0; i < n; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(count + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(count + i), zero);
    uint32_t m = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_min_epu8(v, two), two)));
    for (; m; m &= m - 1) cand[c++] = static_cast<int32_t>(i + __builtin_ctz(m));
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    cand[c] = static_cast<int32_t>(i);
    c += count[i] >= 2;
    count[i] = 0;
  }
  std::fill(count + n, count + (n + 15) / 16 * 16, uint8_t{0});
#endif
  return c;
}

// Requests a bucket's ids (up to 16 cache lines) ahead of its copy. A bucket is a few lines
// somewhere in a large table: left to the hardware prefetcher, each line would be a DRAM miss.
inline void PrefetchBucket(const uint16_t* row, int32_t begin, int32_t end) {
  const char* p = reinterpret_cast<const char*>(row + begin);
  const char* stop = reinterpret_cast<const char*>(row + std::min(end, begin + 16 * 32));
  for (; p < stop; p += 64) __builtin_prefetch(p, 0, 3);
}

// Tables per pass over a segment: a token's count after a pass is at most 2 + 253 = 255 (counts
// are clamped to 2 between passes), so it never wraps in its byte.
constexpr int kTablesPerPass = 253;

// Counts, for each token of one segment, the query's buckets that hold it. `count` points at the
// segment's first token; `codes`: the query's L codes, already checked to lie in [0, 2^K).
inline void CountSegment(const TableSegment& seg, int64_t seg_tokens, const int32_t* codes,
                         int num_bits, int num_tables, uint8_t* count, uint16_t* walk) {
  const int64_t stride = (int64_t{1} << num_bits) + 1;
  constexpr int kAhead = 16;
  constexpr int64_t kWalk = CollisionCounter::kWalkIds;
  int32_t begin[kTablesPerPass], end[kTablesPerPass];
  for (int t0 = 0; t0 < num_tables; t0 += kTablesPerPass) {
    if (t0 > 0) {
      for (int64_t i = 0; i < seg_tokens; ++i) count[i] = std::min<uint8_t>(count[i], 2);
    }
    const int nt = std::min(num_tables - t0, kTablesPerPass);
    // Each table's bucket is elsewhere in memory (a miss per table): read all bucket bounds
    // first (independent loads that overlap), then copy the buckets with the next ones
    // prefetched, and count from the copy.
    for (int t = 0; t < nt; ++t) {
      const int32_t* off = seg.offsets.data() + (t0 + t) * stride + codes[t0 + t];
      begin[t] = off[0];
      end[t] = off[1];
    }
    for (int t = 0; t < std::min(nt, kAhead); ++t) {
      PrefetchBucket(seg.table(t0 + t), begin[t], end[t]);
    }
    int64_t pos = 0;
    for (int t = 0; t < nt; ++t) {
      if (t + kAhead < nt) {
        PrefetchBucket(seg.table(t0 + t + kAhead), begin[t + kAhead], end[t + kAhead]);
      }
      const uint16_t* ids = seg.table(t0 + t) + begin[t];
      const int64_t len = end[t] - begin[t];
      if (pos + len > kWalk) {
        CountIds(walk, pos, count);
        pos = 0;
      }
      if (len > kWalk) {  // a bucket larger than the buffer: count it in place
        CountIds(ids, len, count);
        continue;
      }
      std::memcpy(walk + pos, ids, sizeof(uint16_t) * len);
      pos += len;
    }
    CountIds(walk, pos, count);
  }
}

// Writes to `cand`, in ascending order, every pool token (id < n) that shares the query's code in
// at least 2 tables; returns the count. Ascending ids make the later K/V gathers walk memory
// forwards. The caller has reserved the counter for n and `cand` for n + kScanSlack ids.
// `segments`: the pool's table segments (segment s holds tokens from s * kSegmentTokens).
inline int64_t CollectCandidates(const std::vector<TableSegment>& segments, const int32_t* codes,
                                 int num_bits, int num_tables, int64_t n,
                                 CollisionCounter& counter, int32_t* cand) {
  // (Segments past the pool's tokens may exist: allocated by an insert that then failed.)
  const size_t used = std::min(segments.size(), size_t((n + kSegmentTokens - 1) / kSegmentTokens));
  for (size_t s = 0; s < used; ++s) {
    const int64_t first = int64_t(s) * kSegmentTokens;
    CountSegment(segments[s], std::min(kSegmentTokens, n - first), codes, num_bits, num_tables,
                 counter.count.data() + first, counter.walk.data());
  }
  return TakeCollided(counter.count.data(), n, cand);
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_LSH_TABLES_H_
