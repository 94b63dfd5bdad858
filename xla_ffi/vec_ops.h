// The run-time choice of the vector primitives: one table of function pointers per instruction
// set, scalar or AVX2+FMA (cpu_features.h's UseAvx2), taken once per store or kernel call and
// called per row or per chunk, never per element.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_VEC_OPS_H_
#define PIGJAX_XLA_FFI_VEC_OPS_H_

#include <cstdint>

#include "xla_ffi/collision_prob.h"
#include "xla_ffi/cpu_features.h"
#include "xla_ffi/simd.h"

namespace pigjax {

struct VecOps {
  const char* isa;
  float (*dot_f32)(const float*, const float*, int64_t);
  float (*dot_bf16)(const float*, const bf16*, int64_t);
  void (*axpy_f32)(float, const float*, float*, int64_t);
  void (*axpy_bf16)(float, const bf16*, float*, int64_t);
  float (*dot_i8)(const float*, const int8_t*, int64_t);
  void (*axpy_i8)(float, const int8_t*, float*, int64_t);
  float (*scores)(const float*, const float*, int64_t, const ScoreParams&,
                  const LogCollisionTable&, float*);
  float (*exp_sum)(float*, int64_t, float);
  void (*log_us)(const float*, int64_t, const LogCollisionTable&, float*);

  float Dot(const float* q, const float* k, int64_t d) const { return dot_f32(q, k, d); }
  float Dot(const float* q, const bf16* k, int64_t d) const { return dot_bf16(q, k, d); }
  void Axpy(float w, const float* v, float* o, int64_t d) const { axpy_f32(w, v, o, d); }
  void Axpy(float w, const bf16* v, float* o, int64_t d) const { axpy_bf16(w, v, o, d); }
  float Dot(const float* q, const int8_t* k, int64_t d) const { return dot_i8(q, k, d); }
  void Axpy(float w, const int8_t* v, float* o, int64_t d) const { axpy_i8(w, v, o, d); }
};

inline VecOps ScalarVecOps() {
  return VecOps{"scalar", &scalar::Dot<float>, &scalar::Dot<bf16>, &scalar::Axpy<float>,
                &scalar::Axpy<bf16>, &scalar::Dot<int8_t>, &scalar::Axpy<int8_t>,
                &scalar::Scores, &scalar::ExpSum, &scalar::LogUs};
}

// The best primitives this CPU supports (see UseAvx2).
inline const VecOps& GetVecOps() {
  static const VecOps scalar_ops = ScalarVecOps();
#ifdef PIGJAX_X86
  static const VecOps avx2_ops{"avx2", &avx2::Dot<float>, &avx2::Dot<bf16>, &avx2::Axpy<float>,
                               &avx2::Axpy<bf16>, &avx2::Dot<int8_t>, &avx2::Axpy<int8_t>,
                               &avx2::Scores, &avx2::ExpSum,
                               &avx2::LogUs};
  if (UseAvx2()) return avx2_ops;
#endif
  return scalar_ops;
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_VEC_OPS_H_
