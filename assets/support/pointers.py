"""One writer per pointer: the pools of the unpartitioned assets, and what a step that lost a
pointer race does.

Every unpartitioned asset (``<ds>/merged``, ``<ds>/pruned``, ``<ds>/nanoset``,
``<ds>/dataset_info``, ``blend/<name>``) runs in a pool of its kind whose limit is 1
(:data:`SINGLE_WRITER_POOLS`, set in the instance by ``pipelines.instance.ensure_pool_limits``):
two runs never build the same asset at once, from automation, ``refresh_job`` or ``tokenmill
materialize`` alike. A pool is per kind, not per asset, because Dagster keeps per-pool limits in
the instance database (``dagster.yaml`` only takes a default, which the shard pools use): a
fixed set of names is set once, whatever the recipe.

The pools are the first line; the pointer writes themselves are compare-and-swap
(``tokenmill.storage.versions``, and conditional PUTs on S3), which also covers writers outside
the instance (``tokenmill blend``, another deployment, run-granularity pools that an in-process
run does not wait for). A step whose pointer write is refused (:func:`rerun_superseded`) has
finished an immutable version; it runs once more against the pointer as it is now. When its
inputs are unchanged since the winner read them, the re-run computes the winner's version and
moves nothing (the step reports ``superseded_by``); when they are newer, it reuses its own
complete version and moves the pointer forward from the winner's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue

from tokenmill.errors import ConflictError

MERGED_POOL = "tokenmill_merged"
PRUNED_POOL = "tokenmill_pruned"
NANOSET_POOL = "tokenmill_nanoset"
BLEND_POOL = "tokenmill_blend"
DATASET_INFO_POOL = "tokenmill_dataset_info"
SINGLE_WRITER_POOLS = (MERGED_POOL, PRUNED_POOL, NANOSET_POOL, BLEND_POOL, DATASET_INFO_POOL)
CONFLICT_TRIES = 3  # a step refused this many times in a row fails, naming the last winner


def rerun_superseded(
    body: Callable[..., MaterializeResult],
) -> Callable[..., MaterializeResult]:
    """Wrap an asset body that moves a pointer: on ConflictError run it again (it reads the
    pointer and its inputs anew), up to ``CONFLICT_TRIES`` times; the result then carries
    ``superseded_by`` (the version that won) and ``superseded_version`` (the refused one)."""

    @functools.wraps(body)
    def step(context: AssetExecutionContext, *args: Any, **kwargs: Any) -> MaterializeResult:
        refused: ConflictError | None = None
        attempt = 1
        while True:
            try:
                result = body(context, *args, **kwargs)
            except ConflictError as exc:
                if attempt == CONFLICT_TRIES:
                    raise Failure(
                        description=f"the pointer moved {attempt} times during this step, "
                        f"last to {exc.found}: {exc}",
                        metadata={"superseded_by": MetadataValue.text(str(exc.found))},
                    ) from exc
                context.log.warning(f"superseded by {exc.found}: {exc}; running again")
                refused, attempt = exc, attempt + 1
                continue
            if refused is None:
                return result
            metadata = {
                **(result.metadata or {}),
                "superseded_by": MetadataValue.text(str(refused.found)),
                "superseded_version": MetadataValue.text(refused.version),
            }
            return result._replace(metadata=metadata)

    return step
