"""The ``tokenmill`` command: one subcommand module per verb under ``tokenmill.commands``.

Exit codes: 0 success, 1 failure (bad data, failed check, disk error), 2 usage error.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from tokenmill import __version__
from tokenmill.commands import DefaultsHelpFormatter
from tokenmill.errors import ConfigError, TokenmillError

# Each module exposes ``register(subparsers)``, which adds its parser, and ``run(args)``.
COMMANDS = [
    "tokenize",
    "merge",
    "inspect",
    "verify",
    "export",
    "blend",
    "index",
    "materialize",
    "pull",
    "gc",
    "migrate",
    "explain",
    "find",
    "takedown",
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only`` just that subcommand is imported (fast start-up)."""
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="LLM pretraining data preparation."
    )
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    # A subcommand's help shows every option's default.
    subparser = functools.partial(argparse.ArgumentParser, formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(  # type: ignore[call-overload]  # a partial, not a class
        dest="command", required=True, metavar="COMMAND", parser_class=subparser
    )
    for name in COMMANDS if only is None else [only]:
        command = importlib.import_module(f"tokenmill.commands.{name}")
        command.register(sub)
        sub.choices[name].set_defaults(func=command.run)
    return parser


def run_command(
    command: str, body: Callable[[], int | None], interrupted: str = "interrupted"
) -> int:
    """``body()``'s exit code; a tokenmill or disk error (OSError: a full or failing disk, its
    file named) is one ``tokenmill COMMAND: error: …`` line and code 2 for a ConfigError, 1
    otherwise; Ctrl-C is ``tokenmill COMMAND: <interrupted>`` and code 130; a reader that left
    (``tokenmill inspect ... | head``) ends it quietly, code 1."""
    try:
        return int(body() or 0)
    except BrokenPipeError:
        # As Python's docs on SIGPIPE advise: point stdout at devnull so that the flush at
        # exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (TokenmillError, OSError) as exc:
        print(f"tokenmill {command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        print(f"tokenmill {command}: {interrupted}", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(words)
    return run_command(args.command, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
