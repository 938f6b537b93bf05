"""Device kernels (Triton) and their pure-torch references.

Every kernel here has a reference in `reference.py` that computes the same function with
plain torch ops; the dispatching entry points in `attention.py` pick the Triton kernel on
CUDA when Triton imports, and the reference otherwise (CPU, tests, no Triton).
"""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (it is optional: CPU installs run without it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install without a usable backend
        return False
    return True
