"""Deterministic random weights for ``--random-weights`` (tests, benchmarks, smoke runs)."""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.blocks import RMSNorm

INIT_STD = 0.02


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer in place, the same way on every device.

    Linear and embedding weights ~ N(0, 0.02), biases 0, norms at their identity (w = 1, or
    w = 0 for Gemma 3's (1 + w) norms), other buffers (gemma4 ``layer_scalar``) 1.
    Values are drawn on the CPU from one seeded generator in parameter order.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    norm_weights = {
        id(m.weight): 1.0 - m.style.offset
        for m in model.modules()
        if isinstance(m, RMSNorm) and m.weight is not None
    }
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in norm_weights:
            tensor.fill_(norm_weights[id(tensor)])
        elif name.endswith(".bias"):
            tensor.zero_()
        elif isinstance(tensor, nn.Parameter):
            values = torch.empty(tensor.shape, dtype=torch.float32)
            values.normal_(0.0, INIT_STD, generator=generator)
            tensor.copy_(values)
        else:
            tensor.fill_(1.0)
