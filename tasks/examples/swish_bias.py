import torch
import torch.nn as nn


class Model(nn.Module):
    """SiLU (x * sigmoid(x)) followed by a learned per-feature bias."""

    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) + self.bias


batch_size = 2048
features = 2048


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
