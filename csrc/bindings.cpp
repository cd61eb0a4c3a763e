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
#include "graph/decode_graph.h"
#include "kernels/linear/linear_tiling.h"
#include "kernels/rms_norm/rms_norm_tiling.h"
#include "kernels/rope/rope_tiling.h"
#include "kernels/swiglu/swiglu_tiling.h"
#include "kernels/common/stream_read.h"
#include "kernels/common/ub_probe.h"
#include "kernels/reshape_and_cache/reshape_and_cache_tiling.h"
#include "kernels/paged_attention/paged_attention_tiling.h"
#include "kernels/flash_attention/flash_attention_tiling.h"
#include "kernels/quant_linear/quant_linear_tiling.h"
#include "kernels/quant_linear/quant_simd.h"

namespace py = pybind11;
using AscendC::DataType;
using AscendC::SocInfo;

namespace {

void* Ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
DataType Dt(int code) {
  if (code < 0 || code > 2) AscendC::ThrowError("dtype code must be 0 (float32), 1 (float16) or 2 (bfloat16), got ", code);
  return DataType(code);
}

// A quantized weight as the decode graph takes it: (data, scale, min or 0, bits, group, scale dtype code).
using QuantTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int>;
atb::QuantRef QuantRefOf(const QuantTuple& t) {
  return {Ptr(std::get<0>(t)), Ptr(std::get<1>(t)), Ptr(std::get<2>(t)), std::get<3>(t), std::get<4>(t),
          Dt(std::get<5>(t))};
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

py::dict RopeTilingDict(const atb::RopeTilingData& t) {
  py::dict d;
  d["tokens"] = t.tokens;
  d["heads"] = t.heads;
  d["kv_heads"] = t.kvHeads;
  d["head_dim"] = t.headDim;
  d["rotary_dim"] = t.rotaryDim;
  d["block_dim"] = t.blockDim;
  d["block_factor"] = t.blockFactor;
  d["tokens_per_loop"] = t.tokensPerLoop;
  d["heads_per_loop"] = t.headsPerLoop;
  d["head_pitch"] = t.headPitch;
  d["ub_bytes"] = t.ubBytes;
  d["tiling_key"] = t.tilingKey;
  return d;
}

py::dict SwiGluTilingDict(const atb::SwiGluTilingData& t) {
  py::dict d;
  d["rows"] = t.rows;
  d["cols"] = t.cols;
  d["col_tile"] = t.colTile;
  d["col_chunks"] = t.colChunks;
  d["units"] = t.units;
  d["block_dim"] = t.blockDim;
  d["block_factor"] = t.blockFactor;
  d["rows_per_loop"] = t.rowsPerLoop;
  d["ub_bytes"] = t.ubBytes;
  d["tiling_key"] = t.tilingKey;
  d["col_tiles"] = (t.tilingKey % 10) == atb::SWIGLU_COL_TILES;
  return d;
}

const int32_t* I32(uintptr_t p) { return reinterpret_cast<const int32_t*>(p); }

py::dict PagedAttentionTilingDict(const atb::PagedAttentionTilingData& t) {
  py::dict d;
  d["rows_per_tile"] = t.rowsPerTile;
  d["heads_per_tile"] = t.headsPerTile;
  d["kv_tile"] = t.kvTile;
  d["chunk"] = t.chunk;
  d["block_dim"] = t.blockDim;
  d["merge_block_dim"] = t.mergeBlockDim;
  d["ub_bytes"] = t.ubBytes;
  d["workspace_floats"] = t.workspaceFloats;
  d["tiling_key"] = t.tilingKey;
  d["gather"] = (t.tilingKey % 10) == atb::PA_GATHER;
  d["num_items"] = int64_t(t.items.size());
  d["num_merge_groups"] = int64_t(t.groups.size());
  py::list items;
  for (const auto& it : t.items)
    items.append(py::make_tuple(it.batch, it.kvHead, it.g0, it.gn, it.q0, it.qn, it.kvStart, it.kvEnd, it.partial));
  d["items"] = items;
  return d;
}

py::dict FlashAttentionTilingDict(const atb::FlashAttentionTilingData& t) {
  py::dict d;
  d["group_size"] = t.groupSize;
  d["group_split"] = t.groupSplit;
  d["block_q"] = t.blockQ;
  d["block_kv"] = t.blockKv;
  d["max_rows"] = t.maxRows;
  d["ub_bytes"] = t.ubBytes;
  d["block_dim"] = t.blockDim;
  d["tiling_key"] = t.tilingKey;
  d["num_units"] = int64_t(t.units.size());
  d["core_cost"] = t.coreCost;
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
  m.def("set_threading", &AscendC::SetThreading, py::arg("backend"));
  m.def("threading", &AscendC::Threading);
  m.def("isa", [] { return std::string(AscendC::Simd().isa); });
  m.def("set_isa", [](const std::string& isa) { AscendC::SelectSimd(isa.c_str()); }, py::arg("isa"));
  m.def("cpu_features", [] { return std::string(AscendC::CpuFeatures()); });
  m.def("available_isas", [] { return std::string(AscendC::AvailableIsas()); });
  // Test hook: one block carving `bytes` of UB on `soc` (ValueError past its UB size).
  m.def("_ub_carve_probe", &atb::UbCarveProbe, py::arg("bytes"), py::arg("soc"), py::arg("block_dim") = 1);
  // Memory-bandwidth probe for the benchmarks: reads `nbytes` at `ptr` on every pool thread.
  m.def("stream_read", [](uintptr_t ptr, int64_t nbytes) { return atb::StreamRead(Ptr(ptr), nbytes); },
        py::arg("ptr"), py::arg("nbytes"));

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

  // ---- rope ------------------------------------------------------------------
  m.def("rope_tiling",
        [](int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int dtype,
           const SocInfo& soc, int cos_dtype, bool interleave) {
          return RopeTilingDict(atb::RopeTiling(tokens, heads, kv_heads, head_dim, rotary_dim, Dt(dtype),
                                                Dt(cos_dtype < 0 ? dtype : cos_dtype),
                                                interleave ? atb::ROPE_INTERLEAVE : atb::ROPE_NEOX, soc));
        },
        py::arg("tokens"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("rotary_dim"),
        py::arg("dtype"), py::arg("soc"), py::arg("cos_dtype") = -1, py::arg("interleave") = false);
  // Views cross as (data pointer, token stride, head stride), strides in elements.
  m.def("rope",
        [](uintptr_t q_out, int64_t qo_ts, int64_t qo_hs, uintptr_t k_out, int64_t ko_ts, int64_t ko_hs, uintptr_t q,
           int64_t q_ts, int64_t q_hs, uintptr_t k, int64_t k_ts, int64_t k_hs, uintptr_t cos, uintptr_t sin,
           int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int dtype,
           int cos_dtype, bool interleave, const SocInfo& soc) {
          atb::Rope({Ptr(q_out), qo_ts, qo_hs}, {Ptr(k_out), ko_ts, ko_hs}, {Ptr(q), q_ts, q_hs}, {Ptr(k), k_ts, k_hs},
                    Ptr(cos), Ptr(sin), tokens, heads, kv_heads, head_dim, rotary_dim, Dt(dtype), Dt(cos_dtype),
                    interleave ? atb::ROPE_INTERLEAVE : atb::ROPE_NEOX, soc);
        });
  // ---- linear (decode-shaped, fused epilogues) ------------------------------
  // segments: [(weight_ptr, bias_ptr or 0, out_ptr, n)], 1..3 of them.
  m.def("linear_tiling",
        [](int64_t rows, int64_t k, std::vector<int64_t> seg_rows, int epilogue, int dtype, const SocInfo& soc) {
          atb::LinearTilingData t = atb::LinearTiling(rows, k, seg_rows.data(), int64_t(seg_rows.size()),
                                                      atb::LinearEpilogue(epilogue), Dt(dtype), soc);
          py::dict d;
          d["block_dim"] = t.blockDim;
          d["block_factor"] = t.blockFactor;
          d["m_tile"] = t.mTile;
          d["n_tile"] = t.nTile;
          d["k_tile"] = t.kTile;
          d["ub_bytes"] = t.ubBytes;
          d["tiling_key"] = t.tilingKey;
          return d;
        },
        py::arg("m"), py::arg("k"), py::arg("seg_rows"), py::arg("epilogue"), py::arg("dtype"), py::arg("soc"));
  m.def("linear",
        [](uintptr_t x, int64_t rows, int64_t k, const std::vector<std::tuple<uintptr_t, uintptr_t, uintptr_t, int64_t>>& segs,
           uintptr_t residual, int epilogue, int dtype, const SocInfo& soc) {
          if (segs.empty() || segs.size() > size_t(atb::kLinearMaxSegments))
            AscendC::ThrowError("linear: 1..", atb::kLinearMaxSegments, " segments, got ", segs.size());
          if (epilogue < 0 || epilogue > 2) AscendC::ThrowError("linear: epilogue must be 0, 1 or 2, got ", epilogue);
          atb::LinearSegment s[atb::kLinearMaxSegments];
          for (size_t i = 0; i < segs.size(); ++i)
            s[i] = {Ptr(std::get<0>(segs[i])), Ptr(std::get<1>(segs[i])), Ptr(std::get<2>(segs[i])), std::get<3>(segs[i])};
          py::gil_scoped_release nogil;
          atb::Linear(Ptr(x), rows, k, s, int64_t(segs.size()), Ptr(residual), atb::LinearEpilogue(epilogue), Dt(dtype), soc);
        },
        py::arg("x"), py::arg("m"), py::arg("k"), py::arg("segments"), py::arg("residual"), py::arg("epilogue"),
        py::arg("dtype"), py::arg("soc"));

  // ---- swiglu / silu_mul ---------------------------------------------------------
  m.def("swiglu_tiling",
        [](int64_t rows, int64_t cols, int dtype, const SocInfo& soc) {
          return SwiGluTilingDict(atb::SwiGluTiling(rows, cols, Dt(dtype), soc));
        },
        py::arg("rows"), py::arg("cols"), py::arg("dtype"), py::arg("soc"));
  m.def("silu_mul",
        [](uintptr_t out, uintptr_t gate, int64_t gate_row_stride, uintptr_t up, int64_t up_row_stride, int64_t rows,
           int64_t cols, int dtype, const SocInfo& soc) {
          atb::SiluMul(Ptr(out), Ptr(gate), gate_row_stride, Ptr(up), up_row_stride, rows, cols, Dt(dtype), soc);
        });

  // ---- reshape_and_cache ---------------------------------------------------
  m.def("reshape_and_cache",
        [](uintptr_t key, int64_t key_stride, uintptr_t value, int64_t value_stride, uintptr_t key_cache,
           uintptr_t value_cache, uintptr_t slot_mapping, int64_t tokens, int64_t kv_heads, int64_t head_dim,
           int64_t num_blocks, int64_t block_size, int dtype, const SocInfo& soc) {
          atb::ReshapeAndCache(Ptr(key), key_stride, Ptr(value), value_stride, Ptr(key_cache), Ptr(value_cache),
                               I32(slot_mapping), tokens, kv_heads, head_dim, num_blocks, block_size, Dt(dtype), soc);
        },
        py::arg("key"), py::arg("key_stride"), py::arg("value"), py::arg("value_stride"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"), py::arg("tokens"), py::arg("kv_heads"), py::arg("head_dim"),
        py::arg("num_blocks"), py::arg("block_size"), py::arg("dtype"), py::arg("soc"));

  // ---- paged_attention -----------------------------------------------------
  // q_lens == 0 (null): decode, one query per sequence. window <= 0: none.
  m.def("paged_attention_tiling",
        [](int64_t batch, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
           int64_t block_size, int64_t max_blocks, uintptr_t context_lens, uintptr_t q_lens, int64_t total_q,
           int64_t window, int dtype, const SocInfo& soc) {
          return PagedAttentionTilingDict(atb::PagedAttentionTiling(
              batch, num_heads, kv_heads, head_dim, num_blocks, block_size, max_blocks, I32(context_lens),
              I32(q_lens), total_q, num_heads * head_dim, 1.0f, window, Dt(dtype), soc));
        },
        py::arg("batch"), py::arg("num_heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("max_blocks"), py::arg("context_lens"), py::arg("q_lens"), py::arg("total_q"),
        py::arg("window"), py::arg("dtype"), py::arg("soc"));
  m.def("paged_attention",
        [](uintptr_t out, uintptr_t q, int64_t q_stride, uintptr_t key_cache, uintptr_t value_cache,
           uintptr_t block_tables, uintptr_t context_lens, uintptr_t q_lens, int64_t batch, int64_t num_heads,
           int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
           int64_t total_q, float scale, int64_t window, int dtype, const SocInfo& soc) {
          atb::PagedAttention(Ptr(out), Ptr(q), q_stride, Ptr(key_cache), Ptr(value_cache), I32(block_tables),
                              I32(context_lens), I32(q_lens), batch, num_heads, kv_heads, head_dim, num_blocks,
                              block_size, max_blocks, total_q, scale, window, Dt(dtype), soc);
        },
        py::arg("out"), py::arg("q"), py::arg("q_stride"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("q_lens"), py::arg("batch"), py::arg("num_heads"),
        py::arg("kv_heads"), py::arg("head_dim"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("max_blocks"), py::arg("total_q"), py::arg("scale"), py::arg("window"), py::arg("dtype"),
        py::arg("soc"));

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
              uintptr_t context_lens, uintptr_t slot_mapping, int64_t batch, uintptr_t logits, uintptr_t argmax_out) {
             py::gil_scoped_release nogil;
             g.Step(static_cast<const int32_t*>(Ptr(token_ids)), static_cast<const int32_t*>(Ptr(positions)),
                    static_cast<const int32_t*>(Ptr(block_tables)), max_blocks,
                    static_cast<const int32_t*>(Ptr(context_lens)), static_cast<const int32_t*>(Ptr(slot_mapping)),
                    batch, Ptr(logits), static_cast<int32_t*>(Ptr(argmax_out)));
           },
           py::arg("token_ids"), py::arg("positions"), py::arg("block_tables"), py::arg("max_blocks"),
           py::arg("context_lens"), py::arg("slot_mapping"), py::arg("batch"), py::arg("logits"),
           py::arg("argmax_out"))
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
  m.def("flash_attention_tiling",
        [](const std::vector<int32_t>& cu_seqlens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int dtype,
           const SocInfo& soc, bool causal, int64_t window) {
          if (cu_seqlens.empty()) AscendC::ThrowError("flash_attention: cu_seqlens must have at least one entry");
          int64_t batch = int64_t(cu_seqlens.size()) - 1;
          return FlashAttentionTilingDict(atb::FlashAttentionTiling(cu_seqlens.data(), batch, cu_seqlens.back(),
                                                                    num_heads, num_kv_heads, head_dim, Dt(dtype),
                                                                    1.0f, causal, window, soc));
        },
        py::arg("cu_seqlens"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"),
        py::arg("soc"), py::arg("causal") = true, py::arg("window") = 0);
  m.def("flash_attention",
        [](uintptr_t out, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t cu_seqlens, int64_t batch, int64_t tokens,
           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::vector<int64_t>& strides, int dtype,
           float scale, bool causal, int64_t window, const SocInfo& soc) {
          if (strides.size() != 6) AscendC::ThrowError("flash_attention: strides must be (q_token, q_head, k_token, k_head, v_token, v_head)");
          atb::FlashAttentionStrides st{strides[0], strides[1], strides[2], strides[3], strides[4], strides[5]};
          py::gil_scoped_release release;
          atb::FlashAttention(Ptr(out), Ptr(q), Ptr(k), Ptr(v), static_cast<const int32_t*>(Ptr(cu_seqlens)), batch,
                              tokens, num_heads, num_kv_heads, head_dim, st, Dt(dtype), scale, causal, window, soc);
        },
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens"), py::arg("batch"),
        py::arg("tokens"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("strides"),
        py::arg("dtype"), py::arg("scale"), py::arg("causal"), py::arg("window"), py::arg("soc"));

  // ---- quant_linear (weight-only W8A16 / W4A16) -----------------------------
  // segments: [(data, scale, min or 0, bias or 0, out or 0, n, bits, group, scale dtype code)], 1..3 of them.
  using QuantSegTuple = std::tuple<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, int>;
  auto quantSegs = [](const std::vector<QuantSegTuple>& segs, std::vector<atb::QuantSegment>& out) {
    if (segs.empty() || segs.size() > size_t(atb::kLinearMaxSegments))
      AscendC::ThrowError("quant_linear: 1..", atb::kLinearMaxSegments, " segments, got ", segs.size());
    for (const auto& t : segs)
      out.push_back({Ptr(std::get<0>(t)), Ptr(std::get<1>(t)), Ptr(std::get<2>(t)), Ptr(std::get<3>(t)),
                     Ptr(std::get<4>(t)), std::get<5>(t), std::get<6>(t), std::get<7>(t), Dt(std::get<8>(t))});
  };
  m.def("quant_linear_tiling",
        [quantSegs](int64_t rows, int64_t k, const std::vector<QuantSegTuple>& segs, int epilogue, int dtype,
                    const SocInfo& soc) {
          std::vector<atb::QuantSegment> s;
          quantSegs(segs, s);
          atb::QuantLinearTilingData q = atb::QuantLinearTiling(rows, k, s.data(), int64_t(s.size()),
                                                                atb::LinearEpilogue(epilogue), Dt(dtype), soc);
          const atb::LinearTilingData& t = q.base;
          py::dict d;
          d["block_dim"] = t.blockDim;
          d["block_factor"] = t.blockFactor;
          d["m_tile"] = t.mTile;
          d["n_tile"] = t.nTile;
          d["k_tile"] = t.kTile;
          d["m_pass"] = t.mPass;
          d["k_pad"] = q.kPad;
          d["ub_bytes"] = t.ubBytes;
          d["tiling_key"] = t.tilingKey;
          d["gemm"] = t.tilingKey / 100 == atb::LINEAR_GEMM;
          return d;
        },
        py::arg("m"), py::arg("k"), py::arg("segments"), py::arg("epilogue"), py::arg("dtype"), py::arg("soc"));
  m.def("quant_linear",
        [quantSegs](uintptr_t x, int64_t rows, int64_t k, const std::vector<QuantSegTuple>& segs, uintptr_t residual,
                    int epilogue, int dtype, const SocInfo& soc) {
          if (epilogue < 0 || epilogue > 2) AscendC::ThrowError("quant_linear: epilogue must be 0, 1 or 2, got ", epilogue);
          std::vector<atb::QuantSegment> s;
          quantSegs(segs, s);
          py::gil_scoped_release nogil;
          atb::QuantLinear(Ptr(x), rows, k, s.data(), int64_t(s.size()), Ptr(residual), atb::LinearEpilogue(epilogue),
                           Dt(dtype), soc);
        },
        py::arg("x"), py::arg("m"), py::arg("k"), py::arg("segments"), py::arg("residual"), py::arg("epilogue"),
        py::arg("dtype"), py::arg("soc"));
  m.def("quant_dequant_rows",
        [quantSegs](const QuantSegTuple& w, int64_t k, uintptr_t idx, int64_t count, uintptr_t out, int dtype,
                    const SocInfo& soc) {
          std::vector<atb::QuantSegment> s;
          quantSegs({w}, s);
          py::gil_scoped_release nogil;
          atb::QuantDequantRows(s[0], k, static_cast<const int32_t*>(Ptr(idx)), count, Ptr(out), Dt(dtype), soc);
        },
        py::arg("weight"), py::arg("k"), py::arg("idx"), py::arg("count"), py::arg("out"), py::arg("dtype"),
        py::arg("soc"));
  m.def("quant_set_isa", [](const std::string& isa) { atb::SelectQuantSimd(isa); }, py::arg("isa"));
  m.def("quant_isa", []() { return std::string(atb::QuantSimd().isa); });
  m.def("quant_isa_paths", []() { return atb::QuantIsaPaths(); });
}
