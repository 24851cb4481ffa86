"""The dependency-free PNG writer: valid chunks, exact pixels, deterministic bytes."""

from __future__ import annotations

import base64
import struct
import zlib

import numpy as np
import pytest

from assets.png import bar_chart_png, encode_png, markdown_image, short_number


def decode(png: bytes) -> np.ndarray:
    """A minimal reader for what encode_png writes (8-bit RGB, filter 0), checking every CRC."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + data) & 0xFFFFFFFF
        chunks[kind] = data
        pos += 12 + length
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, -1)
    assert not rows[:, 0].any()  # filter type 0 on every row
    return rows[:, 1:].reshape(height, width, 3)


def test_encode_round_trip() -> None:
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    assert np.array_equal(decode(encode_png(img)), img)
    with pytest.raises(ValueError, match="uint8"):
        encode_png(img.astype(np.int32))


def test_bar_chart_heights_follow_values() -> None:
    png = bar_chart_png([1, 4, 2, 0], ["1", "2", "4", "8"], height=40)
    img = decode(png)
    bar = np.all(img == (66, 106, 196), axis=2)
    columns = bar.sum(axis=0)
    heights = sorted({int(h) for h in columns if h})
    assert heights == [10, 20, 40]  # 1/4, 2/4 and 4/4 of the plot height; the 0 bar is empty
    assert png == bar_chart_png([1, 4, 2, 0], ["1", "2", "4", "8"], height=40)


def test_empty_chart_and_label_count() -> None:
    assert decode(bar_chart_png([])).shape[2] == 3
    with pytest.raises(ValueError, match="2 labels for 1 values"):
        bar_chart_png([1], ["a", "b"])


def test_short_numbers_and_markdown() -> None:
    assert [short_number(v) for v in (7, 1024, 1536, 2_000_000)] == ["7", "1k", "1.5k", "2M"]
    data = b"\x89PNG"
    encoded = base64.b64encode(data).decode()
    assert markdown_image(data, "hist") == f"![hist](data:image/png;base64,{encoded})"
