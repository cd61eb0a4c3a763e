#include "decode_graph.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ascendc/error.h"
#include "ascendc/tensor.h"
#include "ascendc/vec.h"
#include "kernels/linear/linear_rows4.h"
#include "kernels/linear/linear_tiling.h"
#include "kernels/rms_norm/rms_norm_tiling.h"

using AscendC::DataType;

namespace atb {

const char* DecodeNodeName(int node) {
  static const char* names[NODE_COUNT] = {"embed", "norm", "qkv", "rope", "cache_write", "attention", "o_proj",
                                          "mlp", "lm_head", "all_reduce"};
  return node >= 0 && node < NODE_COUNT ? names[node] : "?";
}

namespace {

// Wall time of one node, added to the profile only when profiling is on: off,
// it costs one predictable branch per node (~300 nodes per step of a 30-layer model).
class NodeTimer {
 public:
  NodeTimer(bool on, int64_t* ns, int64_t* calls) : on_(on), ns_(ns), calls_(calls) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~NodeTimer() {
    if (!on_) return;
    *ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
    ++*calls_;
  }

 private:
  bool on_;
  int64_t* ns_;
  int64_t* calls_;
  std::chrono::steady_clock::time_point start_;
};

// out[r] = the first index of row r's largest value (a NaN is never larger; a NaN at index 0 gives 0): the
// scalar walk `if (v > best)`, taken over blocks of the row. A block whose vector max is no larger than the
// best so far cannot change the answer and is skipped; any other block is walked value by value. Logits rise
// past their running best in a handful of a row's blocks, so nearly all of the row goes through the vector
// max: the plain walk took 886 us for SmolLM2's 16 x 49152 fp32 logits, in cache (2% of a batch-16 fp32
// decode step, 5% of a bf16 one).
template <typename T>
void ArgmaxRows(const T* logits, int64_t rows, int64_t cols, int32_t* out) {
  constexpr int64_t kBlock = 512;
  float block[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = logits + r * cols;
    float best = AscendC::ToFloat(row[0]);
    int64_t arg = 0;
    for (int64_t b0 = 0; best == best && b0 < cols; b0 += kBlock) {
      const int64_t n = std::min(kBlock, cols - b0);
      const float* v = block;
      if constexpr (std::is_same<T, float>::value) v = row + b0;
      else AscendC::CastRaw<float, T>(block, row + b0, n);
      // The tables' vector max may drop a lane's running max at a NaN (maxps returns its second operand),
      // so a block whose sum is NaN (a NaN, or infinities of both signs) is walked too.
      const float m = AscendC::Simd().reduce_max(v, n), sum = AscendC::Simd().reduce_sum(v, n);
      if (sum == sum && !(m > best)) continue;
      for (int64_t i = 0; i < n; ++i)
        if (v[i] > best) best = v[i], arg = b0 + i;
    }
    out[r] = int32_t(arg);
  }
}

}  // namespace

DecodeGraph::DecodeGraph(const DecodeGraphConfig& cfg, std::vector<DecodeLayer> layers, const void* embed,
                         const void* finalNorm, const void* lmHead, const void* cos, const void* sin,
                         const AscendC::SocInfo& soc)
    : cfg_(cfg), layers_(std::move(layers)), embed_(embed), finalNorm_(finalNorm), lmHead_(lmHead), cos_(cos),
      sin_(sin), soc_(soc) {
  const auto& c = cfg_;
  ATB_CHECK(c.numLayers >= 1 && int64_t(layers_.size()) == c.numLayers, "DecodeGraph: ", layers_.size(),
            " layers given, config says ", c.numLayers);
  ATB_CHECK(c.hidden >= 1 && c.numHeads >= 1 && c.numKvHeads >= 1 && c.headDim >= 1 && c.intermediate >= 1 &&
                c.vocab >= 1,
            "DecodeGraph: every dimension must be >= 1");
  ATB_CHECK(c.numHeads % c.numKvHeads == 0, "DecodeGraph: num_heads ", c.numHeads, " is not a multiple of num_kv_heads ",
            c.numKvHeads);
  ATB_CHECK(c.rotaryDim >= 2 && c.rotaryDim <= c.headDim && c.rotaryDim % 2 == 0, "DecodeGraph: rotary_dim ",
            c.rotaryDim, " must be even and in [2, head_dim=", c.headDim, "]");
  ATB_CHECK(c.maxBatch >= 1 && c.maxSeqLen >= 1 && c.numBlocks >= 1 && c.blockSize >= 1,
            "DecodeGraph: max_batch, max_seq_len, num_blocks and block_size must be >= 1");
  ATB_CHECK(c.dtype != DataType::BFLOAT16 || soc_.supports_bf16, "DecodeGraph: bfloat16 is not supported on ",
            soc_.name);
  ATB_CHECK(embed_ && finalNorm_ && lmHead_ && cos_ && sin_, "DecodeGraph: embed, final_norm, lm_head, cos and sin are required");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DecodeLayer& l = layers_[i];
    ATB_CHECK(l.inputNorm && l.q && l.k && l.v && l.o && l.postNorm && l.gate && l.up && l.down && l.keyCache &&
                  l.valueCache,
              "DecodeGraph: layer ", i, " is missing a required weight or cache pointer");
    ATB_CHECK((l.qNorm == nullptr) == (l.kNorm == nullptr), "DecodeGraph: layer ", i, " has only one of q_norm/k_norm");
    ATB_CHECK((l.gateQ.data == nullptr) == (l.upQ.data == nullptr), "DecodeGraph: layer ", i,
              " has only one of gate/up quantized (their fused launch needs both or neither)");
  }
  if (c.scale == 0.0f) cfg_.scale = 1.0f / std::sqrt(float(c.headDim));
  if (c.vocabTotal == 0) cfg_.vocabTotal = c.vocab;
  ATB_CHECK(c.vocabStart >= 0 && c.vocabStart + c.vocab <= cfg_.vocabTotal, "DecodeGraph: vocab slice [",
            c.vocabStart, ", ", c.vocabStart + c.vocab, ") is outside the vocabulary of ", cfg_.vocabTotal);
  for (const DecodeLayer& l : layers_) {
    int64_t w = l.window > 0 ? l.window : 0;
    auto it = std::find(distinctWindows_.begin(), distinctWindows_.end(), w);
    windowOf_.push_back(size_t(it - distinctWindows_.begin()));
    if (it == distinctWindows_.end()) distinctWindows_.push_back(w);
  }
  attnPlans_.resize(distinctWindows_.size());

  // Scratch: residual stream x, normed h, q, k, v, attention output, MLP
  // activation, gathered cos/sin; each [maxBatch, width], 64-byte aligned.
  int64_t elt = AscendC::DataTypeSize(c.dtype), celt = AscendC::DataTypeSize(c.cosDtype), B = c.maxBatch;
  int64_t qSize = c.numHeads * c.headDim, kvSize = c.numKvHeads * c.headDim;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    int64_t o = off;
    off += AscendC::AlignUp(bytes, 64);
    return o;
  };
  offX_ = take(B * c.hidden * elt);
  offH_ = take(B * c.hidden * elt);
  offQ_ = take(B * qSize * elt);
  offK_ = take(B * kvSize * elt);
  offV_ = take(B * kvSize * elt);
  offAttn_ = take(B * qSize * elt);
  offAct_ = take(B * c.intermediate * elt);
  offCos_ = take(B * c.rotaryDim * celt);
  offSin_ = take(B * c.rotaryDim * celt);
  scratch_.assign(size_t(off + 64), 0);
  base_ = reinterpret_cast<uint8_t*>(AscendC::AlignUp(int64_t(reinterpret_cast<uintptr_t>(scratch_.data())), 64));
}

void DecodeGraph::ResetProfile() {
  profNs_.fill(0);
  profCalls_.fill(0);
  profSteps_ = 0;
}

void DecodeGraph::Validate(const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables,
                           int64_t maxBlocks, const int32_t* contextLens, const int32_t* slotMapping,
                           int64_t batch, const int32_t* qLens, int64_t numSeqs) const {
  const auto& c = cfg_;
  ATB_CHECK(batch >= 1 && batch <= c.maxBatch, "DecodeGraph.step: batch ", batch, " is outside [1, max_batch=",
            c.maxBatch, "]");
  ATB_CHECK(maxBlocks >= 1, "DecodeGraph.step: block_tables must have at least one column");
  // Sequences: their contexts and the blocks those use (one sequence per row without qLens).
  const int64_t seqs = qLens ? numSeqs : batch;
  ATB_CHECK(seqs >= 1, "DecodeGraph.step: q_lens is empty");
  int64_t rows = 0;
  for (int64_t b = 0; b < seqs; ++b) {
    int64_t ctx = contextLens[b];
    ATB_CHECK(ctx >= 1 && ctx <= maxBlocks * c.blockSize, "DecodeGraph.step: context_lens[", b, "] = ", ctx,
              " is outside [1, ", maxBlocks * c.blockSize, "] (block_tables has ", maxBlocks, " columns of ",
              c.blockSize, " tokens)");
    for (int64_t j = 0, used = AscendC::CeilDiv(ctx, c.blockSize); j < used; ++j) {
      int32_t blk = blockTables[b * maxBlocks + j];
      ATB_CHECK(blk >= 0 && blk < c.numBlocks, "DecodeGraph.step: block_tables[", b, "][", j, "] = ", blk,
                " is outside [0, num_blocks=", c.numBlocks, ")");
    }
    if (!qLens) continue;
    int64_t n = qLens[b];
    ATB_CHECK(n >= 1 && n <= ctx && rows + n <= batch, "DecodeGraph.step: q_lens[", b, "] = ", n,
              " is outside [1, context_lens[", b, "] = ", ctx, "] or past the ", batch, " token rows");
    for (int64_t j = 0; j < n; ++j)
      ATB_CHECK(positions[rows + j] == ctx - n + j, "DecodeGraph.step: positions[", rows + j, "] = ",
                positions[rows + j], ", but sequence ", b, "'s row ", j, " of ", n, " with context_lens ", ctx,
                " is at position ", ctx - n + j);
    rows += n;
  }
  ATB_CHECK(!qLens || rows == batch, "DecodeGraph.step: q_lens sum to ", rows, ", token_ids has ", batch, " rows");
  // Rows: tokens, positions, K/V slots (distinct).
  int64_t slots = c.numBlocks * c.blockSize;
  for (int64_t b = 0; b < batch; ++b) {
    ATB_CHECK(tokenIds[b] >= 0 && tokenIds[b] < c.vocabTotal, "DecodeGraph.step: token_ids[", b, "] = ",
              tokenIds[b], " is outside the vocabulary [0, ", c.vocabTotal, ")");
    ATB_CHECK(positions[b] >= 0 && positions[b] < c.maxSeqLen, "DecodeGraph.step: positions[", b, "] = ",
              positions[b], " is outside [0, max_seq_len=", c.maxSeqLen, ")");
    ATB_CHECK(slotMapping[b] < slots, "DecodeGraph.step: slot_mapping[", b, "] = ", slotMapping[b],
              " is outside the cache's ", slots, " slots");
    for (int64_t e = 0; e < b; ++e)
      ATB_CHECK(slotMapping[b] < 0 || slotMapping[e] != slotMapping[b], "DecodeGraph.step: slot_mapping[", e,
                "] and slot_mapping[", b, "] are both ", slotMapping[b]);
  }
}

int64_t DecodeGraph::StepGreedy(int64_t steps, const int32_t* tokenIds, const int32_t* positions,
                                const int32_t* blockTables, int64_t maxBlocks, const int32_t* contextLens,
                                const int32_t* slotMapping, int64_t batch, void* logits, int32_t* tokensOut,
                                const int32_t* stopTokens, int64_t numStop) {
  const auto& c = cfg_;
  ATB_CHECK(steps >= 1, "DecodeGraph.step_greedy: steps must be >= 1, got ", steps);
  ATB_CHECK(!allReduce_, "DecodeGraph.step_greedy: a tensor-parallel graph's argmax is its vocab slice; "
            "step it one step at a time");
  ATB_CHECK(batch >= 1 && batch <= c.maxBatch, "DecodeGraph.step_greedy: batch ", batch,
            " is outside [1, max_batch=", c.maxBatch, "]");
  // Metadata of every step, [steps, batch] each, checked once before the first step writes anything (the
  // steps then Run unchecked). A later step's tokens are argmaxes, always in the vocabulary: step 0's stand in
  // for them in the check.
  const int64_t n = steps * batch;
  std::vector<int32_t> pos(n), ctx(n), slot(n);
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t i = s * batch + b, p = int64_t(positions[b]) + s;
      pos[i] = int32_t(p);
      ctx[i] = contextLens[b] + int32_t(s);
      if (s == 0) {
        slot[i] = slotMapping[b];
        continue;
      }
      ATB_CHECK(p < c.maxSeqLen && p / c.blockSize < maxBlocks, "DecodeGraph.step_greedy: step ", s,
                " of sequence ", b, " is at position ", p, ", past max_seq_len=", c.maxSeqLen,
                " or past its block table's ", maxBlocks, " blocks of ", c.blockSize);
      slot[i] = int32_t(int64_t(blockTables[b * maxBlocks + p / c.blockSize]) * c.blockSize + p % c.blockSize);
    }
  for (int64_t s = 0; s < steps; ++s)
    Validate(tokenIds, &pos[s * batch], blockTables, maxBlocks, &ctx[s * batch], &slot[s * batch], batch);
  std::vector<int32_t> tokens(tokenIds, tokenIds + batch);
  std::vector<char> stopped(batch, 0);
  int64_t live = numStop > 0 ? batch : -1;   // rows yet to produce a stop token (-1: no stop tokens)
  for (int64_t s = 0; s < steps; ++s) {
    int32_t* out = tokensOut + s * batch;
    Run(tokens.data(), &pos[s * batch], blockTables, maxBlocks, &ctx[s * batch], &slot[s * batch], batch, logits,
        out);
    std::copy_n(out, batch, tokens.data());
    for (int64_t b = 0; b < batch && live > 0; ++b)
      if (!stopped[b] && std::find(stopTokens, stopTokens + numStop, out[b]) != stopTokens + numStop) {
        stopped[b] = 1;
        --live;
      }
    if (live == 0) return s + 1;
  }
  return steps;
}

void DecodeGraph::Plan(const int32_t* contextLens, int64_t maxBlocks, int64_t rows, const int32_t* qLens,
                       int64_t numSeqs) {
  const auto& c = cfg_;
  const int64_t seqs = qLens ? numSeqs : rows;
  for (size_t i = 0; i < distinctWindows_.size(); ++i)
    attnPlans_[i] = PagedAttentionTiling(seqs, c.numHeads, c.numKvHeads, c.headDim, c.numBlocks, c.blockSize,
                                         maxBlocks, contextLens, qLens, rows, c.numHeads * c.headDim, c.scale,
                                         distinctWindows_[i], c.dtype, soc_);
  cachePlan_ = ReshapeAndCacheTiling(rows, c.numKvHeads, c.headDim, c.dtype, soc_);
}

void DecodeGraph::Step(const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables,
                       int64_t maxBlocks, const int32_t* contextLens, const int32_t* slotMapping, int64_t batch,
                       void* logits, int32_t* argmaxOut, const int32_t* qLens, int64_t numSeqs) {
  Validate(tokenIds, positions, blockTables, maxBlocks, contextLens, slotMapping, batch, qLens, numSeqs);
  Run(tokenIds, positions, blockTables, maxBlocks, contextLens, slotMapping, batch, logits, argmaxOut, qLens,
      numSeqs);
}

int64_t DecodeGraph::PlanRows4Streams() {
  const auto& c = cfg_;
  rows4Pieces_.clear();
  rows4Sources_.clear();
  layerRows4_.assign(layers_.size(), {});
  headRows4_ = {};
  rows4Bytes_ = 0;
  if (!Rows4Supported(c.dtype)) return 0;
  // The step's float launches in order, as Run makes them (a launch with a quantized segment has no copy).
  struct Launch {
    int64_t k;
    LinearEpilogue ep;
    int64_t numSegments;
    std::array<const void*, 3> weights;
    std::array<int64_t, 3> rows;
    std::array<Rows4Span*, 3> spans;
  };
  const LinearEpilogue rowMode = c.ownsResidual ? LINEAR_RESIDUAL : LINEAR_PLAIN;
  const int64_t qSize = c.numHeads * c.headDim, kvSize = c.numKvHeads * c.headDim, I = c.intermediate;
  std::vector<Launch> launches;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const DecodeLayer& L = layers_[li];
    auto& sp = layerRows4_[li];
    if (!L.qQ.data && !L.kQ.data && !L.vQ.data)
      launches.push_back(
          {c.hidden, LINEAR_PLAIN, 3, {L.q, L.k, L.v}, {qSize, kvSize, kvSize}, {&sp[kQ], &sp[kK], &sp[kV]}});
    if (!L.oQ.data) launches.push_back({qSize, rowMode, 1, {L.o}, {c.hidden}, {&sp[kO]}});
    if (!L.gateQ.data)
      launches.push_back({c.hidden, LINEAR_SWIGLU, 2, {L.gate, L.up}, {I, I}, {&sp[kGate], &sp[kUp]}});
    if (!L.downQ.data) launches.push_back({I, rowMode, 1, {L.down}, {c.hidden}, {&sp[kDown]}});
  }
  if (!headQ_.data) launches.push_back({c.hidden, LINEAR_PLAIN, 1, {lmHead_}, {c.vocab}, {&headRows4_}});
  // A copy only where a step reads it: the STREAM kernel at 1 row (fp32: unless it reads weights as they lie,
  // Rows4MaxRows 0) or the batch GEMM's packed-x form (Rows4PackedX, by K), which only steps of
  // kLinearPackedXMinRows rows or more run.
  const bool batchSteps = c.maxBatch >= kLinearPackedXMinRows;
  const auto unread = [&](const Launch& l) {
    return Rows4MaxRows(c.dtype) == 0 && !(batchSteps && Rows4PackedX(c.dtype, l.k));
  };
  launches.erase(std::remove_if(launches.begin(), launches.end(), unread), launches.end());
  // Each launch's tiles at 1 row of x, core by core, in the order the STREAM kernel walks them (linear_io.h:
  // a core's rows segment by segment in nTile tiles; SWIGLU reads the gate's tile, then the up's).
  struct Tile {
    int64_t core;
    size_t launch;
    int64_t segment, row, rows;
  };
  std::vector<Tile> tiles;
  for (size_t i = 0; i < launches.size(); ++i) {
    const Launch& l = launches[i];
    const LinearTilingData t = LinearTiling(1, l.k, l.rows.data(), l.numSegments, l.ep, c.dtype, soc_);
    if (t.tilingKey / 100 != LINEAR_STREAM) continue;
    for (int64_t b = 0; b < t.blockDim; ++b) {
      const int64_t first = b * t.blockFactor, last = std::min(t.rows, first + t.blockFactor);
      int64_t base = 0;
      for (int64_t s = 0; s < (l.ep == LINEAR_SWIGLU ? 1 : l.numSegments); ++s) {
        for (int64_t g = std::max(first, base); g < std::min(last, base + t.segRows[s]); g += t.nTile)
          for (int64_t stream = 0; stream < (l.ep == LINEAR_SWIGLU ? 2 : 1); ++stream)
            tiles.push_back(
                {b, i, stream == 1 ? 1 : s, g - base, std::min({t.nTile, last - g, base + t.segRows[s] - g})});
        base += t.segRows[s];
      }
    }
  }
  // Offsets core by core (stable: each core's tiles keep the step's order); each segment's pieces in row order.
  std::vector<size_t> order(tiles.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tiles[a].core < tiles[b].core; });
  const int64_t elt = AscendC::DataTypeSize(c.dtype);
  std::vector<int64_t> offset(tiles.size());
  for (size_t i : order) {
    offset[i] = rows4Bytes_;
    rows4Bytes_ += AscendC::AlignUp(Rows4Elems(tiles[i].rows, launches[tiles[i].launch].k) * elt, 64);
  }
  for (size_t i = 0; i < launches.size(); ++i)
    for (int64_t s = 0; s < launches[i].numSegments; ++s) {
      Rows4Span& span = *launches[i].spans[s];
      span.first = int64_t(rows4Pieces_.size());
      for (size_t j = 0; j < tiles.size(); ++j)
        if (tiles[j].launch == i && tiles[j].segment == s) {
          rows4Pieces_.push_back({tiles[j].row, tiles[j].rows, nullptr});
          rows4Sources_.push_back({launches[i].weights[s], launches[i].k, offset[j]});
        }
      span.count = int64_t(rows4Pieces_.size()) - span.first;
    }
  return rows4Bytes_;
}

void DecodeGraph::PackRows4Streams(void* dst, int64_t bytes) {
  ATB_CHECK(bytes == rows4Bytes_ && rows4Bytes_ > 0, "DecodeGraph.pack_rows4_streams: the plan takes ", rows4Bytes_,
            " bytes (plan_rows4_streams), got a buffer of ", bytes);
  ATB_CHECK(reinterpret_cast<uintptr_t>(dst) % 64 == 0,
            "DecodeGraph.pack_rows4_streams: the buffer must be 64-byte aligned");
  const int64_t elt = AscendC::DataTypeSize(cfg_.dtype);
  for (size_t i = 0; i < rows4Pieces_.size(); ++i) {
    Rows4Piece& p = rows4Pieces_[i];
    const Rows4Source& src = rows4Sources_[i];
    void* out = static_cast<uint8_t*>(dst) + src.offset;
    PackRows4(out, static_cast<const uint8_t*>(src.weight) + p.row * src.k * elt, src.k, p.rows, src.k, cfg_.dtype);
    p.data = out;
  }
}

LinearSegment DecodeGraph::Segment(const void* weight, const void* bias, void* out, int64_t n,
                                   const Rows4Span& span) const {
  LinearSegment s{weight, bias, out, n};
  if (span.count > 0 && rows4Pieces_[size_t(span.first)].data) {
    s.rows4Pieces = &rows4Pieces_[size_t(span.first)];
    s.numRows4Pieces = span.count;
  }
  return s;
}

void DecodeGraph::Run(const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables,
                      int64_t maxBlocks, const int32_t* contextLens, const int32_t* slotMapping, int64_t batch,
                      void* logits, int32_t* argmaxOut, const int32_t* qLens, int64_t numSeqs) {
  const AscendC::PoolLaunchScope onPool;  // no torch op runs inside a step (runtime.h)
  const auto& c = cfg_;
  const DataType dt = c.dtype;
  const int64_t B = batch, elt = AscendC::DataTypeSize(dt), celt = AscendC::DataTypeSize(c.cosDtype);
  const int64_t qSize = c.numHeads * c.headDim, kvSize = c.numKvHeads * c.headDim;
  void *x = Buf(offX_), *h = Buf(offH_), *q = Buf(offQ_), *k = Buf(offK_), *v = Buf(offV_), *attn = Buf(offAttn_),
       *act = Buf(offAct_), *cosB = Buf(offCos_), *sinB = Buf(offSin_);
  auto timer = [&](int node) { return NodeTimer(profiling_, &profNs_[node], &profCalls_[node]); };
  if (profiling_) ++profSteps_;
  auto allReduce = [&]() {
    if (!allReduce_) return;
    auto t = timer(NODE_ALL_REDUCE);
    allReduce_(x, B * c.hidden);
  };
  // Without the residual (tp ranks other than the owner) a row-parallel projection writes its partial sum.
  const LinearEpilogue rowMode = c.ownsResidual ? LINEAR_RESIDUAL : LINEAR_PLAIN;

  {
    auto t = timer(NODE_EMBED);
    if (embedQ_.data) {
      // Quantized tables are built whole (tensor parallelism slices float tables only; see atb/distributed.py).
      ATB_CHECK(c.vocabStart == 0 && c.vocab == c.vocabTotal,
                "DecodeGraph: a quantized embedding cannot be a tensor-parallel vocab slice");
      QuantSegment e{embedQ_.data, embedQ_.scale, embedQ_.min, nullptr, nullptr, c.vocab, embedQ_.bits,
                     embedQ_.group, embedQ_.scaleType};
      QuantDequantRows(e, c.hidden, tokenIds, B, x, dt, soc_);
    } else {
      const auto* emb = static_cast<const uint8_t*>(embed_);
      // Rows outside this rank's vocab slice are zeros (tp: the all-reduce below fills them in).
      for (int64_t b = 0; b < B; ++b) {
        int64_t row = int64_t(tokenIds[b]) - c.vocabStart;
        uint8_t* dst = static_cast<uint8_t*>(x) + b * c.hidden * elt;
        if (row >= 0 && row < c.vocab)
          std::memcpy(dst, emb + row * c.hidden * elt, size_t(c.hidden * elt));
        else
          std::memset(dst, 0, size_t(c.hidden * elt));
      }
    }
    // Shared by every layer: the plan, and the rope rows of this step's positions.
    Plan(contextLens, maxBlocks, B, qLens, numSeqs);
    const auto* cs = static_cast<const uint8_t*>(cos_);
    const auto* sn = static_cast<const uint8_t*>(sin_);
    int64_t row = c.rotaryDim * celt;
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(static_cast<uint8_t*>(cosB) + b * row, cs + int64_t(positions[b]) * row, size_t(row));
      std::memcpy(static_cast<uint8_t*>(sinB) + b * row, sn + int64_t(positions[b]) * row, size_t(row));
    }
  }
  allReduce();

  for (size_t li = 0; li < layers_.size(); ++li) {
    const DecodeLayer& L = layers_[li];
    {
      auto t = timer(NODE_NORM);
      RmsNorm(h, nullptr, x, nullptr, L.inputNorm, B, c.hidden, dt, c.eps, soc_);
    }
    {
      auto t = timer(NODE_QKV);
      const auto& sp = LayerRows4(li);
      LinearSegment segs[3] = {Segment(L.q, L.qBias, q, qSize, sp[kQ]),
                               Segment(L.k, L.kBias, k, kvSize, sp[kK]),
                               Segment(L.v, L.vBias, v, kvSize, sp[kV])};
      const QuantRef* qs[3] = {&L.qQ, &L.kQ, &L.vQ};
      LinearOrQuant(h, B, c.hidden, segs, qs, 3, nullptr, LINEAR_PLAIN, dt, soc_);
      if (L.qNorm) {
        RmsNorm(q, nullptr, q, nullptr, L.qNorm, B * c.numHeads, c.headDim, dt, c.eps, soc_);
        RmsNorm(k, nullptr, k, nullptr, L.kNorm, B * c.numKvHeads, c.headDim, dt, c.eps, soc_);
      }
    }
    {
      auto t = timer(NODE_ROPE);
      RopeView qv{q, qSize, c.headDim}, kv{k, kvSize, c.headDim};
      Rope(qv, kv, qv, kv, cosB, sinB, B, c.numHeads, c.numKvHeads, c.headDim, c.rotaryDim, dt, c.cosDtype,
           c.ropeStyle, soc_);
    }
    {
      auto t = timer(NODE_CACHE);
      ReshapeAndCacheRun(cachePlan_, k, kvSize, v, kvSize, L.keyCache, L.valueCache, slotMapping, soc_);
    }
    {
      auto t = timer(NODE_ATTENTION);
      PagedAttentionRun(attnPlans_[windowOf_[li]], attn, q, L.keyCache, L.valueCache, blockTables, soc_);
    }
    {
      auto t = timer(NODE_O_PROJ);
      LinearSegment seg = Segment(L.o, L.oBias, x, c.hidden, LayerRows4(li)[kO]);
      const QuantRef* qs[1] = {&L.oQ};
      LinearOrQuant(attn, B, qSize, &seg, qs, 1, x, rowMode, dt, soc_);  // x (+)= o_proj(attn), in place
    }
    allReduce();
    {
      auto t = timer(NODE_MLP);
      RmsNorm(h, nullptr, x, nullptr, L.postNorm, B, c.hidden, dt, c.eps, soc_);
      const auto& sp = LayerRows4(li);
      LinearSegment gu[2] = {Segment(L.gate, L.gateBias, act, c.intermediate, sp[kGate]),
                             Segment(L.up, L.upBias, nullptr, c.intermediate, sp[kUp])};
      const QuantRef* guq[2] = {&L.gateQ, &L.upQ};
      LinearOrQuant(h, B, c.hidden, gu, guq, 2, nullptr, LINEAR_SWIGLU, dt, soc_);
      LinearSegment down = Segment(L.down, L.downBias, x, c.hidden, sp[kDown]);
      const QuantRef* dq[1] = {&L.downQ};
      LinearOrQuant(act, B, c.intermediate, &down, dq, 1, x, rowMode, dt, soc_);
    }
    allReduce();
  }

  {
    auto t = timer(NODE_LM_HEAD);
    RmsNorm(h, nullptr, x, nullptr, finalNorm_, B, c.hidden, dt, c.eps, soc_);
    LinearSegment head = Segment(lmHead_, nullptr, logits, c.vocab, headRows4_);
    const QuantRef* hq[1] = {&headQ_};
    LinearOrQuant(h, B, c.hidden, &head, hq, 1, nullptr, LINEAR_PLAIN, dt, soc_);
    if (argmaxOut) {
      switch (dt) {
        case DataType::FLOAT32: ArgmaxRows(static_cast<const float*>(logits), B, c.vocab, argmaxOut); break;
        case DataType::FLOAT16: ArgmaxRows(static_cast<const AscendC::half*>(logits), B, c.vocab, argmaxOut); break;
        case DataType::BFLOAT16:
          ArgmaxRows(static_cast<const AscendC::bfloat16_t*>(logits), B, c.vocab, argmaxOut);
          break;
      }
    }
  }
}

}  // namespace atb
