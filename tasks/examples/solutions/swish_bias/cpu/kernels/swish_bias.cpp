#include "binding_registry.h"

#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>

// One fused pass: y[i, j] = x * sigmoid(x) + bias[j]
static at::Tensor swish_bias_forward(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "swish_bias_forward: x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1) && bias.is_contiguous(),
              "swish_bias_forward: bias must match the last dimension of x");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * cols;
    float* yr = yp + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = xr[c];
      yr[c] = v / (1.0f + std::exp(-v)) + bp[c];
    }
  }
  return y;
}

static void register_swish_bias(pybind11::module& m) {
  m.def("swish_bias_forward", &swish_bias_forward, "fused SiLU + bias (CPU)");
}

REGISTER_BINDING(swish_bias, register_swish_bias);
