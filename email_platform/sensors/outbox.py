"""One outbox sensor per lane: turn pending events into batched, keyed run requests."""

from collections.abc import Sequence

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from sqlalchemy import Row

from email_platform.jobs import send_email_job
from email_platform.lanes import DEFAULT_LANE_CONFIGS, LANES, Lane
from email_platform.resources import AppDatabase, LanePolicy
from email_platform.store import outbox
from email_platform.timeutil import utcnow


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
                run_config={
                    "ops": {"send_email_batch": {"config": {"lane": lane, "event_ids": event_ids}}}
                },
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


def make_outbox_sensor(lane: Lane) -> SensorDefinition:
    defaults = DEFAULT_LANE_CONFIGS[lane]

    @sensor(
        name=f"{lane.value}_outbox_sensor",
        job=send_email_job,
        minimum_interval_seconds=defaults.interval_s,
        default_status=DefaultSensorStatus.RUNNING,
        description=(
            f"Polls the outbox for due {lane.value} events and requests send runs in batches "
            f"of up to {defaults.batch_size}. Stop this sensor to pause {lane.value} mail; "
            "the other lanes keep going. Events stay pending, nothing is lost."
        ),
    )
    def _outbox_sensor(
        context: SensorEvaluationContext, app_database: AppDatabase, lane_policy: LanePolicy
    ) -> SensorResult | SkipReason:
        config = lane_policy.config_for(lane.value)
        now = utcnow()
        limit = config.batch_size * config.max_runs_per_tick
        with app_database.get_engine().begin() as connection:
            rows = outbox.find_requestable(
                connection, lane.value, now, config.request_timeout_s, limit
            )
            if not rows:
                return SkipReason(f"No due {lane.value} events in the outbox.")
            requests = plan_run_requests(lane.value, rows, config.batch_size, config.run_priority)
            # Marked before the requests leave the tick: a batch waits for its run instead of
            # being requested again (in another shape) by the next tick.
            outbox.mark_requested(connection, [r.event_id for r in rows], now)
        context.log.info(f"{len(requests)} {lane.value} run request(s) for {len(rows)} event(s)")
        return SensorResult(run_requests=requests)

    return _outbox_sensor


outbox_sensors: list[SensorDefinition] = [make_outbox_sensor(lane) for lane in LANES]
