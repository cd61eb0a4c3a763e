#include "runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <exception>
#include <mutex>
#include <new>
#include <pthread.h>
#include <thread>
#include <vector>

#include "error.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ATB_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define ATB_CPU_RELAX() asm volatile("yield")
#else
#define ATB_CPU_RELAX() ((void)0)
#endif

namespace AscendC {
namespace detail {
namespace {

// Largest UB any SoC in the table (or host) may ask for; one arena per thread.
constexpr int64_t kArenaBytes = 1 << 20;

thread_local int64_t tBlockIdx = 0;
thread_local int64_t tBlockNum = 1;
thread_local UbArena tArena;
// True on pool workers and inside a launch: a nested launch then runs inline.
thread_local bool tInLaunch = false;

void EnsureArena(int64_t ubSize) {
  ATB_CHECK(ubSize > 0 && ubSize <= kArenaBytes, "KernelLaunch: UB size ", ubSize,
            " bytes is outside (0, ", kArenaBytes, "]");
  if (!tArena.base) {
    tArena.base = static_cast<uint8_t*>(std::aligned_alloc(64, kArenaBytes));
    ATB_CHECK(tArena.base != nullptr, "KernelLaunch: cannot allocate the UB arena");
    tArena.capacity = kArenaBytes;
  }
  tArena.limit = ubSize;
  tArena.used = 0;
}

// A decode step launches a few hundred kernels back to back, microseconds apart:
// workers spin this long for the next launch before sleeping, so they are hot
// for the next kernel but never steal a core from torch for longer than this.
constexpr auto kSpinWindow = std::chrono::microseconds(200);

// One launch's blocks, claimed one at a time by whichever threads run the
// launch (pool workers or OpenMP team members, the caller included), so a late
// or preempted thread only costs the blocks it did not take. The first error
// stops the hand-out and is rethrown to the caller.
struct BlockQueue {
  BlockFn fn = nullptr;
  void* ctx = nullptr;
  int64_t ubSize = 0, blockDim = 0;
  std::atomic<int64_t> next{0};
  std::mutex errMu;
  std::exception_ptr error;

  void Reset(int64_t dim, int64_t ub, BlockFn f, void* c) {
    fn = f;
    ctx = c;
    ubSize = ub;
    blockDim = dim;
    error = nullptr;
    next.store(0, std::memory_order_relaxed);
  }
  void Run() {
    try {
      EnsureArena(ubSize);
      for (;;) {
        int64_t b = next.fetch_add(1, std::memory_order_relaxed);
        if (b >= blockDim) break;
        tBlockIdx = b;
        tBlockNum = blockDim;
        tArena.used = 0;
        fn(ctx);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(errMu);
      if (!error) error = std::current_exception();
      next.store(blockDim);  // stop handing out blocks
    }
    tBlockIdx = 0;
    tBlockNum = 1;
  }
  void RethrowError() {
    if (error) std::rethrow_exception(error);
  }
};

class ThreadPool {
 public:
  explicit ThreadPool(int64_t n) : numThreads_(n < 1 ? 1 : n) {
    for (int64_t i = 1; i < numThreads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int64_t Size() const { return numThreads_; }

  void Launch(int64_t blockDim, int64_t ubSize, BlockFn fn, void* ctx) {
    queue_.Reset(blockDim, ubSize, fn, ctx);
    int64_t helpers = std::min<int64_t>(numThreads_ - 1, blockDim - 1);
    active_.store(helpers, std::memory_order_relaxed);
    wanted_.store(helpers, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_seq_cst);  // Dekker pair with sleepers_
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    queue_.Run();
    // Every block is done or running. Helper slots no worker has claimed yet are
    // withdrawn, so the launch does not wait for a sleeping or preempted thread
    // to wake only to find nothing left (milliseconds on a loaded machine); a
    // late worker's claim then fails and it goes back to waiting.
    int64_t unclaimed = wanted_.exchange(0, std::memory_order_acq_rel);
    if (unclaimed > 0) active_.fetch_sub(unclaimed, std::memory_order_acq_rel);
    while (active_.load(std::memory_order_acquire) > 0) ATB_CPU_RELAX();
    queue_.RethrowError();
  }

 private:
  void WorkerLoop() {
    tInLaunch = true;
    // Generation 0 is the pool's birth: a launch may bump it before this thread
    // first runs, and that launch must not be missed.
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      uint64_t g;
      int spins = 0;
      while ((g = generation_.load(std::memory_order_acquire)) == seen) {
        ATB_CPU_RELAX();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpinWindow) {
          std::unique_lock<std::mutex> lk(mu_);
          sleepers_.fetch_add(1);
          cv_.wait(lk, [&] { return generation_.load() != seen; });
          sleepers_.fetch_sub(1);
        }
      }
      seen = g;
      if (stop_) return;
      // Only as many workers as there are spare blocks join a launch.
      int64_t w = wanted_.fetch_sub(1, std::memory_order_acq_rel);
      if (w <= 0) continue;
      queue_.Run();
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int64_t numThreads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleepers_{0}, active_{0}, wanted_{0};
  bool stop_ = false;
  BlockQueue queue_;
};

std::mutex gPoolMu;
ThreadPool* gPool = nullptr;
int64_t gNumThreads = 1;

// ---- the OpenMP backend: the host's OpenMP team, shared with torch -----------------------------
// torch runs its own ops on an OpenMP team (libgomp.so.1, or Intel's runtime, which exports the
// same GOMP entry points). A second, private pool on the same cores fights it: after every torch op
// its workers spin on the cores our helpers need, and ours spin on the cores torch's team needs, so
// launches lose their helpers and torch ops wait for a preempted team member. Driving launches
// through the runtime torch already loaded gives one set of threads for both. The runtime is looked
// up (never loaded) at first use; without one the private pool serves.
using GompParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);
struct OmpApi {
  GompParallelFn parallel = nullptr;
  const char* library = nullptr;
};

OmpApi FindLoadedOpenMp() {
  OmpApi api;
  for (const char* lib : {"libgomp.so.1", "libiomp5.so", "libomp.so"}) {
    void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (!h) continue;
    api.parallel = reinterpret_cast<GompParallelFn>(dlsym(h, "GOMP_parallel"));
    if (api.parallel) {
      api.library = lib;
      return api;
    }
  }
  return api;
}

// Probed once, at the first launch (atb imports torch before it launches anything).
const OmpApi& Omp() {
  static const OmpApi api = FindLoadedOpenMp();
  return api;
}

enum class Backend { kAuto, kOpenMp, kPool };
std::atomic<Backend> gBackend{Backend::kAuto};

thread_local bool tPreferPool = false;  // a PoolLaunchScope is alive on this thread

bool UseOpenMp() {
  Backend b = gBackend.load(std::memory_order_relaxed);
  return b != Backend::kPool && !(b == Backend::kAuto && tPreferPool) && Omp().parallel;
}

// The parallel region's body, run by every team member (the caller included).
void OmpBody(void* queue) {
  bool wasIn = tInLaunch;
  tInLaunch = true;  // a launch from inside a block runs inline
  static_cast<BlockQueue*>(queue)->Run();
  tInLaunch = wasIn;
}

void LaunchOpenMp(int64_t blockDim, int64_t ubSize, BlockFn fn, void* ctx) {
  BlockQueue queue;
  queue.Reset(blockDim, ubSize, fn, ctx);
  unsigned team = static_cast<unsigned>(std::min<int64_t>(gNumThreads, blockDim));
  Omp().parallel(OmpBody, &queue, team, 0);
  queue.RethrowError();
}

// A forked child has the pool object but none of its threads, and the pool's mutex in whatever state
// they left it: replacing the pool (SetNumThreads deletes it, joining threads that do not exist) or
// launching on it waits for ever. So the child forgets the parent's pool (its memory is left as it is)
// and builds its own at its first launch. The fuzz test's children (set_num_threads after a fork that
// followed decode graph steps, which run on the pool under "auto") hung without this.
void ForgetPoolInChild() {
  gPool = nullptr;
  new (&gPoolMu) std::mutex();
}

void LaunchOnPool(int64_t blockDim, int64_t ubSize, BlockFn fn, void* ctx) {
  static const bool registered = pthread_atfork(nullptr, nullptr, ForgetPoolInChild) == 0;
  (void)registered;
  std::lock_guard<std::mutex> lk(gPoolMu);  // one launch at a time (uncontended in practice)
  if (!gPool || gPool->Size() != gNumThreads) {
    delete gPool;
    gPool = new ThreadPool(gNumThreads);
  }
  gPool->Launch(blockDim, ubSize, fn, ctx);
}

}  // namespace

UbArena& CurrentUb() { return tArena; }

void LaunchBlocks(int64_t blockDim, int64_t ubSize, BlockFn fn, void* ctx) {
  ATB_CHECK(blockDim >= 1, "KernelLaunch: blockDim must be >= 1, got ", blockDim);
  if (blockDim == 1 || gNumThreads == 1 || tInLaunch) {
    // Inline: no hand-off. Also the path for a launch issued from inside a block.
    EnsureArena(ubSize);
    int64_t savedIdx = tBlockIdx, savedNum = tBlockNum;
    for (int64_t b = 0; b < blockDim; ++b) {
      tBlockIdx = b;
      tBlockNum = blockDim;
      tArena.used = 0;
      fn(ctx);
    }
    tBlockIdx = savedIdx;
    tBlockNum = savedNum;
    return;
  }
  tInLaunch = true;
  try {
    if (UseOpenMp()) {
      LaunchOpenMp(blockDim, ubSize, fn, ctx);
    } else {
      LaunchOnPool(blockDim, ubSize, fn, ctx);
    }
  } catch (...) {
    tInLaunch = false;
    throw;
  }
  tInLaunch = false;
}

}  // namespace detail

int64_t GetBlockIdx() { return detail::tBlockIdx; }
int64_t GetBlockNum() { return detail::tBlockNum; }
int64_t GetNumThreads() { return detail::gNumThreads; }

void SetThreading(const std::string& backend) {
  using detail::Backend;
  if (backend == "auto") {
    detail::gBackend.store(Backend::kAuto);
  } else if (backend == "pool") {
    detail::gBackend.store(Backend::kPool);
  } else if (backend == "openmp") {
    ATB_CHECK(detail::Omp().parallel != nullptr,
              "set_threading: 'openmp' needs an OpenMP runtime already loaded by torch "
              "(libgomp.so.1, libiomp5.so or libomp.so); none is");
    detail::gBackend.store(Backend::kOpenMp);
  } else {
    ATB_CHECK(false, "set_threading: backend must be 'auto', 'openmp' or 'pool', got '", backend, "'");
  }
}

bool SetThreadPrefersPool(bool prefer) {
  bool saved = detail::tPreferPool;
  detail::tPreferPool = prefer;
  return saved;
}

PoolLaunchScope::PoolLaunchScope() : saved_(detail::tPreferPool) { detail::tPreferPool = true; }
PoolLaunchScope::~PoolLaunchScope() { detail::tPreferPool = saved_; }

std::string Threading() {
  if (detail::UseOpenMp())
    return std::string("openmp (") + detail::Omp().library + ", shared with torch" +
           (detail::gBackend.load() == detail::Backend::kAuto
                ? "; decode graph steps and engine steps off the main thread on the private pool)"
                : ")");
  return "pool (private threads)";
}
void SetNumThreads(int64_t n) {
  ATB_CHECK(n >= 1 && n <= 1024, "set_num_threads: n must be in [1, 1024], got ", n);
  std::lock_guard<std::mutex> lk(detail::gPoolMu);
  detail::gNumThreads = n;
  delete detail::gPool;  // recreated lazily with the new size
  detail::gPool = nullptr;
}

}  // namespace AscendC
