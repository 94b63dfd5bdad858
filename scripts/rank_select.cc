// The proxy selection's order statistics, LargestAt (xla_ffi/proxy.h) against std::nth_element,
// and the whole per-head selection (avx2::SelectTop) at pool sizes of the benchmark contexts
// (BENCHMARKS.md, "Levers measured").
//
//   g++ -O2 -std=c++17 -I. -o /tmp/rank_select scripts/rank_select.cc && /tmp/rank_select
//
// Nine heads of n scores each (normal, on a 2^-7 grid as the scan's integer sums scaled by a
// power of two), 3% kept. For each n: the sampled threshold's statistic (rank about k / 16 of
// n / 16 sampled scores) and the exact k-th among the ~1.25 k + 64 scores above it, each by
// nth_element over a copy and by LargestAt; then SelectTop per head, which uses LargestAt for
// both. Best of 8 repetitions, microseconds per head. x86-64 with AVX2 only.
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "xla_ffi/proxy.h"

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best of 8 runs of body() over the nine heads, in microseconds per head.
template <typename F>
double BestUs(int heads, F body) {
  double best = 1e30;
  for (int rep = 0; rep < 8; ++rep) {
    const double t0 = Now();
    for (int h = 0; h < heads; ++h) body(h);
    best = std::min(best, (Now() - t0) / heads * 1e6);
  }
  return best;
}

}  // namespace

int main() {
  using namespace pigjax;
  constexpr int kHeads = 9;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 3.f);
  volatile float sink = 0.f;
  for (int64_t n : {4096, 8192, 32768, 131072}) {
    const int64_t k = ProxyKeepCount(0.03f, n), m = n / 16;  // SampleThreshold's stride
    const int64_t r = std::min(m - 1, k / 16 + k / 64 + 4);
    std::vector<float> s(kHeads * n), sample(kHeads * m), kept(kHeads * n), tmp(2 * n);
    std::vector<int64_t> nkept(kHeads);
    for (auto& x : s) x = std::nearbyint(normal(rng) * 128.f) / 128.f;
    for (int h = 0; h < kHeads; ++h) {
      for (int64_t j = 0; j < m; ++j) sample[h * m + j] = s[h * n + j * 16];
      const float theta = LargestAt(&sample[h * m], m, r, tmp.data());
      for (int64_t i = 0; i < n; ++i) {
        kept[h * n + nkept[h]] = s[h * n + i];
        nkept[h] += s[h * n + i] >= theta;
      }
    }
    auto nth = [&](const float* v, int64_t len, int64_t rank) {
      std::copy(v, v + len, tmp.begin());
      std::nth_element(tmp.begin(), tmp.begin() + rank, tmp.begin() + len, std::greater<float>());
      return tmp[rank];
    };
    const double sample_nth = BestUs(kHeads, [&](int h) { sink = nth(&sample[h * m], m, r); });
    const double sample_bins =
        BestUs(kHeads, [&](int h) { sink = LargestAt(&sample[h * m], m, r, tmp.data()); });
    const double kept_nth =
        BestUs(kHeads, [&](int h) { sink = nth(&kept[h * n], nkept[h], k - 1); });
    const double kept_bins = BestUs(
        kHeads, [&](int h) { sink = LargestAt(&kept[h * n], nkept[h], k - 1, tmp.data()); });
    std::vector<float> buf;
    std::vector<int32_t> ids, sel(n + kScanSlack);
    const double select = BestUs(kHeads, [&](int h) {
      float tau = 0.f, z = 0.f;
      avx2::SelectTop(&s[h * n], n, k, buf, ids, sel.data(), &tau, &z);
      sink = tau + z;
    });
    std::printf("n %6lld (k %4lld): sample rank of %5lld: nth_element %6.1f us, bins %6.1f us; "
                "k-th of %5lld kept: nth_element %6.1f us, bins %6.1f us; SelectTop %6.1f us\n",
                static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(m),
                sample_nth, sample_bins, static_cast<long long>(nkept[0]), kept_nth, kept_bins,
                select);
  }
  return 0;
}
