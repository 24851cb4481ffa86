"""Following a growing blend from training: which version extends the one in use.

A blend built with ``semantics: growing`` records ``"extends": <version>`` when every split's
sample i is the same as in that version for every i below its length. Versions chain (each
extends the one before), so a job pinned to version v may switch to the current version c when
the chain c → … → v is unbroken: the samples it consumed are the first ones of c, and it
continues at the same step with no replay and no gap. ``tokenmill.loader.FollowGrowth`` and
``reopen_if_extended`` make that check at the steps you choose (e.g. each checkpoint), through
:func:`newest_extension`; anything else (an edited dataset, changed settings, a
version removed from the chain) keeps the job on its version, which stays readable until
``tokenmill gc`` removes it.
"""

from __future__ import annotations

import os

from tokenmill.errors import ConfigError
from tokenmill.formats.blend_manifest import (
    manifest_path,
    read_blend_manifest,
    version_manifest_path,
)


def newest_extension(manifest: str | os.PathLike[str], version: str) -> str | None:
    """The blend's current version when it is ``version`` or extends it through a chain of
    versions each recording the one it extends (all still present), else None."""
    mpath = manifest_path(manifest)
    current = read_blend_manifest(mpath)
    info, seen = current, set()
    while str(info["version"]) != version:
        parent = info.get("extends")
        if parent is None or parent in seen:
            return None
        seen.add(parent)
        try:
            info = read_blend_manifest(version_manifest_path(mpath, str(parent)))
        except ConfigError:  # a version of the chain was removed: the chain cannot be checked
            return None
    return str(current["version"])
