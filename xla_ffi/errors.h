// The messages of the FFI error contract (docs/design.md, "FFI error contract"): one sentence
// naming the operand and its limit, built from values of any printable type.
//
// Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_ERRORS_H_
#define PIGJAX_XLA_FFI_ERRORS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

namespace pigjax {

template <typename... Args>
std::string Str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <size_t N>
std::string ShapeStr(const std::array<int64_t, N>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < N; ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

// "fn: name[i0, i1, ...] = nan is not finite; ..." for flat index i of an array of shape dims.
template <size_t N>
std::string NonFiniteError(const char* fn, const char* name, const std::array<int64_t, N>& dims,
                           int64_t flat, float value) {
  std::array<int64_t, N> idx{};
  for (size_t k = N; k-- > 0;) {
    idx[k] = flat % dims[k];
    flat /= dims[k];
  }
  std::ostringstream os;
  os << fn << ": " << name << ShapeStr(idx) << " = " << value
     << " is not finite; the store accepts only finite keys, values, means and queries (a NaN or "
        "Inf here usually means the model's activations overflowed).";
  return os.str();
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_ERRORS_H_
