// The pool estimators a host store can run, registered by name (StoreConfig::estimator,
// config.ESTIMATORS in Python; docs/design.md, "Estimators"). An estimator decides what the store
// builds at insert (its index of each pool) and how it selects and weighs rows at attend; the
// store (store.h) does everything else: the operand checks, the rows, the threads, the pieces and
// their merge.
//
// An estimator is one header, estimator_<name>.h, with a class that derives from
// EstimatorDefaults (store_core.h) and has:
//
//   static constexpr const char* kName;          its name
//   using Index = ...;                           what it keeps per pool, beside the rows
//   static std::string CheckConfig(const StoreConfig&);            its settings (default: none)
//   static int64_t CodeColumns(const StoreConfig&);                codes operands' last dim
//   static uint64_t IndexBytes(const StoreConfig&, CheckedSize&);  a full pool's index
//   static uint64_t ScratchBytes(const StoreConfig&);              per worker, beyond the store's
//   E(const StoreConfig&, size_t num_pools, int workers);
//   uint64_t Bytes() const;                      what it holds now
//   void Clear(size_t pool);                     a pool emptied
//   void Append(StoreCore&, const InsertArgs&, int64_t b, int64_t kvh, size_t pool, HeadPool& p,
//               int64_t len);                    insert, per (row, kv head), before the rows are
//                                                copied: p.mu and the index (may throw bad_alloc)
//   void FinishInsert(StoreCore&, const InsertArgs&, const std::vector<int64_t>& n0);
//                                                insert, after every pool's rows (default: none)
//   std::string Attend(StoreCore&, const AttendArgs&, const AttendPlan&);
//                                                o, lse and count of every query head
//   void ProfileAfterAttend(StoreCore&, const AttendArgs&, const AttendPlan&);  (default: none)
//
// and, here, its #include and one entry in AnyEstimator. The store picks the estimator once per
// insert or attend call (std::visit, a switch); nothing inside an estimator's loops is virtual.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_ESTIMATORS_H_
#define PIGJAX_XLA_FFI_ESTIMATORS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "xla_ffi/errors.h"
#include "xla_ffi/estimator_magicpig.h"
#include "xla_ffi/estimator_proxy.h"
#include "xla_ffi/store_config.h"

namespace pigjax {

// Every estimator, in the order their names are listed to the user.
using AnyEstimator = std::variant<MagicPigEstimator, ProxyEstimator>;

template <typename E>
struct EstimatorTag {
  using type = E;
};

// Calls f(EstimatorTag<E>{}) for the estimator E named `name`; false if there is none.
template <size_t I = 0, typename F>
bool WithEstimatorType(const std::string& name, F&& f) {
  if constexpr (I == std::variant_size_v<AnyEstimator>) {
    return false;
  } else {
    using E = std::variant_alternative_t<I, AnyEstimator>;
    if (name == E::kName) {
      f(EstimatorTag<E>{});
      return true;
    }
    return WithEstimatorType<I + 1>(name, f);
  }
}

// "'a', 'b' or 'c'": the registered names.
template <size_t I = 0>
std::string EstimatorNames() {
  using E = std::variant_alternative_t<I, AnyEstimator>;
  constexpr size_t n = std::variant_size_v<AnyEstimator>;
  const std::string name = Str("'", E::kName, "'");
  if constexpr (I + 1 == n) {
    return name;
  } else {
    return name + (I + 2 == n ? " or " : ", ") + EstimatorNames<I + 1>();
  }
}

// Empty if `name` is a registered estimator, else the sentence saying which ones are.
inline std::string CheckEstimatorName(const std::string& name) {
  if (WithEstimatorType(name, [](auto) {})) return "";
  return Str("store estimator must be ", EstimatorNames(), ", got '", name, "'.");
}

// Empty string if the configuration is usable, else a sentence saying what is wrong.
inline std::string CheckConfig(const StoreConfig& c) {
  if (auto e = CheckEstimatorName(c.estimator); !e.empty()) return e;
  std::string e;
  WithEstimatorType(c.estimator, [&](auto tag) {
    e = CheckConfigFor<typename decltype(tag)::type>(c);
  });
  return e;
}

// Worst-case bytes of a configuration that passed CheckConfig.
inline uint64_t EstimateBytes(const StoreConfig& c) {
  uint64_t bytes = 0;
  WithEstimatorType(c.estimator, [&](auto tag) {
    CheckedEstimateBytes<typename decltype(tag)::type>(c, &bytes);
  });
  return bytes;
}

// Code columns the insert and attend operands carry (one per table for magicpig, none for the
// proxy), for a configuration that passed CheckConfig.
inline int64_t CodeColumns(const StoreConfig& c) {
  int64_t n = 0;
  WithEstimatorType(c.estimator, [&](auto tag) { n = decltype(tag)::type::CodeColumns(c); });
  return n;
}

// The estimator of a configuration that passed CheckConfig.
inline AnyEstimator MakeEstimator(const StoreConfig& c, size_t num_pools, int workers) {
  std::optional<AnyEstimator> e;
  WithEstimatorType(c.estimator, [&](auto tag) {
    using E = typename decltype(tag)::type;
    e.emplace(std::in_place_type<E>, c, num_pools, workers);
  });
  return std::move(*e);
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_ESTIMATORS_H_
