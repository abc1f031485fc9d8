// The moelab op library: defines the namespace and the ISA introspection ops. Each op's
// schema and CPU kernel are registered in its own binding file (TORCH_LIBRARY_FRAGMENT).
#include <map>
#include <mutex>
#include <string>

#include "common.h"

namespace moelab {

void check_is_cpu(const at::Tensor& t, const char* op, const char* arg) {
  MOELAB_CHECK(t.device().is_cpu(), op, arg, "must be a CPU tensor, got ", t.device());
}

void check_cpu(const at::Tensor& t, const char* op, const char* arg, int64_t ndim,
               std::initializer_list<at::ScalarType> dtypes, bool contiguous) {
  check_is_cpu(t, op, arg);
  check_tensor(t, op, arg, ndim, dtypes, contiguous);
}

void check_range(const at::Tensor& t, const char* op, const char* arg, int64_t lo, int64_t hi) {
  if (t.numel() == 0) return;
  int64_t mn = t.min().item<int64_t>(), mx = t.max().item<int64_t>();
  MOELAB_CHECK(mn >= lo && mx < hi, op, arg, "holds ", (mn < lo ? mn : mx),
               ", outside the valid range [", lo, ", ", hi, ")");
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
  TORCH_CHECK(cpu::parse_isa(name.c_str(), &isa), "moelab::set_isa: argument 'name' must be one of ",
              cpu::isa_names(), "; got '", name, "'");
  cpu::set_isa_cap(isa);
}

}  // namespace moelab

TORCH_LIBRARY(moelab, m) {
  m.def("backend_info() -> str[]", &moelab::backend_info);
  m.def("set_isa(str name) -> ()", &moelab::set_isa);
}
