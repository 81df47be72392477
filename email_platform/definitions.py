"""The code location: every job, sensor, asset and resource, wired in one place.

What it gives merges into a project's own definitions (``Definitions.merge``) without a clash:
no code-location executor or loggers (each job sets its own), resource keys under ``email_``,
asset keys under ``email_platform/`` in one group (docs/dagster-component.md).
"""

from dagster import Definitions

from email_platform.assets import analytics_assets
from email_platform.jobs import alert_job, ingest_webhooks_job, lane_worker_job, send_email_job
from email_platform.resources import (
    AppDatabase,
    EmailProviderResource,
    LanePolicy,
    RoutingResource,
    Warehouse,
)
from email_platform.resources.alerts import AlertSettings
from email_platform.sensors.alerts import alerts_sensor
from email_platform.sensors.analytics import analytics_job, analytics_sensors
from email_platform.sensors.brakes import brake_sensors
from email_platform.sensors.outbox import outbox_sensors
from email_platform.sensors.outcomes import OutcomeHandler, make_outcomes_sensor
from email_platform.sensors.retention import retention_jobs, retention_schedules
from email_platform.sensors.run_failure import email_run_failure_sensor
from email_platform.sensors.webhooks import webhook_inbox_sensor


def build_definitions(
    *,
    email_database: AppDatabase | None = None,
    email_provider: EmailProviderResource | None = None,
    email_lanes: LanePolicy | None = None,
    email_routing: RoutingResource | None = None,
    email_warehouse: Warehouse | None = None,
    email_alerts: AlertSettings | None = None,
    outcome_handler: OutcomeHandler | str | None = None,
) -> Definitions:
    """Definitions with the given resources (each argument is its resource key); defaults
    read ``EMAIL_PLATFORM_*`` at run time. ``outcome_handler``: the product's callback for
    provider outcomes (docs/outcomes.md; None: ``EMAIL_PLATFORM_OUTCOME_HANDLER``)."""
    return Definitions(
        jobs=[
            send_email_job,
            lane_worker_job,
            ingest_webhooks_job,
            alert_job,
            analytics_job,
            *retention_jobs,
        ],
        sensors=[
            *outbox_sensors,
            webhook_inbox_sensor,
            email_run_failure_sensor,
            *analytics_sensors,
            *brake_sensors,
            alerts_sensor,
            make_outcomes_sensor(outcome_handler),
        ],
        schedules=retention_schedules,
        assets=analytics_assets,
        resources={
            "email_database": email_database or AppDatabase(),
            "email_provider": email_provider or EmailProviderResource(),
            "email_lanes": email_lanes or LanePolicy(),
            "email_routing": email_routing or RoutingResource(),
            "email_warehouse": email_warehouse or Warehouse(),
            "email_alerts": email_alerts or AlertSettings(),
        },
    )


defs = build_definitions()
