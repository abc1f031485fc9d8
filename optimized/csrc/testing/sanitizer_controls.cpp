// Negative controls for `make sanitize`: deliberate memory and undefined-behaviour bugs, so a
// test can prove that the sanitized build really reports (tests/test_sanitize.py runs each in
// a subprocess and expects the sanitizer's report and a failed exit).
//
// Compiled ONLY into the sanitized extension (optimized/_build.py adds csrc/testing/ when
// MOELAB_SANITIZE=1); the normal moelab_cpu never contains these ops. They live in their own
// namespace, moelab_test, so nothing in moelab can call them by accident.
#ifndef MOELAB_SANITIZE
#error "sanitizer_controls.cpp is for the sanitized build only (MOELAB_SANITIZE=1)"
#endif
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

namespace moelab_test {
namespace {

// Reads the element just past the end of x (a heap-buffer-overflow: torch's CPU allocator
// gives each storage its own malloc block of exactly nbytes).
double oob_read(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "moelab_test::oob_read: argument 'x' must be a contiguous f32 CPU tensor");
  const volatile float* p = x.data_ptr<float>();
  return p[x.numel()];   // BUG (deliberate): one element past the end
}

// a + b in 32-bit signed arithmetic, with no overflow check (signed-integer-overflow for,
// e.g., a = INT32_MAX, b = 1).
int64_t int32_add(int64_t a, int64_t b) {
  volatile int32_t x = static_cast<int32_t>(a), y = static_cast<int32_t>(b);
  int32_t r = x + y;     // BUG (deliberate): undefined when the sum leaves int32
  return r;
}

// Loads an int32 from byte `offset` of x's storage through an int32 pointer (a misaligned
// load for an offset that is not a multiple of 4).
int64_t load_int32_at(const at::Tensor& x, int64_t offset) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kByte && x.is_contiguous() &&
              offset >= 0 && offset + 4 <= x.numel(),
              "moelab_test::load_int32_at: 'x' must be a contiguous uint8 CPU tensor holding bytes "
              "[offset, offset + 4)");
  const uint8_t* base = x.data_ptr<uint8_t>() + offset;
  return *reinterpret_cast<const int32_t*>(base);   // BUG (deliberate): misaligned for offset % 4 != 0
}

}  // namespace
}  // namespace moelab_test

TORCH_LIBRARY(moelab_test, m) {
  m.def("oob_read(Tensor x) -> float", &moelab_test::oob_read);
  m.def("int32_add(int a, int b) -> int", &moelab_test::int32_add);
  m.def("load_int32_at(Tensor x, int offset) -> int", &moelab_test::load_int32_at);
}
