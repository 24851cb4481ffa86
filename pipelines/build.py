"""Assemble the ``Definitions`` of a recipe: assets, checks, jobs, sensors, schedules, resources."""

from __future__ import annotations

from dagster import Definitions, SensorDefinition, in_process_executor

from assets.factory import build_assets
from assets.support.resources import StorageResource, TokenizerResource
from pipelines.jobs import merge_job, refresh_job, shard_job
from pipelines.schedules import build_refresh_schedule, build_reprocess_schedule
from pipelines.sensors import (
    automation_sensor,
    build_recipe_sensor,
    build_shard_sensor,
    build_takedown_sensor,
)
from tokenmill.recipe import Recipe


def resources_for(recipe: Recipe) -> dict[str, object]:
    """The ``storage`` and ``tokenizer`` resources configured from a recipe."""
    return {
        "storage": StorageResource(
            root=recipe.storage.root, s3_endpoint_url=recipe.storage.s3_endpoint_url
        ),
        "tokenizer": TokenizerResource(
            path=recipe.tokenizer.path,
            append_eod=recipe.tokenizer.append_eod,
            workers=recipe.tokenizer.workers,
        ),
    }


def build_definitions(recipe: Recipe) -> Definitions:
    """Everything Dagster needs for one recipe. Runs execute their steps in one process: the
    steps are sequential and short, and a process per step would cost more than the work."""
    assets, checks = build_assets(recipe)
    refresh = refresh_job(recipe)
    jobs = [refresh]
    sensors: list[SensorDefinition] = [automation_sensor(), build_recipe_sensor(recipe, refresh)]
    if recipe.takedown.list is not None:
        sensors.append(build_takedown_sensor(recipe, refresh))
    schedules = []
    for ds in recipe.datasets:
        per_dataset = [shard_job(ds), merge_job(ds.name)]
        jobs += per_dataset
        endpoint = recipe.storage.s3_endpoint_url
        sensors.append(build_shard_sensor(ds, per_dataset, endpoint))
        if recipe.schedules.reprocess:
            schedules.append(
                build_reprocess_schedule(ds, recipe.schedules.reprocess, per_dataset[0], endpoint)
            )
    if recipe.schedules.refresh:
        schedules.append(build_refresh_schedule(recipe.schedules.refresh, refresh))
    return Definitions(
        executor=in_process_executor,
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=sensors,
        schedules=schedules,
        resources=resources_for(recipe),
    )
