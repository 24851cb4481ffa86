"""What the Dagster daemons do with a sensor, driven in process: one tick, its partition
requests applied, and a run request executed as the launched run would be."""

from __future__ import annotations

from dagster import DagsterInstance, Definitions, RunRequest, SensorResult, build_sensor_context


def tick(
    defs: Definitions, instance: DagsterInstance, cursor: str | None, name: str = "docs"
) -> SensorResult:
    """One tick of dataset ``name``'s shard sensor (its partition requests not applied)."""
    sensor = defs.resolve_sensor_def(f"{name}_shard_sensor")
    with build_sensor_context(instance=instance, cursor=cursor, definitions=defs) as context:
        result = sensor(context)
    assert isinstance(result, SensorResult)
    return result


def apply(instance: DagsterInstance, result: SensorResult) -> None:
    """What the sensor daemon does with the partition requests."""
    for request in result.dynamic_partitions_requests or []:
        if type(request).__name__ == "AddDynamicPartitionsRequest":
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
        else:
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)


def execute(defs: Definitions, instance: DagsterInstance, request: RunRequest) -> bool:
    """Run a sensor's request as the launched run would: its job (the refresh job when it names
    none), partition (or range) tags and asset selection; whether it succeeded."""
    result = defs.resolve_job_def(request.job_name or "refresh_job").execute_in_process(
        instance=instance,
        partition_key=request.partition_key,
        tags=dict(request.tags),
        asset_selection=request.asset_selection,
        raise_on_error=False,
    )
    return bool(result.success)
