// The only pybind11 file: the Python face of the C++ core (atb._C).
// Tensors cross as (data pointer, shape ints, dtype code); the Python
// wrappers in atb/kernels/ validate them, so kernels here trust their inputs.
// C++ std::invalid_argument surfaces as Python ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ascendc/error.h"
#include "ascendc/runtime.h"
#include "ascendc/simd.h"
#include "ascendc/soc.h"
#include "kernels/rms_norm/rms_norm_tiling.h"

namespace py = pybind11;
using AscendC::DataType;
using AscendC::SocInfo;

namespace {

void* Ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
DataType Dt(int code) {
  if (code < 0 || code > 2) AscendC::ThrowError("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16), got ", code);
  return DataType(code);
}

py::dict RmsNormTilingDict(const atb::RmsNormTilingData& t) {
  py::dict d;
  d["rows"] = t.rows;
  d["cols"] = t.cols;
  d["block_dim"] = t.blockDim;
  d["block_factor"] = t.blockFactor;
  d["rows_per_loop"] = t.rowsPerLoop;
  d["col_tile"] = t.colTile;
  d["ub_bytes"] = t.ubBytes;
  d["tiling_key"] = t.tilingKey;
  d["split_d"] = (t.tilingKey % 10) == atb::RMS_NORM_SPLIT_D;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "atb native core: AscendC-style runtime and fused kernels on the CPU";

  // ---- runtime -------------------------------------------------------------
  py::class_<SocInfo>(m, "SocInfo")
      .def_readonly("name", &SocInfo::name)
      .def_readonly("cube_core_num", &SocInfo::cube_core_num)
      .def_readonly("vector_core_num", &SocInfo::vector_core_num)
      .def_readonly("ub_size", &SocInfo::ub_size)
      .def_readonly("l1_size", &SocInfo::l1_size)
      .def_readonly("supports_bf16", &SocInfo::supports_bf16)
      .def_readonly("is_host", &SocInfo::is_host)
      .def("__repr__", [](const SocInfo& s) {
        return "SocInfo(name='" + s.name + "', cube_core_num=" + std::to_string(s.cube_core_num) +
               ", vector_core_num=" + std::to_string(s.vector_core_num) + ", ub_size=" + std::to_string(s.ub_size) +
               ", l1_size=" + std::to_string(s.l1_size) + ", supports_bf16=" + (s.supports_bf16 ? "True" : "False") + ")";
      });
  m.def("get_soc", &AscendC::GetSocInfo, py::arg("name"));
  m.def("soc_names", &AscendC::SocNames);
  m.def("get_num_threads", &AscendC::GetNumThreads);
  m.def("set_num_threads", &AscendC::SetNumThreads, py::arg("n"));
  m.def("isa", [] { return std::string(AscendC::Simd().isa); });
  m.def("set_isa", [](const std::string& isa) { AscendC::SelectSimd(isa.c_str()); }, py::arg("isa"));
  m.def("cpu_features", [] { return std::string(AscendC::CpuFeatures()); });

  // ---- rms_norm / add_rms_norm ---------------------------------------------
  m.def("rms_norm_tiling",
        [](int64_t rows, int64_t cols, int dtype, const SocInfo& soc, bool residual) {
          return RmsNormTilingDict(atb::RmsNormTiling(rows, cols, Dt(dtype), 1e-6f, residual, soc));
        },
        py::arg("rows"), py::arg("cols"), py::arg("dtype"), py::arg("soc"), py::arg("residual") = false);
  m.def("rms_norm",
        [](uintptr_t y, uintptr_t x, uintptr_t weight, int64_t rows, int64_t cols, int dtype, float eps,
           const SocInfo& soc) { atb::RmsNorm(Ptr(y), nullptr, Ptr(x), nullptr, Ptr(weight), rows, cols, Dt(dtype), eps, soc); },
        py::arg("y"), py::arg("x"), py::arg("weight"), py::arg("rows"), py::arg("cols"), py::arg("dtype"),
        py::arg("eps"), py::arg("soc"));
  m.def("add_rms_norm",
        [](uintptr_t y, uintptr_t residual_out, uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows,
           int64_t cols, int dtype, float eps, const SocInfo& soc) {
          atb::RmsNorm(Ptr(y), Ptr(residual_out), Ptr(x), Ptr(residual), Ptr(weight), rows, cols, Dt(dtype), eps, soc);
        },
        py::arg("y"), py::arg("residual_out"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("rows"),
        py::arg("cols"), py::arg("dtype"), py::arg("eps"), py::arg("soc"));
}
