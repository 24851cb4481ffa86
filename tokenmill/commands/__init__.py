"""CLI subcommands; each module has ``register(subparsers)`` and a ``run(args) -> int``."""
