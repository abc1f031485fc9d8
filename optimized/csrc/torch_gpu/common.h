// Shared by the GPU bindings (CUDA, and ROCm through torch's hipify): argument checks that
// name the op and the argument, the current stream, and turning a launcher's status into an
// error. The kernels are in csrc/gpu (torch-free); these files only check and call them.
//
// The schemas are defined once, by the CPU bindings (csrc/torch/); this extension is loaded
// after the CPU one and adds the CUDA implementations (dispatch key CUDA, which is also the
// key of ROCm tensors).
#pragma once
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <torch/library.h>

#include "../gpu/launch.h"
#include "../torch/checks.h"   // the device-independent argument checks, shared with the CPU bindings

namespace moelab::gpu_binding {

using checks::check_disjoint;
using checks::check_numel;
using checks::check_tensor;
using checks::span_of;
using checks::Span;

static_assert(gpu::kRouteMaxExperts == checks::kRouteMaxExperts && gpu::kRouteMaxTopK == checks::kRouteMaxTopK &&
                  gpu::kRouteMaxGroups == checks::kRouteMaxGroups &&
                  gpu::kRouteMaxGroupedExperts == checks::kRouteMaxGroupedExperts &&
                  gpu::kSkinnyMaxT == checks::kSkinnyMaxT,
              "the kernels' limits are the contract's (csrc/torch/checks.h)");
static_assert(int(gpu::kSoftmaxTopk) == checks::kSoftmaxTopk && int(gpu::kTopkSoftmax) == checks::kTopkSoftmax &&
                  int(gpu::kSigmoidTopk) == checks::kSigmoidTopk && int(gpu::kSigmoidBias) == checks::kSigmoidBias &&
                  int(gpu::kGroupedSigmoidBias) == checks::kGroupedSigmoidBias && int(gpu::kLlama4) == checks::kLlama4,
              "method codes");

inline gpu::Stream current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// True while the current stream records a CUDA graph: then no host read-back is possible,
// so the device-side index checks are left in the status words (see permute/unpermute).
inline bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// Whether to read the device-side index checks back (a small synchronous copy per call):
// yes unless MOELAB_GPU_SYNC_CHECKS=0 (benchmarks of the eager host path set it; read once).
inline bool sync_checks() {
  static const bool on = [] {
    const char* v = std::getenv("MOELAB_GPU_SYNC_CHECKS");
    return v == nullptr || std::string(v) != "0";
  }();
  return on && !capturing();
}

// The device: a GPU tensor, on the same GPU as `like` when given.
inline void check_is_gpu(const at::Tensor& t, const char* op, const char* arg, const at::Tensor* like = nullptr) {
  MOELAB_CHECK(t.is_cuda(), op, arg, "must be a CUDA/ROCm tensor, got ", t.device());
  if (like != nullptr)
    MOELAB_CHECK(t.device() == like->device(), op, arg, "must be on ", like->device(), ", got ", t.device());
}

// The device, then rank, dtype and optionally contiguity (checks::check_tensor).
inline void check_gpu(const at::Tensor& t, const char* op, const char* arg, int64_t ndim,
                      std::initializer_list<at::ScalarType> dtypes, bool contiguous = true,
                      const at::Tensor* like = nullptr) {
  check_is_gpu(t, op, arg, like);
  check_tensor(t, op, arg, ndim, dtypes, contiguous);
}

inline Fmt fmt_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return Fmt::kBF16;
    case at::kHalf: return Fmt::kF16;
    default: return Fmt::kF32;
  }
}

inline void check_launch(int status, const char* op) {
  TORCH_CHECK(status == gpu::kOk, "moelab::", op, ": GPU kernel launch failed: ", gpu::status_string(status),
              " (status ", status, ")");
}

}  // namespace moelab::gpu_binding
