"""The sensor that keeps the analytics warehouse fresh: ``analytics_refresh_sensor``.

It compares a cheap fingerprint of the operational tables' change markers
(``warehouse.operational_fingerprint``) with the one it saw last, and requests a run of the
``analytics_warehouse`` multi-asset (``assets/analytics.py``) when they differ: at most once per
the ``Warehouse`` resource's ``refresh_interval_s``, at least every ``HEARTBEAT_S`` with nothing
new, from scratch once a day, again after a failed run, and one run at a time.
"""

import hashlib
import json
import time
from datetime import UTC, datetime

from dagster import (
    AssetSelection,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SkipReason,
    define_asset_job,
    in_process_executor,
    sensor,
)

from email_platform import warehouse as core
from email_platform.assets.analytics import FULL_TAG, HEARTBEAT_S, analytics_warehouse
from email_platform.resources import AppDatabase
from email_platform.resources.warehouse import Warehouse

# New sends and webhooks reach the warehouse within about this long (the sensor's interval).
# How often the sensor looks for new data (the fingerprint is a few indexed max() queries);
# how often it may start a refresh is the Warehouse resource's refresh_interval_s.
SENSOR_TICK_S = 10
RUN_TAGS = {"email/job": "analytics"}
# Incremental loads re-read a look-back window; a row committed later than that after a newer
# one would be missed, so the sensor asks for a full rebuild this often (1M messages: seconds).
RECONCILE_S = 24 * 3600

_IN_FLIGHT = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]
# The refresh runs in its own asset job: its step executes in the run's process (a step process
# of its own, and one per check, would cost about a CPU-second each for steps that read one
# DuckDB file one by one anyway), without imposing an executor on the code location.
analytics_job = define_asset_job(
    "email_analytics_job",
    selection=AssetSelection.assets(analytics_warehouse),
    description="Refreshes the DuckDB warehouse and runs its checks (analytics_refresh_sensor).",
    executor_def=in_process_executor,
)


@sensor(
    name="analytics_refresh_sensor",
    job=analytics_job,
    minimum_interval_seconds=SENSOR_TICK_S,
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Refreshes the DuckDB warehouse (the email_platform assets, checks included) after sends, "
        "attempts, webhooks or dead-letter changes: at most once per the warehouse resource's "
        "refresh_interval_s (EMAIL_PLATFORM_ANALYTICS_REFRESH_S, default 60 s) while data keeps "
        f"coming, and at least every {HEARTBEAT_S // 60} minutes; once a day it rebuilds from "
        "scratch to catch rows committed after the incremental look-back. A failed refresh is "
        "retried after the interval. One at a time."
    ),
)
def analytics_refresh_sensor(
    context: SensorEvaluationContext, email_database: AppDatabase, email_warehouse: Warehouse
) -> RunRequest | SkipReason:
    cursor = json.loads(context.cursor) if context.cursor else {}
    fingerprint = core.operational_fingerprint(email_database.get_engine())
    now = time.time()
    since_last = now - cursor.get("requested_at", 0)
    due = since_last >= HEARTBEAT_S
    latest = context.instance.get_runs(filters=RunsFilter(tags=RUN_TAGS), limit=1)
    # A refresh that failed loaded nothing (it commits all or nothing): try again, and if it
    # was the daily full rebuild, that again, rather than wait for new data or the next day.
    failed = bool(latest) and latest[0].status == DagsterRunStatus.FAILURE
    if fingerprint == cursor.get("fingerprint") and not due and not failed:
        return SkipReason("Nothing new in the operational tables since the last refresh.")
    interval = email_warehouse.resolved_refresh_interval_s()
    if since_last < interval:
        return SkipReason(
            f"New data; the next refresh may start in {interval - since_last:.0f}s "
            f"(refresh_interval_s={interval:g})."
        )
    running = context.instance.get_runs(
        filters=RunsFilter(tags=RUN_TAGS, statuses=_IN_FLIGHT), limit=1
    )
    if running:
        return SkipReason(f"Refresh run {running[0].run_id} is still in flight.")
    # The first refresh builds from scratch anyway; count the reconcile period from it.
    full = now - cursor.get("full_at", now) >= RECONCILE_S or (
        failed and latest[0].tags.get(FULL_TAG) == "true"
    )
    context.update_cursor(
        json.dumps(
            {
                "fingerprint": fingerprint,
                "requested_at": now,
                "full_at": now if full else cursor.get("full_at", now),
            }
        )
    )
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%S")
    return RunRequest(
        run_key=f"analytics:{stamp}:{hashlib.sha256(fingerprint.encode()).hexdigest()[:8]}",
        asset_selection=list(analytics_warehouse.keys),
        tags={**RUN_TAGS, FULL_TAG: "true"} if full else RUN_TAGS,
    )


analytics_sensors = [analytics_refresh_sensor]
