"""The send jobs (one batch per run, or a resident lane worker) and the ingestion job.

Each job's run config is built here and read back here: the shape is one contract, and only
ids travel in it (no addresses, no payloads).
"""

from collections.abc import Mapping, Sequence
from typing import Any

from dagster import in_process_executor, job, multiprocess_executor

from email_platform.jobs.executors import switchable_executor
from email_platform.jobs.loggers import JOB_LOGGERS
from email_platform.ops.alerts import announce_alert
from email_platform.ops.ingest import ingest_webhook_batch
from email_platform.ops.lane_worker import run_lane_worker
from email_platform.ops.send import send_email_batch

# A batch run and an ingestion run execute their one step in the run's own process: a step
# process of its own, and another for each retry, cost more CPU than the batch's sends under a
# backlog on a small machine. Their ops retry by raising RetryRequested themselves
# (ops/retry.py), so an operator's terminate ends the step instead of retrying it. The lane
# worker keeps its step process and RetryPolicy: it starts once in a lifetime of minutes.
# EMAIL_PLATFORM_EXECUTOR=celery runs both send jobs' steps on Celery workers (executors.py).


@job(
    description=(
        "Sends one batch of outbox events from one lane. Launched by the lane's outbox sensor; "
        "the run's tags say the lane, event type, batch size and first/last event id. "
        "Re-execute a failed run from failure to replay its dead letters safely."
    ),
    tags={"email/job": "send"},
    executor_def=switchable_executor(in_process_executor),
    logger_defs=JOB_LOGGERS,
)
def send_email_job() -> None:
    send_email_batch()


@job(
    description=(
        "Ingests one batch of stored provider webhooks: normalized events, delivery states, "
        "suppressions. Launched by the webhook inbox sensor; safe to re-execute."
    ),
    tags={"email/job": "ingest"},
    executor_def=in_process_executor,
    logger_defs=JOB_LOGGERS,
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
    executor_def=switchable_executor(multiprocess_executor),
    logger_defs=JOB_LOGGERS,
)
def lane_worker_job() -> None:
    run_lane_worker()


@job(
    description=(
        "Announces one alert raised or resolved by the alerts sensor (a dead letter, a late "
        "lane, a silent worker, a failed run, a misconfigured provider, a tripped brake, an "
        "open circuit): "
        "logs it as JSON and posts it to the configured Slack-compatible webhook. The run's "
        "tags say the alert and whether it was raised or resolved."
    ),
    tags={"email/job": "alert"},
    executor_def=in_process_executor,
    logger_defs=JOB_LOGGERS,
)
def alert_job() -> None:
    announce_alert()


#: Every run the platform launches names its console logger: Dagster builds a job's own
#: loggers only when the run config mentions them, else its coloured text console. Each job
#: makes ``console`` the JSON logger (``email_platform.jobs.loggers``).
RUN_LOGGERS: dict[str, Any] = {"console": {"config": {"log_level": "INFO"}}}


def _with_loggers(ops: dict[str, Any]) -> dict[str, Any]:
    return {"ops": ops, "loggers": {name: dict(c) for name, c in RUN_LOGGERS.items()}}


def send_run_config(lane: str, event_ids: Sequence[str]) -> dict[str, Any]:
    """Run config of a ``send_email_job`` run for one lane's batch."""
    return _with_loggers(
        {"send_email_batch": {"config": {"lane": lane, "event_ids": list(event_ids)}}}
    )


def send_run_event_ids(run_config: Mapping[str, Any] | None) -> list[str]:
    """The event ids a ``send_email_job`` run was asked to send; ``[]`` for any other run."""
    ops = (run_config or {}).get("ops", {})
    return list(ops.get("send_email_batch", {}).get("config", {}).get("event_ids", []))


def lane_worker_run_config(lane: str) -> dict[str, Any]:
    """Run config of a ``lane_worker_job`` run."""
    return _with_loggers({"run_lane_worker": {"config": {"lane": lane}}})


def ingest_run_config(inbox_ids: Sequence[int]) -> dict[str, Any]:
    """Run config of an ``ingest_webhooks_job`` run for a batch of stored webhooks."""
    return _with_loggers({"ingest_webhook_batch": {"config": {"inbox_ids": list(inbox_ids)}}})


def ingest_run_inbox_ids(run_config: Mapping[str, Any] | None) -> list[int]:
    """The stored webhooks an ``ingest_webhooks_job`` run was asked to apply; ``[]`` for any
    other run."""
    ops = (run_config or {}).get("ops", {})
    return list(ops.get("ingest_webhook_batch", {}).get("config", {}).get("inbox_ids", []))


def alert_run_config(transition: Any) -> dict[str, Any]:
    """The alert job's config for one ``store.alerts.Transition``."""
    return _with_loggers(
        {
            "announce_alert": {
                "config": {
                    "key": transition.key,
                    "kind": transition.kind,
                    "lane": transition.lane,
                    "severity": transition.severity,
                    "summary": transition.summary,
                    "state": transition.state,
                    "raised_at": transition.raised_at.isoformat(),
                    "raise_count": transition.raise_count,
                }
            }
        }
    )
