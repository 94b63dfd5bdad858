// The handle registry: Python and the FFI handlers refer to host stores by an int32 handle
// (docs/design.md, "The host store": `ffi::State` is per compiled executable, and a store is
// shared by the prefill and decode programs).
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_REGISTRY_H_
#define PIGJAX_XLA_FFI_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "xla_ffi/errors.h"
#include "xla_ffi/store.h"

namespace pigjax {

class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry();  // never destroyed: handlers may run at exit
    return *r;
  }
  int32_t Add(std::shared_ptr<Store> s) {
    std::lock_guard<std::mutex> lock(mu_);
    const int32_t h = next_++;
    stores_[h] = std::move(s);
    return h;
  }
  // Null if unknown. The shared_ptr keeps the store alive while a call uses it.
  std::shared_ptr<Store> Find(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stores_.find(handle);
    return it == stores_.end() ? nullptr : it->second;
  }
  bool Remove(int64_t handle) {
    std::shared_ptr<Store> s;  // destroyed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stores_.find(handle);
    if (it == stores_.end()) return false;
    s = std::move(it->second);
    stores_.erase(it);
    return true;
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Store>> stores_;
  int32_t next_ = 1;
};

inline std::string UnknownHandle(const char* fn, int64_t handle) {
  return Str(fn, ": unknown store handle ", handle,
             " (the HostKVStore was closed, or the handle never came from one).");
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_REGISTRY_H_
