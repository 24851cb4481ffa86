"""CLI subcommands; each module has ``register(subparsers)`` and a ``run(args) -> int``."""


def throughput(nbytes: int, seconds: float) -> str:
    """``"<rate> MB/s"``: whole MB/s from 100 up, else three significant digits (so a small
    input does not read as 0 MB/s)."""
    rate = nbytes / 1e6 / max(seconds, 1e-9)
    return f"{rate:.0f} MB/s" if rate >= 100 else f"{rate:.3g} MB/s"
