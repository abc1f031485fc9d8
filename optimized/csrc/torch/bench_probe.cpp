// moelab::read_stream(Tensor buf, int streams_per_thread, int prefetch_blocks=0) -> int:
// a MEASUREMENT TOOL for the benchmarks (experiments/timing.py, read_bandwidth()), not an MoE
// op. It reads every byte of a contiguous CPU tensor of any dtype once, with 64-byte vector
// loads, and returns their sum (unsigned bytes, as int64), so the reads cannot be eliminated
// and a test can check that exactly the buffer was read. The whole 64-byte blocks are split
// across the torch threads (at::parallel_for, one contiguous chunk each); within a thread,
// over `streams_per_thread` interleaved sub-ranges (csrc/cpu/read_stream_kernel.h), optionally
// with a software prefetch `prefetch_blocks` blocks ahead in each (0: the hardware prefetchers
// only). Timing it over a buffer far larger than the last-level cache gives the read bandwidth
// a streaming kernel can reach here.
#include <atomic>

#include "../cpu/read_stream.h"
#include "common.h"

namespace moelab {
namespace {

constexpr const char* kOp = "read_stream";
// Blocks per at::parallel_for task (256 KiB): a small buffer stays on one thread.
constexpr int64_t kGrainBlocks = 4096;

int64_t read_stream_cpu(const at::Tensor& buf, int64_t streams, int64_t prefetch) {
  MOELAB_CHECK(buf.defined(), kOp, "buf", "must be a tensor");
  check_is_cpu(buf, kOp, "buf");
  MOELAB_CHECK(buf.is_contiguous(), kOp, "buf", "must be contiguous");
  MOELAB_CHECK(buf.numel() > 0, kOp, "buf", "must not be empty");
  MOELAB_CHECK(streams >= 1 && streams <= cpu::kReadStreamMaxStreams, kOp, "streams_per_thread",
               "must be in [1, ", cpu::kReadStreamMaxStreams, "], got ", streams);
  MOELAB_CHECK(prefetch >= 0 && prefetch <= cpu::kReadStreamMaxPrefetch, kOp, "prefetch_blocks",
               "must be in [0, ", cpu::kReadStreamMaxPrefetch, "], got ", prefetch);
  const auto* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t nbytes = static_cast<int64_t>(buf.nbytes()), nblk = nbytes / 64;
  auto* fn = MOELAB_PICK(read_stream_bytes);
  const int s = static_cast<int>(streams);
  std::atomic<uint64_t> total{0};
  if (nblk > 0) {
    at::parallel_for(0, nblk, kGrainBlocks, [&](int64_t b0, int64_t b1) {
      total.fetch_add(fn(p + b0 * 64, (b1 - b0) * 64, s, prefetch), std::memory_order_relaxed);
    });
  }
  // the tail after the last whole block (< 64 bytes)
  uint64_t sum = total.load() + fn(p + nblk * 64, nbytes - nblk * 64, 1, 0);
  return static_cast<int64_t>(sum);
}

const int kRegistered = register_op_level(kOp, cpu::Isa::kAvx512);

}  // namespace
}  // namespace moelab

TORCH_LIBRARY_FRAGMENT(moelab, m) { m.def("read_stream(Tensor buf, int streams_per_thread, int prefetch_blocks=0) -> int"); }
TORCH_LIBRARY_IMPL(moelab, CPU, m) { m.impl("read_stream", &moelab::read_stream_cpu); }
