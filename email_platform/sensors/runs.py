"""What the batching sensors ask of the run queue before requesting runs."""

from collections.abc import Sequence
from typing import TypeVar

from dagster import (
    DagsterInstance,
    DagsterInvariantViolationError,
    DagsterRunStatus,
    RunsFilter,
    SensorEvaluationContext,
)

T = TypeVar("T")


def instance_of(context: SensorEvaluationContext) -> DagsterInstance | None:
    """The sensor's instance; None for a context built without one (no runs to look at)."""
    try:
        return context.instance
    except DagsterInvariantViolationError:
        return None


def queued_runs(instance: DagsterInstance | None, job_name: str, lane: str) -> int:
    """Runs of ``job_name`` tagged ``email/lane=lane`` waiting in the run queue."""
    if instance is None:
        return 0
    return instance.get_runs_count(
        RunsFilter(job_name=job_name, tags={"email/lane": lane}, statuses=[DagsterRunStatus.QUEUED])
    )


def whole_batches(rows: Sequence[T], batch_size: int, queue_is_waiting: bool) -> list[T]:
    """``rows``, less a trailing partial batch while the lane already has a run waiting in the
    run queue: that batch would only wait behind it, and by the next tick more rows join it.
    Under a backlog the lane so gets full batches instead of one small run per tick (each run
    costs two process starts); with no run queued a partial batch goes out at once."""
    if not queue_is_waiting:
        return list(rows)
    return list(rows[: len(rows) // batch_size * batch_size])
