"""Safety net: whatever a failed send run still holds is given back to the outbox."""

from dagster import DefaultSensorStatus, RunFailureSensorContext, run_failure_sensor

from email_platform.jobs import (
    ingest_run_inbox_ids,
    ingest_webhooks_job,
    lane_worker_job,
    send_email_job,
    send_run_event_ids,
)
from email_platform.observability import logs
from email_platform.resources import AppDatabase
from email_platform.store import inbox, outbox

# Past this many requests an event that keeps failing to start waits out the lane's request
# timeout instead of being requested again at once: no tight loop of doomed runs.
MAX_FAST_REREQUESTS = 5


@run_failure_sensor(
    name="email_run_failure_sensor",
    monitored_jobs=[send_email_job, lane_worker_job, ingest_webhooks_job],
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "When a send or ingestion run fails outside its own error handling (worker killed, out "
        "of memory, step crashed), releases what it still held: outbox events go back to their "
        "lane sensor (same idempotency keys), stored webhooks back to the inbox sensor. Dead "
        "letters the run recorded stay as they are."
    ),
)
def email_run_failure_sensor(context: RunFailureSensorContext, email_database: AppDatabase) -> None:
    run = context.dagster_run
    released: list[str] = []
    with email_database.get_engine().begin() as connection:
        released = outbox.release_run(connection, run.run_id)
        inbox.release_run(connection, run.run_id)
        # Events and webhooks the run never claimed (it died before the claim) can be
        # requested again now, not after the sensor's request timeout.
        outbox.make_requestable(
            connection, send_run_event_ids(run.run_config), max_requests=MAX_FAST_REREQUESTS
        )
        inbox.make_requestable(
            connection, ingest_run_inbox_ids(run.run_config), max_requests=MAX_FAST_REREQUESTS
        )
    if released:
        context.log.warning(
            f"run {run.run_id} failed holding {len(released)} event(s); released them: "
            f"first_event_id={released[0]} last_event_id={released[-1]}",
            **logs.fields(
                run_id=run.run_id,
                lane=run.tags.get("email/lane"),
                first_event_id=released[0],
                last_event_id=released[-1],
            ),
        )
