"""The send job: one op, one claimed batch of one lane per run."""

from dagster import job

from email_platform.ops.ingest import ingest_webhook_batch
from email_platform.ops.send import send_email_batch


@job(
    description=(
        "Sends one batch of outbox events from one lane. Launched by the lane's outbox sensor; "
        "the run's tags say the lane, event type, batch size and first/last event id. "
        "Re-execute a failed run from failure to replay its dead letters safely."
    ),
    tags={"email/job": "send"},
)
def send_email_job() -> None:
    send_email_batch()


@job(
    description=(
        "Ingests one batch of stored provider webhooks: normalized events, delivery states, "
        "suppressions. Launched by the webhook inbox sensor; safe to re-execute."
    ),
    tags={"email/job": "ingest"},
)
def ingest_webhooks_job() -> None:
    ingest_webhook_batch()
