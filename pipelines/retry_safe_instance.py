"""``RetrySafeInstance``, by the name the ``infra/`` configs load it with (``instance_class:
{module: pipelines.retry_safe_instance, class: RetrySafeInstance}``): a Dagster instance whose
failed runs are always seen as failed by the retry daemon. It rests on Dagster internals, so
it lives in ``assets.support.dagster_private`` with every other private use.
"""

from assets.support.dagster_private import RetrySafeInstance

__all__ = ["RetrySafeInstance"]
