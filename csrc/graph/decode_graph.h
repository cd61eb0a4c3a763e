// The decode graph: one decode step of a LLaMA-family model (LLaMA, Mistral,
// Qwen2 q/k/v bias, Qwen3 q/k norm) as one native call, ATB GraphOperation
// style. Built once from the model's shapes, raw pointers to its weights and
// to the paged KV cache (all owned and kept alive by the caller), it runs
//   embedding -> per layer [rms_norm, fused q/k/v linear (+bias), q/k norm,
//   rope, reshape_and_cache, paged_attention, o_proj + residual, rms_norm,
//   gate/up + SwiGLU, down_proj + residual] -> final rms_norm -> lm_head
// through the kernels' host entries, with no Python and no allocation of its
// own per step (activations live in scratch sized for maxBatch at build time).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"
#include "kernels/linear/linear_tiling.h"
#include "kernels/paged_attention/paged_attention_tiling.h"
#include "kernels/quant_linear/quant_linear_tiling.h"
#include "kernels/reshape_and_cache/reshape_and_cache_tiling.h"
#include "kernels/rope/rope_tiling.h"

namespace atb {

struct DecodeGraphConfig {
  int64_t numLayers = 0, hidden = 0, numHeads = 0, numKvHeads = 0, headDim = 0, intermediate = 0, vocab = 0;
  float eps = 1e-6f;
  float scale = 0.0f;           // attention softmax scale (HF's `scaling`)
  int64_t rotaryDim = 0;
  RopeStyle ropeStyle = ROPE_NEOX;
  int64_t maxBatch = 1;
  int64_t maxSeqLen = 0;        // rows of the cos/sin table; positions must be below it
  int64_t numBlocks = 0, blockSize = 0;  // the paged KV cache pool of every layer
  AscendC::DataType dtype = AscendC::DataType::FLOAT32;      // weights, activations, KV cache
  AscendC::DataType cosDtype = AscendC::DataType::FLOAT32;   // cos/sin table: dtype or float32
  // Tensor parallelism (one rank's shard; see SetAllReduce): the embedding / LM head rows are the vocab
  // slice [vocabStart, vocabStart + vocab) of vocabTotal (0: no tp, the whole vocabulary), and only the
  // rank that ownsResidual adds the residual (and holds the o/down bias) before the partial sums are added.
  int64_t vocabStart = 0, vocabTotal = 0;
  bool ownsResidual = true;
};

// Sums `count` elements of config.dtype at `data` over the tensor-parallel ranks, in place.
using AllReduceFn = std::function<void(void* data, int64_t count)>;

// One layer's parameters: raw pointers into the caller's tensors (HF layout,
// contiguous, all of config.dtype). Optional ones are null.
struct DecodeLayer {
  const void* inputNorm = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* qBias = nullptr;
  const void* kBias = nullptr;
  const void* vBias = nullptr;
  const void* qNorm = nullptr;  // Qwen3: RMSNorm over each head's head_dim
  const void* kNorm = nullptr;
  const void* o = nullptr;
  const void* oBias = nullptr;
  const void* postNorm = nullptr;
  const void* gate = nullptr;
  const void* gateBias = nullptr;
  const void* up = nullptr;
  const void* upBias = nullptr;
  const void* down = nullptr;
  const void* downBias = nullptr;
  void* keyCache = nullptr;     // [numBlocks, blockSize, numKvHeads, headDim]
  void* valueCache = nullptr;
  int64_t window = 0;           // sliding window; <= 0: full attention
  // Quantized projections (W8A16 / W4A16): storage of each weight; data == nullptr keeps it float.
  // gate and up are both quantized or both float (they share one fused launch).
  QuantRef qQ, kQ, vQ, oQ, gateQ, upQ, downQ;
};

// Profiled nodes, in execution order. "embed" also covers the per-step work
// every layer shares: the rope rows of the step's positions and the plan
// (paged-attention tiling per distinct sliding window, the cache-write tiling).
enum DecodeNode : int { NODE_EMBED, NODE_NORM, NODE_QKV, NODE_ROPE, NODE_CACHE, NODE_ATTENTION, NODE_O_PROJ,
                        NODE_MLP, NODE_LM_HEAD, NODE_ALL_REDUCE, NODE_COUNT };
const char* DecodeNodeName(int node);

class DecodeGraph {
 public:
  DecodeGraph(const DecodeGraphConfig& cfg, std::vector<DecodeLayer> layers, const void* embed, const void* finalNorm,
              const void* lmHead, const void* cos, const void* sin, const AscendC::SocInfo& soc);

  // One decode step for `batch` sequences, one new token each. All metadata is
  // int32: tokenIds/positions/contextLens/slotMapping [batch], blockTables
  // [batch, maxBlocks] contiguous (entries past a sequence's context are not read).
  // Everything is validated before anything is written (std::invalid_argument).
  // logits: [batch, vocab] in config.dtype. argmaxOut (optional): int32 [batch]
  // greedy tokens (first maximum, as torch.argmax).
  // qLens (optional, int32 [numSeqs]): several consecutive new tokens per sequence (speculative decoding's
  // verification). `batch` then counts rows (tokens): tokenIds/positions/slotMapping/logits/argmaxOut are per
  // row, sequence s's qLens[s] rows in order at positions contextLens[s] - qLens[s] .. contextLens[s] - 1;
  // blockTables and contextLens are per sequence. Each row attends causally, as if decoded alone at its
  // position, and the sequence's K/V is read once for all its rows.
  void Step(const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables, int64_t maxBlocks,
            const int32_t* contextLens, const int32_t* slotMapping, int64_t batch, void* logits, int32_t* argmaxOut,
            const int32_t* qLens = nullptr, int64_t numSeqs = 0);

  // `steps` greedy decode steps in one call, with no Python between them: each step's argmax is the next
  // step's token, and positions, context lengths and slots advance by one (a later step's slot comes from the
  // block tables, which must already cover it). tokensOut: int32 [steps, batch]. Every step's metadata is
  // validated before the first step runs. Not for a tensor-parallel graph (its argmax is a vocab slice).
  // stopTokens (numStop of them, may be none): the call ends after the step by which every row has produced
  // one of them (a sequence that ended has nothing to gain from the steps left). Returns the steps run.
  int64_t StepGreedy(int64_t steps, const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables,
                     int64_t maxBlocks, const int32_t* contextLens, const int32_t* slotMapping, int64_t batch,
                     void* logits, int32_t* tokensOut, const int32_t* stopTokens = nullptr, int64_t numStop = 0);

  // Quantized embedding table / LM head (data == nullptr: the float pointers given at build).
  // The embedding lookup then dequantizes each token's row.
  void SetQuantTables(const QuantRef& embed, const QuantRef& head) {
    embedQ_ = embed;
    headQ_ = head;
  }
  // The rows4 copies of the float projections and LM head (kernels/linear/linear_rows4.h), laid out for the
  // steps that read them most (1 row of x; fp32 1 or 2; batch steps' packed-x GEMM reads them too, tile by
  // tile, Rows4PackedX): one piece per core tile of each launch, each core's pieces
  // of the whole step one after another in the order it reads them, so that a core streams one front-to-back
  // run of memory from the first layer to the LM head. PlanRows4Streams (after SetQuantTables) returns the
  // bytes they take (0: nothing to copy: no rows4 kernel for the dtype, or every weight quantized);
  // PackRows4Streams packs them into dst (64-byte aligned, that many bytes, kept alive by the caller), and
  // steps read them from then on (the same bits as the weights as they lie).
  int64_t PlanRows4Streams();
  void PackRows4Streams(void* dst, int64_t bytes);
  // Tensor parallelism: called on the residual stream after the embedding and after the row-parallel
  // o and down projections (2 * numLayers + 1 times per step); logits stay this rank's vocab slice.
  void SetAllReduce(AllReduceFn fn) { allReduce_ = std::move(fn); }

  void SetProfiling(bool on) { profiling_ = on; }
  bool Profiling() const { return profiling_; }
  void ResetProfile();
  // Accumulated wall time (ns) and call count per node since the last reset.
  const std::array<int64_t, NODE_COUNT>& ProfileNs() const { return profNs_; }
  const std::array<int64_t, NODE_COUNT>& ProfileCalls() const { return profCalls_; }
  int64_t ProfiledSteps() const { return profSteps_; }
  const DecodeGraphConfig& Config() const { return cfg_; }
  int64_t ScratchBytes() const { return int64_t(scratch_.size()); }

 private:
  void Validate(const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables, int64_t maxBlocks,
                const int32_t* contextLens, const int32_t* slotMapping, int64_t batch,
                const int32_t* qLens = nullptr, int64_t numSeqs = 0) const;
  void* Buf(int64_t off) { return base_ + off; }
  // The step's plan, from metadata Validate() accepted: one paged-attention
  // tiling per distinct window (windows_[i] is layer i's index into plans_),
  // one cache-write tiling. Reused by every layer of the step.
  void Plan(const int32_t* contextLens, int64_t maxBlocks, int64_t rows, const int32_t* qLens, int64_t numSeqs);
  // Step's body over metadata already validated (Step and StepGreedy check it first).
  void Run(const int32_t* tokenIds, const int32_t* positions, const int32_t* blockTables, int64_t maxBlocks,
           const int32_t* contextLens, const int32_t* slotMapping, int64_t batch, void* logits, int32_t* argmaxOut,
           const int32_t* qLens = nullptr, int64_t numSeqs = 0);

  // A launch's segment, with its rows4 pieces where there are some.
  struct Rows4Span {
    int64_t first = 0, count = 0;  // in rows4Pieces_
  };
  LinearSegment Segment(const void* weight, const void* bias, void* out, int64_t n, const Rows4Span& span) const;
  enum { kQ, kK, kV, kO, kGate, kUp, kDown, kProjections };
  const std::array<Rows4Span, kProjections>& LayerRows4(size_t layer) const {
    static const std::array<Rows4Span, kProjections> none{};
    return layer < layerRows4_.size() ? layerRows4_[layer] : none;
  }

  DecodeGraphConfig cfg_;
  std::vector<DecodeLayer> layers_;
  const void* embed_;
  const void* finalNorm_;
  const void* lmHead_;
  QuantRef embedQ_, headQ_;
  const void* cos_;
  const void* sin_;
  AscendC::SocInfo soc_;
  // Scratch: one 64-byte aligned arena carved at build time.
  std::vector<uint8_t> scratch_;
  uint8_t* base_ = nullptr;
  int64_t offX_ = 0, offH_ = 0, offQ_ = 0, offK_ = 0, offV_ = 0, offAttn_ = 0, offAct_ = 0, offCos_ = 0, offSin_ = 0;
  std::vector<int64_t> distinctWindows_;   // the sliding windows in use, each once
  std::vector<size_t> windowOf_;           // per layer: its index into distinctWindows_ / attnPlans_
  std::vector<PagedAttentionTilingData> attnPlans_;
  ReshapeAndCacheTilingData cachePlan_;
  AllReduceFn allReduce_;
  // The rows4 streams (PlanRows4Streams): every piece, each segment's in row order; where each is packed from.
  std::vector<Rows4Piece> rows4Pieces_;
  struct Rows4Source {
    const void* weight;
    int64_t k, offset;
  };
  std::vector<Rows4Source> rows4Sources_;
  std::vector<std::array<Rows4Span, kProjections>> layerRows4_;
  Rows4Span headRows4_;
  int64_t rows4Bytes_ = 0;
  bool profiling_ = false;
  std::array<int64_t, NODE_COUNT> profNs_{}, profCalls_{};
  int64_t profSteps_ = 0;
};

}  // namespace atb
