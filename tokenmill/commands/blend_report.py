"""Owns the blend report of ``tokenmill blend`` and ``tokenmill inspect``: a per-split table of
requested weights against realized shares."""

from __future__ import annotations

import os

from tokenmill.formats.blend_manifest import (
    SPLITS,
    manifest_path,
    read_blend_manifest,
    schema_errors,
)
from tokenmill.verify import realized_shares


def describe_blend(path: str | os.PathLike[str]) -> str:
    """A per-split table of requested weights against the realized blend proportions."""
    mpath = manifest_path(path)
    manifest = read_blend_manifest(mpath)
    with schema_errors(mpath):
        lines = [
            f"blend {manifest['name']!r}: semantics {manifest['semantics']}, sequence length "
            f"{manifest['sequence_length']}, split {manifest['split']}, seed {manifest['seed']}"
        ]
        shares = realized_shares(manifest, mpath)
        for split in (s for s in SPLITS if s in manifest["splits"]):
            info = manifest["splits"][split]
            if info["mode"] == "exhaustive":
                how = "exhaustive: one epoch of every dataset, shares follow dataset sizes"
            elif info["mode"] == "growing":
                cap = info["samples_requested"]
                how = f"growing, weighted, {'no cap' if cap is None else f'cap {cap}'}"
                how += f", extends {manifest.get('extends') or 'nothing'}"
            elif info["samples_requested"] is None:
                how = "weighted, one epoch of every dataset"
            else:
                how = f"weighted, requested {info['samples_requested']}"
            split_shares = [sh for sh in shares if sh.split == split]
            size = split_shares[0].size if split_shares else 0
            lines += ["", f"{split}: {size} samples ({how})"]
            rows = [["dataset", "weight", "realized", "diff", "samples", "index len", "epochs"]]
            for ds, sh in zip(info["datasets"], split_shares, strict=True):
                rows.append(
                    [
                        ds["name"],
                        f"{sh.requested:.4f}",
                        f"{sh.realized:.4f}",
                        f"{sh.realized - sh.requested:+.4f}",
                        str(sh.samples),
                        str(ds["length"]),
                        f"{ds['epochs']:.3f}",
                    ]
                )
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines += [
                "  ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=True))
                )
                for r in rows
            ]
            lines += [
                f"  left out: {entry['name']} ({entry['reason']})"
                for entry in info.get("skipped", [])
            ]
        return "\n".join(lines)
