#include "binding_registry.h"

#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// Eight floats at a time through GCC/Clang vector extensions: the compiler will not vectorize a clamp
// on floats by itself (it must keep FP exceptions), and these lower to AVX2 with -march=native and
// to narrower registers elsewhere.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

// exp(x) with no libm call: Cephes' expf range reduction (x = n ln2 + r, |r| <= ln2/2) and degree-6
// polynomial, about 1 ulp; the clamp keeps 2^n a normal float, and silu's x / (1 + exp(-x)) only needs
// exp to saturate past it.
static inline f8 exp8(f8 x) {
  const f8 lo = f8{} - 87.3f, hi = f8{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  f8 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f8 p = f8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f8 e = p * (r * r) + r + 1.0f;
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  return e * reinterpret_cast<const f8&>(bits);
}

static inline f8 swish_bias8(f8 v, f8 b) { return v / (1.0f + exp8(-v)) + b; }

// One fused pass over memory: y[i, j] = x * sigmoid(x) + bias[j], rows split across OpenMP threads
// (eager PyTorch reads and writes the whole tensor twice: silu, then the add).
static at::Tensor swish_bias_forward(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "swish_bias_forward: x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1) && bias.is_contiguous() &&
                  bias.scalar_type() == at::kFloat,
              "swish_bias_forward: bias must be float32 and match the last dimension of x");
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
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      f8 v, b;
      std::memcpy(&v, xr + c, sizeof v);  // unaligned loads and stores
      std::memcpy(&b, bp + c, sizeof b);
      const f8 y8 = swish_bias8(v, b);
      std::memcpy(yr + c, &y8, sizeof y8);
    }
    if (c < cols) {  // the tail, padded to one vector
      f8 v{}, b{};
      const size_t n = static_cast<size_t>(cols - c) * sizeof(float);
      std::memcpy(&v, xr + c, n);
      std::memcpy(&b, bp + c, n);
      const f8 y8 = swish_bias8(v, b);
      std::memcpy(yr + c, &y8, n);
    }
  }
  return y;
}

static void register_swish_bias(pybind11::module& m) {
  m.def("swish_bias_forward", &swish_bias_forward, "fused SiLU + bias (CPU)");
}

REGISTER_BINDING(swish_bias, register_swish_bias);
