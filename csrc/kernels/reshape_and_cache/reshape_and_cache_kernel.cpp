// ReshapeAndCache: scatter new K/V rows into the paged cache at slot_mapping.
// A pure data-movement kernel (as on the NPU, where it is MTE copies only):
// CopyIn brings a tile of tokens' K and V rows into UB, CopyOut writes each
// row to its cache slot; there is no vector compute stage.
#include <algorithm>

#include "ascendc/kernel_operator.h"
#include "reshape_and_cache_tiling.h"
#include "kernels/common/tiling_key.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelReshapeAndCache {
 public:
  void Init(GM_ADDR key, int64_t keyStride, GM_ADDR value, int64_t valueStride, GM_ADDR keyCache, GM_ADDR valueCache,
            const int32_t* slotMapping, const ReshapeAndCacheTilingData& t) {
    t_ = t;
    first_ = GetBlockIdx() * t.blockFactor;
    count_ = std::max<int64_t>(0, std::min(t.blockFactor, t.tokens - first_));
    keyStride_ = keyStride;
    valueStride_ = valueStride;
    kGm_.SetGlobalBuffer(reinterpret_cast<T*>(key));
    vGm_.SetGlobalBuffer(reinterpret_cast<T*>(value));
    kcGm_.SetGlobalBuffer(reinterpret_cast<T*>(keyCache));
    vcGm_.SetGlobalBuffer(reinterpret_cast<T*>(valueCache));
    slots_ = slotMapping;
    int64_t tileBytes = t.tokensPerLoop * t.rowElems * int64_t(sizeof(T));
    pipe_.InitBuffer(inK_, BUFFER_NUM, tileBytes);
    pipe_.InitBuffer(inV_, BUFFER_NUM, tileBytes);
  }

  void Process() {
    for (int64_t i = 0; i < count_; i += t_.tokensPerLoop) {
      int64_t n = std::min(t_.tokensPerLoop, count_ - i);
      CopyIn(first_ + i, n);
      CopyOut(first_ + i, n);
    }
  }

 private:
  // n token rows, strided in GM, packed in UB (rowElems * sizeof(T) bytes each).
  void CopyRows(TQue<QuePosition::VECIN, BUFFER_NUM>& q, const GlobalTensor<T>& src, int64_t stride, int64_t tok,
                int64_t n) {
    LocalTensor<T> x = q.template AllocTensor<T>();
    int64_t rowBytes = t_.rowElems * int64_t(sizeof(T));
    DataCopyParams p;
    p.blockCount = n;
    p.blockLen = rowBytes;
    p.srcStride = (stride - t_.rowElems) * int64_t(sizeof(T));
    p.dstStride = 0;
    if (rowBytes % ONE_BLK_SIZE == 0) {
      DataCopyPad(x, src[tok * stride], p);
    } else {  // UB rows stay packed so CopyOut can address row i at i * rowElems
      for (int64_t r = 0; r < n; ++r) DataCopy(x[r * t_.rowElems], src[(tok + r) * stride], t_.rowElems);
    }
    q.EnQue(x);
  }

  void CopyIn(int64_t tok, int64_t n) {
    CopyRows(inK_, kGm_, keyStride_, tok, n);
    CopyRows(inV_, vGm_, valueStride_, tok, n);
  }

  void CopyOut(int64_t tok, int64_t n) {
    LocalTensor<T> k = inK_.template DeQue<T>();
    LocalTensor<T> v = inV_.template DeQue<T>();
    for (int64_t r = 0; r < n; ++r) {
      int64_t slot = slots_[tok + r];
      if (slot < 0) continue;  // padding token
      DataCopy(kcGm_[slot * t_.rowElems], k[r * t_.rowElems], t_.rowElems);
      DataCopy(vcGm_[slot * t_.rowElems], v[r * t_.rowElems], t_.rowElems);
    }
    inK_.FreeTensor(k);
    inV_.FreeTensor(v);
  }

  ReshapeAndCacheTilingData t_;
  int64_t first_ = 0, count_ = 0, keyStride_ = 0, valueStride_ = 0;
  const int32_t* slots_ = nullptr;
  TPipe pipe_;
  TQue<QuePosition::VECIN, BUFFER_NUM> inK_, inV_;
  GlobalTensor<T> kGm_, vGm_, kcGm_, vcGm_;
};

template <typename T>
void RunReshapeAndCache(GM_ADDR key, int64_t keyStride, GM_ADDR value, int64_t valueStride, GM_ADDR keyCache,
                        GM_ADDR valueCache, const int32_t* slotMapping, const ReshapeAndCacheTilingData& t) {
  KernelReshapeAndCache<T> op;
  op.Init(key, keyStride, value, valueStride, keyCache, valueCache, slotMapping, t);
  op.Process();
}

}  // namespace

void ReshapeAndCache(const void* key, int64_t keyStride, const void* value, int64_t valueStride, void* keyCache,
                     void* valueCache, const int32_t* slotMapping, int64_t tokens, int64_t kvHeads, int64_t headDim,
                     int64_t numBlocks, int64_t blockSize, DataType dtype, const SocInfo& soc) {
  if (tokens == 0) return;
  ATB_CHECK(numBlocks >= 1 && blockSize >= 1, "reshape_and_cache: the cache must have >= 1 block of >= 1 slot, got ",
            numBlocks, " blocks of ", blockSize);
  ATB_CHECK(keyStride >= kvHeads * headDim && valueStride >= kvHeads * headDim, "reshape_and_cache: token strides (",
            keyStride, ", ", valueStride, ") must be >= kv_heads * head_dim = ", kvHeads * headDim);
  ReshapeAndCacheTilingData t = ReshapeAndCacheTiling(tokens, kvHeads, headDim, dtype, soc);
  // Every slot is checked before the launch: a bad call leaves the cache untouched.
  CheckSlotMapping(slotMapping, tokens, numBlocks, blockSize);
  ReshapeAndCacheRun(t, key, keyStride, value, valueStride, keyCache, valueCache, slotMapping, soc);
}

void ReshapeAndCacheRun(const ReshapeAndCacheTilingData& t, const void* key, int64_t keyStride, const void* value,
                        int64_t valueStride, void* keyCache, void* valueCache, const int32_t* slotMapping,
                        const SocInfo& soc) {
  auto kernel = [&]() {
    DispatchDtype(TilingKeyDtype(t.tilingKey), [&](auto tag) {
      RunReshapeAndCache<decltype(tag)>(GmAddr(key), keyStride, GmAddr(value), valueStride, GmAddr(keyCache),
                                        GmAddr(valueCache), slotMapping, t);
    });
  };
  KernelLaunch(t.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
