// XLA FFI binding of the weight-quantized matmul (quant.h): y[M, N] = x[M, K] W[N, K]^T with W in
// 32-element blocks. Registered beside the store handlers by ffi.cc's `registrations()`.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/errors.h"
#include "xla_ffi/quant.h"
#include "xla_ffi/quant_ffi.h"
#include "xla_ffi/store_config.h"
#include "xla_ffi/thread_pool.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

using pigjax::Str;
using pigjax::ComputePool;
namespace quant = pigjax::quant;

// Below this many block products a call runs on the calling thread: waking a worker costs more.
constexpr int64_t kMinParallelBlocks = 8192;
// Rows per task: a multiple of the kernel's 4-row pass.
constexpr int64_t kRowsPerTask = 64;

ffi::Error QMatMulImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, int32_t format, int32_t act_bits,
                       int32_t packed, ffi::Result<ffi::AnyBuffer> y) {
  constexpr const char* fn = "quant_matmul";
  auto err = [](std::string msg) { return ffi::Error::InvalidArgument(std::move(msg)); };
  if (format < 0 || format >= quant::kNumFormats) {
    return err(Str(fn, ": format must be 0 (q8_0), 1 (q4_0) or 2 (q4_1), got ", format, "."));
  }
  const auto f = static_cast<quant::Format>(format);
  if (act_bits != 8 && act_bits != 16) {
    return err(Str(fn, ": act_bits must be 8 or 16, got ", act_bits, "."));
  }
  const bool low = act_bits == 16;
  if (packed != 0 && packed != 1) {
    return err(Str(fn, ": packed must be 0 or 1, got ", packed, "."));
  }
  if (x.element_type() != ffi::DataType::F32) {
    return err(Str(fn, ": x must be float32, got ", x.element_type(), "."));
  }
  if (x.dimensions().size() != 2) {
    return err(Str(fn, ": x must have rank 2 [M, K], got rank ", x.dimensions().size(), "."));
  }
  if (w.element_type() != ffi::DataType::U8) {
    return err(Str(fn, ": w must be uint8 blocks, got ", w.element_type(), "."));
  }
  if (w.dimensions().size() != 2) {
    return err(Str(fn, ": w must have rank 2 [N, blocks * bytes], got rank ",
                   w.dimensions().size(), "."));
  }
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t N = w.dimensions()[0], row_bytes = w.dimensions()[1];
  if (K % quant::kBlock != 0) {
    return err(Str(fn, ": x's last dimension K=", K, " must be a multiple of ", quant::kBlock,
                   " (the block size)."));
  }
  const int64_t nb = K / quant::kBlock, bytes = quant::BlockBytes(f);
  if (row_bytes != nb * bytes) {
    return err(Str(fn, ": w has ", row_bytes, " bytes per row; ", quant::FormatName(f), " needs ",
                   nb, " blocks x ", bytes, " bytes = ", nb * bytes, " for K=", K, "."));
  }
  if (packed && N % quant::kPackRows != 0) {
    return err(Str(fn, ": w in the packed layout needs a multiple of ", quant::kPackRows,
                   " rows, got ", N, "."));
  }
  if (y->element_type() != ffi::DataType::F32 || y->dimensions().size() != 2 ||
      y->dimensions()[0] != M || y->dimensions()[1] != N) {
    return err(Str(fn, ": the result must be float32 [", M, ", ", N, "]."));
  }
  if (M == 0 || N == 0) return ffi::Error::Success();

  const quant::QuantOps& ops = quant::GetQuantOps();
  thread_local std::vector<quant::ActBlock> xq;
  xq.resize(M * nb);
  const float* xp = static_cast<const float*>(x.untyped_data());
  for (int64_t m = 0; m < M; ++m) ops.quantize_row(xp + m * K, K, low, xq.data() + m * nb);

  const uint8_t* wp = static_cast<const uint8_t*>(w.untyped_data());
  float* yp = static_cast<float*>(y->untyped_data());
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
  const quant::ActBlock* xqp = xq.data();
  ComputePool().ParallelFor(
      tasks,
      [&](int64_t t, int) {
        const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
        ops.matmul_rows(f, low, packed, wp, nb, xqp, M, n0, n1, yp, N);
      },
      /*inline_only=*/M * N * nb < kMinParallelBlocks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatMul, QMatMulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x: f32[M, K]
                                  .Arg<ffi::AnyBuffer>()  // w: u8[N, K / 32 * block bytes]
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("act_bits")  // 8 or 16 (see quant.h ActBlock)
                                  .Attr<int32_t>("packed")  // 1: the packed layout (quant.h)
                                  .Ret<ffi::AnyBuffer>());  // y: f32[M, N]

namespace pigjax {

ThreadPool& ComputePool() {
  static ThreadPool pool([] {
    const char* env = std::getenv("PIGJAX_MATMUL_THREADS");
    const int n = env ? std::atoi(env) : 0;
    return ResolveThreads(n > 0 ? std::min(n, 256) : 0);
  }());
  return pool;
}

void AddQuantRegistrations(nb::dict& registrations) {
  registrations["pigjax_quant_matmul"] = nb::capsule(reinterpret_cast<void*>(QuantMatMul));
}

void DefineQuantFunctions(nb::module_& m) {
  m.def("quant_isa", [] { return std::string(quant::GetQuantOps().isa); });
  m.def("quant_num_threads", [] { return ComputePool().size(); });
}

}  // namespace pigjax
