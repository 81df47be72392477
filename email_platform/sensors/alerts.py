"""The alerts sensor: every half minute, what is wrong now becomes open alerts, what stopped
being wrong is resolved, and each change launches one ``alert_job`` run (the UI's signal, and
the Slack post, which so never delays a send)."""

import time
from datetime import UTC, datetime

from dagster import (
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import LANES
from email_platform.common.timeutil import utcnow
from email_platform.jobs import (
    alert_job,
    alert_run_config,
    ingest_webhooks_job,
    lane_worker_job,
    send_email_job,
)
from email_platform.observability import logs
from email_platform.operating.alerts import conditions as found
from email_platform.resources import AppDatabase, EmailProviderResource, LanePolicy
from email_platform.resources.alerts import AlertSettings
from email_platform.sensors.runs import instance_of
from email_platform.store import alerts as alert_rows
from email_platform.store import lane_workers

ALERT_INTERVAL_S = 30
#: The jobs whose failed runs are alerts (an alert run's own failure is not: no loops).
WATCHED_JOBS = (send_email_job.name, lane_worker_job.name, ingest_webhooks_job.name)


def _dagster_conditions(
    context: SensorEvaluationContext, app_database: AppDatabase, settings: AlertSettings
) -> tuple[list[found.Condition], set[str]]:
    """Failed runs and silent workers, from the instance; empty without one."""
    instance = instance_of(context)
    if instance is None:
        return [], set()
    now_ts = time.time()
    conditions: list[found.Condition] = []
    for job_name in WATCHED_JOBS:
        failed = instance.get_run_records(
            RunsFilter(
                job_name=job_name,
                statuses=[DagsterRunStatus.FAILURE],
                updated_after=datetime.fromtimestamp(now_ts - settings.failed_run_window_s, UTC),
            ),
            limit=50,
        )
        for record in failed:
            run = record.dagster_run
            replays = instance.get_runs(
                RunsFilter(
                    tags={"dagster/parent_run_id": run.run_id},
                    statuses=[DagsterRunStatus.SUCCESS],
                ),
                limit=1,
            )
            if not replays:
                conditions.append(
                    found.failed_run_condition(
                        run.run_id,
                        job_name,
                        run.tags.get("email/lane"),
                        "re-execute it from failure to replay its dead letters",
                    )
                )
    started = instance.get_runs(
        RunsFilter(job_name=lane_worker_job.name, statuses=[DagsterRunStatus.STARTED])
    )
    with app_database.get_engine().connect() as connection:
        beats = lane_workers.heartbeats(connection, [run.run_id for run in started])
    workers: dict[str, list] = {}
    for run in started:
        beat = beats.get(run.run_id)
        if beat is not None and beat.ended_at is None:
            workers.setdefault(run.tags.get("email/lane", "?"), []).append(beat.heartbeat_at)
    conditions += found.silent_worker_conditions(workers, utcnow(), settings.silent_worker_s)
    return conditions, {found.RUN_FAILED, found.WORKER_SILENT}


def _configuration_conditions(email_provider: EmailProviderResource) -> list[found.Condition]:
    try:
        email_provider.open(1).close()
    except (ConfigurationError, ValueError) as exc:
        return [found.configuration_condition(str(exc))]
    return []


@sensor(
    name="alerts_sensor",
    jobs=[alert_job],
    minimum_interval_seconds=ALERT_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Raises an alert once when a dead letter is open, a lane's oldest due event is older "
        "than the lane's target, a worker stopped heart-beating, a send or ingest run failed, "
        "the provider is misconfigured, a brake paused a lane or a provider's circuit breaker "
        "opened; resolves it when that ends. "
        "Each raise and resolve launches one alert_job run (and a Slack post if configured)."
    ),
)
def alerts_sensor(
    context: SensorEvaluationContext,
    email_database: AppDatabase,
    email_lanes: LanePolicy,
    email_provider: EmailProviderResource,
    email_alerts: AlertSettings,
) -> SensorResult | SkipReason:
    now = utcnow()
    lanes = [email_lanes.config_for(lane.value) for lane in LANES]
    dagster_side, dagster_kinds = _dagster_conditions(context, email_database, email_alerts)
    with email_database.get_engine().begin() as connection:
        conditions = [
            *found.dead_letter_conditions(connection),
            *found.late_lane_conditions(connection, lanes, now),
            *found.brake_conditions(connection),
            *found.circuit_conditions(connection, now),
            *_configuration_conditions(email_provider),
            *dagster_side,
        ]
        evaluated = {
            found.DEAD_LETTERS,
            found.LANE_LATE,
            found.BRAKE,
            found.CONFIGURATION,
            found.CIRCUIT_OPEN,
            *dagster_kinds,
        }
        transitions = alert_rows.reconcile(connection, conditions, evaluated, now)
    if not transitions:
        return SkipReason(f"{len(conditions)} alert(s) open, none raised or resolved.")
    requests = []
    for transition in transitions:
        context.log.info(
            f"alert {transition.state}: {transition.key}: {transition.summary}",
            **logs.fields(alert=transition.key, lane=transition.lane, state=transition.state),
        )
        requests.append(
            RunRequest(
                run_key=(f"alert:{transition.key}:{transition.raise_count}:{transition.state}"),
                run_config=alert_run_config(transition),
                tags={
                    "email/alert": transition.key[:200],
                    "email/alert_state": transition.state,
                    "email/alert_kind": transition.kind,
                },
            )
        )
    return SensorResult(run_requests=requests)
