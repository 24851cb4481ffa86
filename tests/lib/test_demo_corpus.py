"""The demo corpus (tokenmill_dev.corpus): prose documents hold the text of docstrings and
comments, without the Python syntax around them."""

from __future__ import annotations

import itertools
import re

from tokenmill_dev.corpus import _prose, stdlib_documents

SOURCE = '''x = 1
def f():
    r"""Raw docstring with \\d+ in it.

    Second line."""
# a comment
    B = rb\'\'\'bytes block\'\'\'
    t = f"""{x} formatted"""
'''


def test_prose_drops_quotes_and_string_prefixes() -> None:
    assert _prose(SOURCE).splitlines() == [
        "Raw docstring with \\d+ in it.",
        "Second line.",
        "a comment",
        "B = bytes block",
        "t = {x} formatted",
    ]


def test_raw_docstrings_of_the_stdlib_lose_their_prefix() -> None:
    """Lines that open a ``r\"\"\"`` docstring in the stdlib reach the corpus without the ``r``."""
    docs = list(itertools.islice(stdlib_documents(kind="all"), 1200))
    prose = {line for d in docs if d["kind"] == "docs" for line in d["text"].splitlines()}
    opened = {
        stripped[4:].strip()
        for d in docs
        if d["kind"] == "code"
        for stripped in map(str.strip, d["text"].splitlines())
        if re.fullmatch(r'r"""\w[^"]*', stripped)
    }
    assert opened & prose  # found, without the prefix
    assert not {"r" + line for line in opened} & prose
