#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

// One fused pass, four floats per thread (16-byte loads), bias read through the read-only cache.
__global__ void swish_bias_kernel(const float4* __restrict__ x, const float* __restrict__ bias,
                                  float4* __restrict__ y, int64_t n4, int64_t cols) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float4 v = x[i];
    const int64_t c = (i * 4) % cols;
    float4 out;
    out.x = v.x / (1.0f + __expf(-v.x)) + __ldg(bias + c);
    out.y = v.y / (1.0f + __expf(-v.y)) + __ldg(bias + c + 1);
    out.z = v.z / (1.0f + __expf(-v.z)) + __ldg(bias + c + 2);
    out.w = v.w / (1.0f + __expf(-v.w)) + __ldg(bias + c + 3);
    y[i] = out;
  }
}

__global__ void swish_bias_scalar_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                         float* __restrict__ y, int64_t n, int64_t cols) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float v = x[i];
    y[i] = v / (1.0f + __expf(-v)) + bias[i % cols];
  }
}

void launch_swish_bias(const float* x, const float* bias, float* y, int64_t n, int64_t cols,
                       cudaStream_t stream) {
  const int threads = 256;
  if (cols % 4 == 0) {
    const int64_t n4 = n / 4;
    const int blocks = (int)std::min<int64_t>((n4 + threads - 1) / threads, 132 * 16);
    swish_bias_kernel<<<blocks, threads, 0, stream>>>(reinterpret_cast<const float4*>(x), bias,
                                                      reinterpret_cast<float4*>(y), n4, cols);
  } else {
    const int blocks = (int)std::min<int64_t>((n + threads - 1) / threads, 132 * 16);
    swish_bias_scalar_kernel<<<blocks, threads, 0, stream>>>(x, bias, y, n, cols);
  }
}
