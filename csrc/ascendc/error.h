// Errors raised by tiling, launch and UB carving. std::invalid_argument maps to
// Python's ValueError in the bindings; messages name what was expected and got.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace AscendC {

template <typename... Args>
[[noreturn]] void ThrowError(const Args&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw std::invalid_argument(os.str());
}

#define ATB_CHECK(cond, ...)                          \
  do {                                                \
    if (!(cond)) ::AscendC::ThrowError(__VA_ARGS__);  \
  } while (0)

}  // namespace AscendC
