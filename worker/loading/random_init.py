"""Deterministic random weights for ``--random-weights`` (tests, benchmarks, smoke runs)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.layers.blocks import RMSNorm

INIT_STD = 0.02


def norm_identities(model: nn.Module) -> dict[int, float]:
    """id(weight) -> the value that makes it the identity, for every RMSNorm weight: 1, or 0 for
    Gemma 3's (1 + w) norms."""
    return {
        id(m.weight): 1.0 - m.style.offset
        for m in model.modules()
        if isinstance(m, RMSNorm) and m.weight is not None
    }


def fill_entry(
    name: str,
    entry: torch.Tensor,
    out: torch.Tensor,
    norm_weights: dict[int, float],
    draw: Callable[[torch.Tensor], object],
) -> None:
    """`out` (`entry`'s shape) filled as the recipe fills the model's state-dict entry `name`
    (`entry` itself, or a copy elsewhere: a checkpoint's file): a norm at its identity, a bias
    0, another parameter by `draw(out)`, another buffer (gemma4 ``layer_scalar``) 1."""
    if id(entry) in norm_weights:
        out.fill_(norm_weights[id(entry)])
    elif name.endswith(".bias"):
        out.zero_()
    elif isinstance(entry, nn.Parameter):
        draw(out)
    else:
        out.fill_(1.0)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer in place, the same way on every device.

    Linear and embedding weights ~ N(0, 0.02), biases 0, norms at their identity (w = 1, or
    w = 0 for Gemma 3's (1 + w) norms), other buffers (gemma4 ``layer_scalar``) 1.
    Values are drawn on the CPU from one seeded generator in parameter order.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def draw(tensor: torch.Tensor) -> None:
        values = torch.empty(tensor.shape, dtype=torch.float32)
        tensor.copy_(values.normal_(0.0, INIT_STD, generator=generator))

    norm_weights = norm_identities(model)
    for name, tensor in model.state_dict(keep_vars=True).items():
        fill_entry(name, tensor, tensor, norm_weights, draw)
