// The SIMT emulator's scheduler (see emu.h): one fiber per thread of a block, warp
// collectives and block barriers as rendezvous points, blocks run in order.
#include "emu.h"
// The Ids members share their names with the kernel-side macros.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

#include <ucontext.h>

// AddressSanitizer build (tests/gpu_emu.py under `make sanitize`): ASan tracks one stack per
// thread, so every switch between the scheduler's stack and a fiber's is announced to it
// (__sanitizer_start_switch_fiber before swapcontext, __sanitizer_finish_switch_fiber after);
// then reports inside a kernel unwind through the fiber's frames, and nothing mistakes a fiber
// stack for a corrupted thread stack.
#if defined(__SANITIZE_ADDRESS__)
#define MOELAB_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MOELAB_EMU_ASAN 1
#endif
#endif
#if MOELAB_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace moelab::emu {
namespace {

enum Wait : int { kRunning = 0, kAtWarp = 1, kAtBlock = 2 };
constexpr size_t kStack = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  Ids ids;
  int tid = 0, warp = 0, lane = 0;
  bool done = false;
  int wait = kRunning;
  uint64_t gen = 0;
  char* stack = nullptr;          // kStack bytes, from g_stacks
  void* fake_stack = nullptr;     // ASan's fake stack of this fiber while it is switched out
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<uint64_t> slots;      // [warps][2][kEmuWarp]
  ucontext_t sched{};                // zeroed: ASan's swapcontext reads its uc_stack
  const std::function<void()>* body = nullptr;
  // Dynamic shared memory: exactly the launch's bytes, in an allocation of its own, so that an
  // access past the end is a heap-buffer-overflow under ASan (zero-filled, as before).
  std::unique_ptr<char, decltype(&std::free)> smem{nullptr, &std::free};
};

Block* g_block = nullptr;
Fiber* g_cur = nullptr;
int g_error = 0;
std::vector<std::vector<char>> g_stacks;
#if MOELAB_EMU_ASAN
const void* g_sched_bottom = nullptr;   // the scheduler's stack, as ASan reports it to a fiber
size_t g_sched_size = 0;
#endif

// Scheduler -> fiber f (returns when f switches back).
void switch_to(Block& b, Fiber& f) {
#if MOELAB_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStack);
#endif
  swapcontext(&b.sched, &f.ctx);
#if MOELAB_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// Fiber f -> scheduler (returns when the scheduler resumes f; never when f has finished).
void switch_back(Fiber& f, bool finished) {
#if MOELAB_EMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &f.fake_stack, g_sched_bottom, g_sched_size);
#else
  (void)finished;
#endif
  swapcontext(&f.ctx, &g_block->sched);
#if MOELAB_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, &g_sched_bottom, &g_sched_size);
#endif
}

void entry() {
#if MOELAB_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
  (*g_block->body)();
  g_cur->done = true;
  switch_back(*g_cur, true);
}

uint64_t* warp_slots(Fiber& f, uint64_t gen) {
  return g_block->slots.data() + (size_t(f.warp) * 2 + (gen & 1)) * kEmuWarp;
}

unsigned seed() {
  const char* s = std::getenv("MOELAB_EMU_SEED");
  return s ? unsigned(std::strtoul(s, nullptr, 10)) : 12345u;
}

void run_block(const dim3& grid, const dim3& block, const dim3& bidx, size_t smem, const std::function<void()>& body,
               std::mt19937& rng) {
  const int n = int(block.x * block.y * block.z);
  const int warps = (n + kEmuWarp - 1) / kEmuWarp;
  Block b;
  b.fibers.resize(size_t(n));
  b.slots.assign(size_t(warps) * 2 * kEmuWarp, 0);
  b.body = &body;
  b.smem.reset(static_cast<char*>(std::calloc(smem, 1)));
  if (smem && !b.smem) throw std::bad_alloc();
  if (g_stacks.size() < size_t(n)) g_stacks.resize(size_t(n));
  for (int t = 0; t < n; ++t) {
    Fiber& f = b.fibers[size_t(t)];
    f.tid = t;
    f.warp = t / kEmuWarp;
    f.lane = t % kEmuWarp;
    f.ids.threadIdx = dim3(unsigned(t) % block.x, (unsigned(t) / block.x) % block.y, unsigned(t) / (block.x * block.y));
    f.ids.blockIdx = bidx;
    f.ids.blockDim = block;
    f.ids.gridDim = grid;
    if (g_stacks[size_t(t)].empty()) g_stacks[size_t(t)].resize(kStack);
    getcontext(&f.ctx);
    f.stack = g_stacks[size_t(t)].data();
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, entry, 0);
  }
  Block* saved = g_block;
  g_block = &b;
  std::vector<int> order(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) order[size_t(t)] = t;
  for (;;) {
    bool progressed = false, all_done = true;
    std::shuffle(order.begin(), order.end(), rng);
    for (int t : order) {
      Fiber& f = b.fibers[size_t(t)];
      if (f.done || f.wait != kRunning) continue;
      g_cur = &f;
      switch_to(b, f);
      progressed = true;
    }
    for (const Fiber& f : b.fibers) all_done = all_done && f.done;
    if (all_done) break;
    // Warp collectives: every live lane of the warp waiting there.
    for (int w = 0; w < warps; ++w) {
      int live = 0, waiting = 0, present = 0;
      for (int l = 0; l < kEmuWarp; ++l) {
        const int t = w * kEmuWarp + l;
        if (t >= n) continue;
        ++present;
        const Fiber& f = b.fibers[size_t(t)];
        if (f.done) continue;
        ++live;
        waiting += f.wait == kAtWarp;
      }
      if (live == 0 || waiting != live) continue;
      if (live != kEmuWarp) {
        g_block = saved;
        throw std::runtime_error("emulator: warp collective in warp " + std::to_string(w) + " of block (" +
                                 std::to_string(bidx.x) + "," + std::to_string(bidx.y) + ") with only " +
                                 std::to_string(live) + " of " + std::to_string(kEmuWarp) + " lanes live (" +
                                 std::to_string(present) + " present)");
      }
      for (int l = 0; l < kEmuWarp; ++l) b.fibers[size_t(w * kEmuWarp + l)].wait = kRunning;
      progressed = true;
    }
    // Block barrier: every live thread waiting there.
    int live = 0, at_block = 0;
    for (const Fiber& f : b.fibers)
      if (!f.done) {
        ++live;
        at_block += f.wait == kAtBlock;
      }
    if (live > 0 && at_block == live) {
      for (Fiber& f : b.fibers) f.wait = kRunning;
      progressed = true;
    }
    if (!progressed) {
      g_block = saved;
      throw std::runtime_error("emulator: deadlock in block (" + std::to_string(bidx.x) + "," +
                               std::to_string(bidx.y) + "): threads wait at different barriers");
    }
  }
  g_block = saved;
}

}  // namespace

const Ids& ids() { return g_cur->ids; }
int lane() { return g_cur->lane; }

const uint64_t* exchange(uint64_t v) {
  Fiber& f = *g_cur;
  uint64_t* s = warp_slots(f, f.gen);
  s[f.lane] = v;
  f.wait = kAtWarp;
  switch_back(f, false);
  ++f.gen;
  return s;
}

void sync_block() {
  Fiber& f = *g_cur;
  f.wait = kAtBlock;
  switch_back(f, false);
}

void* dynamic_smem() { return g_block->smem.get(); }

int last_error() {
  const int e = g_error;
  g_error = 0;
  return e;
}

void launch(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || smem > 64 * 1024) {
    g_error = 9;   // cudaErrorInvalidConfiguration
    return;
  }
  static std::mt19937 rng(seed());
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_block(grid, block, dim3(x, y, z), smem, body, rng);
}

}  // namespace moelab::emu
