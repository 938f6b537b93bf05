"""build_model: the one constructor the loader calls, and the supported architectures."""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.models.causal_lm import CausalLM
from worker.models.config import SUPPORTED_ARCHITECTURES, Family, ModelConfig
from worker.models.gemma3 import build_gemma3
from worker.models.gemma4 import build_gemma4
from worker.models.llama import build_llama
from worker.models.qwen3_5_moe import build_qwen3_5_moe

__all__ = ["SUPPORTED_ARCHITECTURES", "build_model"]

_BUILDERS: dict[Family, Callable[[ModelConfig, torch.dtype], CausalLM]] = {
    "llama": build_llama,
    "gemma3": build_gemma3,
    "gemma4": build_gemma4,
    "qwen3_5_moe": build_qwen3_5_moe,
}


def build_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> CausalLM:
    """An nn.Module with HF parameter names whose storage is allocated but NOT initialized.

    The module is built on the meta device (no init pass, no memory) and then given empty storage
    on ``device`` once, so loading does not allocate twice. Fill it with ``load_weights`` or
    ``worker.loading.random_init.init_random_weights``. ``device="meta"`` leaves it storage-less.
    """
    with torch.device("meta"):
        model = _BUILDERS[config.family](config, dtype)
    if torch.device(device).type != "meta":
        model = model.to_empty(device=device)
    return model.eval()
