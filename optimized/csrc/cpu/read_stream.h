// read_stream: a measurement tool, not an MoE kernel. It streams a buffer from memory as fast
// as one core can and returns the sum of its bytes, so the reads cannot be optimized away.
// experiments/timing.py times it for the benchmark's DRAM floor (read_bandwidth()): the most
// a read-only stream gets on this machine. Declared at each ISA level (see isa_dispatch.h);
// torch-free, the binding (csrc/torch/bench_probe.cpp) splits the buffer across threads.
#pragma once
#include <cstdint>

#include "isa_dispatch.h"

namespace moelab::cpu {
constexpr int kReadStreamMaxStreams = 16;   // streams (independent accumulator chains) per thread
constexpr int64_t kReadStreamMaxPrefetch = 4096;   // blocks (256 KiB) ahead at most
}  // namespace moelab::cpu

// The sum of the bytes p[0, nbytes) as unsigned 8-bit values (mod 2^64). The whole 64-byte
// blocks are split into `streams` (1..kReadStreamMaxStreams) equal contiguous sub-ranges read
// concurrently, one 64-byte load from each per step (so the core keeps `streams` independent
// misses in flight besides what the prefetchers fetch); the blocks left over (< streams) and
// the tail (< 64 bytes) are read after. prefetch > 0: each step also prefetches into L2 the
// block that many blocks ahead in each stream (never past the stream's end). p needs no
// alignment; nothing outside [p, p + nbytes) is read or prefetched.
MOELAB_CPU_KERNEL(uint64_t, read_stream_bytes, (const uint8_t* p, int64_t nbytes, int streams, int64_t prefetch))
