"""The retention op: the application database's purge (``email_platform.operating.retention``) and
the Dagster instance's own history, which open-source Dagster keeps forever (its ``retention``
setting covers schedule and sensor ticks only)."""

import contextlib
from datetime import datetime, timedelta

from dagster import (
    Config,
    DagsterInstance,
    DagsterRunStatus,
    MetadataValue,
    OpExecutionContext,
    RunsFilter,
    op,
)

from email_platform.common import config as settings
from email_platform.common.timeutil import utcnow
from email_platform.operating import retention
from email_platform.resources import AppDatabase
from email_platform.store import circuits

#: Runs in these states are over; anything queued, starting or running is never deleted.
FINISHED_RUNS = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]


class RetentionConfig(Config):
    dry_run: bool = False


@op(
    tags={"kind": "email"},
    description=(
        "Closes dead letters past their message's expiry as 'expired', then deletes what is "
        "past its retention in batches of EMAIL_PLATFORM_RETENTION_BATCH_SIZE rows per "
        "transaction: resolved dead letters, finished events with their messages, attempts "
        "and provider events, processed raw webhooks, circuit rows of runs long gone; then "
        "finished Dagster runs (with their captured logs) older than "
        "EMAIL_PLATFORM_DAGSTER_RUN_RETENTION_DAYS (at most "
        "EMAIL_PLATFORM_DAGSTER_RUN_PURGE_LIMIT a run). Never anything pending, in flight or "
        "open, nor suppressions. dry_run counts only."
    ),
)
def purge_retention(
    context: OpExecutionContext, config: RetentionConfig, email_database: AppDatabase
) -> dict:
    chosen = settings.retention_settings()
    report = retention.purge(
        email_database.get_engine(), chosen, dry_run=config.dry_run, log=context.log.info
    )
    counts = report.as_dict()
    with email_database.get_engine().begin() as connection:
        counts["provider_circuits"] = circuits.delete_stale(
            connection, utcnow(), dry_run=config.dry_run
        )
    counts["dagster_runs"] = purge_dagster_runs(
        context.instance,
        older_than_days=chosen.dagster_runs_days,
        limit=chosen.dagster_runs_per_purge,
        dry_run=config.dry_run,
        keep_run_ids=[context.run_id],
    )
    context.log.info(
        ("retention (dry run): " if config.dry_run else "retention: ")
        + " ".join(f"{table}={n}" for table, n in counts.items())
    )
    context.add_output_metadata(
        {
            **{table: MetadataValue.int(n) for table, n in counts.items()},
            "dry_run": MetadataValue.bool(config.dry_run),
            "transactions": MetadataValue.int(report.batches),
        }
    )
    return counts


def purge_dagster_runs(
    instance: DagsterInstance,
    *,
    older_than_days: int,
    limit: int,
    dry_run: bool = False,
    now: datetime | None = None,
    keep_run_ids: list[str] | None = None,
) -> int:
    """Delete (with their event logs and captured stdout/stderr) at most ``limit`` finished
    runs last updated more than ``older_than_days`` ago, oldest first; ``dry_run`` counts them
    (up to ``limit``). ``DagsterInstance.delete_run`` leaves the captured logs, where a lane
    worker's per-message JSON lines are (about 0.4 KB an email)."""
    cutoff = (now or utcnow()) - timedelta(days=older_than_days)
    runs = instance.get_runs(
        filters=RunsFilter(statuses=FINISHED_RUNS, updated_before=cutoff),
        limit=limit,
        ascending=True,
    )
    doomed = [run.run_id for run in runs if run.run_id not in (keep_run_ids or [])]
    if not dry_run:
        for run_id in doomed:
            # A log manager that keeps them elsewhere (S3 ...) may not delete: its own policy.
            with contextlib.suppress(NotImplementedError):
                instance.compute_log_manager.delete_logs(prefix=[run_id])
            instance.delete_run(run_id)
    return len(doomed)
