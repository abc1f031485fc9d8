// Run-time instruction-set choice for the CPU kernels (torch-free).
//
// Each kernel source is compiled once per ISA level (see isa_begin.h), never with
// -march=native; the binding asks active_isa() which copy to call. MOELAB_ISA in the
// environment, or set_isa(), caps the level (to test every path on one machine).
#pragma once

namespace moelab::cpu {

#if defined(__x86_64__) || defined(__i386__)
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
constexpr int kIsaTop = 3;
#elif defined(__aarch64__)
// kAvx2 / kAvx512 / kAvx512Bf16 are the names the bindings give an op's highest level
// (register_op_level); every op has a NEON kernel, so on aarch64 they mean the NEON level.
enum class Isa : int { kScalar = 0, kNeon = 1, kAvx2 = 1, kAvx512 = 1, kAvx512Bf16 = 1 };
constexpr int kIsaTop = 1;
#else
// The portable level only; the x86 names alias it for the same reason as on aarch64.
enum class Isa : int { kScalar = 0, kAvx2 = 0, kAvx512 = 0, kAvx512Bf16 = 0 };
constexpr int kIsaTop = 0;
#endif

Isa detected_isa();                 // what cpuid (x86) / the hwcaps (aarch64) say this CPU runs
Isa active_isa();                   // min(detected, cap); the cap starts from MOELAB_ISA
void set_isa_cap(Isa cap);          // tests: force a lower level for this process
const char* isa_name(Isa isa);      // "scalar", "avx2", "avx512", "avx512_bf16"; "neon" on aarch64
bool parse_isa(const char* name, Isa* out);
const char* isa_names();            // this build's level names, comma-separated (messages)

}  // namespace moelab::cpu
