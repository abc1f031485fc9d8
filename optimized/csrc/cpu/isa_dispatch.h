// Declares one kernel at every ISA level and picks the active one at run time.
//
//   MOELAB_CPU_KERNEL(void, route_rows, (const float* x, ...));   // in a header
//   auto* fn = MOELAB_PICK(route_rows);                            // in a binding
#pragma once
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#define MOELAB_CPU_KERNEL(ret, name, params)                  \
  namespace moelab::cpu {                                     \
  namespace scalar { ret name params; }                       \
  namespace avx2 { ret name params; }                         \
  namespace avx512 { ret name params; }                       \
  namespace avx512bf16 { ret name params; }                   \
  }

#define MOELAB_PICK(name)                                                         \
  (::moelab::cpu::active_isa() == ::moelab::cpu::Isa::kAvx512Bf16 ? &::moelab::cpu::avx512bf16::name \
   : ::moelab::cpu::active_isa() == ::moelab::cpu::Isa::kAvx512   ? &::moelab::cpu::avx512::name     \
   : ::moelab::cpu::active_isa() == ::moelab::cpu::Isa::kAvx2     ? &::moelab::cpu::avx2::name       \
                                                                  : &::moelab::cpu::scalar::name)
#elif defined(__aarch64__)
// aarch64: the portable level and NEON (isa_begin.h); no x86 level exists in this build.
#define MOELAB_CPU_KERNEL(ret, name, params)                  \
  namespace moelab::cpu {                                     \
  namespace scalar { ret name params; }                       \
  namespace neon { ret name params; }                         \
  }

#define MOELAB_PICK(name)                                                                \
  (::moelab::cpu::active_isa() == ::moelab::cpu::Isa::kNeon ? &::moelab::cpu::neon::name \
                                                            : &::moelab::cpu::scalar::name)
#else
#define MOELAB_CPU_KERNEL(ret, name, params)                  \
  namespace moelab::cpu {                                     \
  namespace scalar { ret name params; }                       \
  }

#define MOELAB_PICK(name) (&::moelab::cpu::scalar::name)
#endif
