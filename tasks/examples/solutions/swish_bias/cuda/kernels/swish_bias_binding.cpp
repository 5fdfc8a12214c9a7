#include "binding_registry.h"

#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

void launch_swish_bias(const float* x, const float* bias, float* y, int64_t n, int64_t cols,
                       cudaStream_t stream);

static at::Tensor swish_bias_forward(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "swish_bias_forward: x must be a contiguous float32 CUDA tensor");
  TORCH_CHECK(bias.is_cuda() && bias.dim() == 1 && bias.size(0) == x.size(-1) && bias.is_contiguous(),
              "swish_bias_forward: bias must be a contiguous CUDA vector matching the last dimension of x");
  at::Tensor y = at::empty_like(x);
  if (x.numel() == 0) return y;
  launch_swish_bias(x.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<float>(), x.numel(), x.size(-1),
                    c10::cuda::getCurrentCUDAStream());
  return y;
}

static void register_swish_bias(pybind11::module& m) {
  m.def("swish_bias_forward", &swish_bias_forward, "fused SiLU + bias (CUDA)");
}

REGISTER_BINDING(swish_bias, register_swish_bias);
