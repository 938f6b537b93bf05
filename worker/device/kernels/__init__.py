"""Device kernels (Triton) and their pure-torch references.

Every kernel here has a reference in `reference.py` that computes the same function with
plain torch ops; the dispatching entry points in `attention.py` pick the Triton kernel on
CUDA when Triton imports, and the reference otherwise (CPU, tests, no Triton). Installing
Triton changes nothing on the CPU: only the kernel tests send CPU tensors through it (Triton's
interpreter, TRITON_INTERPRET=1 with TOKENPIPE_TRITON_CPU=1, or by calling a kernel directly).
"""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (optional at run time: CPU installs run without it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install without a usable backend
        return False
    return True


def dependent_launch(device: object) -> bool:
    """Programmatic dependent launch for the quantized GEMVs (on unless TOKENPIPE_QUANT_PDL=0):
    on a CUDA device of compute capability 9+, with a Triton that has grid dependency control
    (+1.7-2.4% at batch 1 on an H200 in five A/B runs over sessions 11-13). The
    GEMV is launched as a dependent of the kernel before it and waits (``gdc_wait``) before
    reading x; the small kernels that precede GEMVs (norms, the gated activation, attention's
    combine) signal ``gdc_launch_dependents`` at their start so it can begin loading weights."""
    import os

    if os.environ.get("TOKENPIPE_QUANT_PDL", "1") == "0":
        return False
    return _dependent_launch_supported(str(device))


def dependent_small(device: object) -> bool:
    """Programmatic dependent launch for the decode step's small kernels too (norms, rotary,
    the KV store, attention's split and combine, the gated activation), where
    ``dependent_launch`` holds, unless TOKENPIPE_PDL_SMALL=0: each is launched as a dependent
    of the kernel before and waits for it (``gdc_wait``) before any memory access, then lets
    its own dependent launch; the GEMV lets its dependent launch once its main loop is done.
    A launch inside a CUDA graph then overlaps the kernel before instead of following it
    (~0.45-0.65 us a kernel boundary on an H200, BENCHMARKS "session 16")."""
    import os

    setting = os.environ.get("TOKENPIPE_PDL_SMALL", "")
    if setting == "0" or (setting != "1" and not _small_dependents[0]):
        return False
    return dependent_launch(device)


# the loaded model's preference (``prefer_small_dependents``); TOKENPIPE_PDL_SMALL=0/1 overrides
_small_dependents = [True]


def prefer_small_dependents(on: bool) -> None:
    """The model's choice for ``dependent_small`` (process-wide: a worker holds one model),
    set before its kernels are first launched or captured. A hybrid model whose steps run
    plain launches between the small kernels can lose by them (Qwen3.5-MoE, BENCHMARKS
    "session 18"); TOKENPIPE_PDL_SMALL=1 or 0 overrides it."""
    _small_dependents[0] = on


@functools.cache
def _dependent_launch_supported(device: str) -> bool:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    try:
        import triton.language.extra.cuda as cuda_extra
    except Exception:  # noqa: BLE001
        return False
    has = hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")
    return has and torch.cuda.get_device_capability(torch.device(device))[0] >= 9
