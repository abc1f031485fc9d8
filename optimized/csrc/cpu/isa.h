// Run-time instruction-set choice for the CPU kernels (torch-free).
//
// Each kernel source is compiled once per ISA level (see isa_begin.h), never with
// -march=native; the binding asks active_isa() which copy to call. MOELAB_ISA in the
// environment, or set_isa(), caps the level (to test every path on one machine).
#pragma once

namespace moelab::cpu {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

Isa detected_isa();                 // what cpuid says this CPU runs
Isa active_isa();                   // min(detected, cap); the cap starts from MOELAB_ISA
void set_isa_cap(Isa cap);          // tests: force a lower level for this process
const char* isa_name(Isa isa);      // "scalar", "avx2", "avx512", "avx512_bf16"
bool parse_isa(const char* name, Isa* out);

}  // namespace moelab::cpu
