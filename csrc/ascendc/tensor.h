// AscendC memory objects on the CPU.
//   GlobalTensor<T>  a view of global memory (the tensors Python passed in).
//   LocalTensor<T>   a slice of this core's Unified Buffer.
//   TPipe            carves the UB into queue/buffer slots; carving past the
//                    SoC's UB size is an error, as the hardware would fail.
//   TQue<pos,depth>  AllocTensor/EnQue/DeQue/FreeTensor over `num` slots.
//                    On the CPU the copy engine and vector unit are the same
//                    thread, so queues are synchronous hand-offs; they keep the
//                    kernels' structure (and their UB budget) that of the NPU.
//   TBuf<VECCALC>    scratch UB with Get<T>().
//   DataCopy         GM <-> UB copies of whole 32-byte blocks; DataCopyPad for
//                    ragged lengths and strided multi-row copies.
#pragma once
#include <cstdint>
#include <cstring>

#include "dtype.h"
#include "error.h"
#include "runtime.h"

namespace AscendC {

using GM_ADDR = uint8_t*;
// A host pointer as the kernels' global-memory address.
inline GM_ADDR GmAddr(const void* p) { return reinterpret_cast<GM_ADDR>(const_cast<void*>(p)); }
constexpr int32_t BUFFER_NUM = 2;   // double buffering (ping-pong)
constexpr int64_t ONE_BLK_SIZE = 32;  // bytes moved per DataCopy block
constexpr int64_t UB_ALIGN = 64;      // UB slot alignment (cache line)

inline int64_t AlignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, B1, A2, B2, CO1, CO2 };
using QuePosition = TPosition;

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(T* addr, int64_t size = -1) { addr_ = addr; size_ = size; }
  void SetGlobalBuffer(GM_ADDR addr, int64_t size = -1) { SetGlobalBuffer(reinterpret_cast<T*>(addr), size); }
  T* GetPhyAddr() const { return addr_; }
  T* GetPhyAddr(int64_t off) const { return addr_ + off; }
  int64_t GetSize() const { return size_; }
  GlobalTensor operator[](int64_t off) const {
    GlobalTensor g;
    g.addr_ = addr_ + off;
    g.size_ = size_ < 0 ? -1 : size_ - off;
    return g;
  }
  T GetValue(int64_t i) const { return addr_[i]; }
  void SetValue(int64_t i, T v) { addr_[i] = v; }

 private:
  T* addr_ = nullptr;
  int64_t size_ = -1;
};

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(T* addr, int64_t size) : addr_(addr), size_(size) {}
  T* GetPhyAddr() const { return addr_; }
  T* GetPhyAddr(int64_t off) const { return addr_ + off; }
  int64_t GetSize() const { return size_; }
  LocalTensor operator[](int64_t off) const { return LocalTensor(addr_ + off, size_ - off); }
  T GetValue(int64_t i) const { return addr_[i]; }
  void SetValue(int64_t i, T v) { addr_[i] = v; }
  T& operator()(int64_t i) const { return addr_[i]; }
  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    return LocalTensor<U>(reinterpret_cast<U*>(addr_), size_ * int64_t(sizeof(T)) / int64_t(sizeof(U)));
  }

 private:
  T* addr_ = nullptr;
  int64_t size_ = 0;
};

namespace detail {
// One carved UB region: `num` slots of `bytes` each.
struct UbRegion {
  uint8_t* base = nullptr;
  int64_t slotBytes = 0;
  int32_t num = 0;
};
}  // namespace detail

template <TPosition pos, int32_t depth>
class TQue {
 public:
  template <typename T>
  LocalTensor<T> AllocTensor() {
    ATB_CHECK(allocated_ < region_.num, "TQue::AllocTensor: all ", region_.num,
              " slots are in use (FreeTensor missing or InitBuffer num too small)");
    uint8_t* p = region_.base + region_.slotBytes * (next_ % region_.num);
    ++next_;
    ++allocated_;
    return LocalTensor<T>(reinterpret_cast<T*>(p), region_.slotBytes / int64_t(sizeof(T)));
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) { queued_ = t.GetPhyAddr(); }
  template <typename T>
  LocalTensor<T> DeQue() {
    return LocalTensor<T>(reinterpret_cast<T*>(queued_), region_.slotBytes / int64_t(sizeof(T)));
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>&) { --allocated_; }

  detail::UbRegion region_;

 private:
  void* queued_ = nullptr;
  int32_t next_ = 0;
  int32_t allocated_ = 0;
};

template <TPosition pos>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() const { return LocalTensor<T>(reinterpret_cast<T*>(region_.base), region_.slotBytes / int64_t(sizeof(T))); }
  template <typename T>
  LocalTensor<T> Get(int64_t len) const {
    ATB_CHECK(len * int64_t(sizeof(T)) <= region_.slotBytes, "TBuf::Get: ", len, " elements exceed the buffer's ",
              region_.slotBytes, " bytes");
    return LocalTensor<T>(reinterpret_cast<T*>(region_.base), len);
  }

  detail::UbRegion region_;
};

class TPipe {
 public:
  TPipe() : start_(detail::CurrentUb().used) {}
  ~TPipe() { detail::CurrentUb().used = start_; }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;

  template <TPosition pos, int32_t depth>
  void InitBuffer(TQue<pos, depth>& que, int32_t num, int64_t bytes) {
    que.region_ = Carve(num, bytes);
  }
  template <TPosition pos>
  void InitBuffer(TBuf<pos>& buf, int64_t bytes) {
    buf.region_ = Carve(1, bytes);
  }
  void Reset() { detail::CurrentUb().used = start_; }

 private:
  detail::UbRegion Carve(int32_t num, int64_t bytes) {
    auto& ub = detail::CurrentUb();
    int64_t slot = AlignUp(bytes, UB_ALIGN);
    int64_t need = slot * num;
    ATB_CHECK(num >= 1 && bytes > 0, "TPipe::InitBuffer: bad num=", num, " bytes=", bytes);
    ATB_CHECK(ub.used + need <= ub.limit, "TPipe::InitBuffer: UB overflow: ", ub.used, " bytes already carved + ",
              need, " requested > ", ub.limit, " bytes of UB on this SoC");
    detail::UbRegion r{ub.base + ub.used, slot, num};
    ub.used += need;
    return r;
  }
  int64_t start_;
};

// GM -> UB and UB -> GM: `count` elements, a whole number of 32-byte blocks.
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, int64_t count) {
  std::memcpy(dst.GetPhyAddr(), src.GetPhyAddr(), size_t(count) * sizeof(T));
}
template <typename T>
inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, int64_t count) {
  std::memcpy(dst.GetPhyAddr(), src.GetPhyAddr(), size_t(count) * sizeof(T));
}
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, int64_t count) {
  std::memcpy(dst.GetPhyAddr(), src.GetPhyAddr(), size_t(count) * sizeof(T));
}

// blockCount rows of blockLen bytes; strides are the gaps (bytes) between rows
// on the GM side, UB rows are packed and padded up to 32 bytes as on hardware.
struct DataCopyParams {
  int64_t blockCount = 1;
  int64_t blockLen = 0;   // bytes per row
  int64_t srcStride = 0;  // bytes skipped after each source row
  int64_t dstStride = 0;  // bytes skipped after each destination row
};

template <typename T>
inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyParams& p) {
  auto* d = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
  auto* s = reinterpret_cast<const uint8_t*>(src.GetPhyAddr());
  int64_t ubRow = AlignUp(p.blockLen, ONE_BLK_SIZE) + p.dstStride;
  for (int64_t r = 0; r < p.blockCount; ++r) std::memcpy(d + r * ubRow, s + r * (p.blockLen + p.srcStride), size_t(p.blockLen));
}
template <typename T>
inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyParams& p) {
  auto* d = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
  auto* s = reinterpret_cast<const uint8_t*>(src.GetPhyAddr());
  int64_t ubRow = AlignUp(p.blockLen, ONE_BLK_SIZE) + p.srcStride;
  for (int64_t r = 0; r < p.blockCount; ++r) std::memcpy(d + r * (p.blockLen + p.dstStride), s + r * ubRow, size_t(p.blockLen));
}

}  // namespace AscendC
