"""Path-safety rules for names and relative paths read from recipes, manifests and keys: every
stage checks a name here before joining it under a folder, so a tampered or mistyped value can
never name a file outside it. Stdlib only: the loader and the producers both import it."""

from __future__ import annotations

import re

from tokenmill.errors import ConfigError

VERSION_CHARS = 16  # a version folder is named by the first 16 hex digits of its version hash
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def is_lower_hex(text: str) -> bool:
    """True when ``text`` is lowercase hex digits only (a version hash or its folder name)."""
    return bool(text) and all(c in "0123456789abcdef" for c in text)


def has_control_character(text: str) -> bool:
    """True when ``text`` holds an ASCII control character (C0 or DEL)."""
    return _CONTROL.search(text) is not None  # one C scan: manifests hold thousands of paths


def leading_parents(relative: str) -> int | None:
    """How many ``..`` lead the ``/``-separated path, or None when a ``..`` follows a folder
    name (``os.path.relpath`` never writes that; only a tampered manifest does)."""
    parts = relative.split("/")
    leading = next((i for i, part in enumerate(parts) if part != ".."), len(parts))
    return None if ".." in parts[leading:] else leading


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one file-name part inside a folder (empty, ``.`` or ``..``, a
    slash or backslash, a control character), or None when it can."""
    if not name:
        return "is empty"
    if name in (".", ".."):
        return f"is {name!r}"
    if "/" in name or "\\" in name:
        return "contains a slash or backslash"
    return "contains a control character" if has_control_character(name) else None


def document_stem(prefix: str, text_key: str) -> str:
    """``<prefix>_<text_key>_document``: Megatron's ``preprocess_data.py`` naming of a pair;
    ConfigError when ``text_key`` is not one file-name part (the files would go elsewhere)."""
    problem = name_problem(text_key)
    if problem:
        raise ConfigError(
            f"text_key {text_key!r} {problem}; it is part of the file names "
            "<prefix>_<text_key>_document.*, so it must be one file-name part"
        )
    return f"{prefix}_{text_key}_document"


def relative_path_problem(relative: str) -> str | None:
    """Why a ``/``-separated path cannot be joined under a folder and stay there, one file per
    name (absolute, or a part that :func:`name_problem` refuses), or None when it can."""
    if relative.startswith("/"):
        return "is absolute"
    for part in relative.split("/"):
        problem = name_problem(part)
        if problem:
            return f"has a part that {problem}" if relative else problem
    return None
