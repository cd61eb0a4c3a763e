// The only pybind11 file: the Python face of the C++ core (atb._C).
// Tensors cross as (data pointer, shape ints, dtype code); the Python
// wrappers in atb/kernels/ validate them, so kernels here trust their inputs.
// C++ std::invalid_argument surfaces as Python ValueError.
#include <optional>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <type_traits>

#include "ascendc/error.h"
#include "ascendc/runtime.h"
#include "ascendc/simd.h"
#include "ascendc/soc.h"
#include "binding_utils.h"
#include "graph/decode_graph.h"
#include "kernels/linear/linear_rows4.h"
#include "kernels/linear/linear_tiling.h"
#include "kernels/rms_norm/rms_norm_tiling.h"
#include "kernels/rope/rope_tiling.h"
#include "kernels/swiglu/swiglu_tiling.h"
#include "kernels/common/stream_read.h"
#include "kernels/common/tiling_key.h"
#include "kernels/common/ub_probe.h"
#include "kernels/reshape_and_cache/reshape_and_cache_tiling.h"
#include "kernels/paged_attention/paged_attention_tiling.h"
#include "kernels/flash_attention/flash_attention_tiling.h"
#include "kernels/quant_linear/quant_linear_tiling.h"
#include "kernels/quant_linear/quant_simd.h"

namespace py = pybind11;
using AscendC::DataType;
using AscendC::SocInfo;
using atb::bind::Def;
using atb::bind::Dict;
using atb::bind::Dt;
using atb::bind::I32;
using atb::bind::Ptr;

namespace {

// A quantized weight as the decode graph takes it: (data, scale, min or 0, bits, group, scale dtype code).
using QuantTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int>;
atb::QuantRef QuantRefOf(const QuantTuple& t) {
  return {Ptr(std::get<0>(t)), Ptr(std::get<1>(t)), Ptr(std::get<2>(t)), std::get<3>(t), std::get<4>(t),
          Dt(std::get<5>(t))};
}

bool IsVariant(int64_t tilingKey, int64_t variant) { return atb::TilingKeyVariant(tilingKey) == variant; }

py::dict RmsNormTilingDict(const atb::RmsNormTilingData& t) {
  return Dict("rows", t.rows, "cols", t.cols, "block_dim", t.blockDim, "block_factor", t.blockFactor,
              "rows_per_loop", t.rowsPerLoop, "col_tile", t.colTile, "ub_bytes", t.ubBytes, "tiling_key",
              t.tilingKey, "split_d", IsVariant(t.tilingKey, atb::RMS_NORM_SPLIT_D));
}

py::dict RopeTilingDict(const atb::RopeTilingData& t) {
  return Dict("tokens", t.tokens, "heads", t.heads, "kv_heads", t.kvHeads, "head_dim", t.headDim, "rotary_dim",
              t.rotaryDim, "block_dim", t.blockDim, "block_factor", t.blockFactor, "tokens_per_loop",
              t.tokensPerLoop, "heads_per_loop", t.headsPerLoop, "head_pitch", t.headPitch, "ub_bytes", t.ubBytes,
              "tiling_key", t.tilingKey);
}

py::dict SwiGluTilingDict(const atb::SwiGluTilingData& t) {
  return Dict("rows", t.rows, "cols", t.cols, "col_tile", t.colTile, "col_chunks", t.colChunks, "units", t.units,
              "block_dim", t.blockDim, "block_factor", t.blockFactor, "rows_per_loop", t.rowsPerLoop, "ub_bytes",
              t.ubBytes, "tiling_key", t.tilingKey, "col_tiles", IsVariant(t.tilingKey, atb::SWIGLU_COL_TILES));
}

py::dict PagedAttentionTilingDict(const atb::PagedAttentionTilingData& t) {
  py::list items;
  for (const auto& it : t.items)
    items.append(py::make_tuple(it.batch, it.kvHead, it.g0, it.gn, it.q0, it.qn, it.kvStart, it.kvEnd, it.partial));
  return Dict("rows_per_tile", t.rowsPerTile, "heads_per_tile", t.headsPerTile, "kv_tile", t.kvTile, "chunk",
              t.chunk, "block_dim", t.blockDim, "merge_block_dim", t.mergeBlockDim, "ub_bytes", t.ubBytes,
              "workspace_floats", t.workspaceFloats, "tiling_key", t.tilingKey, "gather",
              IsVariant(t.tilingKey, atb::PA_GATHER), "num_items", int64_t(t.items.size()), "num_merge_groups",
              int64_t(t.groups.size()), "items", items);
}

py::dict FlashAttentionTilingDict(const atb::FlashAttentionTilingData& t) {
  return Dict("group_size", t.groupSize, "group_split", t.groupSplit, "block_q", t.blockQ, "block_kv", t.blockKv,
              "dp_bf16", t.dpBf16, "max_rows", t.maxRows, "ub_bytes", t.ubBytes, "block_dim", t.blockDim, "tiling_key", t.tilingKey,
              "num_units", int64_t(t.units.size()), "core_cost", t.coreCost);
}

// linear_tiling's keys; quant_linear_tiling adds its own to them.
py::dict LinearTilingDict(const atb::LinearTilingData& t) {
  return Dict("block_dim", t.blockDim, "block_factor", t.blockFactor, "m_tile", t.mTile, "n_tile", t.nTile,
              "k_tile", t.kTile, "ub_bytes", t.ubBytes, "tiling_key", t.tilingKey, "form",
              t.form == atb::kDpPacked ? "packed"
              : t.form == atb::kPackedX ? "packed_x"
              : t.form == atb::kDpRows  ? "rows"
                                        : "f32_tiles");
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
  // The codes the ops take as ints, exported once so Python reads them instead of mirroring them.
  py::enum_<DataType>(m, "DataType")
      .value("FLOAT32", DataType::FLOAT32)
      .value("FLOAT16", DataType::FLOAT16)
      .value("BFLOAT16", DataType::BFLOAT16);
  py::enum_<atb::LinearEpilogue>(m, "LinearEpilogue")
      .value("PLAIN", atb::LINEAR_PLAIN)
      .value("RESIDUAL", atb::LINEAR_RESIDUAL)
      .value("SWIGLU", atb::LINEAR_SWIGLU);
  // Up to this many rows a float linear runs the STREAM kernel on every SIMD table (AVX512-BF16's dp GEMM takes
  // over at kLinearDpMinRows, the others' GEMM at kLinearGemmMinRows), which computes a row the same way at
  // any such M.
  m.attr("LINEAR_STREAM_MAX_ROWS") = py::int_(std::min(atb::kLinearDpMinRows, atb::kLinearGemmMinRows) - 1);
  py::enum_<atb::RopeStyle>(m, "RopeStyle").value("NEOX", atb::ROPE_NEOX).value("INTERLEAVE", atb::ROPE_INTERLEAVE);
  m.def("get_soc", &AscendC::GetSocInfo, py::arg("name"));
  m.def("soc_names", &AscendC::SocNames);
  m.def("get_num_threads", &AscendC::GetNumThreads);
  m.def("set_num_threads", &AscendC::SetNumThreads, py::arg("n"));
  m.def("set_threading", &AscendC::SetThreading, py::arg("backend"));
  m.def("set_thread_prefers_pool", &AscendC::SetThreadPrefersPool, py::arg("prefer"));
  m.def("threading", &AscendC::Threading);
  m.def("isa", [] { return std::string(AscendC::Simd().isa); });
  m.def("set_isa", [](const std::string& isa) { AscendC::SelectSimd(isa.c_str()); }, py::arg("isa"));
  m.def("cpu_features", [] { return std::string(AscendC::CpuFeatures()); });
  m.def("stream_prefetch_bytes", [] { return AscendC::StreamPrefetchBytes(); });
  m.def("set_stream_prefetch_bytes", [](int64_t bytes) { AscendC::SetStreamPrefetchBytes(bytes); }, py::arg("bytes"));
  m.def("fp32_decode_copy", [] { return AscendC::Fp32DecodeReadsCopy(); });
  m.def("set_fp32_decode_copy", [](int on) { AscendC::SetFp32DecodeReadsCopy(on); }, py::arg("on"));
  m.def("fp32_batch_copy", [] { return AscendC::Fp32BatchReadsCopy(); });
  m.def("set_fp32_batch_copy", [](int on) { AscendC::SetFp32BatchReadsCopy(on); }, py::arg("on"));
  m.def("available_isas", [] { return std::string(AscendC::AvailableIsas()); });
  // Test hook: one block carving `bytes` of UB on `soc` (ValueError past its UB size).
  m.def("_ub_carve_probe", &atb::UbCarveProbe, py::arg("bytes"), py::arg("soc"), py::arg("block_dim") = 1);
  // Memory-bandwidth probe for the benchmarks: reads `nbytes` at `ptr` on every pool thread.
  m.def("stream_read", [](uintptr_t ptr, int64_t nbytes) { return atb::StreamRead(Ptr(ptr), nbytes); },
        py::arg("ptr"), py::arg("nbytes"));

  // ---- rms_norm / add_rms_norm ---------------------------------------------
  Def(
      m, "rms_norm_tiling",
      [](int64_t rows, int64_t cols, int dtype, const SocInfo& soc, bool residual) {
        return RmsNormTilingDict(atb::RmsNormTiling(rows, cols, Dt(dtype), 1e-6f, residual, soc));
      },
      "rows", "cols", "dtype", "soc", py::arg("residual") = false);
  Def(
      m, "rms_norm",
      [](uintptr_t y, uintptr_t x, uintptr_t weight, int64_t rows, int64_t cols, int dtype, float eps,
         const SocInfo& soc) { atb::RmsNorm(Ptr(y), nullptr, Ptr(x), nullptr, Ptr(weight), rows, cols, Dt(dtype), eps, soc); },
      "y", "x", "weight", "rows", "cols", "dtype", "eps", "soc");
  Def(
      m, "add_rms_norm",
      [](uintptr_t y, uintptr_t residual_out, uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t rows,
         int64_t cols, int dtype, float eps, const SocInfo& soc) {
        atb::RmsNorm(Ptr(y), Ptr(residual_out), Ptr(x), Ptr(residual), Ptr(weight), rows, cols, Dt(dtype), eps, soc);
      },
      "y", "residual_out", "x", "residual", "weight", "rows", "cols", "dtype", "eps", "soc");

  // ---- rope ------------------------------------------------------------------
  Def(
      m, "rope_tiling",
      [](int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int dtype,
         const SocInfo& soc, int cos_dtype, bool interleave) {
        return RopeTilingDict(atb::RopeTiling(tokens, heads, kv_heads, head_dim, rotary_dim, Dt(dtype),
                                              Dt(cos_dtype < 0 ? dtype : cos_dtype), atb::bind::RopeStyleOf(interleave),
                                              soc));
      },
      "tokens", "heads", "kv_heads", "head_dim", "rotary_dim", "dtype", "soc", py::arg("cos_dtype") = -1,
      py::arg("interleave") = false);
  // Views cross as (data pointer, token stride, head stride), strides in elements.
  m.def("rope",
        [](uintptr_t q_out, int64_t qo_ts, int64_t qo_hs, uintptr_t k_out, int64_t ko_ts, int64_t ko_hs, uintptr_t q,
           int64_t q_ts, int64_t q_hs, uintptr_t k, int64_t k_ts, int64_t k_hs, uintptr_t cos, uintptr_t sin,
           int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int dtype,
           int cos_dtype, bool interleave, const SocInfo& soc) {
          atb::Rope({Ptr(q_out), qo_ts, qo_hs}, {Ptr(k_out), ko_ts, ko_hs}, {Ptr(q), q_ts, q_hs}, {Ptr(k), k_ts, k_hs},
                    Ptr(cos), Ptr(sin), tokens, heads, kv_heads, head_dim, rotary_dim, Dt(dtype), Dt(cos_dtype),
                    atb::bind::RopeStyleOf(interleave), soc);
        });
  // ---- linear (decode-shaped, fused epilogues) ------------------------------
  // segments: [(weight_ptr, bias_ptr or 0, out_ptr, n)], 1..3 of them.
  Def(
      m, "linear_tiling",
      [](int64_t rows, int64_t k, std::vector<int64_t> seg_rows, int epilogue, int dtype, const SocInfo& soc,
         bool row_invariant, bool rows4_copies) {
        return LinearTilingDict(atb::LinearTiling(rows, k, seg_rows.data(), int64_t(seg_rows.size()),
                                                  atb::LinearEpilogue(epilogue), Dt(dtype), soc, row_invariant,
                                                  rows4_copies));
      },
      "m", "k", "seg_rows", "epilogue", "dtype", "soc", py::arg("row_invariant") = false,
      py::arg("rows4_copies") = false);
  Def(
      m, "linear",
      [](uintptr_t x, int64_t rows, int64_t k,
         const std::vector<std::tuple<uintptr_t, uintptr_t, uintptr_t, int64_t, uintptr_t>>& segs, uintptr_t residual,
         int epilogue, int dtype, const SocInfo& soc, bool row_invariant) {
        atb::bind::CheckSegmentCount("linear", segs.size());
        atb::LinearEpilogue ep = atb::bind::CheckedEpilogue("linear", epilogue);
        atb::LinearSegment s[atb::kLinearMaxSegments];
        atb::Rows4Piece whole[atb::kLinearMaxSegments];  // a rows4 copy given: one piece of all its rows
        for (size_t i = 0; i < segs.size(); ++i) {
          s[i] = {Ptr(std::get<0>(segs[i])), Ptr(std::get<1>(segs[i])), Ptr(std::get<2>(segs[i])), std::get<3>(segs[i])};
          if (std::get<4>(segs[i])) {
            whole[i] = {0, std::get<3>(segs[i]), Ptr(std::get<4>(segs[i]))};
            s[i].rows4Pieces = &whole[i];
            s[i].numRows4Pieces = 1;
          }
        }
        py::gil_scoped_release nogil;
        atb::Linear(Ptr(x), rows, k, s, int64_t(segs.size()), Ptr(residual), ep, Dt(dtype), soc, row_invariant);
      },
      "x", "m", "k", "segments", "residual", "epilogue", "dtype", "soc", py::arg("row_invariant") = false);

  // ---- rows4: the decode weights' repacked layout (kernels/linear/linear_rows4.h) ---------------------
  Def(m, "rows4_numel", [](int64_t n, int64_t k) { return atb::Rows4Elems(n, k); }, "n", "k");
  Def(m, "rows4_supported", [](int dtype) { return atb::Rows4Supported(Dt(dtype)); }, "dtype");
  Def(m, "rows4_packed_x", [](int dtype, int64_t k) { return atb::Rows4PackedX(Dt(dtype), k); }, "dtype", "k");
  Def(
      m, "pack_rows4",
      [](uintptr_t dst, uintptr_t w, int64_t ldw, int64_t n, int64_t k, int dtype) {
        py::gil_scoped_release nogil;
        atb::PackRows4(Ptr(dst), Ptr(w), ldw, n, k, Dt(dtype));
      },
      "dst", "w", "ldw", "n", "k", "dtype");

  // ---- swiglu / silu_mul ---------------------------------------------------------
  Def(
      m, "swiglu_tiling",
      [](int64_t rows, int64_t cols, int dtype, const SocInfo& soc) {
        return SwiGluTilingDict(atb::SwiGluTiling(rows, cols, Dt(dtype), soc));
      },
      "rows", "cols", "dtype", "soc");
  m.def("silu_mul",
        [](uintptr_t out, uintptr_t gate, int64_t gate_row_stride, uintptr_t up, int64_t up_row_stride, int64_t rows,
           int64_t cols, int dtype, const SocInfo& soc) {
          atb::SiluMul(Ptr(out), Ptr(gate), gate_row_stride, Ptr(up), up_row_stride, rows, cols, Dt(dtype), soc);
        });

  // ---- reshape_and_cache ---------------------------------------------------
  Def(
      m, "reshape_and_cache",
      [](uintptr_t key, int64_t key_stride, uintptr_t value, int64_t value_stride, uintptr_t key_cache,
         uintptr_t value_cache, uintptr_t slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
         int64_t num_blocks, int64_t block_size, int dtype, const SocInfo& soc) {
        atb::ReshapeAndCache(Ptr(key), key_stride, Ptr(value), value_stride, Ptr(key_cache), Ptr(value_cache),
                             I32(slot_mapping), tokens, kv_heads, head_dim, num_blocks, block_size, Dt(dtype), soc);
      },
      "key", "key_stride", "value", "value_stride", "key_cache", "value_cache", "slot_mapping", "tokens", "kv_heads",
      "head_dim", "num_blocks", "block_size", "dtype", "soc");

  // ---- paged_attention -----------------------------------------------------
  // q_lens == 0 (null): decode, one query per sequence. window <= 0: none.
  Def(
      m, "paged_attention_tiling",
      [](int64_t batch, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
         int64_t max_blocks, uintptr_t context_lens, uintptr_t q_lens, int64_t total_q, int64_t window, int dtype,
         const SocInfo& soc) {
        return PagedAttentionTilingDict(atb::PagedAttentionTiling(
            batch, num_heads, kv_heads, head_dim, num_blocks, block_size, max_blocks, I32(context_lens), I32(q_lens),
            total_q, num_heads * head_dim, 1.0f, window, Dt(dtype), soc));
      },
      "batch", "num_heads", "kv_heads", "head_dim", "num_blocks", "block_size", "max_blocks", "context_lens", "q_lens",
      "total_q", "window", "dtype", "soc");
  Def(
      m, "paged_attention",
      [](uintptr_t out, uintptr_t q, int64_t q_stride, uintptr_t key_cache, uintptr_t value_cache,
         uintptr_t block_tables, uintptr_t context_lens, uintptr_t q_lens, int64_t batch, int64_t num_heads,
         int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
         int64_t total_q, float scale, int64_t window, int dtype, const SocInfo& soc) {
        atb::PagedAttention(Ptr(out), Ptr(q), q_stride, Ptr(key_cache), Ptr(value_cache), I32(block_tables),
                            I32(context_lens), I32(q_lens), batch, num_heads, kv_heads, head_dim, num_blocks,
                            block_size, max_blocks, total_q, scale, window, Dt(dtype), soc);
      },
      "out", "q", "q_stride", "key_cache", "value_cache", "block_tables", "context_lens", "q_lens", "batch",
      "num_heads", "kv_heads", "head_dim", "num_blocks", "block_size", "max_blocks", "total_q", "scale", "window",
      "dtype", "soc");

  // ---- decode graph ----------------------------------------------------------
  // Typed build description: a config and one DecodeLayer per layer, whose
  // pointer fields (ints from data_ptr()) carry the names of atb's LayerWeights
  // fields. The Python owner (atb.graph.DecodeGraph) keeps every tensor alive.
  py::class_<atb::DecodeGraphConfig> config(m, "DecodeGraphConfig");
  // Enum fields cross as their int codes (the same codes the kernels take).
  auto code = [&config](const char* name, auto member, auto from) {
    config.def_property(
        name, [member](const atb::DecodeGraphConfig& c) { return int(c.*member); },
        [member, from](atb::DecodeGraphConfig& c, int v) { c.*member = from(v); });
  };
  code("rope_style", &atb::DecodeGraphConfig::ropeStyle, [](int v) { return atb::RopeStyle(v); });
  code("dtype", &atb::DecodeGraphConfig::dtype, Dt);
  code("cos_dtype", &atb::DecodeGraphConfig::cosDtype, Dt);
  config.def(py::init<>())
      .def_readwrite("num_layers", &atb::DecodeGraphConfig::numLayers)
      .def_readwrite("hidden", &atb::DecodeGraphConfig::hidden)
      .def_readwrite("num_heads", &atb::DecodeGraphConfig::numHeads)
      .def_readwrite("num_kv_heads", &atb::DecodeGraphConfig::numKvHeads)
      .def_readwrite("head_dim", &atb::DecodeGraphConfig::headDim)
      .def_readwrite("intermediate", &atb::DecodeGraphConfig::intermediate)
      .def_readwrite("vocab", &atb::DecodeGraphConfig::vocab)
      .def_readwrite("eps", &atb::DecodeGraphConfig::eps)
      .def_readwrite("scale", &atb::DecodeGraphConfig::scale)
      .def_readwrite("rotary_dim", &atb::DecodeGraphConfig::rotaryDim)
      .def_readwrite("max_batch", &atb::DecodeGraphConfig::maxBatch)
      .def_readwrite("max_seq_len", &atb::DecodeGraphConfig::maxSeqLen)
      .def_readwrite("num_blocks", &atb::DecodeGraphConfig::numBlocks)
      .def_readwrite("block_size", &atb::DecodeGraphConfig::blockSize)
      .def_readwrite("vocab_start", &atb::DecodeGraphConfig::vocabStart)
      .def_readwrite("vocab_total", &atb::DecodeGraphConfig::vocabTotal)
      .def_readwrite("owns_residual", &atb::DecodeGraphConfig::ownsResidual);
  py::class_<atb::DecodeLayer> layer(m, "DecodeLayer");
  layer.def(py::init<>()).def_readwrite("window", &atb::DecodeLayer::window);
  auto pointer = [&layer](const char* name, auto member) {
    layer.def_property(
        name, [member](const atb::DecodeLayer& l) { return reinterpret_cast<uintptr_t>(l.*member); },
        [member](atb::DecodeLayer& l, uintptr_t p) {
          using P = std::remove_reference_t<decltype(l.*member)>;
          l.*member = static_cast<P>(Ptr(p));
        });
  };
  pointer("input_norm", &atb::DecodeLayer::inputNorm);
  pointer("q", &atb::DecodeLayer::q);
  pointer("k", &atb::DecodeLayer::k);
  pointer("v", &atb::DecodeLayer::v);
  pointer("q_bias", &atb::DecodeLayer::qBias);
  pointer("k_bias", &atb::DecodeLayer::kBias);
  pointer("v_bias", &atb::DecodeLayer::vBias);
  pointer("q_norm", &atb::DecodeLayer::qNorm);
  pointer("k_norm", &atb::DecodeLayer::kNorm);
  pointer("o", &atb::DecodeLayer::o);
  pointer("o_bias", &atb::DecodeLayer::oBias);
  pointer("post_attention_norm", &atb::DecodeLayer::postNorm);
  pointer("gate", &atb::DecodeLayer::gate);
  pointer("gate_bias", &atb::DecodeLayer::gateBias);
  pointer("up", &atb::DecodeLayer::up);
  pointer("up_bias", &atb::DecodeLayer::upBias);
  pointer("down", &atb::DecodeLayer::down);
  pointer("down_bias", &atb::DecodeLayer::downBias);
  pointer("key_cache", &atb::DecodeLayer::keyCache);
  pointer("value_cache", &atb::DecodeLayer::valueCache);
  // A quantized projection: its LayerWeights field name and (data, scale, min or 0, bits, group, scale dtype
  // code); the float pointer field of the same name holds the data pointer.
  layer.def(
      "set_quant",
      [](atb::DecodeLayer& l, const std::string& name, const QuantTuple& t) {
        atb::QuantRef* r = name == "q"      ? &l.qQ
                           : name == "k"    ? &l.kQ
                           : name == "v"    ? &l.vQ
                           : name == "o"    ? &l.oQ
                           : name == "gate" ? &l.gateQ
                           : name == "up"   ? &l.upQ
                           : name == "down" ? &l.downQ
                                            : nullptr;
        if (!r) AscendC::ThrowError("DecodeLayer.set_quant: ", name, " is not a projection (q, k, v, o, gate, up, down)");
        *r = QuantRefOf(t);
      },
      py::arg("name"), py::arg("storage"));

  py::class_<atb::DecodeGraph>(m, "DecodeGraph")
      .def(py::init([](const atb::DecodeGraphConfig& c, std::vector<atb::DecodeLayer> layers, uintptr_t embed,
                       uintptr_t final_norm, uintptr_t lm_head, uintptr_t cos, uintptr_t sin, const SocInfo& soc) {
             return new atb::DecodeGraph(c, std::move(layers), Ptr(embed), Ptr(final_norm), Ptr(lm_head), Ptr(cos),
                                         Ptr(sin), soc);
           }),
           py::arg("config"), py::arg("layers"), py::arg("embed"), py::arg("final_norm"), py::arg("lm_head"),
           py::arg("cos"), py::arg("sin"), py::arg("soc"))
      .def("step",
           [](atb::DecodeGraph& g, uintptr_t token_ids, uintptr_t positions, uintptr_t block_tables, int64_t max_blocks,
              uintptr_t context_lens, uintptr_t slot_mapping, int64_t batch, uintptr_t logits, uintptr_t argmax_out,
              uintptr_t q_lens, int64_t num_seqs) {
             py::gil_scoped_release nogil;
             g.Step(I32(token_ids), I32(positions), I32(block_tables), max_blocks, I32(context_lens),
                    I32(slot_mapping), batch, Ptr(logits), static_cast<int32_t*>(Ptr(argmax_out)),
                    q_lens ? I32(q_lens) : nullptr, num_seqs);
           },
           py::arg("token_ids"), py::arg("positions"), py::arg("block_tables"), py::arg("max_blocks"),
           py::arg("context_lens"), py::arg("slot_mapping"), py::arg("batch"), py::arg("logits"),
           py::arg("argmax_out"), py::arg("q_lens") = 0, py::arg("num_seqs") = 0)
      .def("step_greedy",
           [](atb::DecodeGraph& g, int64_t steps, uintptr_t token_ids, uintptr_t positions, uintptr_t block_tables,
              int64_t max_blocks, uintptr_t context_lens, uintptr_t slot_mapping, int64_t batch, uintptr_t logits,
              uintptr_t tokens_out, uintptr_t stop_tokens, int64_t num_stop) {
             py::gil_scoped_release nogil;
             return g.StepGreedy(steps, I32(token_ids), I32(positions), I32(block_tables), max_blocks,
                                 I32(context_lens), I32(slot_mapping), batch, Ptr(logits),
                                 static_cast<int32_t*>(Ptr(tokens_out)), num_stop ? I32(stop_tokens) : nullptr,
                                 num_stop);
           },
           py::arg("steps"), py::arg("token_ids"), py::arg("positions"), py::arg("block_tables"),
           py::arg("max_blocks"), py::arg("context_lens"), py::arg("slot_mapping"), py::arg("batch"),
           py::arg("logits"), py::arg("tokens_out"), py::arg("stop_tokens") = 0, py::arg("num_stop") = 0)
      .def("plan_rows4_streams", &atb::DecodeGraph::PlanRows4Streams)
      .def("pack_rows4_streams",
           [](atb::DecodeGraph& g, uintptr_t dst, int64_t bytes) {
             py::gil_scoped_release release;
             g.PackRows4Streams(Ptr(dst), bytes);
           },
           py::arg("dst"), py::arg("bytes"))
      .def("set_quant_tables",
           [](atb::DecodeGraph& g, const std::optional<QuantTuple>& embed, const std::optional<QuantTuple>& head) {
             g.SetQuantTables(embed ? QuantRefOf(*embed) : atb::QuantRef{}, head ? QuantRefOf(*head) : atb::QuantRef{});
           },
           py::arg("embed"), py::arg("lm_head"))
      // fn(address, count) runs with the GIL held (pybind11 takes it); an exception it raises ends the step.
      .def("set_all_reduce",
           [](atb::DecodeGraph& g, std::function<void(uintptr_t, int64_t)> fn) {
             g.SetAllReduce([fn](void* data, int64_t count) { fn(reinterpret_cast<uintptr_t>(data), count); });
           },
           py::arg("fn"))
      .def_property("profiling", &atb::DecodeGraph::Profiling, &atb::DecodeGraph::SetProfiling)
      .def("reset_profile", &atb::DecodeGraph::ResetProfile)
      .def("profile",
           [](const atb::DecodeGraph& g) {
             py::dict d;
             for (int i = 0; i < atb::NODE_COUNT; ++i) {
               py::dict e;
               e["ns"] = g.ProfileNs()[i];
               e["calls"] = g.ProfileCalls()[i];
               d[atb::DecodeNodeName(i)] = e;
             }
             return py::make_tuple(d, g.ProfiledSteps());
           })
      .def_property_readonly("scratch_bytes", &atb::DecodeGraph::ScratchBytes);

  // ---- flash_attention -----------------------------------------------------
  Def(
      m, "flash_attention_tiling",
      [](const std::vector<int32_t>& cu_seqlens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int dtype,
         const SocInfo& soc, bool causal, int64_t window) {
        if (cu_seqlens.empty()) AscendC::ThrowError("flash_attention: cu_seqlens must have at least one entry");
        int64_t batch = int64_t(cu_seqlens.size()) - 1;
        return FlashAttentionTilingDict(atb::FlashAttentionTiling(cu_seqlens.data(), batch, cu_seqlens.back(),
                                                                  num_heads, num_kv_heads, head_dim, Dt(dtype), 1.0f,
                                                                  causal, window, soc));
      },
      "cu_seqlens", "num_heads", "num_kv_heads", "head_dim", "dtype", "soc", py::arg("causal") = true,
      py::arg("window") = 0);
  Def(
      m, "flash_attention",
      [](uintptr_t out, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t cu_seqlens, int64_t batch, int64_t tokens,
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::vector<int64_t>& strides, int dtype,
         float scale, bool causal, int64_t window, const SocInfo& soc) {
        if (strides.size() != 6) AscendC::ThrowError("flash_attention: strides must be (q_token, q_head, k_token, k_head, v_token, v_head)");
        atb::FlashAttentionStrides st{strides[0], strides[1], strides[2], strides[3], strides[4], strides[5]};
        py::gil_scoped_release release;
        atb::FlashAttention(Ptr(out), Ptr(q), Ptr(k), Ptr(v), I32(cu_seqlens), batch, tokens, num_heads, num_kv_heads,
                            head_dim, st, Dt(dtype), scale, causal, window, soc);
      },
      "out", "q", "k", "v", "cu_seqlens", "batch", "tokens", "num_heads", "num_kv_heads", "head_dim", "strides",
      "dtype", "scale", "causal", "window", "soc");

  // ---- quant_linear (weight-only W8A16 / W4A16) -----------------------------
  // segments: [(data, scale, min or 0, bias or 0, out or 0, n, bits, group, scale dtype code)], 1..3 of them.
  using QuantSegTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, int>;
  auto quantSegs = [](const std::vector<QuantSegTuple>& segs) {
    atb::bind::CheckSegmentCount("quant_linear", segs.size());
    std::vector<atb::QuantSegment> out;
    for (const auto& t : segs)
      out.push_back({Ptr(std::get<0>(t)), Ptr(std::get<1>(t)), Ptr(std::get<2>(t)), Ptr(std::get<3>(t)),
                     Ptr(std::get<4>(t)), std::get<5>(t), std::get<6>(t), std::get<7>(t), Dt(std::get<8>(t))});
    return out;
  };
  Def(
      m, "quant_linear_tiling",
      [quantSegs](int64_t rows, int64_t k, const std::vector<QuantSegTuple>& segs, int epilogue, int dtype,
                  const SocInfo& soc) {
        std::vector<atb::QuantSegment> s = quantSegs(segs);
        atb::QuantLinearTilingData q = atb::QuantLinearTiling(rows, k, s.data(), int64_t(s.size()),
                                                              atb::LinearEpilogue(epilogue), Dt(dtype), soc);
        py::dict d = LinearTilingDict(q.base);
        atb::bind::Put(d, "m_pass", q.base.mPass, "k_pad", q.kPad, "gemm",
                       atb::TilingKeyMode(q.base.tilingKey) == atb::LINEAR_GEMM);
        return d;
      },
      "m", "k", "segments", "epilogue", "dtype", "soc");
  Def(
      m, "quant_linear",
      [quantSegs](uintptr_t x, int64_t rows, int64_t k, const std::vector<QuantSegTuple>& segs, uintptr_t residual,
                  int epilogue, int dtype, const SocInfo& soc) {
        atb::LinearEpilogue ep = atb::bind::CheckedEpilogue("quant_linear", epilogue);
        std::vector<atb::QuantSegment> s = quantSegs(segs);
        py::gil_scoped_release nogil;
        atb::QuantLinear(Ptr(x), rows, k, s.data(), int64_t(s.size()), Ptr(residual), ep, Dt(dtype), soc);
      },
      "x", "m", "k", "segments", "residual", "epilogue", "dtype", "soc");
  Def(
      m, "quant_dequant_rows",
      [quantSegs](const QuantSegTuple& w, int64_t k, uintptr_t idx, int64_t count, uintptr_t out, int dtype,
                  const SocInfo& soc) {
        std::vector<atb::QuantSegment> s = quantSegs({w});
        py::gil_scoped_release nogil;
        atb::QuantDequantRows(s[0], k, I32(idx), count, Ptr(out), Dt(dtype), soc);
      },
      "weight", "k", "idx", "count", "out", "dtype", "soc");
  m.def("quant_set_isa", [](const std::string& isa) { atb::SelectQuantSimd(isa); }, py::arg("isa"));
  m.def("quant_isa", []() { return std::string(atb::QuantSimd().isa); });
  m.def("quant_isa_paths", []() { return atb::QuantIsaPaths(); });
}
