"""The code location: every job, sensor, asset and resource, wired in one place."""

from dagster import Definitions, in_process_executor

from email_platform.assets import analytics_assets
from email_platform.jobs import alert_job, ingest_webhooks_job, lane_worker_job, send_email_job
from email_platform.loggers import json_console_logger
from email_platform.resources import (
    AppDatabase,
    EmailProviderResource,
    LanePolicy,
    RoutingResource,
    Warehouse,
)
from email_platform.resources.alerts import AlertSettings
from email_platform.sensors.alerts import alerts_sensor
from email_platform.sensors.analytics import analytics_sensors
from email_platform.sensors.brakes import brake_sensors
from email_platform.sensors.outbox import outbox_sensors
from email_platform.sensors.retention import retention_jobs, retention_schedules
from email_platform.sensors.run_failure import email_run_failure_sensor
from email_platform.sensors.webhooks import webhook_inbox_sensor


def build_definitions(
    *,
    app_database: AppDatabase | None = None,
    email_provider: EmailProviderResource | None = None,
    lane_policy: LanePolicy | None = None,
    routing: RoutingResource | None = None,
    warehouse: Warehouse | None = None,
    alerts: AlertSettings | None = None,
) -> Definitions:
    """Definitions with the given resources; defaults read ``EMAIL_PLATFORM_*`` at run time."""
    return Definitions(
        jobs=[send_email_job, lane_worker_job, ingest_webhooks_job, alert_job, *retention_jobs],
        sensors=[
            *outbox_sensors,
            webhook_inbox_sensor,
            email_run_failure_sensor,
            *analytics_sensors,
            *brake_sensors,
            alerts_sensor,
        ],
        schedules=retention_schedules,
        assets=analytics_assets,
        # Asset runs execute their steps in the run's own process. The multiprocess default
        # starts one more Python process per asset and per check (about a CPU-second each,
        # seconds under load) for steps that read one DuckDB file one by one anyway. The send
        # and ingestion jobs choose their own executor (jobs.py).
        executor=in_process_executor,
        # Every job's console lines as JSON objects (the event log keeps the sentences).
        loggers={"console": json_console_logger},
        resources={
            "app_database": app_database or AppDatabase(),
            "email_provider": email_provider or EmailProviderResource(),
            "lane_policy": lane_policy or LanePolicy(),
            "routing": routing or RoutingResource(),
            "warehouse": warehouse or Warehouse(),
            "alerts": alerts or AlertSettings(),
        },
    )


defs = build_definitions()
