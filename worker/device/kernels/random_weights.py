"""`--random-weights` drawn on the model's own device (seconds for 31B on a GPU, where the
CPU draw of `worker.loading.random_init.init_random_weights` takes minutes).

Same recipe as that function (Linear / embedding weights ~ N(0, 0.02), biases 0, norms at
their identity, other buffers 1) from a generator on the device, so the values differ from
the CPU draw: use it for benchmarks, and the CPU draw where GPU and CPU must agree.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.blocks import RMSNorm
from worker.loading.random_init import INIT_STD


@torch.no_grad()
def init_random_weights_on_device(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer in place on its own device."""
    norm_weights = {
        id(m.weight): 1.0 - m.style.offset
        for m in model.modules()
        if isinstance(m, RMSNorm) and m.weight is not None
    }
    generators: dict[torch.device, torch.Generator] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in norm_weights:
            tensor.fill_(norm_weights[id(tensor)])
        elif name.endswith(".bias"):
            tensor.zero_()
        elif isinstance(tensor, nn.Parameter):
            gen = generators.get(tensor.device)
            if gen is None:
                gen = generators[tensor.device] = torch.Generator(tensor.device).manual_seed(seed)
            tensor.normal_(0.0, INIT_STD, generator=gen)
        else:
            tensor.fill_(1.0)
