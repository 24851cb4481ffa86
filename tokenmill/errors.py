"""Exceptions raised by tokenmill; each names the file/record/setting involved so users can act."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class for every error tokenmill raises on purpose."""


class FormatError(TokenmillError):
    """An on-disk artifact (.bin/.idx/.npy/manifest) is malformed or inconsistent."""

    def __init__(self, path: object, field: str, message: str) -> None:
        self.path = str(path)
        self.field = field
        super().__init__(f"{self.path}: {field}: {message}")


class BadRecordError(TokenmillError):
    """An input record cannot be used; carries the file and 1-based line number."""

    def __init__(self, path: object, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}:{line}: {reason}")


class InputError(TokenmillError):
    """An input file is unreadable as a whole (corrupt compression, missing partner file...)."""


class ConfigError(TokenmillError, ValueError):
    """A setting (CLI flag, recipe field, API argument) has a value that is not allowed."""


class CacheError(TokenmillError):
    """A cached index or manifest does not match what it claims to describe."""


class ConflictError(TokenmillError):
    """A pointer moved between the build's read and its write (compare-and-swap refused): names
    the pointer, the version the build read at its start, the one found, and its own."""

    def __init__(self, path: object, expected: str | None, found: str | None, version: str) -> None:
        self.path = str(path)
        self.expected = expected
        self.found = found
        self.version = version
        super().__init__(
            f"{self.path}: the pointer moved during this build (read {expected or 'no pointer'} "
            f"at the start, found {found or 'no pointer'}); version {version} is complete but "
            "the pointer was left as found"
        )
