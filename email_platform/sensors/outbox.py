"""One outbox sensor per lane: turn pending events into batched, keyed run requests."""

import time
from collections.abc import Sequence
from typing import Any

from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRecord,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from sqlalchemy import Row

from email_platform.common.ids import new_ulid
from email_platform.common.lanes import (
    DEFAULT_LANE_CONFIGS,
    LANES,
    Lane,
    LaneConfig,
    outbox_sensor_name,
)
from email_platform.common.timeutil import as_utc, utcnow
from email_platform.jobs import (
    lane_worker_job,
    lane_worker_run_config,
    send_email_job,
    send_run_config,
    send_run_event_ids,
)
from email_platform.observability import logs
from email_platform.resources import AppDatabase, LanePolicy
from email_platform.sensors.runs import (
    UNFINISHED_RUN_STATUSES,
    instance_of,
    warm_workers_held,
    whole_batches,
)
from email_platform.store import lane_pauses, lane_workers, outbox


def batch_run_key(lane: str, event_ids: Sequence[str], request_round: int) -> str:
    """``event_id`` for one event, ``{lane}:{first}:{last}`` for a batch.

    A batch requested again (its first run died, or was never launched) gets ``:r{n}``:
    Dagster never re-launches a key it has seen, whatever became of that run.
    """
    base = event_ids[0] if len(event_ids) == 1 else f"{lane}:{event_ids[0]}:{event_ids[-1]}"
    return base if request_round == 0 else f"{base}:r{request_round}"


def plan_run_requests(
    lane: str, rows: Sequence[Row], batch_size: int, run_priority: int
) -> list[RunRequest]:
    requests: list[RunRequest] = []
    seen_keys: set[str] = set()
    for start in range(0, len(rows), batch_size):
        batch = sorted(rows[start : start + batch_size], key=lambda r: r.event_id)
        event_ids = [r.event_id for r in batch]
        run_key = batch_run_key(lane, event_ids, max(r.request_count for r in batch))
        # Dagster's own run_key dedupe is not reliable within one tick with several submit
        # workers; never yield the same key twice.
        if run_key in seen_keys:
            continue
        seen_keys.add(run_key)
        event_types = sorted({r.event_type for r in batch})
        requests.append(
            RunRequest(
                run_key=run_key,
                job_name=send_email_job.name,
                run_config=send_run_config(lane, event_ids),
                tags={
                    "email/lane": lane,
                    "email/event_type": event_types[0] if len(event_types) == 1 else "mixed",
                    "email/batch_size": str(len(event_ids)),
                    "email/first_event_id": event_ids[0],
                    "email/last_event_id": event_ids[-1],
                    "dagster/priority": str(run_priority),
                },
            )
        )
    return requests


#: Most of a worker's lifetime after which the sensor starts its successor, so the lane is
#: never without one while the old worker finishes.
HANDOVER_S = 60.0
#: A started worker run silent for this long is dead (its process is gone: the default run
#: launcher does not notice), and one that never beat within ``STARTUP_GRACE_S`` of its start.
HEARTBEAT_STALE_S = 60.0
STARTUP_GRACE_S = 120.0


def live_workers(
    instance: DagsterInstance, app_database: AppDatabase, lane: LaneConfig, now_ts: float
) -> int:
    """Worker runs of ``lane`` queued, starting, or running and alive, and not about to end.

    A started worker whose heartbeat stopped is reported failed here, so the run failure
    sensor gives its claims back and the UI shows it, and a new worker replaces it.
    """
    records = [
        record
        for record in instance.get_run_records(
            RunsFilter(
                job_name=lane_worker_job.name,
                tags={"email/lane": lane.lane.value},
                statuses=UNFINISHED_RUN_STATUSES,
            )
        )
        # A re-execution replays its parent's dead letters; it does not poll the outbox.
        if record.dagster_run.parent_run_id is None
    ]
    with app_database.get_engine().connect() as connection:
        beats = lane_workers.heartbeats(connection, [r.dagster_run.run_id for r in records])
    handover_s = min(HANDOVER_S, lane.worker_lifetime_s / 4)
    live = 0
    for record in records:
        run = record.dagster_run
        started = record.start_time or record.create_timestamp.timestamp()
        beat = beats.get(run.run_id)
        if run.status == DagsterRunStatus.STARTED and _is_dead(beat, started, now_ts):
            instance.report_run_failed(
                run,
                message=(
                    f"lane worker silent since "
                    f"{beat.heartbeat_at.isoformat() if beat else 'its start'}: its process is "
                    "gone; its claims are released and a new worker starts"
                ),
            )
            continue
        if beat is not None and beat.ended_at is not None:
            continue  # finished its loop; the run is only wrapping up
        if started + lane.worker_lifetime_s - handover_s > now_ts:
            live += 1
    return live


def _is_dead(beat: Any, started_ts: float, now_ts: float) -> bool:
    if beat is None:
        return now_ts - started_ts > STARTUP_GRACE_S
    if beat.ended_at is not None:
        return False
    return now_ts - as_utc(beat.heartbeat_at).timestamp() > HEARTBEAT_STALE_S


def report_dead_holders(instance: DagsterInstance | None, run_ids: Sequence[str]) -> int:
    """Mark failed the started runs whose claims went unrenewed past their lease.

    Their process is gone (the default run launcher does not notice a killed run process), so
    without this they would show as running forever; failing them also lets the run failure
    sensor give back at once what they still hold.
    """
    reported = 0
    if instance is None:
        return reported
    for run_id in run_ids:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.status in (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED):
            instance.report_run_failed(
                run,
                message="its claims went unrenewed past their lease: its process is gone; "
                "its events are released and requested again",
            )
            reported += 1
    return reported


def lane_send_runs(instance: DagsterInstance | None, lane: str) -> list[RunRecord]:
    """The unfinished ``send_email_job`` runs of ``lane``: one fetch per sensor tick."""
    if instance is None:
        return []
    return list(
        instance.get_run_records(
            RunsFilter(
                job_name=send_email_job.name,
                tags={"email/lane": lane},
                statuses=UNFINISHED_RUN_STATUSES,
            )
        )
    )


def _since(record: RunRecord) -> float:
    return record.start_time or record.create_timestamp.timestamp()


def report_idle_send_runs(
    instance: DagsterInstance | None,
    connection: Any,
    records: Sequence[RunRecord],
    now_ts: float,
) -> int:
    """Mark failed the send runs among ``records`` started over ``STARTUP_GRACE_S`` ago that
    hold no event: a live batch run claims at its start and holds its events until it ends
    (retry waits included), so these were killed before claiming, or after what they held was
    taken over. Without this each would fill one of the run queue's slots for good."""
    if instance is None:
        return 0
    started = [
        record
        for record in records
        if record.dagster_run.status == DagsterRunStatus.STARTED
        and now_ts - _since(record) > STARTUP_GRACE_S
    ]
    holders = outbox.holding(connection, [r.dagster_run.run_id for r in started])
    reported = 0
    for record in started:
        if record.dagster_run.run_id not in holders:
            instance.report_run_failed(
                record.dagster_run,
                message=f"running over {STARTUP_GRACE_S:.0f} s and holding no event: its "
                "process is gone",
            )
            reported += 1
    return reported


def awaited_event_ids(records: Sequence[RunRecord], now_ts: float) -> set[str]:
    """Events asked of the send runs among ``records`` that have yet to claim them: queued
    runs (the queue starts each in turn, however long it is), and runs created or started
    within ``STARTUP_GRACE_S``. Requesting these again past ``request_timeout_s`` made a run
    that would claim nothing for each, and on a full run queue those pushed the real ones
    further back. An older run that has not claimed is dead or dying (failed above when it
    started and holds nothing)."""
    awaited: set[str] = set()
    for record in records:
        run = record.dagster_run
        if run.status == DagsterRunStatus.QUEUED or now_ts - _since(record) <= STARTUP_GRACE_S:
            awaited.update(send_run_event_ids(run.run_config))
    return awaited


def worker_run_request(lane: LaneConfig) -> RunRequest:
    return RunRequest(
        # Unique per request: a worker is not tied to events, and the claim is the gate.
        run_key=f"{lane.lane.value}:worker:{new_ulid()}",
        job_name=lane_worker_job.name,
        run_config=lane_worker_run_config(lane.lane.value),
        tags={
            "email/lane": lane.lane.value,
            "email/worker": "lane",
            "dagster/priority": str(lane.run_priority),
        },
    )


def keep_workers(
    context: SensorEvaluationContext, app_database: AppDatabase, lane: LaneConfig
) -> SensorResult | SkipReason:
    """Worker mode: keep ``warm_workers`` running, and up to ``workers`` while events are due."""
    name = lane.lane.value
    live = live_workers(context.instance, app_database, lane, time.time())
    missing = lane.workers - live
    if missing <= 0:
        return SkipReason(f"{lane.workers} {name} worker run(s) running.")
    warm = 0 if warm_workers_held(instance_of(context), time.time()) else lane.warm_workers
    start = max(0, warm - live)
    if start < missing:
        with app_database.get_engine().connect() as connection:
            if outbox.find_due(connection, name, utcnow(), 1):
                start = missing
    if not start:
        return SkipReason(f"No due {name} events in the outbox.")
    context.log.info(f"starting {start} {name} worker run(s)", **logs.fields(lane=name))
    return SensorResult(run_requests=[worker_run_request(lane) for _ in range(start)])


def paused_lane_reason(app_database: AppDatabase, lane: str) -> str | None:
    """The SkipReason of a lane paused in ``lane_pauses`` (by an operator or a brake): who,
    why and since when, and how to resume it; None if it is not paused."""
    with app_database.get_engine().connect() as connection:
        pause = lane_pauses.active(connection, lane)
    if pause is None:
        return None
    kind = "A brake" if pause.paused_by.startswith("brake:") else "An operator"
    return (
        f"{lane_pauses.describe(pause)}. {kind} paused it: nothing is requested and its "
        f"workers end; events stay pending. Resume with `email-platform lanes resume {lane}`."
    )


def make_outbox_sensor(lane: Lane) -> SensorDefinition:
    defaults = DEFAULT_LANE_CONFIGS[lane]

    @sensor(
        name=outbox_sensor_name(lane.value),
        jobs=[send_email_job, lane_worker_job],
        minimum_interval_seconds=defaults.interval_s,
        default_status=DefaultSensorStatus.RUNNING,
        description=(
            f"Keeps {lane.value} mail moving: with lane workers (the default) it starts a "
            f"resident worker run when due {lane.value} events wait and none is running; with "
            f"workers=0 it requests send runs in batches of up to {defaults.batch_size}. Stop "
            f"this sensor, or run `email-platform lanes pause {lane.value}`, to pause "
            f"{lane.value} mail (its workers end within seconds); the other lanes keep going. "
            "Events stay pending, nothing is lost."
        ),
    )
    def _outbox_sensor(
        context: SensorEvaluationContext, email_database: AppDatabase, email_lanes: LanePolicy
    ) -> SensorResult | SkipReason:
        config = email_lanes.config_for(lane.value)
        paused = paused_lane_reason(email_database, lane.value)
        if paused is not None:
            return SkipReason(paused)
        if config.workers > 0:
            return keep_workers(context, email_database, config)
        now = utcnow()
        limit = config.batch_size * config.max_runs_per_tick
        with email_database.get_engine().begin() as connection:
            holders = outbox.holders_past_lease(connection, lane.value, now)
            instance = instance_of(context)
            if holders:
                report_dead_holders(instance, holders)
            runs = lane_send_runs(instance, lane.value)
            report_idle_send_runs(instance, connection, runs, time.time())
            awaited = awaited_event_ids(runs, time.time())
            requestable = [
                row
                for row in outbox.find_requestable(
                    connection, lane.value, now, config.request_timeout_s, limit + len(awaited)
                )
                if row.event_id not in awaited
            ][:limit]
            queued = sum(r.dagster_run.status == DagsterRunStatus.QUEUED for r in runs)
            rows = whole_batches(requestable, config.batch_size, queue_is_waiting=queued > 0)
            if not rows:
                if requestable:
                    return SkipReason(
                        f"{len(requestable)} due {lane.value} event(s) wait for a full batch "
                        f"of {config.batch_size} or an empty queue: {queued} {lane.value} "
                        "run(s) are queued."
                    )
                return SkipReason(f"No due {lane.value} events in the outbox.")
            requests = plan_run_requests(lane.value, rows, config.batch_size, config.run_priority)
            # Marked before the requests leave the tick: a batch waits for its run instead of
            # being requested again (in another shape) by the next tick.
            outbox.mark_requested(connection, [r.event_id for r in rows], now)
        context.log.info(
            f"{len(requests)} {lane.value} run request(s) for {len(rows)} event(s)",
            **logs.fields(
                lane=lane.value, first_event_id=rows[0].event_id, last_event_id=rows[-1].event_id
            ),
        )
        return SensorResult(run_requests=requests)

    return _outbox_sensor


outbox_sensors: list[SensorDefinition] = [make_outbox_sensor(lane) for lane in LANES]
