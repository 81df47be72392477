"""What the sensors ask of the run queue before requesting runs, and the clean stop of lane
workers (the demo, a shutdown, ``email-platform workers stop``)."""

from collections.abc import Sequence
from typing import TypeVar

from dagster import (
    DagsterInstance,
    DagsterInvariantViolationError,
    DagsterRunStatus,
    RunsFilter,
    SensorEvaluationContext,
)

from email_platform.common.lanes import STOP_TAG

T = TypeVar("T")

#: Key in the instance's key-value store: until when (epoch seconds) no warm worker is started.
WARM_HOLD_KEY = "email_platform/warm_workers_held_until"
#: Worker runs that have not finished (a queued one counts: it will start). Here, not in
#: ``outbox``: the outbox sensors and ``stop_lane_workers`` both read it, and ``outbox``
#: imports this module.
UNFINISHED_RUN_STATUSES = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]


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


def stop_lane_workers(instance: DagsterInstance, lane: str | None = None) -> int:
    """Tag every unfinished lane-worker run (of ``lane``, or all) with ``STOP_TAG``; returns how
    many are unfinished. Each sees its batch in flight through, gives back what it holds and
    ends as a success within seconds; a queued one ends so as soon as it starts."""
    runs = instance.get_runs(
        RunsFilter(
            job_name="lane_worker_job",
            statuses=UNFINISHED_RUN_STATUSES,
            tags={"email/lane": lane} if lane else {},
        )
    )
    for run in runs:
        if STOP_TAG not in run.tags:
            instance.add_run_tags(run.run_id, {STOP_TAG: "requested"})
    return len(runs)


def hold_warm_workers(instance: DagsterInstance, until_ts: float) -> None:
    """Start no warm worker before ``until_ts`` (a drain: the sensors still tick, and would
    otherwise replace every warm worker the drain stops). Workers for due events still start."""
    instance.run_storage.set_cursor_values({WARM_HOLD_KEY: repr(until_ts)})


def warm_workers_held(instance: DagsterInstance | None, now_ts: float) -> bool:
    if instance is None:
        return False
    value = instance.run_storage.get_cursor_values({WARM_HOLD_KEY}).get(WARM_HOLD_KEY)
    try:
        return value is not None and float(value) > now_ts
    except ValueError:
        return False
