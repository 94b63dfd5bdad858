// _pigjax_devtools: a second extension module for the tests and the benchmarks, not part of
// pigjax's library API (nothing in the pigjax package imports it). It holds
//   - pigjax_scale, a trivial XLA FFI handler (y = x * scale) that proves the build and the
//     registration path (tests/test_devtools.py);
//   - stream_bandwidth, a STREAM-style bandwidth probe that the decode benchmarks print beside
//     the kernel's bytes (tools/bench.py memory_bandwidth).
// Built by the same CMake as _pigjax_ffi (xla_ffi/CMakeLists.txt) and installed beside the
// package, not inside it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/pair.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_features.h"
#include "xla_ffi/simd.h"
#include "xla_ffi/store_config.h"
#include "xla_ffi/thread_pool.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

// y = x * scale: a trivial handler that proves the build and registration path.
ffi::Error ScaleImpl(ffi::BufferR1<ffi::F32> x, float scale, ffi::ResultBufferR1<ffi::F32> y) {
  const int64_t n = x.element_count();
  if (static_cast<int64_t>(y->element_count()) != n) {
    return ffi::Error::InvalidArgument("scale: output size differs from input size");
  }
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * scale;
  return ffi::Error::Success();
}

#ifdef PIGJAX_X86
PIGJAX_AVX2 float SumAvx2(const float* a, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
         s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_loadu_ps(a + i));
    s1 = _mm256_add_ps(s1, _mm256_loadu_ps(a + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_loadu_ps(a + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_loadu_ps(a + i + 24));
  }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  float t = 0.f;
  for (float x : out) t += x;
  for (; i < n; ++i) t += a[i];
  return t;
}
#endif  // PIGJAX_X86

float Sum(const float* a, int64_t n) {
#ifdef PIGJAX_X86
  if (pigjax::CpuHasAvx2Fma()) return SumAvx2(a, n);
#endif
  return static_cast<float>(std::accumulate(a, a + n, 0.0));
}

// Best copy and read bandwidth (GB/s) of `repeats` passes over `bytes`-sized float arrays.
std::pair<double, double> StreamBandwidth(int64_t bytes, int threads, int repeats) {
  const int64_t n = std::max<int64_t>(bytes / 4, 1024);
  std::vector<float> a(n, 1.f), b(n, 0.f);
  pigjax::ThreadPool pool(threads);
  const int64_t chunks = int64_t{threads} * 16, per = (n + chunks - 1) / chunks;
  std::vector<float> sums(chunks);
  double best_copy = 0, best_read = 0;
  for (int r = 0; r < repeats; ++r) {
    uint64_t t0 = pigjax::NowNs();
    pool.ParallelFor(chunks, [&](int64_t c, int) {
      const int64_t lo = c * per, hi = std::min(n, lo + per);
      if (lo < hi) std::memcpy(b.data() + lo, a.data() + lo, (hi - lo) * 4);
    });
    uint64_t t1 = pigjax::NowNs();
    best_copy = std::max(best_copy, 2.0 * n * 4 / double(t1 - t0));
    pool.ParallelFor(chunks, [&](int64_t c, int) {
      const int64_t lo = c * per, hi = std::min(n, lo + per);
      if (lo < hi) sums[c] = Sum(a.data() + lo, hi - lo);
    });
    uint64_t t2 = pigjax::NowNs();
    best_read = std::max(best_read, 1.0 * n * 4 / double(t2 - t1));
  }
  volatile float sink = sums[0];
  (void)sink;
  return {best_copy, best_read};
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Scale, ScaleImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::BufferR1<ffi::F32>>());

NB_MODULE(_pigjax_devtools, m) {
  m.doc() = "pigjax's test and benchmark helpers; not part of the library API.";
  m.def("registrations", []() {
    nb::dict d;
    d["pigjax_scale"] = nb::capsule(reinterpret_cast<void*>(Scale));
    return d;
  });
  // STREAM-style bandwidth (GB/s, best of `repeats`) with `threads` threads (0 = all): a copy
  // b = a of two `bytes`-sized float arrays (counted as 2 x bytes) and a read-only sum of a.
  m.def("stream_bandwidth", [](int64_t bytes, int threads, int repeats) {
    nb::gil_scoped_release release;
    return StreamBandwidth(bytes, pigjax::ResolveThreads(threads), repeats);
  });
}
