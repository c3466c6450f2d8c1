// Shape-error messages shared by the handlers: "<op>: `<name>` must have shape <rule>; got [..]."
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace moonep {

inline std::string dims_str(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline xla::ffi::Error shape_error(const char* op, const char* name, const std::string& expected,
                                   xla::ffi::Span<const int64_t> got) {
  return xla::ffi::Error::InvalidArgument(std::string(op) + ": `" + name + "` must have shape " +
                                          expected + "; got " + dims_str(got) + ".");
}

}  // namespace moonep
