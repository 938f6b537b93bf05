"""Everything the CUDA path needs after a model is loaded, in one call.

    loaded.model = prepare_model_for_device(loaded, device, random_weights, seed)

On CUDA: merges each layer's q/k/v and gate/up weights (``CausalLM.fuse_projections``: one
GEMV/GEMM each, HF names gone afterwards: call it after the weights are in), and wraps the
model in ``GraphedCausalLM`` (decode steps replayed from CUDA graphs, with the fused Triton
norms / rotary / activation of ``worker.models.layers``). On any other device the model is
returned unchanged, so the CPU path stays bit-for-bit what it was.

Random weights are drawn by ``worker.loading.load_model`` before this runs; drawing them on
the GPU (``worker.kernels.random_weights``) must happen there, not here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch


def prepare_model_for_device(
    loaded: Any,
    device: torch.device | str,
    random_weights: bool = False,
    seed: int = 0,
    *,
    cuda_graphs: bool = True,
) -> Any:
    """-> the model object the Engine should use (``loaded.model`` itself off CUDA).

    ``random_weights`` and ``seed`` are accepted so the call site stays the same when an
    on-device step needs them; the current steps do not. TOKENPIPE_NO_FUSE=1 skips the merge,
    TOKENPIPE_NO_GRAPHS=1 (or ``cuda_graphs=False``) the CUDA graphs.
    """
    del random_weights, seed
    model = loaded.model
    if torch.device(device).type != "cuda":
        return model
    from worker.cuda_graphs import GraphedCausalLM

    inner = model.inner if isinstance(model, GraphedCausalLM) else model
    if os.environ.get("TOKENPIPE_NO_FUSE") != "1" and hasattr(inner, "fuse_projections"):
        merged = inner.fuse_projections()
        torch.cuda.empty_cache()
        print(f"cuda_setup: merged the projections of {merged} modules", file=sys.stderr)
    if isinstance(model, GraphedCausalLM):
        return model
    if cuda_graphs and os.environ.get("TOKENPIPE_NO_GRAPHS") != "1":
        return GraphedCausalLM(model)
    return model
