"""``tokenmill pull``: copy a blend (local or ``s3://``) with exactly the files it needs."""

from __future__ import annotations

import argparse

from tokenmill.commands import add_storage_options
from tokenmill.storage.pull import DEFAULT_JOBS, pull


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``pull`` subcommand."""
    p = sub.add_parser(
        "pull",
        help="copy the files a blend manifest needs into a local folder, verified and resumable",
        description="Copy exactly the files the blend at MANIFEST_URI reads (blend arrays, index "
        "caches, each dataset's .bin/.idx and manifest), hashed while streaming, into DIR with "
        "the source layout; files already complete are skipped, and the blend manifest is "
        "written last. Then open it with tokenmill.loader.open_blend(<printed path>).",
    )
    p.add_argument("manifest", metavar="MANIFEST_URI", help="manifest.json (or its folder), s3://")
    p.add_argument("dest", metavar="DIR", help="local folder; the source layout is kept under it")
    add_storage_options(p, root=False)
    p.add_argument(
        "--version",
        metavar="V",
        help="pull this version of the blend (its hash or first 16 hex digits, as recorded in "
        "ds.version): versions/<v16>/manifest.json beside MANIFEST_URI, and its files",
    )
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="parallel transfers")


def run(args: argparse.Namespace) -> int:
    """Pull, then print what was fetched and the manifest to open."""
    report = pull(
        args.manifest,
        args.dest,
        endpoint_url=args.endpoint_url,
        jobs=args.jobs,
        version=args.version,
    )
    print(
        f"pulled {len(report.fetched)} files ({report.bytes_fetched} bytes), "
        f"{len(report.skipped)} already complete"
    )
    print(f"open with: tokenmill.loader.open_blend({str(report.manifest)!r})")
    return 0
