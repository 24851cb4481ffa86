"""Length histograms (``tokenmill.tokenize.stats``): power-of-two buckets with the empty ones in
between kept, and a markdown bar table short enough for the Dagster UI to draw inline."""

from __future__ import annotations

import numpy as np

from tokenmill.tokenize.stats import (
    BAR,
    Bucket,
    histogram_markdown,
    histogram_text,
    length_histogram,
)


def test_buckets_keep_the_empty_ones_between_lengths() -> None:
    buckets = length_histogram([3, 3, 200])
    assert [(b.lo, b.hi, b.count) for b in buckets] == [
        (2, 4, 2),
        (4, 8, 0),
        (8, 16, 0),
        (16, 32, 0),
        (32, 64, 0),
        (64, 128, 0),
        (128, 256, 1),
    ]
    assert sum(b.count for b in length_histogram(np.arange(1000))) == 1000
    assert length_histogram([]) == []


def test_markdown_bars_are_proportional_and_empty_buckets_have_none() -> None:
    text = histogram_markdown([Bucket(2, 4, 50), Bucket(4, 8, 0), Bucket(8, 16, 1)])
    lines = text.splitlines()
    assert lines[:2] == ["| tokens from | count | |", "|---:|---:|:---|"]
    assert lines[2] == f"| 2 | 50 | {BAR * 24} |"
    assert lines[3] == "| 4 | 0 |  |"
    assert lines[4] == f"| 8 | 1 | {BAR} |"  # a non-empty bucket always shows


def test_markdown_narrows_its_bars_to_stay_inline() -> None:
    buckets = length_histogram(np.concatenate([np.arange(1, 2**20, 97), np.full(5000, 7)]))
    wide = histogram_markdown(buckets, limit=10_000)
    narrow = histogram_markdown(buckets, limit=len(wide) - 1)
    assert len(narrow) < len(wide) and BAR * 24 in wide and BAR * 24 not in narrow
    assert len(histogram_markdown(buckets)) < 1000
    assert [row.split("|")[2] for row in narrow.splitlines()] == [
        row.split("|")[2] for row in wide.splitlines()
    ]  # same counts, only the bars narrowed


def test_terminal_chart_shows_empty_buckets_without_a_bar() -> None:
    lines = histogram_text([Bucket(2, 4, 4), Bucket(4, 8, 0)], width=8).splitlines()
    assert lines[0].endswith(" 4  ########") and lines[1].endswith(" 0")
