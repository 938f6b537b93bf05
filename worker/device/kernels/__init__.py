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
