// The operands of a host store's insert and attend, as the FFI handlers hand them over (shapes
// as received, checked by the store before any work), and the check every float operand gets.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_OPERANDS_H_
#define PIGJAX_XLA_FFI_OPERANDS_H_

#include <array>
#include <cstdint>
#include <cstring>

#include "xla_ffi/pool.h"
#include "xla_ffi/simd.h"

namespace pigjax {

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

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_OPERANDS_H_
