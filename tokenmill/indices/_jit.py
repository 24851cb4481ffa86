"""numba compilation of the index and blend kernels, when numba (a dependency of the
``pipeline`` extra, not of the base install) is importable.

Kernels are plain Python functions in numba's subset. ``_sample_index`` and ``_shuffle`` compile
theirs on first use, ``_blend_kernels`` when it is imported; each keeps a numpy path giving the
same result for when numba is missing. ``tokenmill.loader`` never imports this module.
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
