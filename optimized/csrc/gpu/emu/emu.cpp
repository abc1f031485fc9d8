// The SIMT emulator's scheduler (see emu.h): one fiber per thread of a block, warp
// collectives and block barriers as rendezvous points, blocks run in order.
#include "emu.h"
// The Ids members share their names with the kernel-side macros.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

#include <dlfcn.h>
#include <link.h>
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
#include <cinttypes>
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
  int kind = 0;                   // the warp collective waited at (Collective)
  uint64_t site = 0;              // its call site (a hash of the return addresses)
  uint32_t wsync = 0;             // warp syncs this lane has completed (memory ordering)
  bool released = false, pending_acquire = false;   // HIP: fences around a wave barrier
  char* stack = nullptr;          // kStack bytes, from g_stacks
  void* fake_stack = nullptr;     // ASan's fake stack of this fiber while it is switched out
  struct Copy {                   // a cp.async not landed yet: n bytes src -> dst
    char* dst;
    const char* src;
    int n;
  };
  std::vector<Copy> open;                  // issued since the last commit
  std::vector<std::vector<Copy>> groups;   // committed, oldest first
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<uint64_t> slots;      // [warps][2][kEmuWarp][kSlotWords]
  uint32_t epoch = 0;               // block barriers completed
  ucontext_t sched{};                // zeroed: ASan's swapcontext reads its uc_stack
  const std::function<void()>* body = nullptr;
  // Dynamic shared memory: exactly the launch's bytes, in an allocation of its own, so that an
  // access past the end is a heap-buffer-overflow under ASan (zero-filled, as before).
  std::unique_ptr<char, decltype(&std::free)> smem{nullptr, &std::free};
};

Block* g_block = nullptr;
Fiber* g_cur = nullptr;
int g_error = 0;
std::string g_fail;                 // a rule a fiber broke (the launch throws it)
int64_t g_grid_cap = 0, g_cap_hits = 0;
std::vector<std::string> g_log;
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

[[noreturn]] void fail(const std::string& msg);
std::string who(const Fiber& f);

void entry() {
#if MOELAB_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
  (*g_block->body)();
  if (!g_cur->open.empty() || !g_cur->groups.empty())
    fail("emulator: " + who(*g_cur) + " exited with cp.async copies it never waited for");
  g_cur->done = true;
  switch_back(*g_cur, true);
}

uint64_t* warp_slots(Fiber& f, uint64_t gen) {
  return g_block->slots.data() + (size_t(f.warp) * 2 + (gen & 1)) * kEmuWarp * kSlotWords;
}

// ------------------------------------------------------------------- shared-memory shadow
// Per byte of shared memory: the block generation that last touched it (another value: not
// written in this block, i.e. uninitialised), the last writer with the barrier epoch and warp
// sync count it wrote at, and the readers since (one thread, or kMany; their warp, or kMany;
// the highest warp sync count among them).
constexpr int32_t kNone = -1, kMany = -2;
struct Shadow {
  uint32_t gen;
  int32_t wtid;
  uint32_t wepoch, wsync;
  int32_t rtid, rwarp;
  uint32_t repoch, rsync;
  int32_t copy;   // 1 + the thread whose cp.async into this byte has not landed yet; 0: none
};
struct Region {
  uintptr_t lo = 0, hi = 0;
  std::vector<Shadow> shadow;
};
Region g_static, g_dynamic;          // static __shared__ (this module's TLS), dynamic
uint32_t g_gen = 0;                  // block generation
bool g_checks = false;               // hooks active (a kernel is running, rules on)
bool g_in_hook = false;

std::string hex(uintptr_t p) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%" PRIxPTR, p);
  return b;
}

// A rule broken by the running fiber: remember it, abandon the fiber (it never resumes), and
// let the scheduler throw.
[[noreturn]] void fail(const std::string& msg) {
  g_in_hook = false;
  if (g_fail.empty()) g_fail = msg;
  g_cur->done = true;
  switch_back(*g_cur, true);
  std::abort();   // never resumed
}

// The static shared memory range: this module's thread-local block (every `__shared__`).
thread_local char g_tls_marker;
int find_tls(dl_phdr_info* info, size_t, void* data) {
  auto* r = static_cast<Region*>(data);
  const uintptr_t me = reinterpret_cast<uintptr_t>(&find_tls);
  bool mine = false;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD && me >= info->dlpi_addr + ph.p_vaddr && me < info->dlpi_addr + ph.p_vaddr + ph.p_memsz)
      mine = true;
  }
  if (!mine) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_TLS && info->dlpi_tls_data != nullptr) {
      r->lo = reinterpret_cast<uintptr_t>(info->dlpi_tls_data);
      r->hi = r->lo + ph.p_memsz;
    }
  }
  return 1;
}
void init_static_region() {
  if (g_static.hi != 0) return;
  g_tls_marker = 1;   // this thread's TLS block of the module exists from here on
  dl_iterate_phdr(find_tls, &g_static);
  if (g_static.hi == 0) throw std::runtime_error("emulator: cannot find the static shared memory (TLS) range");
  g_static.shadow.assign(g_static.hi - g_static.lo, Shadow{0, kNone, 0, 0, kNone, kNone, 0, 0, 0});
}

const char* kind_name(int k) {
  return k == kShfl ? "shuffle" : k == kBallot ? "ballot" : k == kSync ? "warp sync" : k == kMma ? "mma" : k == kLdmatrix ? "ldmatrix" : "__syncthreads";
}

std::string who(const Fiber& f) {
  return "thread " + std::to_string(f.tid) + " (warp " + std::to_string(f.warp) + ", lane " + std::to_string(f.lane) +
         ") of block (" + std::to_string(f.ids.blockIdx.x) + "," + std::to_string(f.ids.blockIdx.y) + "," +
         std::to_string(f.ids.blockIdx.z) + ")";
}

Region* region_of(uintptr_t p) {
  return p >= g_static.lo && p < g_static.hi ? &g_static : p >= g_dynamic.lo && p < g_dynamic.hi ? &g_dynamic : nullptr;
}

__attribute__((no_sanitize_thread)) void access(uintptr_t p, int n, bool write) {
  if (!g_checks || g_in_hook || g_cur == nullptr) return;
  g_in_hook = true;
  Fiber& f = *g_cur;
  if (n > 1 && (p & uintptr_t(n - 1)) != 0)
    fail(std::string("emulator: misaligned ") + std::to_string(n) + "-byte " + (write ? "store" : "load") + " at " +
         hex(p) + " by " + who(f) + " (GPUs need natural alignment)");
  Region* r = region_of(p);
  if (r == nullptr) {
    g_in_hook = false;
    return;
  }
  const uint32_t epoch = g_block->epoch;
  for (int i = 0; i < n; ++i) {
    if (p + uintptr_t(i) >= r->hi) break;
    Shadow& s = r->shadow[p + uintptr_t(i) - r->lo];
    if (s.gen != g_gen) s = Shadow{g_gen, kNone, 0, 0, kNone, kNone, 0, 0, 0};
    const char* what = r == &g_static ? "static shared memory" : "dynamic shared memory";
    if (s.copy != 0)
      fail(std::string("emulator: ") + (write ? "store to" : "load of") + " a cp.async destination in " + what +
           " at " + hex(p + i) + " by " + who(f) + " before thread " + std::to_string(s.copy - 1) +
           "'s cp.async wait landed it");
    // Ordered before this access: the same thread, a block barrier since, or a warp sync since
    // within the same warp.
    auto ordered = [&](int32_t tid, int32_t warp, uint32_t ep, uint32_t sy) {
      return tid == f.tid || ep != epoch || (warp == f.warp && sy < f.wsync);
    };
    if (!write) {
      if (s.wtid == kNone)
        fail(std::string("emulator: read of uninitialised ") + what + " at " + hex(p + i) + " by " + who(f) +
             " (no thread of this block wrote it)");
      if (!ordered(s.wtid, s.wtid / kEmuWarp, s.wepoch, s.wsync))
        fail(std::string("emulator: shared-memory race (read after write) on ") + what + " at " + hex(p + i) +
             ": written by thread " + std::to_string(s.wtid) + ", read by " + who(f) +
             " with no barrier between them");
      if (s.rtid == kNone || s.repoch != epoch) {
        s.rtid = f.tid;
        s.rwarp = f.warp;
        s.repoch = epoch;
        s.rsync = f.wsync;
      } else {
        if (s.rtid != f.tid) s.rtid = kMany;
        if (s.rwarp != f.warp) s.rwarp = kMany;
        if (f.wsync > s.rsync) s.rsync = f.wsync;
      }
    } else {
      if (s.wtid != kNone && !ordered(s.wtid, s.wtid / kEmuWarp, s.wepoch, s.wsync))
        fail(std::string("emulator: shared-memory race (write after write) on ") + what + " at " + hex(p + i) +
             ": written by thread " + std::to_string(s.wtid) + " and by " + who(f) + " with no barrier between them");
      if (s.rtid != kNone && s.rtid != f.tid && !ordered(s.rtid, s.rwarp, s.repoch, s.rsync))
        fail(std::string("emulator: shared-memory race (write after read) on ") + what + " at " + hex(p + i) +
             ": read by " + (s.rtid == kMany ? std::string("several threads") : "thread " + std::to_string(s.rtid)) +
             ", then written by " + who(f) + " with no barrier between them");
      s.wtid = f.tid;
      s.wepoch = epoch;
      s.wsync = f.wsync;
      s.rtid = kNone;
    }
  }
  g_in_hook = false;
}

// The call site of a collective: its source file and line (the portability.h wrappers hand on
// their caller's), with the kind. Lanes at two different shuffles differ; two calls of one
// helper (a block scan) from different places of a kernel do not.
uint64_t call_site(int kind, const char* file, int line) {
  return (reinterpret_cast<uintptr_t>(file) * 1099511628211ull) ^ (uint64_t(uint32_t(line)) << 8) ^ uint64_t(kind);
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
  b.slots.assign(size_t(warps) * 2 * kEmuWarp * kSlotWords, 0);
  b.body = &body;
  // Dynamic shared memory is uninitialised at a block's start: poisoned bytes (and tracked).
  b.smem.reset(static_cast<char*>(std::malloc(smem ? smem : 1)));
  if (!b.smem) throw std::bad_alloc();
  std::memset(b.smem.get(), 0xa5, smem);
  ++g_gen;                                     // every shared byte: not written by this block
  g_dynamic.lo = reinterpret_cast<uintptr_t>(b.smem.get());
  g_dynamic.hi = g_dynamic.lo + smem;
  if (g_dynamic.shadow.size() < smem) g_dynamic.shadow.resize(smem, Shadow{0, kNone, 0, 0, kNone, kNone, 0, 0, 0});
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
      g_cur = nullptr;
      if (!g_fail.empty()) {
        const std::string msg = g_fail;
        g_fail.clear();
        g_block = saved;
        throw std::runtime_error(msg);
      }
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
      const Fiber& f0 = b.fibers[size_t(w * kEmuWarp)];
      bool all_released = true;
      for (int l = 0; l < kEmuWarp; ++l) {
        const Fiber& f = b.fibers[size_t(w * kEmuWarp + l)];
        all_released = all_released && f.released;
        if (f.kind != f0.kind || f.site != f0.site) {
          g_block = saved;
          throw std::runtime_error(std::string("emulator: the lanes of warp ") + std::to_string(w) + " of block (" +
                                   std::to_string(bidx.x) + "," + std::to_string(bidx.y) +
                                   ") meet at different collectives (lane 0 at a " + kind_name(f0.kind) + ", lane " +
                                   std::to_string(l) + " at a " + kind_name(f.kind) +
                                   (f.kind == f0.kind ? " from another call site" : "") + ")");
        }
      }
      for (int l = 0; l < kEmuWarp; ++l) {
        Fiber& f = b.fibers[size_t(w * kEmuWarp + l)];
        f.wait = kRunning;
        if (f0.kind == kSync) {
          // CUDA: __syncwarp orders the warp's memory accesses. HIP: the wave barrier does so
          // only between a release fence before it (every lane) and an acquire fence after it.
          if (kEmuWarp == 64) f.pending_acquire = all_released;
          else ++f.wsync;
          f.released = false;
        }
      }
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
      const Fiber* first = nullptr;
      for (const Fiber& f : b.fibers) {
        if (f.done) continue;
        if (first == nullptr) first = &f;
        if (f.site != first->site) {
          g_block = saved;
          throw std::runtime_error("emulator: the threads of block (" + std::to_string(bidx.x) + "," +
                                   std::to_string(bidx.y) + ") meet at different __syncthreads (threads " +
                                   std::to_string(first->tid) + " and " + std::to_string(f.tid) + ")");
        }
      }
      for (Fiber& f : b.fibers) f.wait = kRunning;
      ++b.epoch;
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

const uint64_t* exchange_n(const uint64_t* v, int n, int kind, const char* file, int line) {
  Fiber& f = *g_cur;
  uint64_t* s = warp_slots(f, f.gen);
  for (int i = 0; i < n; ++i) s[size_t(f.lane) * kSlotWords + size_t(i)] = v[i];
  f.kind = kind;
  f.site = call_site(kind, file, line);
  f.wait = kAtWarp;
  switch_back(f, false);
  ++f.gen;
  return s;
}

void sync_block(const char* file, int line) {
  Fiber& f = *g_cur;
  f.site = call_site(0, file, line);
  f.wait = kAtBlock;
  switch_back(f, false);
}

void fence(int order) {
  Fiber& f = *g_cur;
  if (order == __ATOMIC_RELEASE || order == __ATOMIC_ACQ_REL || order == __ATOMIC_SEQ_CST) f.released = true;
  if ((order == __ATOMIC_ACQUIRE || order == __ATOMIC_ACQ_REL || order == __ATOMIC_SEQ_CST) && f.pending_acquire) {
    ++f.wsync;
    f.pending_acquire = false;
  }
}

void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const char* file, int line) {
  const uint64_t mine[5] = {a[0] | (uint64_t(a[1]) << 32), a[2] | (uint64_t(a[3]) << 32), b[0] | (uint64_t(b[1]) << 32),
                            bits(d[0]) | (bits(d[1]) << 32), bits(d[2]) | (bits(d[3]) << 32)};
  const uint64_t* s = exchange_n(mine, 5, kMma, file, line);
  auto reg = [&](int l, int word, int half) { return uint32_t(s[size_t(l) * kSlotWords + size_t(word)] >> (32 * half)); };
  // A[r][k]: lane (r % 8) * 4 + (k % 8) / 2, register (r >= 8) + 2 * (k >= 8), half k % 2.
  auto A = [&](int r, int k) {
    const int ri = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t w = reg((r & 7) * 4 + ((k & 7) >> 1), ri >> 1, ri & 1);
    return __uint_as_float((k & 1 ? w >> 16 : w & 0xffffu) << 16);
  };
  // B[k][n]: lane n * 4 + (k % 8) / 2, register (k >= 8), half k % 2.
  auto B = [&](int k, int n) {
    const uint32_t w = reg(n * 4 + ((k & 7) >> 1), 2, k >= 8 ? 1 : 0);
    return __uint_as_float((k & 1 ? w >> 16 : w & 0xffffu) << 16);
  };
  const int g = lane() >> 2, c = lane() & 3;
  for (int q = 0; q < 4; ++q) {
    const int r = g + (q >= 2 ? 8 : 0), n = 2 * c + (q & 1);
    float acc = d[q];
    for (int k = 0; k < 16; ++k) acc = std::fmaf(A(r, k), B(k, n), acc);
    d[q] = acc;
  }
}

void ldmatrix_exchange(uint32_t (&r)[4], uint64_t lo, uint64_t hi, const char* file, int line) {
  const uint64_t mine[2] = {lo, hi};
  const uint64_t* s = exchange_n(mine, 2, kLdmatrix, file, line);
  const int t = lane();
  for (int i = 0; i < 4; ++i) {
    const uint64_t w = s[size_t(8 * i + t / 4) * kSlotWords + size_t((t & 3) >> 1)];
    r[i] = uint32_t(w >> (32 * (t & 1)));
  }
}

void require_shared(const void* p, const char* what) {
  if (g_cur == nullptr || !g_checks) return;   // the shared ranges are known only with the rules
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (region_of(a) == nullptr)
    fail(std::string("emulator: ") + what + " from " + hex(a) + ", not shared memory, by " + who(*g_cur));
}

void vector_access(const void* p, size_t n, bool write) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (g_cur == nullptr || n < 2 || (a & (n - 1)) == 0) return;
  fail(std::string("emulator: misaligned ") + std::to_string(n) + "-byte vector " + (write ? "store" : "load") +
       " at " + hex(a) + " by " + who(*g_cur) + " (GPUs need natural alignment)");
}

// cp.async: checked and recorded as a write of the issuing thread at issue (the copy may land
// any time before the wait), its bytes then marked pending so that any access fails until the
// wait lands them; the bytes move at the wait, and count as written by the thread then.
void async_copy(void* dst, const void* src, int n) {
  if (g_cur == nullptr) {
    std::memcpy(dst, src, size_t(n));
    return;
  }
  Fiber& f = *g_cur;
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (((d | s) & uintptr_t(n - 1)) != 0)
    fail("emulator: misaligned " + std::to_string(n) + "-byte cp.async " + hex(s) + " -> " + hex(d) + " by " + who(f));
  Region* r = region_of(d);   // known only in the builds with the rules (g_checks)
  if (g_checks && r == nullptr) fail("emulator: cp.async to " + hex(d) + ", not shared memory, by " + who(f));
  access(d, n, true);
  if (g_checks)
    for (int i = 0; i < n && d + uintptr_t(i) < r->hi; ++i) r->shadow[d + uintptr_t(i) - r->lo].copy = f.tid + 1;
  f.open.push_back({static_cast<char*>(dst), static_cast<const char*>(src), n});
}

void async_commit() {
  if (g_cur == nullptr) return;
  g_cur->groups.push_back(std::move(g_cur->open));
  g_cur->open.clear();
}

void async_wait(int keep) {
  if (g_cur == nullptr) return;
  Fiber& f = *g_cur;
  while (int(f.groups.size()) > keep) {
    for (const Fiber::Copy& c : f.groups.front()) {
      std::memcpy(c.dst, c.src, size_t(c.n));
      const uintptr_t d = reinterpret_cast<uintptr_t>(c.dst);
      Region* r = region_of(d);
      if (!g_checks || r == nullptr) continue;
      for (int i = 0; i < c.n && d + uintptr_t(i) < r->hi; ++i) {
        Shadow& sh = r->shadow[d + uintptr_t(i) - r->lo];
        sh.copy = 0;
        sh.wtid = f.tid;
        sh.wepoch = g_block->epoch;
        sh.wsync = f.wsync;
        sh.rtid = kNone;
      }
    }
    f.groups.erase(f.groups.begin());
  }
}

void* dynamic_smem() { return g_block->smem.get(); }

int last_error() {
  const int e = g_error;
  g_error = 0;
  return e;
}

int64_t grid_cap(int64_t c) {
  if (g_grid_cap > 0 && g_grid_cap < c) {
    ++g_cap_hits;
    return g_grid_cap;
  }
  return c;
}
void set_grid_cap(int64_t cap) { g_grid_cap = cap; }
int64_t grid_cap_hits() { return g_cap_hits; }
const std::vector<std::string>& launch_log() { return g_log; }
void clear_launch_log() { g_log.clear(); }

void launch(const char* name, dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535 || smem > 64 * 1024) {
    g_error = 9;   // cudaErrorInvalidConfiguration
    return;
  }
  if (g_log.size() < 100000)
    g_log.push_back(std::string(name) + " " + std::to_string(grid.x) + " " + std::to_string(grid.y) + " " +
                    std::to_string(grid.z) + " " + std::to_string(block.x) + " " + std::to_string(block.y) + " " +
                    std::to_string(block.z));
  static std::mt19937 rng(seed());
#if MOELAB_EMU_RULES
  init_static_region();
  g_checks = true;
#endif
  // Blocks run to completion one at a time, in a shuffled order: a kernel that expects block 0
  // to finish before block 1 reads its output sees the other order too.
  std::vector<dim3> order;
  order.reserve(size_t(grid.x) * grid.y * grid.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) order.push_back(dim3(x, y, z));
  std::shuffle(order.begin(), order.end(), rng);
  try {
    for (const dim3& b : order) run_block(grid, block, b, smem, body, rng);
  } catch (...) {
    g_checks = false;
    g_dynamic.lo = g_dynamic.hi = 0;
    throw;
  }
  g_checks = false;
  g_dynamic.lo = g_dynamic.hi = 0;
}

}  // namespace moelab::emu

// ---------------------------------------------------------------------------- access hooks
// The kernels (and the rule controls) are compiled with -fsanitize=thread but linked without
// its runtime (tests/gpu_emu.py): the compiler calls these before every load and store of
// kernel code, and the emulator checks its rules there. Nothing else of ThreadSanitizer is used.
#define MOELAB_EMU_HOOK(n)                                                                                      \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_read##n(void* p) {                                \
    ::moelab::emu::access(reinterpret_cast<uintptr_t>(p), n, false);                                           \
  }                                                                                                            \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_write##n(void* p) {                               \
    ::moelab::emu::access(reinterpret_cast<uintptr_t>(p), n, true);                                            \
  }                                                                                                            \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_unaligned_read##n(void* p) {                      \
    ::moelab::emu::access(reinterpret_cast<uintptr_t>(p), n, false);                                           \
  }                                                                                                            \
  extern "C" __attribute__((no_sanitize_thread)) void __tsan_unaligned_write##n(void* p) {                     \
    ::moelab::emu::access(reinterpret_cast<uintptr_t>(p), n, true);                                            \
  }
MOELAB_EMU_HOOK(1)
MOELAB_EMU_HOOK(2)
MOELAB_EMU_HOOK(4)
MOELAB_EMU_HOOK(8)
MOELAB_EMU_HOOK(16)
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_read_range(void* p, unsigned long n) {
  for (unsigned long i = 0; i < n; ++i) ::moelab::emu::access(reinterpret_cast<uintptr_t>(p) + i, 1, false);
}
extern "C" __attribute__((no_sanitize_thread)) void __tsan_write_range(void* p, unsigned long n) {
  for (unsigned long i = 0; i < n; ++i) ::moelab::emu::access(reinterpret_cast<uintptr_t>(p) + i, 1, true);
}
