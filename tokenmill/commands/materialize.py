"""``tokenmill materialize``: run the whole pipeline headlessly through Dagster.

The library never imports Dagster, so this runs ``python -m pipelines.materialize`` in a child
process in the code location (the folder holding ``workspace.yaml`` and ``pipelines/``):
``--code-location``, ``$TOKENMILL_CODE_LOCATION``, the current directory or a parent, or the
checkout this package was installed from. ``DAGSTER_HOME`` defaults to
``<code location>/.dagster_home``. The exit code is the child's; SIGINT, SIGTERM and SIGHUP are
passed on to it (it ends its run cleanly) and waited for: no child outlives this command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tokenmill.errors import ConfigError

CODE_LOCATION_ENV = "TOKENMILL_CODE_LOCATION"
ENTRY_MODULE = "pipelines.materialize"
DISPLAY_DIR_ENV = "TOKENMILL_DISPLAY_DIR"  # the caller's directory: paths are shown relative to it
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def is_code_location(path: Path) -> bool:
    """True for a folder with ``workspace.yaml`` and ``pipelines/materialize.py``."""
    return (path / "workspace.yaml").is_file() and (path / "pipelines" / "materialize.py").is_file()


def find_code_location(explicit: str | None = None) -> Path:
    """The code location folder (see the module docstring); ConfigError naming what was tried."""
    chosen = explicit or os.environ.get(CODE_LOCATION_ENV)
    if chosen:
        path = Path(chosen).expanduser().resolve()
        if not is_code_location(path):
            source = "--code-location" if explicit else f"${CODE_LOCATION_ENV}"
            raise ConfigError(
                f"{source} {chosen}: not a tokenmill code location "
                "(expected workspace.yaml and pipelines/materialize.py in it)"
            )
        return path
    cwd = Path.cwd().resolve()
    installed_from = Path(__file__).resolve().parents[2]
    for candidate in (cwd, *cwd.parents, installed_from):
        if is_code_location(candidate):
            return candidate
    raise ConfigError(
        f"no tokenmill code location found from {cwd} upwards or at {installed_from}; run from "
        f"the repo root, or pass --code-location DIR (or set ${CODE_LOCATION_ENV})"
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``materialize`` subcommand."""
    p = sub.add_parser(
        "materialize",
        help="register new shards and materialize every stale asset through Dagster",
        description="Register the shards found in the recipe's sources as partitions, then "
        "materialize every stale asset (raw -> hf -> tokens -> merged -> nanoset -> blends) in "
        "process on the configured Dagster instance (DAGSTER_HOME, default "
        "<code location>/.dagster_home); a second run after adding a shard processes only that "
        "shard and rebuilds what depends on it. Prints the counts and how to open each blend.",
    )
    p.add_argument("--recipe", help="recipe YAML (default $TOKENMILL_RECIPE or recipes/demo.yaml)")
    p.add_argument(
        "--code-location",
        help="folder with workspace.yaml and pipelines/ (default: $TOKENMILL_CODE_LOCATION, "
        "the current folder or a parent, or the checkout tokenmill was installed from)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print Dagster's warnings and full tracebacks (by default each failure is one line "
        "of the summary and the tracebacks go to a log file it names)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``python -m pipelines.materialize`` in the code location; return its exit code."""
    root = find_code_location(args.code_location)
    command = [sys.executable, "-m", ENTRY_MODULE]
    if args.recipe:
        recipe = Path(args.recipe).expanduser().resolve()
        if not recipe.is_file():
            raise ConfigError(f"--recipe {args.recipe}: no such file")
        command += ["--recipe", str(recipe)]
    if args.verbose:
        command.append("--verbose")
    env = dict(os.environ)
    env.setdefault("DAGSTER_HOME", str(root / ".dagster_home"))
    env[DISPLAY_DIR_ENV] = str(Path.cwd())
    # The child runs in ``root``: paths given relative to the caller's directory are fixed here.
    for name in ("DAGSTER_HOME", "TOKENMILL_RECIPE"):
        if env.get(name) and not Path(env[name]).is_absolute():
            env[name] = str(Path(env[name]).resolve())
    return wait_forwarding(subprocess.Popen(command, cwd=root, env=env))


def wait_forwarding(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child``, passing on each SIGINT/SIGTERM/SIGHUP (the child's runs take a
    repeated interrupt as one); its exit code, 128 + N when signal N ended it."""

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code
