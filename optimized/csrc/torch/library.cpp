// The moelab op library: defines the namespace and the ISA introspection ops. Each op's
// schema and CPU kernel are registered in its own binding file (TORCH_LIBRARY_FRAGMENT).
#include <cmath>
#include <map>
#include <mutex>
#include <string>

#include "common.h"

namespace moelab {

void check_cpu(const at::Tensor& t, const char* op, const char* arg, int64_t ndim,
               std::initializer_list<at::ScalarType> dtypes, bool contiguous) {
  MOELAB_CHECK(t.device().is_cpu(), op, arg, "must be a CPU tensor, got ", t.device());
  MOELAB_CHECK(ndim < 0 || t.dim() == ndim, op, arg, "must be ", ndim, "-D, got ", t.dim(), "-D");
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  MOELAB_CHECK(ok, op, arg, "has unsupported dtype ", t.scalar_type());
  MOELAB_CHECK(!contiguous || t.is_contiguous(), op, arg, "must be contiguous");
}

void check_range(const at::Tensor& t, const char* op, const char* arg, int64_t lo, int64_t hi) {
  if (t.numel() == 0) return;
  int64_t mn = t.min().item<int64_t>(), mx = t.max().item<int64_t>();
  MOELAB_CHECK(mn >= lo && mx < hi, op, arg, "holds ", (mn < lo ? mn : mx),
               ", outside the valid range [", lo, ", ", hi, ")");
}

void check_finite(double v, const char* op, const char* arg) {
  MOELAB_CHECK(std::isfinite(v), op, arg, "must be a finite float, got ", v);
}

int64_t check_numel(std::initializer_list<int64_t> sizes, int64_t elem_size, const char* op, const char* arg) {
  int64_t n = 1;
  bool overflow = false;
  for (int64_t s : sizes) {
    MOELAB_CHECK(s >= 0, op, arg, "gives a negative output size ", s);
    overflow = overflow || __builtin_mul_overflow(n, s, &n);
  }
  int64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(n, elem_size, &bytes);
  if (overflow) {
    std::string shape;
    for (int64_t s : sizes) shape += (shape.empty() ? "" : ", ") + std::to_string(s);
    MOELAB_CHECK(false, op, arg, "makes an output of shape [", shape, "] (", elem_size,
                 "-byte elements) whose byte size overflows int64");
  }
  return n;
}

Span span_of(const at::Tensor& t, const char* name) {
  if (!t.defined() || t.numel() == 0) return {name, 0, 0};
  int64_t last = 0;   // element offset of the last element (strides are >= 0 in torch)
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {name, lo, lo + uintptr_t(last + 1) * uintptr_t(t.element_size())};
}

void check_disjoint(std::initializer_list<Span> inputs, std::initializer_list<Span> outputs, const char* op) {
  auto meet = [](const Span& a, const Span& b) { return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi; };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const Span& i : inputs)
      MOELAB_CHECK(!meet(*o, i), op, o->name, "must not share memory with input '", i.name, "'");
    for (auto o2 = o + 1; o2 != outputs.end(); ++o2)
      MOELAB_CHECK(!meet(*o, *o2), op, o->name, "must not share memory with output '", o2->name, "'");
  }
}

Fmt fmt_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return Fmt::kBF16;
    case at::kHalf: return Fmt::kF16;
    default: return Fmt::kF32;
  }
}

static std::map<std::string, int>& op_levels() {
  static std::map<std::string, int> m;
  return m;
}
static std::mutex& op_levels_mutex() {
  static std::mutex m;
  return m;
}

int register_op_level(const char* op, cpu::Isa max_level) {
  std::lock_guard<std::mutex> g(op_levels_mutex());
  op_levels()[op] = static_cast<int>(max_level);
  return 0;
}

cpu::Isa op_isa(cpu::Isa max_level) {
  int a = static_cast<int>(cpu::active_isa()), m = static_cast<int>(max_level);
  return static_cast<cpu::Isa>(a < m ? a : m);
}

static std::vector<std::string> backend_info() {
  std::lock_guard<std::mutex> g(op_levels_mutex());
  std::vector<std::string> out;
  out.push_back(std::string("detected:") + cpu::isa_name(cpu::detected_isa()));
  out.push_back(std::string("active:") + cpu::isa_name(cpu::active_isa()));
  for (auto& [op, lvl] : op_levels()) out.push_back(op + ":" + cpu::isa_name(op_isa(static_cast<cpu::Isa>(lvl))));
  return out;
}

static void set_isa(const std::string& name) {
  cpu::Isa isa;
  TORCH_CHECK(cpu::parse_isa(name.c_str(), &isa), "moelab::set_isa: argument 'name' must be one of "
              "scalar, avx2, avx512, avx512_bf16; got '", name, "'");
  cpu::set_isa_cap(isa);
}

}  // namespace moelab

TORCH_LIBRARY(moelab, m) {
  m.def("backend_info() -> str[]", &moelab::backend_info);
  m.def("set_isa(str name) -> ()", &moelab::set_isa);
}
