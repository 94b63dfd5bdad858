// The dense decode-attention FFI target, added to the extension module by ffi.cc (see
// decode_attention_ffi.cc).
#ifndef PIGJAX_XLA_FFI_DECODE_ATTENTION_FFI_H_
#define PIGJAX_XLA_FFI_DECODE_ATTENTION_FFI_H_

#include "nanobind/nanobind.h"

namespace pigjax {

// Adds the "pigjax_decode_attend" FFI capsule to `registrations`.
void AddDecodeAttentionRegistrations(nanobind::dict& registrations);

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_DECODE_ATTENTION_FFI_H_
