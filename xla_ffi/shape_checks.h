// Shape-error messages shared by the handlers: "<op>: `<name>` must have shape <rule>; got [..]."
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace moonep {

inline std::string dims_str(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string dims_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (auto it = dims.begin(); it != dims.end(); ++it)
    s += (it != dims.begin() ? ", " : "") + std::to_string(*it);
  return s + "]";
}

inline bool has_shape(xla::ffi::Span<const int64_t> dims, std::initializer_list<int64_t> expected) {
  if (dims.size() != expected.size()) return false;
  size_t i = 0;
  for (int64_t e : expected)
    if (dims[i++] != e) return false;
  return true;
}

inline xla::ffi::Error shape_error(const char* op, const char* name, const std::string& expected,
                                   xla::ffi::Span<const int64_t> got) {
  return xla::ffi::Error::InvalidArgument(std::string(op) + ": `" + name + "` must have shape " +
                                          expected + "; got " + dims_str(got) + ".");
}

}  // namespace moonep
