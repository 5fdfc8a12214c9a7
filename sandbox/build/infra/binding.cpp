// Fixed infrastructure: the cuda_extension module, filled from the binding registry.
#include "binding_registry.h"

PYBIND11_MODULE(cuda_extension, m) {
  m.doc() = "kernels built by the cuda-agent sandbox";
  for (const auto& entry : cuda_agent::registry()) {
    entry.fn(m);
  }
}
