// XLA FFI bindings of pigjax's host kernels, exported to Python with nanobind.
// The kernels themselves live in headers free of XLA and nanobind includes.
#include <cstdint>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

// y = x * scale: a trivial handler that proves the build and registration path.
static ffi::Error ScaleImpl(ffi::BufferR1<ffi::F32> x, float scale,
                            ffi::ResultBufferR1<ffi::F32> y) {
  const int64_t n = x.element_count();
  if (y->element_count() != n) {
    return ffi::Error::InvalidArgument("scale: output size differs from input size");
  }
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * scale;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Scale, ScaleImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::BufferR1<ffi::F32>>());

template <typename T>
static nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

NB_MODULE(_pigjax_ffi, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["pigjax_scale"] = EncapsulateFfiHandler(Scale);
    return d;
  });
}
