"""The send jobs (one batch per run, or a resident lane worker) and the ingestion job."""

from dagster import job, multiprocess_executor

from email_platform.ops.ingest import ingest_webhook_batch
from email_platform.ops.lane_worker import run_lane_worker
from email_platform.ops.send import send_email_batch

# These jobs run their step in a subprocess (one more process start per run) on purpose: their
# ops have a RetryPolicy, and an in-process step turns a "terminate run" interrupt into a retry
# (Dagster 1.13, op_execution_error_boundary), so the run would stay CANCELING and keep going.


@job(
    description=(
        "Sends one batch of outbox events from one lane. Launched by the lane's outbox sensor; "
        "the run's tags say the lane, event type, batch size and first/last event id. "
        "Re-execute a failed run from failure to replay its dead letters safely."
    ),
    tags={"email/job": "send"},
    executor_def=multiprocess_executor,
)
def send_email_job() -> None:
    send_email_batch()


@job(
    description=(
        "Ingests one batch of stored provider webhooks: normalized events, delivery states, "
        "suppressions. Launched by the webhook inbox sensor; safe to re-execute."
    ),
    tags={"email/job": "ingest"},
    executor_def=multiprocess_executor,
)
def ingest_webhooks_job() -> None:
    ingest_webhook_batch()


@job(
    description=(
        "A resident worker for one lane: claims and sends the lane's events as they come due, "
        "until its lifetime or idle time is up. Kept running by the lane's outbox sensor; the "
        "run's metadata says what it sent. Re-execute a failed worker run to replay its dead "
        "letters."
    ),
    tags={"email/job": "lane_worker"},
    executor_def=multiprocess_executor,
)
def lane_worker_job() -> None:
    run_lane_worker()
