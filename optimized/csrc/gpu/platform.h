// Which GPU platform this translation unit is built for: MOELAB_HIP is 1 for AMD (hipcc, or a
// ROCm torch build compiling host code with __HIP_PLATFORM_AMD__ / USE_ROCM), else 0 (CUDA).
// MOELAB_EMU (tests only): the CPU emulator of emu/emu.h; warp 64 emulates the HIP flavour.
#pragma once
#if defined(MOELAB_EMU)
#define MOELAB_HIP (MOELAB_EMU_WARP == 64)
#elif defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__) || defined(USE_ROCM)
#define MOELAB_HIP 1
#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif
#else
#define MOELAB_HIP 0
#endif
