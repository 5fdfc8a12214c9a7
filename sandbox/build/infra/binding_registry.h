// Fixed infrastructure: every kernels/*_binding.cpp registers its Python functions here.
//
//   static void register_relu(pybind11::module& m) { m.def("relu_forward", &relu_forward); }
//   REGISTER_BINDING(relu, register_relu);
//
// torch/csrc/utils/pybind.h brings pybind11 and the at::Tensor <-> torch.Tensor casters at a
// fraction of the compile time of torch/extension.h. Include per-op ATen headers
// (ATen/ops/empty.h, ...) and c10/cuda/CUDAStream.h where you need them.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace cuda_agent {

using RegisterFn = void (*)(pybind11::module&);

struct Registration {
  const char* name;
  RegisterFn fn;
};

inline std::vector<Registration>& registry() {
  static std::vector<Registration> entries;
  return entries;
}

struct Registrar {
  Registrar(const char* name, RegisterFn fn) { registry().push_back({name, fn}); }
};

}  // namespace cuda_agent

#define REGISTER_BINDING(name, fn) \
  static ::cuda_agent::Registrar cuda_agent_registrar_##name(#name, fn)
