#include "isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace moelab::cpu {

#if defined(__x86_64__) || defined(__i386__)
Isa detected_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                __builtin_cpu_supports("f16c");
    bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    // avx512_bf16 also requires VBMI (vpermb/vpermi2b: the fp8 decoder); every CPU with
    // AVX512-BF16 has it except Cooper Lake, which then runs the avx512 level.
    bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
    return bf16 ? Isa::kAvx512Bf16 : avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kScalar;
  }();
  return isa;
}
#elif defined(__aarch64__)
Isa detected_isa() {
  // ASIMD is architectural on aarch64, but a kernel that could be built for a core without it
  // (or an emulator that hides it) should say so rather than fault: ask the kernel's hwcaps.
  static const Isa isa = [] {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMD) ? Isa::kNeon : Isa::kScalar;
#else
    return Isa::kNeon;
#endif
  }();
  return isa;
}
#else
Isa detected_isa() { return Isa::kScalar; }
#endif

static std::atomic<int>& cap() {
  static std::atomic<int> c = [] {
    Isa isa = static_cast<Isa>(kIsaTop);
    const char* env = std::getenv("MOELAB_ISA");
    if (env && *env) parse_isa(env, &isa);
    return static_cast<int>(isa);
  }();
  return c;
}

Isa active_isa() {
  int d = static_cast<int>(detected_isa()), c = cap().load(std::memory_order_relaxed);
  return static_cast<Isa>(d < c ? d : c);
}

void set_isa_cap(Isa c) { cap().store(static_cast<int>(c)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
#if defined(__x86_64__) || defined(__i386__)
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
#elif defined(__aarch64__)
    case Isa::kNeon: return "neon";
#endif
  }
  return "?";
}

const char* isa_names() {
#if defined(__x86_64__) || defined(__i386__)
  return "scalar, avx2, avx512, avx512_bf16";
#elif defined(__aarch64__)
  return "scalar, neon";
#else
  return "scalar";
#endif
}

bool parse_isa(const char* name, Isa* out) {
  for (int i = 0; i <= kIsaTop; ++i) {
    if (std::strcmp(name, isa_name(static_cast<Isa>(i))) == 0) {
      *out = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

}  // namespace moelab::cpu
