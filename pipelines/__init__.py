"""The Dagster code location (with ``assets/``): definitions, partitions, sensors, schedules, jobs.

Loaded by ``workspace.yaml`` from the repo root; the ``tokenmill`` library never imports it.
"""
