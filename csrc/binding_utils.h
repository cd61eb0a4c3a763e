// What every binding in bindings.cpp does the same way, written once: Python
// ints to pointers and codes, an op defined from its argument names, and a
// tiling struct turned into the dict Python reads.
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

#include <pybind11/pybind11.h>

#include "ascendc/dtype.h"
#include "ascendc/error.h"
#include "kernels/linear/linear_tiling.h"
#include "kernels/rope/rope_tiling.h"

namespace atb::bind {

namespace py = pybind11;

inline void* Ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
inline const int32_t* I32(uintptr_t p) { return static_cast<const int32_t*>(Ptr(p)); }

inline AscendC::DataType Dt(int code) {
  if (code < 0 || code > 2) AscendC::ThrowError("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16), got ", code);
  return AscendC::DataType(code);
}

// The epilogue codes a launch accepts; tiling calls pass theirs unchecked (LinearTiling checks the combination).
inline LinearEpilogue CheckedEpilogue(const char* op, int code) {
  if (code < 0 || code > 2) AscendC::ThrowError(op, ": epilogue must be 0, 1 or 2, got ", code);
  return LinearEpilogue(code);
}

inline void CheckSegmentCount(const char* op, size_t n) {
  if (n == 0 || n > size_t(kLinearMaxSegments))
    AscendC::ThrowError(op, ": 1..", kLinearMaxSegments, " segments, got ", n);
}

inline RopeStyle RopeStyleOf(bool interleave) { return interleave ? ROPE_INTERLEAVE : ROPE_NEOX; }

// An argument is named by a string, or given whole (py::arg("x") = default).
inline py::arg Arg(const char* name) { return py::arg(name); }
inline py::arg_v Arg(py::arg_v a) { return a; }

// m.def(name, fn, py::arg(names)...): the names, in the order fn takes them, are the op's keyword API.
template <typename F, typename... Names>
void Def(py::module_& m, const char* name, F&& fn, Names&&... names) {
  m.def(name, std::forward<F>(fn), Arg(std::forward<Names>(names))...);
}

// {"key": value, ...} from alternating keys and values.
inline void Put(py::dict&) {}
template <typename V, typename... Rest>
void Put(py::dict& d, const char* key, const V& value, Rest&&... rest) {
  d[key] = value;
  Put(d, std::forward<Rest>(rest)...);
}
template <typename... KeysAndValues>
py::dict Dict(KeysAndValues&&... kv) {
  py::dict d;
  Put(d, std::forward<KeysAndValues>(kv)...);
  return d;
}

}  // namespace atb::bind
