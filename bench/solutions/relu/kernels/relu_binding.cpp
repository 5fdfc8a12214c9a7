#include "binding_registry.h"

#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

void launch_relu(const float* x, float* y, int64_t n, cudaStream_t s);

static at::Tensor relu_forward(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "relu_forward: expected a contiguous float32 CUDA tensor");
  at::Tensor y = at::empty_like(x);
  launch_relu(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), c10::cuda::getCurrentCUDAStream());
  return y;
}

static void register_relu(pybind11::module& m) { m.def("relu_forward", &relu_forward, "ReLU (CUDA)"); }

REGISTER_BINDING(relu, register_relu);
