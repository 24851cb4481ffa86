"""CLI subcommands; each module has ``register(subparsers)`` and a ``run(args) -> int``."""

import argparse

# Why the one-off commands fail on a bad line while recipes quarantine by default (shown in help).
BAD_RECORD_HELP = (
    "fail: exit 1 naming FILE:LINE (the default, as Megatron's preprocess_data.py, so a one-off "
    "run never drops data unnoticed); quarantine: bad lines go to a .quarantine.jsonl file with "
    "their original bytes (the pipeline's default, where one bad line must not stop a run over "
    "thousands of shards)"
)


def add_storage_options(p: argparse.ArgumentParser, *, root: bool = True) -> None:
    """The options of a command that works on a storage root: the positional ``ROOT`` (unless
    ``root`` is False) and ``--endpoint-url`` (credentials come from the environment only)."""
    if root:
        p.add_argument("root", metavar="ROOT", help="storage root: a folder or s3://bucket/prefix")
    p.add_argument(
        "--endpoint-url",
        help="S3 endpoint (default $AWS_ENDPOINT_URL, else AWS); credentials come from the "
        "environment only",
    )


def add_index_options(p: argparse.ArgumentParser, *, train_help: str) -> None:
    """The index settings ``tokenmill index`` and ``tokenmill blend`` share."""
    from tokenmill.indices.growing import ERA_SAMPLES
    from tokenmill.indices.nanoset_keys import SEMANTICS

    p.add_argument("--sequence-length", type=int, required=True, metavar="S")
    p.add_argument("--split", default="949,50,1", help="train,valid,test weights")
    p.add_argument("--seed", type=int, default=1234, help="index shuffle seed")
    p.add_argument("--train-samples", type=int, metavar="N", help=train_help)
    p.add_argument(
        "--semantics",
        choices=SEMANTICS,
        default="megatron",
        help="index rules; growing: splits by document identity, each version extends the "
        "previous one",
    )
    p.add_argument(
        "--era-samples",
        type=int,
        default=ERA_SAMPLES,
        metavar="N",
        help="growing semantics: samples per shuffled era",
    )


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already states its default
    or there is none worth stating (None, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def throughput(nbytes: int, seconds: float) -> str:
    """``"<rate> MB/s"``: whole MB/s from 100 up, else three significant digits (so a small
    input does not read as 0 MB/s)."""
    rate = nbytes / 1e6 / max(seconds, 1e-9)
    return f"{rate:.0f} MB/s" if rate >= 100 else f"{rate:.3g} MB/s"
