"""A tiny dependency-free PNG writer for bar charts (document-length histograms in the UI).

Pixels are drawn into a numpy ``uint8`` RGB array and encoded as an 8-bit truecolor PNG
(signature, IHDR, one zlib IDAT, IEND; filter 0 on every row). Labels use a built-in 3x5 pixel
font scaled 2x, so no font files or plotting libraries are needed. Same input -> same bytes.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_BACKGROUND = (255, 255, 255)
_AXIS = (90, 90, 90)
_BAR = (66, 106, 196)
_TEXT = (40, 40, 40)
_SCALE = 2  # font pixels per glyph pixel
# 3x5 glyphs, one string of 5 rows of 3 bits each ('#' = ink).
_FONT = {
    "0": "####.##.##.####",
    "1": ".#.##..#..#.###",
    "2": "###..#####..###",
    "3": "###..####..####",
    "4": "#.##.####..#..#",
    "5": "####..###..####",
    "6": "####..####.####",
    "7": "###..#..#..#..#",
    "8": "####.#####.####",
    "9": "####.####..####",
    "k": "#..#.###.#.##.#",
    "M": "#.####.##.##.##",
    "-": "......###......",
    ".": ".............#.",
    " ": "...............",
}


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def encode_png(rgb: npt.NDArray[np.uint8]) -> bytes:
    """PNG bytes of an ``(height, width, 3)`` uint8 image."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"image must be (height, width, 3) uint8, got {rgb.shape} {rgb.dtype}")
    height, width = rgb.shape[:2]
    rows = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], 1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join(
        [
            _SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)),
            _chunk(b"IEND", b""),
        ]
    )


def text_width(text: str) -> int:
    """Pixel width of ``text`` in the built-in font."""
    return max(0, len(text) * 4 * _SCALE - _SCALE)


def _draw_text(img: npt.NDArray[np.uint8], text: str, x: int, y: int) -> None:
    """Draw ``text`` with its top-left corner at (x, y); characters outside the font are skipped."""
    for i, char in enumerate(text):
        glyph = _FONT.get(char)
        if glyph is None:
            continue
        bits = np.array([c == "#" for c in glyph], dtype=bool).reshape(5, 3)
        mask = np.kron(bits, np.ones((_SCALE, _SCALE), dtype=bool))
        x0 = x + i * 4 * _SCALE
        region = img[y : y + mask.shape[0], x0 : x0 + mask.shape[1]]
        region[mask[: region.shape[0], : region.shape[1]]] = _TEXT


def short_number(value: int) -> str:
    """``1536`` -> ``1.5k``, ``2000000`` -> ``2M``: labels that fit under a bar."""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if value >= size:
            text = f"{value / size:.1f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return str(value)


def bar_chart_png(
    values: Sequence[float], labels: Sequence[str] | None = None, *, height: int = 160
) -> bytes:
    """A bar chart: one bar per value, scaled to the largest, optional label under each bar.

    The peak value is written at the top left. An empty ``values`` gives a small blank chart.
    """
    labels = list(labels) if labels is not None else [""] * len(values)
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels for {len(values)} values")
    peak = max((float(v) for v in values), default=0.0)
    label_h = 5 * _SCALE + 6
    bar_w = max([16, *(text_width(t) + 4 for t in labels)])
    left, top = 4, 5 * _SCALE + 8
    width = left + max(1, len(values)) * (bar_w + 2) + 4
    img = np.empty((top + height + label_h, width, 3), np.uint8)
    img[:] = _BACKGROUND
    base = top + height
    img[base, left:width] = _AXIS
    for i, (value, label) in enumerate(zip(values, labels, strict=True)):
        x = left + i * (bar_w + 2) + 1
        bar = round(height * float(value) / peak) if peak > 0 else 0
        if value and not bar:
            bar = 1
        img[base - bar : base, x : x + bar_w] = _BAR
        _draw_text(img, label, x + (bar_w - text_width(label)) // 2, base + 4)
    _draw_text(img, short_number(round(peak)), left, 2)
    return encode_png(img)


def markdown_image(png: bytes, alt: str) -> str:
    """``![alt](data:image/png;base64,...)``: an inline image for markdown metadata."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"
