"""The scheduled purge of operational history past its retention: ``retention_job``, run daily
by ``retention_schedule``."""

from dagster import (
    DefaultScheduleStatus,
    JobDefinition,
    ScheduleDefinition,
    in_process_executor,
    job,
)

from email_platform.jobs.loggers import JOB_LOGGERS
from email_platform.ops.retention import purge_retention

#: Daily, at a quiet hour (UTC). A run left over from yesterday is harmless: every batch is
#: its own transaction and re-reads what is due.
RETENTION_CRON = "17 3 * * *"


@job(
    description=(
        "Purges operational history past its retention (docs/retention.md): marks dead "
        "letters past their expiry 'expired', deletes resolved dead letters, finished events "
        "with their messages, attempts and provider events, processed raw webhooks, and old "
        "finished Dagster runs, in bounded batches. Run with ops.purge_retention.config."
        "dry_run: true to count only."
    ),
    tags={"email/job": "retention"},
    executor_def=in_process_executor,
    logger_defs=JOB_LOGGERS,
)
def retention_job() -> None:
    purge_retention()


retention_schedule = ScheduleDefinition(
    name="retention_schedule",
    job=retention_job,
    cron_schedule=RETENTION_CRON,
    execution_timezone="UTC",
    default_status=DefaultScheduleStatus.RUNNING,
    description="Runs retention_job once a day (03:17 UTC).",
)

retention_jobs: list[JobDefinition] = [retention_job]
retention_schedules: list[ScheduleDefinition] = [retention_schedule]
