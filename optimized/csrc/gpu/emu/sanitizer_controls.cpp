// Negative controls of the sanitized emulator build (tests/gpu_emu.py under MOELAB_SANITIZE=1,
// tests/test_sanitize.py): tiny kernels, run by the emulator like the real ones, that overflow
// dynamic shared memory, overflow a static __shared__ array, or overflow a signed int, when
// asked to. They prove that a kernel bug of each kind is reported on the CPU: the emulator's
// fiber switches keep ASan working, and dynamic shared memory has exactly the launch's bytes.
// Never part of the normal emulator build.
#if !MOELAB_SANITIZE
#error "sanitizer_controls.cpp belongs to the sanitized emulator build only (MOELAB_SANITIZE=1)"
#endif

#include <torch/extension.h>

#include "emu.h"

namespace {

constexpr int kThreads = 64;

// Stages n floats in dynamic shared memory (n * 4 bytes), then thread 0 reads element idx.
__global__ void dynamic_smem_read_kernel(const float* in, int n, int idx, float* out) {
  MOELAB_EXTERN_SHARED(float, buf);
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) buf[i] = in[i];
  __syncthreads();
  if (threadIdx.x == 0) out[0] = buf[idx];
}

// A static __shared__ array of kThreads floats; thread 0 reads element idx.
__global__ void static_smem_read_kernel(int idx, float* out) {
  __shared__ float buf[kThreads];
  buf[threadIdx.x] = float(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = buf[idx];
}

// Every thread computes row * ld in 32-bit int, as a careless index would.
__global__ void int_index_kernel(int row, int ld, int* out) {
  const int off = row * ld;
  if (threadIdx.x == 0) out[0] = off;
}

double dynamic_smem_read(const at::Tensor& in, int64_t idx) {
  const at::Tensor x = in.contiguous().to(at::kFloat);
  at::Tensor out = at::zeros({1}, at::kFloat);
  const int n = int(x.numel());
  MOELAB_LAUNCH(dynamic_smem_read_kernel, 1, kThreads, size_t(n) * sizeof(float), nullptr, x.data_ptr<float>(), n,
                int(idx), out.data_ptr<float>());
  return out.item<float>();
}

double static_smem_read(int64_t idx) {
  at::Tensor out = at::zeros({1}, at::kFloat);
  MOELAB_LAUNCH(static_smem_read_kernel, 1, kThreads, 0, nullptr, int(idx), out.data_ptr<float>());
  return out.item<float>();
}

int64_t int_index(int64_t row, int64_t ld) {
  at::Tensor out = at::zeros({1}, at::kInt);
  MOELAB_LAUNCH(int_index_kernel, 1, kThreads, 0, nullptr, int(row), int(ld), out.data_ptr<int32_t>());
  return out.item<int>();
}

}  // namespace

void moelab_emu_sanitizer_controls(pybind11::module& m) {
  m.def("control_dynamic_smem_read", &dynamic_smem_read);
  m.def("control_static_smem_read", &static_smem_read);
  m.def("control_int_index", &int_index);
}
