// How fast this machine reads scattered pool rows, against how fast it streams memory: the
// ceiling of MagicPIG's gather (BENCHMARKS.md, "Targets and what stands in the way").
//
//   g++ -O2 -mavx2 -std=c++17 -pthread -o /tmp/row_reads scripts/row_reads.cc && /tmp/row_reads
//
// One 2 GiB buffer on huge pages (as the store's rows). Stream: every byte read in order, by 1
// and 2 threads. Rows: 1 row in 20, at random and in ascending order (as a head's candidates),
// each read whole (4 or 2 cache lines: a bfloat16 or an int8 row at head_dim 64), with the lines
// of the row `ahead` rows on prefetched; int8 rows both 256 bytes apart (the bfloat16 spacing,
// so only the row size differs) and 128 bytes apart (packed, as the store keeps them). No arithmetic beyond an add per 32 bytes,
// so this is the gather with its compute taken out. Each configuration draws its own rows, so
// none finds the previous one's rows in the caches. x86-64 with AVX2 only.
#include <immintrin.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr size_t kBytes = size_t{2} << 30;
constexpr size_t kHuge = size_t{2} << 20;

// Runs body(thread) on `threads` threads and returns the slowest one's seconds.
template <typename F>
double Timed(int threads, F body) {
  std::vector<double> secs(threads);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      const double t0 = Now();
      body(t);
      secs[t] = Now() - t0;
    });
  }
  for (auto& t : ts) t.join();
  double worst = 0;
  for (double s : secs) worst = s > worst ? s : worst;
  return worst;
}

}  // namespace

int main() {
  char* raw = static_cast<char*>(mmap(nullptr, kBytes + kHuge, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (raw == MAP_FAILED) return 1;
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(kHuge - 1);
  char* buf = reinterpret_cast<char*>(aligned);
  madvise(buf, kBytes, MADV_HUGEPAGE);
  std::memset(buf, 1, kBytes);
  volatile int sink = 0;

  for (int threads : {1, 2}) {
    const double s = Timed(threads, [&](int t) {
      const size_t part = kBytes / threads;
      const char* p = buf + part * t;
      __m256i acc = _mm256_setzero_si256();
      for (size_t i = 0; i < part; i += 32) {
        acc = _mm256_add_epi32(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
      }
      sink = sink + _mm256_extract_epi32(acc, 0);
    });
    std::printf("stream, %d thread(s): %.1f GB/s\n", threads, kBytes / s / 1e9);
  }

  // (lines, bytes between rows): bfloat16 rows; int8 rows spaced as bfloat16 ones; int8 rows
  // packed as the store packs them.
  const std::pair<int, size_t> layouts[] = {{4, 256}, {2, 256}, {2, 128}};
  for (auto [lines, row_bytes] : layouts) {
    const size_t rows = kBytes / row_bytes;
    for (int threads : {1, 2}) {
      for (int ahead : {8, 16, 32}) {
        std::vector<std::vector<uint32_t>> ids(threads);
        for (int t = 0; t < threads; ++t) {
          std::mt19937_64 rng(1000 * lines + 100 * threads + ahead + 10 * t);
          const size_t part = rows / threads;
          for (size_t i = part * t; i < part * (t + 1); ++i) {
            if (rng() % 20 == 0) ids[t].push_back(static_cast<uint32_t>(i));
          }
        }
        const double s = Timed(threads, [&](int t) {
          const std::vector<uint32_t>& id = ids[t];
          __m256i acc = _mm256_setzero_si256();
          for (size_t j = 0; j < id.size(); ++j) {
            if (j + ahead < id.size()) {
              const char* q = buf + size_t{id[j + ahead]} * row_bytes;
              for (int l = 0; l < lines; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
            }
            const char* q = buf + size_t{id[j]} * row_bytes;
            for (int h = 0; h < 2 * lines; ++h) {
              const auto* line = reinterpret_cast<const __m256i*>(q + 32 * h);
              acc = _mm256_add_epi32(acc, _mm256_load_si256(line));
            }
          }
          sink = sink + _mm256_extract_epi32(acc, 0);
        });
        const double n = static_cast<double>(ids[0].size());
        std::printf("rows of %d lines %3zu B apart, %d thread(s), %2d ahead: "
                    "%.1f ns per row per thread, %.1f GB/s\n",
                    lines, row_bytes, threads, ahead, s / n * 1e9, threads * n * 64 * lines / s / 1e9);
      }
    }
  }
  munmap(raw, kBytes + kHuge);
  return 0;
}
