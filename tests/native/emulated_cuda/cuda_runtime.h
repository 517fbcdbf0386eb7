// Just enough of the CUDA runtime for the header-only kernels and their launchers to compile and
// run as host C++, for the emulators (tests/native/*_emulator.cpp).  A launch runs its grid on the
// calling thread, one block after another, each block's threads as fibers (ucontext) that change
// hands only where a thread waits (__syncthreads and __syncthreads_or, __syncwarp, a shuffle) or
// ends, taken in the order the emulator sets: first to last, last to first, or shuffled.  A result
// that depends on the order of two threads' accesses between barriers then differs between orders.
// What a launch would be refused for on a GPU (a block of more than 1024 threads, grid axes past their
// limits, more than 48 KB of dynamic shared memory), a barrier that cannot be met (a lane of the
// mask gone, or threads that wait at different barriers), a lane outside its own mask and a
// thread that ends before a __syncthreads the others reach (the kernels keep every thread to
// their barriers) are errors the launch returns, each with its reason (emulated::error()).
// Device-only code (__CUDA_ARCH__) is not compiled: the emulators check the kernels' logic, not
// the device's instructions.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __shared__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline thread_local dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim, gridDim;

struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorInvalidConfiguration = 9;
constexpr cudaError_t cudaErrorLaunchFailure = 719;
using cudaStream_t = void*;
constexpr int cudaLaunchAttributeProgrammaticStreamSerialization = 1;
struct cudaLaunchAttributeValue {
  int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
  int id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};

namespace emulated {

// The order in which a block's ready threads run, from one wait to the next.
enum class Order { kFirstToLast = 0, kLastToFirst = 1, kShuffled = 2 };

// A launch as the kernel saw it, for the tests to compare with the plan.
struct Launch {
  dim3 grid, block;
  size_t smem;
  bool pdl;
};

// The dynamic shared memory a block sees (`extern __shared__`: the emulator defines the array the
// kernels' declaration names, in the kernels' namespace, as this).  Filled with NaN before each block.
constexpr size_t kSharedBytes = 48 * 1024;

struct State {
  Order order = Order::kFirstToLast;
  uint32_t seed = 0;
  std::vector<Launch> launches;
  std::string error;  // why the last failed launch failed
  void* shared = nullptr;
};
inline State& state() {
  static thread_local State s;
  return s;
}
inline const std::string& error() { return state().error; }

namespace detail {

struct Fiber {
  ucontext_t ctx;
  dim3 tid;
  unsigned linear;
  enum { kReady, kWaiting, kDone } status = kReady;
  bool block_wide = false;  // waits at __syncthreads (else at a warp barrier of `mask`)
  unsigned mask = 0;
};

struct Block {
  std::function<void()> body;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  std::vector<float> lanes;  // a shuffle's values, one a thread
  std::vector<char> flags;   // a __syncthreads_or's predicates, one a thread
  std::string error;
};
inline thread_local Block* t_block = nullptr;

constexpr size_t kStackBytes = 128 * 1024;

inline void entry() {
  Block& b = *t_block;
  b.body();
  b.current->status = Fiber::kDone;  // uc_link returns to the scheduler
}

inline void wait(bool block_wide, unsigned mask) {
  Block& b = *t_block;
  Fiber& f = *b.current;
  f.status = Fiber::kWaiting, f.block_wide = block_wide, f.mask = mask;
  swapcontext(&f.ctx, &b.scheduler);
}

// Releases the barriers every thread they need has reached; false (with b.error) for one that
// never can be.
inline bool release(Block& b) {
  bool any_block = false, all_block = true, any_done = false;
  for (const Fiber& f : b.fibers) {
    any_done |= f.status == Fiber::kDone;
    if (f.status == Fiber::kDone) continue;
    const bool at_block = f.status == Fiber::kWaiting && f.block_wide;
    any_block |= at_block;
    all_block &= at_block;
  }
  if (any_block && any_done) {  // the kernels' rule (a GPU might let it pass): none leaves before one
    b.error = "a thread ended before a __syncthreads its block's other threads wait at";
    return false;
  }
  if (any_block && all_block) {
    for (Fiber& f : b.fibers)
      if (f.status == Fiber::kWaiting) f.status = Fiber::kReady;
    return true;
  }
  for (Fiber& f : b.fibers) {
    if (f.status != Fiber::kWaiting || f.block_wide) continue;
    const unsigned warp = f.linear / 32, lane = f.linear % 32;
    if (!(f.mask >> lane & 1u)) {
      b.error = "a thread waits at a warp barrier whose mask leaves out its own lane";
      return false;
    }
    bool met = true;
    for (unsigned l = 0; l < 32 && met; ++l) {
      if (!(f.mask >> l & 1u)) continue;
      const unsigned t = warp * 32 + l;
      if (t >= b.fibers.size()) {
        b.error = "a warp barrier's mask names a lane past the block's threads";
        return false;
      }
      const Fiber& g = b.fibers[t];
      if (g.status == Fiber::kDone) {
        b.error = "a warp barrier's mask names a lane that has ended";
        return false;
      }
      met = g.status == Fiber::kWaiting && !g.block_wide && g.mask == f.mask;
    }
    if (met)
      for (unsigned l = 0; l < 32; ++l)
        if (f.mask >> l & 1u) b.fibers[warp * 32 + l].status = Fiber::kReady;
  }
  return true;
}

inline bool run_block(Block& b, const dim3& block, char* stacks, std::mt19937& rng) {
  const unsigned n = block.x * block.y * block.z;
  b.fibers.assign(n, Fiber{});
  b.lanes.assign(n, 0.0f);
  b.flags.assign(n, 0);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.tid = dim3(i % block.x, i / block.x % block.y, i / (block.x * block.y));
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks + static_cast<size_t>(i) * kStackBytes;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, entry, 0);
  }
  std::vector<unsigned> order(n);
  for (unsigned i = 0; i < n; ++i) order[i] = i;
  const Order how = state().order;
  if (how == Order::kLastToFirst) std::reverse(order.begin(), order.end());
  for (;;) {
    if (how == Order::kShuffled) std::shuffle(order.begin(), order.end(), rng);
    for (unsigned i : order) {
      Fiber& f = b.fibers[i];
      if (f.status != Fiber::kReady) continue;
      threadIdx = f.tid;
      b.current = &f;
      swapcontext(&b.scheduler, &f.ctx);
    }
    if (!b.error.empty()) return false;  // a shuffle's
    if (std::all_of(b.fibers.begin(), b.fibers.end(), [](const Fiber& f) { return f.status == Fiber::kDone; }))
      return true;
    if (!release(b)) return false;
    if (std::none_of(b.fibers.begin(), b.fibers.end(), [](const Fiber& f) { return f.status == Fiber::kReady; })) {
      b.error =
          "threads wait at barriers that cannot all be met (__syncthreads and a warp's, or warps' of other masks)";
      return false;
    }
  }
}

}  // namespace detail

// Runs `kernel` over `config`'s grid (the body calls the kernel with its arguments).
inline cudaError_t launch(const cudaLaunchConfig_t& config, std::function<void()> body) {
  State& s = state();
  const dim3 g = config.gridDim, bd = config.blockDim;
  const unsigned long long threads = 1ull * bd.x * bd.y * bd.z;
  if (threads == 0 || threads > 1024 || bd.z > 64 || g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u ||
      g.y > 65535 || g.z > 65535) {
    s.error = "a launch no GPU takes: block " + std::to_string(bd.x) + "x" + std::to_string(bd.y) + "x" +
              std::to_string(bd.z) + ", grid " + std::to_string(g.x) + "x" + std::to_string(g.y) + "x" +
              std::to_string(g.z);
    return cudaErrorInvalidConfiguration;
  }
  if (config.dynamicSmemBytes > kSharedBytes) {
    s.error = "dynamic shared memory past 48 KB without the opt-in: " + std::to_string(config.dynamicSmemBytes);
    return cudaErrorInvalidValue;
  }
  bool pdl = false;
  for (unsigned i = 0; i < config.numAttrs; ++i)
    pdl |= config.attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
           config.attrs[i].val.programmaticStreamSerializationAllowed;
  s.launches.push_back(Launch{g, bd, config.dynamicSmemBytes, pdl});
  // Stacks reserved, not committed: a thread touches a few pages of its own.
  const size_t bytes = threads * detail::kStackBytes;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    s.error = "no memory for the threads' stacks";
    return cudaErrorLaunchFailure;
  }
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { munmap(p, n); }
  } unmap{mem, bytes};
  std::mt19937 rng(s.seed);
  detail::Block b;
  b.body = std::move(body);
  detail::t_block = &b;
  blockDim = bd, gridDim = g;
  cudaError_t result = cudaSuccess;
  for (unsigned z = 0; z < g.z && result == cudaSuccess; ++z)
    for (unsigned y = 0; y < g.y && result == cudaSuccess; ++y)
      for (unsigned x = 0; x < g.x && result == cudaSuccess; ++x) {
        blockIdx = dim3(x, y, z);
        if (s.shared != nullptr) {
          float* f = static_cast<float*>(s.shared);
          std::fill(f, f + kSharedBytes / sizeof(float), __builtin_nanf(""));
        }
        if (!detail::run_block(b, bd, static_cast<char*>(mem), rng)) {
          s.error = b.error + " (block " + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + ")";
          result = cudaErrorLaunchFailure;
        }
      }
  detail::t_block = nullptr;
  return result;
}

}  // namespace emulated

template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...), const Args&... args) {
  return emulated::launch(*config, [&] { kernel(args...); });
}

inline void __syncthreads() { emulated::detail::wait(true, 0); }

// A block barrier that also returns whether any thread of the block passed a nonzero predicate:
// each posts its own, all meet, each reads every one, all meet again before a slot may be reused.
inline int __syncthreads_or(int predicate) {
  auto& b = *emulated::detail::t_block;
  b.flags[b.current->linear] = predicate != 0;
  __syncthreads();
  int any = 0;
  for (const char f : b.flags) any |= f;
  __syncthreads();
  return any;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { emulated::detail::wait(false, mask); }

inline int __ffs(int x) { return __builtin_ffs(x); }

// The emulated threads change hands only where one waits, so an atomic is a plain read-modify-write.
inline unsigned atomicMax(unsigned* address, unsigned v) {
  const unsigned old = *address;
  if (v > old) *address = v;
  return old;
}

// The value of lane (this lane ^ offset) of the mask: every lane of it posts its own, all meet,
// each takes its partner's, all meet again before a slot may be reused.
inline float __shfl_xor_sync(unsigned mask, float v, int offset) {
  auto& b = *emulated::detail::t_block;
  const unsigned me = b.current->linear, partner = (me & ~31u) | ((me & 31u) ^ static_cast<unsigned>(offset));
  if (!(mask >> (partner & 31u) & 1u)) b.error = "a shuffle from a lane outside its mask";
  b.lanes[me] = v;
  __syncwarp(mask);
  const float other = b.lanes[partner];
  __syncwarp(mask);
  return other;
}
// The same of an unsigned value (CUDA's overload), its bits carried through the float slots.
inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int offset) {
  float f;
  std::memcpy(&f, &v, sizeof f);
  f = __shfl_xor_sync(mask, f, offset);
  std::memcpy(&v, &f, sizeof v);
  return v;
}
