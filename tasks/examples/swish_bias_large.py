import torch
import torch.nn as nn


class Model(nn.Module):
    """SiLU (x * sigmoid(x)) followed by a learned per-feature bias.

    The same model as example/swish_bias, sized for a data-centre GPU: a 1 GiB activation makes eager
    PyTorch's two passes over memory (silu, then the add) take about 1.4 ms on an H100, well past launch
    overhead, so a fused kernel's single pass shows as a real speedup. The GPU demo runs this task.
    """

    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) + self.bias


batch_size = 32768
features = 8192


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
