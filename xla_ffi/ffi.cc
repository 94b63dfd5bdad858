// XLA FFI bindings of pigjax's host kernels, exported to Python with nanobind.
// The kernels themselves live in headers free of XLA and nanobind includes (store.h and below).
#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/vector.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/decode_attention_ffi.h"
#include "xla_ffi/quant_ffi.h"
#include "xla_ffi/registry.h"
#include "xla_ffi/store.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------------------------
// Host KV store handlers. Operands are AnyBuffer so every rank/dtype problem gets a message that
// names the operand, rather than a generic decoding error.

namespace {

using pigjax::Str;

// Shape of `b` into `out` if it has rank N, else an error message.
template <size_t N>
std::string Shape(const char* fn, const char* name, const ffi::AnyBuffer& b,
                  std::array<int64_t, N>* out) {
  auto dims = b.dimensions();
  if (dims.size() != N) {
    return Str(fn, ": ", name, " must have rank ", N, ", got rank ", dims.size(), ".");
  }
  for (size_t i = 0; i < N; ++i) (*out)[i] = dims[i];
  return "";
}

std::string NeedDtype(const char* fn, const char* name, const ffi::AnyBuffer& b,
                      ffi::DataType want) {
  if (b.element_type() == want) return "";
  return Str(fn, ": ", name, " must be ", want, ", got ", b.element_type(), ".");
}

// float32 or bfloat16 operand.
std::string FloatDtype(const char* fn, const char* name, const ffi::AnyBuffer& b,
                       pigjax::DType* out) {
  if (b.element_type() == ffi::DataType::F32) {
    *out = pigjax::DType::kF32;
  } else if (b.element_type() == ffi::DataType::BF16) {
    *out = pigjax::DType::kBf16;
  } else {
    return Str(fn, ": ", name, " must be float32 or bfloat16, got ", b.element_type(), ".");
  }
  return "";
}

// The store behind an int32 scalar handle operand.
std::string FindStore(const char* fn, const ffi::AnyBuffer& handle,
                      std::shared_ptr<pigjax::Store>* out) {
  if (handle.element_type() != ffi::DataType::S32 || handle.element_count() != 1) {
    return Str(fn, ": the store handle must be an int32 scalar, got ", handle.element_type(),
               " with ", handle.element_count(), " elements.");
  }
  const int32_t h = *static_cast<const int32_t*>(handle.untyped_data());
  *out = pigjax::Registry::Get().Find(h);
  return *out ? "" : pigjax::UnknownHandle(fn, h);
}

#define PIGJAX_RETURN_IF_ERROR(expr)                                        \
  do {                                                                      \
    std::string _msg = (expr);                                              \
    if (!_msg.empty()) return ffi::Error::InvalidArgument(std::move(_msg)); \
  } while (0)

ffi::Error StoreInsertImpl(ffi::AnyBuffer handle, ffi::AnyBuffer slots, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::AnyBuffer codes, ffi::AnyBuffer lengths,
                           ffi::AnyBuffer mu, int32_t layer, ffi::Result<ffi::AnyBuffer> sizes) {
  constexpr const char* fn = "store_insert";
  std::shared_ptr<pigjax::Store> store;
  PIGJAX_RETURN_IF_ERROR(FindStore(fn, handle, &store));
  pigjax::InsertArgs a;
  std::array<int64_t, 1> s1;
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "slots", slots, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "slots", slots, &s1));
  a.slots_size = s1[0];
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "lengths", lengths, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "lengths", lengths, &s1));
  a.lengths_size = s1[0];
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "result", *sizes, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "result", *sizes, &s1));
  a.new_sizes_size = s1[0];
  PIGJAX_RETURN_IF_ERROR(FloatDtype(fn, "k", k, &a.k_dtype));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "k", k, &a.k_shape));
  PIGJAX_RETURN_IF_ERROR(FloatDtype(fn, "v", v, &a.v_dtype));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "v", v, &a.v_shape));
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "codes", codes, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "codes", codes, &a.codes_shape));
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "mu", mu, ffi::DataType::F32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "mu", mu, &a.mu_shape));
  a.layer = layer;
  a.slots = static_cast<const int32_t*>(slots.untyped_data());
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.codes = static_cast<const int32_t*>(codes.untyped_data());
  a.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  a.mu = static_cast<const float*>(mu.untyped_data());
  a.new_sizes = static_cast<int32_t*>(sizes->untyped_data());
  PIGJAX_RETURN_IF_ERROR(store->Insert(a));
  return ffi::Error::Success();
}

ffi::Error StoreAttendImpl(ffi::AnyBuffer handle, ffi::AnyBuffer slots, ffi::AnyBuffer q,
                           ffi::AnyBuffer codes, ffi::AnyBuffer /*dep*/, int32_t layer,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                           ffi::Result<ffi::AnyBuffer> count) {
  constexpr const char* fn = "store_attend";
  std::shared_ptr<pigjax::Store> store;
  PIGJAX_RETURN_IF_ERROR(FindStore(fn, handle, &store));
  pigjax::AttendArgs a;
  std::array<int64_t, 1> s1;
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "slots", slots, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "slots", slots, &s1));
  a.slots_size = s1[0];
  PIGJAX_RETURN_IF_ERROR(FloatDtype(fn, "q", q, &a.q_dtype));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "q", q, &a.q_shape));
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "q_codes", codes, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "q_codes", codes, &a.codes_shape));
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "o", *o, ffi::DataType::F32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "o", *o, &a.o_shape));
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "lse", *lse, ffi::DataType::F32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "lse", *lse, &a.lse_shape));
  PIGJAX_RETURN_IF_ERROR(NeedDtype(fn, "count", *count, ffi::DataType::S32));
  PIGJAX_RETURN_IF_ERROR(Shape(fn, "count", *count, &a.count_shape));
  a.layer = layer;
  a.slots = static_cast<const int32_t*>(slots.untyped_data());
  a.q = q.untyped_data();
  a.codes = static_cast<const int32_t*>(codes.untyped_data());
  a.o = static_cast<float*>(o->untyped_data());
  a.lse = static_cast<float*>(lse->untyped_data());
  a.count = static_cast<int32_t*>(count->untyped_data());
  PIGJAX_RETURN_IF_ERROR(store->Attend(a));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StoreInsert, StoreInsertImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // handle: int32[]
                                  .Arg<ffi::AnyBuffer>()  // slots: int32[B]
                                  .Arg<ffi::AnyBuffer>()  // k: [B, Hkv, T, D]
                                  .Arg<ffi::AnyBuffer>()  // v: [B, Hkv, T, D]
                                  .Arg<ffi::AnyBuffer>()  // codes: int32[B, Hkv, T, L]
                                  .Arg<ffi::AnyBuffer>()  // lengths: int32[B]
                                  .Arg<ffi::AnyBuffer>()  // mu: f32[B, Hkv, D]
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>());  // new pool sizes: int32[B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(StoreAttend, StoreAttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // handle: int32[]
                                  .Arg<ffi::AnyBuffer>()  // slots: int32[B]
                                  .Arg<ffi::AnyBuffer>()  // q: [B, Hq, D]
                                  .Arg<ffi::AnyBuffer>()  // q_codes: int32[B, Hq, L]
                                  .Arg<ffi::AnyBuffer>()  // dep: orders this after an insert
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>()    // o: f32[B, Hq, D]
                                  .Ret<ffi::AnyBuffer>()    // lse: f32[B, Hq]
                                  .Ret<ffi::AnyBuffer>());  // count: int32[B, Hq]

// ---------------------------------------------------------------------------------------------
// Python module: FFI capsules plus the store's lifetime and bookkeeping functions.

template <typename T>
static nb::capsule EncapsulateFfiHandler(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

static pigjax::StoreConfig MakeConfig(int num_layers, int num_slots, int num_kv_heads,
                                      int head_dim, int num_bits, int num_tables,
                                      int64_t capacity, const std::string& dtype, int threads,
                                      const std::string& estimator, int proxy_bits,
                                      float proxy_fraction, const std::string& proxy_tail) {
  pigjax::StoreConfig c;
  c.num_layers = num_layers;
  c.num_slots = num_slots;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.num_bits = num_bits;
  c.num_tables = num_tables;
  c.capacity = capacity;
  c.threads = threads;
  if (dtype == "bfloat16") {
    c.dtype = pigjax::DType::kBf16;
  } else if (dtype == "float32") {
    c.dtype = pigjax::DType::kF32;
  } else if (dtype == "int8") {
    c.dtype = pigjax::DType::kI8;
  } else {
    throw std::invalid_argument("store dtype must be 'bfloat16', 'float32' or 'int8', got '" +
                                dtype + "'.");
  }
  if (auto e = pigjax::CheckEstimatorName(estimator); !e.empty()) throw std::invalid_argument(e);
  c.estimator = estimator;
  if (proxy_tail != "mean" && proxy_tail != "none") {
    throw std::invalid_argument("proxy_tail must be 'mean' or 'none', got '" + proxy_tail + "'.");
  }
  c.proxy_bits = proxy_bits;
  c.proxy_fraction = proxy_fraction;
  c.proxy_tail = proxy_tail == "mean";
  if (auto e = pigjax::CheckConfig(c); !e.empty()) throw std::invalid_argument(e);
  return c;
}

static std::shared_ptr<pigjax::Store> GetStore(int64_t handle, const char* fn) {
  auto s = pigjax::Registry::Get().Find(handle);
  if (!s) throw std::invalid_argument(pigjax::UnknownHandle(fn, handle));
  return s;
}

static void Check(const std::string& e) {
  if (!e.empty()) throw std::invalid_argument(e);
}

NB_MODULE(_pigjax_ffi, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["pigjax_insert"] = EncapsulateFfiHandler(StoreInsert);
    d["pigjax_attend"] = EncapsulateFfiHandler(StoreAttend);
    pigjax::AddQuantRegistrations(d);
    pigjax::AddDecodeAttentionRegistrations(d);
    return d;
  });
  pigjax::DefineQuantFunctions(m);
  m.def("store_estimate_bytes",
        [](int num_layers, int num_slots, int num_kv_heads, int head_dim, int num_bits,
           int num_tables, int64_t capacity, const std::string& dtype, int threads,
           const std::string& estimator, int proxy_bits, float proxy_fraction,
           const std::string& proxy_tail) {
          return pigjax::EstimateBytes(MakeConfig(num_layers, num_slots, num_kv_heads, head_dim,
                                                  num_bits, num_tables, capacity, dtype,
                                                  threads, estimator, proxy_bits, proxy_fraction,
                                                  proxy_tail));
        });
  m.def("store_create",
        [](int num_layers, int num_slots, int num_kv_heads, int head_dim, int num_bits,
           int num_tables, int64_t capacity, const std::string& dtype, int threads,
           const std::string& estimator, int proxy_bits, float proxy_fraction,
           const std::string& proxy_tail) {
          auto c = MakeConfig(num_layers, num_slots, num_kv_heads, head_dim, num_bits,
                              num_tables, capacity, dtype, threads, estimator, proxy_bits,
                              proxy_fraction, proxy_tail);
          // All hardware threads (the default): the compute pool, which the matmuls and the
          // dense kernel use too, so that one set of workers serves the whole decode step.
          return pigjax::Registry::Get().Add(std::make_shared<pigjax::Store>(
              c, threads == 0 ? &pigjax::ComputePool() : nullptr));
        });
  m.def("store_free", [](int64_t h) { return pigjax::Registry::Get().Remove(h); });
  m.def("store_reset", [](int64_t h, int64_t slot) {
    auto s = GetStore(h, "store_reset");
    Check(s->CheckSlot(slot));
    nb::gil_scoped_release release;
    s->Reset(static_cast<int>(slot));
  });
  m.def("store_num_tokens", [](int64_t h, int64_t layer, int64_t slot) {
    auto s = GetStore(h, "store_num_tokens");
    Check(s->CheckLayer(layer));
    Check(s->CheckSlot(slot));
    nb::gil_scoped_release release;
    return s->NumTokens(static_cast<int>(layer), static_cast<int>(slot));
  });
  m.def("store_memory_bytes", [](int64_t h) {
    auto s = GetStore(h, "store_memory_bytes");
    nb::gil_scoped_release release;
    return s->MemoryBytes();
  });
  // The kernel's log u(cos) (interpolated table; AVX2 or scalar as GetVecOps picks, so
  // PIGJAX_KERNELS=scalar selects the scalar one), for tests against pigjax/lsh.py.
  m.def("log_collision_prob", [](const std::vector<float>& cos, int num_bits, int num_tables) {
    pigjax::StoreConfig c;
    c.num_layers = c.num_slots = c.num_kv_heads = c.head_dim = 1;
    c.capacity = 1;
    c.num_bits = num_bits;
    c.num_tables = num_tables;
    Check(pigjax::CheckConfig(c));
    const pigjax::LogCollisionTable table(num_bits, num_tables);
    std::vector<float> out(cos.size());
    pigjax::GetVecOps().log_us(cos.data(), static_cast<int64_t>(cos.size()), table, out.data());
    return out;
  });
  m.def("store_set_profiling", [](int64_t h, bool on) {
    auto s = GetStore(h, "store_set_profiling");
    nb::gil_scoped_release release;
    s->SetProfiling(on);
  });
  m.def("store_profile", [](int64_t h) {
    auto s = GetStore(h, "store_profile");
    pigjax::Profile p;
    {
      nb::gil_scoped_release release;
      p = s->GetProfile();
    }
    nb::dict d;
    d["attend_calls"] = p.attend_calls;
    d["attend_ns"] = p.attend_ns;
    d["insert_calls"] = p.insert_calls;
    d["insert_ns"] = p.insert_ns;
    d["lookup_ns"] = p.lookup_ns;
    d["score_ns"] = p.score_ns;
    d["softmax_ns"] = p.softmax_ns;
    d["heads"] = p.heads;
    d["ids_walked"] = p.ids_walked;
    d["candidates"] = p.candidates;
#ifdef PIGJAX_PROFILE
    d["distinct_candidates"] = p.distinct_candidates;  // (only in -DPIGJAX_PROFILE=ON builds)
#endif
    nb::list bins;
    for (uint64_t x : p.candidate_bins) bins.append(x);
    d["candidate_bins"] = bins;
    d["bytes"] = p.bytes;
    d["parallel_calls"] = p.parallel_calls;
    d["alone_ns"] = p.alone_ns;
    return d;
  });
  m.def("store_num_threads", [](int64_t h) { return GetStore(h, "store_num_threads")->num_threads(); });
  m.def("store_isa", [](int64_t h) { return std::string(GetStore(h, "store_isa")->isa()); });
}
