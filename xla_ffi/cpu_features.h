// The CPU features the kernels may use and the run-time choice between their AVX2 and scalar
// versions: the one place that reads the CPU's feature bits and PIGJAX_KERNELS.
//
// The extension is compiled without -march, so that it runs on any x86-64: each AVX2 kernel is a
// function compiled for AVX2+FMA on its own (PIGJAX_AVX2) and called only where UseAvx2() holds,
// so nothing executes an instruction the CPU lacks. Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_CPU_FEATURES_H_
#define PIGJAX_XLA_FFI_CPU_FEATURES_H_

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define PIGJAX_X86 1
#include <immintrin.h>
// The target of every AVX2 kernel (the attend's, the proxy scan's, the dense decode kernel's).
#define PIGJAX_AVX2 __attribute__((target("avx2,fma")))
// The quantized matmul's kernels, which also convert IEEE halves (F16C).
#define PIGJAX_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#endif

namespace pigjax {

// Whether PIGJAX_KERNELS=scalar is set in the environment: it forces the portable fallback
// everywhere (for tests and for comparing the two). Read at every call, not cached, so that a
// test can set it between two stores.
inline bool ScalarKernelsForced() {
  const char* force = std::getenv("PIGJAX_KERNELS");
  return force && std::strcmp(force, "scalar") == 0;
}

// Whether the CPU has AVX2 and FMA (read once).
inline bool CpuHasAvx2Fma() {
#ifdef PIGJAX_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

// Whether the CPU has F16C (read once).
inline bool CpuHasF16c() {
#ifdef PIGJAX_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c");
  }();
  return has;
#else
  return false;
#endif
}

// Whether to run the PIGJAX_AVX2 kernels: the CPU has them and the scalar ones are not forced.
inline bool UseAvx2() { return CpuHasAvx2Fma() && !ScalarKernelsForced(); }

// Whether to run the PIGJAX_AVX2_F16C kernels (the quantized matmul's).
inline bool UseAvx2F16c() { return CpuHasAvx2Fma() && CpuHasF16c() && !ScalarKernelsForced(); }

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_CPU_FEATURES_H_
