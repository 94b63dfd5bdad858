// XLA FFI binding of the dense decode attention (decode_attention.h). Registered beside the store
// and matmul handlers by ffi.cc's `registrations()`.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/decode_attention.h"
#include "xla_ffi/decode_attention_ffi.h"
#include "xla_ffi/errors.h"
#include "xla_ffi/quant_ffi.h"
#include "xla_ffi/vec_ops.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

using pigjax::Str;

// Both handlers: `valid` is null for pigjax_decode_attend, [B, S] flags for the masked one.
ffi::Error Run(const char* fn, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
               ffi::Buffer<ffi::S32> lengths, const ffi::Buffer<ffi::S8>* valid,
               ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse) {
  auto err = [](std::string msg) { return ffi::Error::InvalidArgument(std::move(msg)); };
  if (q.element_type() != ffi::DataType::F32 || q.dimensions().size() != 3) {
    return err(Str(fn, ": q must be float32 [B, H, D], got ", q.element_type(), " of rank ",
                   q.dimensions().size(), "."));
  }
  const auto kt = k.element_type();
  if (kt != ffi::DataType::F32 && kt != ffi::DataType::BF16) {
    return err(Str(fn, ": k must be float32 or bfloat16, got ", kt, "."));
  }
  if (v.element_type() != kt) {
    return err(Str(fn, ": v must have k's dtype (", kt, "), got ", v.element_type(), "."));
  }
  if (k.dimensions().size() != 4) {
    return err(Str(fn, ": k must have rank 4 [B, K, S, D], got rank ", k.dimensions().size(), "."));
  }
  const int64_t B = q.dimensions()[0], H = q.dimensions()[1], D = q.dimensions()[2];
  const int64_t K = k.dimensions()[1], S = k.dimensions()[2];
  if (k.dimensions()[0] != B || k.dimensions()[3] != D) {
    return err(Str(fn, ": k is [", k.dimensions()[0], ", ", K, ", ", S, ", ", k.dimensions()[3],
                   "]; q [B, H, D] needs k's batch ", B, " and head dim ", D, "."));
  }
  if (K == 0 || H % K != 0) {
    return err(Str(fn, ": q's ", H, " heads must be a multiple of k's ", K, " KV heads."));
  }
  if (v.dimensions().size() != 4 || v.dimensions()[0] != B || v.dimensions()[1] != K ||
      v.dimensions()[2] != S || v.dimensions()[3] != D) {
    return err(Str(fn, ": v must have k's shape [", B, ", ", K, ", ", S, ", ", D, "]."));
  }
  if (lengths.dimensions().size() != 1 || lengths.dimensions()[0] != B) {
    return err(Str(fn, ": lengths must be int32 [", B, "]."));
  }
  if (o->element_type() != ffi::DataType::F32 || o->dimensions().size() != 3 ||
      o->dimensions()[0] != B || o->dimensions()[1] != H || o->dimensions()[2] != D) {
    return err(Str(fn, ": the output o must be float32 [", B, ", ", H, ", ", D, "]."));
  }
  if (lse->element_type() != ffi::DataType::F32 || lse->dimensions().size() != 2 ||
      lse->dimensions()[0] != B || lse->dimensions()[1] != H) {
    return err(Str(fn, ": the output lse must be float32 [", B, ", ", H, "]."));
  }
  if (valid && (valid->dimensions().size() != 2 || valid->dimensions()[0] != B ||
                valid->dimensions()[1] != S)) {
    return err(Str(fn, ": valid must be int8 [", B, ", ", S, "] (one flag per cache row)."));
  }
  const int8_t* vp = valid ? valid->typed_data() : nullptr;
  // A length outside [0, S] is clamped: the caller's length counts the token just written, which
  // a full cache drops (write_kv ignores positions past the end).
  std::vector<int32_t> len(B);
  for (int64_t b = 0; b < B; ++b) {
    len[b] = static_cast<int32_t>(std::clamp<int64_t>(lengths.typed_data()[b], 0, S));
  }
  const pigjax::decode::Shape sh{B, K, H / K, S, D};
  const pigjax::VecOps& ops = pigjax::GetVecOps();
  const float* qp = static_cast<const float*>(q.untyped_data());
  float* op = static_cast<float*>(o->untyped_data());
  float* lp = static_cast<float*>(lse->untyped_data());
  if (kt == ffi::DataType::F32) {
    pigjax::decode::Attend(ops, pigjax::ComputePool(), sh, qp,
                           static_cast<const float*>(k.untyped_data()),
                           static_cast<const float*>(v.untyped_data()), len.data(), vp, op, lp);
  } else {
    pigjax::decode::Attend(ops, pigjax::ComputePool(), sh, qp,
                           static_cast<const pigjax::bf16*>(k.untyped_data()),
                           static_cast<const pigjax::bf16*>(v.untyped_data()), len.data(), vp, op,
                           lp);
  }
  return ffi::Error::Success();
}

ffi::Error DecodeAttendImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::AnyBuffer> lse) {
  return Run("decode_attend", q, k, v, lengths, nullptr, o, lse);
}

ffi::Error DecodeAttendMaskedImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S8> valid,
                                  ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse) {
  return Run("decode_attend_masked", q, k, v, lengths, &valid, o, lse);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttend, DecodeAttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q: f32[B, H, D]
                                  .Arg<ffi::AnyBuffer>()  // k: f32|bf16[B, K, S, D]
                                  .Arg<ffi::AnyBuffer>()  // v: like k
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths: [B] visible rows
                                  .Ret<ffi::AnyBuffer>()  // o: f32[B, H, D]
                                  .Ret<ffi::AnyBuffer>());  // lse: f32[B, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttendMasked, DecodeAttendMaskedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // q: f32[B, H, D]
                                  .Arg<ffi::AnyBuffer>()  // k: f32|bf16[B, K, S, D]
                                  .Arg<ffi::AnyBuffer>()  // v: like k
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths: [B] visible rows
                                  .Arg<ffi::Buffer<ffi::S8>>()   // valid: [B, S] row flags
                                  .Ret<ffi::AnyBuffer>()  // o: f32[B, H, D]
                                  .Ret<ffi::AnyBuffer>());  // lse: f32[B, H]

namespace pigjax {

void AddDecodeAttentionRegistrations(nb::dict& registrations) {
  registrations["pigjax_decode_attend"] = nb::capsule(reinterpret_cast<void*>(DecodeAttend));
  registrations["pigjax_decode_attend_masked"] =
      nb::capsule(reinterpret_cast<void*>(DecodeAttendMasked));
}

}  // namespace pigjax
