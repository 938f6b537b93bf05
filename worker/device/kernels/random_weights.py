"""`--random-weights` drawn on the model's own device (seconds for 31B on a GPU, where the
CPU draw of `worker.loading.random_init.init_random_weights` takes minutes).

Same recipe as that function (Linear / embedding weights ~ N(0, 0.02), biases 0, norms at
their identity, other buffers 1) from a generator on the device, so the values differ from
the CPU draw: use it for benchmarks, and the CPU draw where GPU and CPU must agree.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.loading.random_init import INIT_STD, fill_entry, norm_identities


@torch.no_grad()
def init_random_weights_on_device(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer in place on its own device."""
    generators: dict[torch.device, torch.Generator] = {}

    def draw(tensor: torch.Tensor) -> None:
        gen = generators.get(tensor.device)
        if gen is None:
            gen = generators[tensor.device] = torch.Generator(tensor.device).manual_seed(seed)
        tensor.normal_(0.0, INIT_STD, generator=gen)

    norm_weights = norm_identities(model)
    for name, tensor in model.state_dict(keep_vars=True).items():
        fill_entry(name, tensor, tensor, norm_weights, draw)
