"""Model families on one set of layers.

The contract the engine uses (see ARCHITECTURE.md, "The model contract"):
``build_model``, ``ModelConfig``, ``StepInput``, ``KVCache``, ``init_random_weights``.
"""

from worker.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from worker.models.kv import KVCache
from worker.models.random_init import init_random_weights
from worker.models.registry import build_model
from worker.models.step import StepInput

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "KVCache",
    "ModelConfig",
    "StepInput",
    "build_model",
    "init_random_weights",
]
