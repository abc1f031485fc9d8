// moelab_fastcall: the moelab ops a decode step calls, bound through pybind11 with their C++
// types, each calling the dispatcher's typed handle of the op.
//
// Why. `torch.ops.moelab.route(...)` converts its Python arguments against the op's schema
// into a stack of IValues before the dispatcher runs: about 1.1 us for route's four arguments
// on a Zen 4 core, a third of a one-token call (`python -m experiments.micro route_call_cost`).
// A typed handle takes the arguments as C++ values, which pybind11 converts for less.
//
// What stays the same. The call goes through the dispatcher like torch.ops': the CPU or CUDA
// kernel by the tensors' device, Autograd, Python dispatch modes and fake tensors, the
// profiler's record of the op. The kernels' argument checks raise the same RuntimeError. The
// GIL is released while the op runs, as torch.ops does. Under torch.compile the wrappers
// call torch.ops instead (optimized/fastcall.py), since Dynamo cannot trace a pybind11 call.
//
// Each binding's signature is the one the op's CPU kernel was registered with
// (csrc/torch/*.cpp); `typed` checks it when this module is imported, so a mismatch is an
// import error naming the op, never a wrong call.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;

template <class Sig> struct Bind;
template <class R, class... A> struct Bind<R(A...)> {
  static void def(pybind11::module_& m, const char* name) {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow((std::string("moelab::") + name).c_str(), "")
                        .template typed<R(A...)>();
    m.def(name, [op](A... a) -> R { return op.call(std::forward<A>(a)...); },
          pybind11::call_guard<pybind11::gil_scoped_release>());
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moelab ops bound with their C++ types (csrc/python/fastcall.cpp); optimized.fastcall uses them";
  Bind<std::tuple<Tensor, Tensor>(const Tensor&, int64_t, const std::string&, const OptTensor&, double,
                                  std::optional<bool>, int64_t, int64_t, std::optional<double>)>::def(m, "route");
  Bind<Tensor(const Tensor&, const Tensor&)>::def(m, "router_gemm");
  Bind<Tensor(const Tensor&, const Tensor&, const OptTensor&)>::def(m, "skinny_gemm");
  Bind<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t,
                                                  int64_t)>::def(m, "permute");
  Bind<void(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t, int64_t, const Tensor&, const Tensor&,
            const Tensor&, const Tensor&, const Tensor&)>::def(m, "permute_out");
  Bind<Tensor(const Tensor&, const Tensor&, const Tensor&)>::def(m, "unpermute");
}
