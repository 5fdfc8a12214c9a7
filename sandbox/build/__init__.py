"""Building: the workspace's kernels into the `cuda_extension` module (ninja, nvcc/g++), the torch
toolchain's flags, compiler diagnostics, and the fixed infrastructure every extension links (`infra/`)."""
