// Kernel launch on the CPU: blockDim logical AI cores scheduled over a
// persistent thread pool. Each executing thread owns one Unified Buffer arena
// (64-byte aligned, allocated once); a block sees GetBlockIdx()/GetBlockNum()
// exactly as on the NPU. The caller's thread works too, so a launch with
// blockDim 1 (or one thread) runs inline with no hand-off at all.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace AscendC {

int64_t GetBlockIdx();
int64_t GetBlockNum();

// Thread pool size (the caller's thread included). Default: what the Python
// side passes at import (torch.get_num_threads()).
int64_t GetNumThreads();
void SetNumThreads(int64_t n);

// How launches get their threads: "openmp" runs them on the OpenMP team torch
// already loaded (one set of threads for torch ops and kernels), "pool" on a
// private persistent pool, "auto" (default) picks openmp when it is there.
void SetThreading(const std::string& backend);
std::string Threading();   // the backend in use, in words

// While one lives, "auto" runs this thread's launches on the private pool, not on the OpenMP team: for a
// run of launches with no torch op between them (a decode graph step), where nothing else wants the
// cores and the pool's workers stay awake from one launch to the next. libgomp's team is the better
// neighbour of torch ops (the patched model), but between a graph step's ~240 launches it costs more,
// most of all when the caller is not the main thread (the server's engine thread). Zen 4, 2 threads,
// SmolLM2 bf16 engine decode tok/s, medians of 4 interleaved runs, OpenMP -> pool: batch 1 main thread
// 100.7 -> 105.8, worker thread 73.7 -> 106.7; batch 16 main 607 -> 641, worker 536 -> 592. The patched
// model (torch ops between kernels) measured the other way (decode 40.5 -> 36.0), so it stays on OpenMP.
// The same preference, set for the calling thread from Python (the engine's steps off the main thread);
// returns the previous setting.
bool SetThreadPrefersPool(bool prefer);

class PoolLaunchScope {
 public:
  PoolLaunchScope();
  ~PoolLaunchScope();
  PoolLaunchScope(const PoolLaunchScope&) = delete;
  PoolLaunchScope& operator=(const PoolLaunchScope&) = delete;

 private:
  bool saved_;
};

namespace detail {
struct UbArena {
  uint8_t* base = nullptr;
  int64_t capacity = 0;   // bytes allocated for this thread
  int64_t limit = 0;      // the launching SoC's UB size
  int64_t used = 0;       // bytes carved by the current block's TPipe(s)
};
UbArena& CurrentUb();

using BlockFn = void (*)(void* ctx);
// Runs fn(ctx) once per block index in [0, blockDim), ubSize bytes of UB per core.
void LaunchBlocks(int64_t blockDim, int64_t ubSize, BlockFn fn, void* ctx);
}  // namespace detail

// KernelLaunch(blockDim, ubSize, kernel, args...): calls kernel(args...) on every
// block. Exceptions thrown by a block are rethrown to the caller after all
// blocks finished (hardware would abort the launch; we report it).
template <typename Kernel, typename... Args>
void KernelLaunch(int64_t blockDim, int64_t ubSize, Kernel&& kernel, Args&&... args) {
  auto call = [&]() { kernel(args...); };
  using Call = decltype(call);
  detail::LaunchBlocks(blockDim, ubSize, [](void* c) { (*static_cast<Call*>(c))(); }, &call);
}

}  // namespace AscendC
