// The quantized-matmul FFI target and its helper functions, added to the extension module by
// ffi.cc (see quant_ffi.cc).
#ifndef PIGJAX_XLA_FFI_QUANT_FFI_H_
#define PIGJAX_XLA_FFI_QUANT_FFI_H_

#include "nanobind/nanobind.h"
#include "xla_ffi/thread_pool.h"

namespace pigjax {

// The pool of the stateless compute handlers (quantized matmul, dense decode attention), sized to
// the hardware (PIGJAX_MATMUL_THREADS overrides). XLA runs a program's thunks one after another,
// so their calls never overlap. The host stores keep pools of their own.
ThreadPool& ComputePool();

// Adds the "pigjax_quant_matmul" FFI capsule to `registrations`.
void AddQuantRegistrations(nanobind::dict& registrations);
// Defines quant_isa() and quant_num_threads() on module `m`.
void DefineQuantFunctions(nanobind::module_& m);

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_QUANT_FFI_H_
