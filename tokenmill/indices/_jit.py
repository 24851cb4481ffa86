"""numba compilation of the index and blend kernels when numba (the ``pipeline`` extra, not the
base install) is importable: kernels are plain Python in numba's subset, each with a numpy path
giving the same result without it. ``tokenmill.loader`` never imports this module.
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
    """A numba dispatcher for ``kernel``, compiled on first call to code that releases the GIL
    (cached on disk when numba finds a writable folder); ``inline``: compiled into callers."""
    if inline:
        return numba.njit(inline="always")(kernel)
    try:
        return numba.njit(cache=True, nogil=True)(kernel)
    except RuntimeError:  # numba found no writable cache location
        return numba.njit(nogil=True)(kernel)
