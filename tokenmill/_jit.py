"""numba compilation of the index and blend kernels, when numba (pipeline extra) is installed.

Kernels are plain Python functions in numba's subset; every caller keeps an exact numpy path
for when numba is missing. ``tokenmill.loader`` never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import numba
except ImportError:  # the library works without numba, only slower
    numba = None  # type: ignore[assignment]


def available() -> bool:
    """True when numba can be imported."""
    return numba is not None


def compile_kernel(kernel: Callable[..., Any], *, inline: bool = False) -> Callable[..., Any]:
    """Machine code for ``kernel`` that releases the GIL; cached on disk when possible.

    ``inline`` kernels are helpers compiled into their callers instead.
    """
    if inline:
        return numba.njit(inline="always")(kernel)
    try:
        return numba.njit(cache=True, nogil=True)(kernel)
    except RuntimeError:  # numba found no writable cache location
        return numba.njit(nogil=True)(kernel)
