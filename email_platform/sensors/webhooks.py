"""The webhook inbox sensor: stored webhooks become batched ingestion runs."""

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from email_platform.common.timeutil import utcnow
from email_platform.jobs import ingest_run_config, ingest_webhooks_job
from email_platform.resources import AppDatabase
from email_platform.sensors.runs import instance_of, queued_runs, whole_batches
from email_platform.store import inbox

BATCH_SIZE = 500
MAX_RUNS_PER_TICK = 4
REQUEST_TIMEOUT_S = 300


@sensor(
    name="webhook_inbox_sensor",
    job=ingest_webhooks_job,
    minimum_interval_seconds=5,
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        f"Polls the webhook inbox for stored provider webhooks and requests ingestion runs in "
        f"batches of up to {BATCH_SIZE}. Each run normalizes, dedupes and applies the events."
    ),
)
def webhook_inbox_sensor(
    context: SensorEvaluationContext, email_database: AppDatabase
) -> SensorResult | SkipReason:
    now = utcnow()
    with email_database.get_engine().begin() as connection:
        stored = inbox.find_requestable(
            connection, now, REQUEST_TIMEOUT_S, BATCH_SIZE * MAX_RUNS_PER_TICK
        )
        queued = queued_runs(instance_of(context), ingest_webhooks_job.name, "webhooks")
        rows = whole_batches(stored, BATCH_SIZE, queue_is_waiting=queued > 0)
        if not rows:
            if stored:
                return SkipReason(
                    f"{len(stored)} stored webhook(s) wait for a full batch of {BATCH_SIZE} "
                    f"or an empty queue: {queued} ingestion run(s) are queued."
                )
            return SkipReason("No stored webhooks waiting for ingestion.")
        requests: list[RunRequest] = []
        for start in range(0, len(rows), BATCH_SIZE):
            batch = rows[start : start + BATCH_SIZE]
            ids = [r.inbox_id for r in batch]
            round_ = max(r.request_count for r in batch)
            key = f"webhooks:{ids[0]}:{ids[-1]}" + (f":r{round_}" if round_ else "")
            requests.append(
                RunRequest(
                    run_key=key,
                    run_config=ingest_run_config(ids),
                    tags={
                        "email/lane": "webhooks",
                        "email/batch_size": str(len(ids)),
                        "email/first_inbox_id": str(ids[0]),
                        "email/last_inbox_id": str(ids[-1]),
                    },
                )
            )
        inbox.mark_requested(connection, [r.inbox_id for r in rows], now)
    return SensorResult(run_requests=requests)
