"""The ``bulk_brake`` asset check: the bulk lane's brake, judged over the warehouse.

It judges the same two rates (``sensors/brakes.py``'s ``BRAKE_RATES``, each the analysts'
definition), over the same window (the brake's ``window_s``, never before the lane's last
resume) with the same settings (``EMAIL_PLATFORM_BRAKE*``) as the brake sensor, counting from
``email_funnel`` instead of the operational tables. A failing check pauses the bulk lane as
the sensor would: the two cannot disagree on what a spike is, only on how fresh their data is.
"""

from datetime import datetime

from dagster import AssetCheckResult, AssetCheckSeverity, MetadataValue, asset_check

from email_platform.assets.keys import asset_key
from email_platform.common.timeutil import isoformat
from email_platform.resources import AppDatabase
from email_platform.resources.brakes import BrakePolicy, BrakeSettings
from email_platform.resources.warehouse import Warehouse
from email_platform.sensors import brakes
from email_platform.store.lane_pauses import LaneRates
from email_platform.warehouse.checks_brake import funnel_rates
from email_platform.warehouse.files import connect_read_only


@asset_check(
    asset=asset_key("email_funnel"),
    name="bulk_brake",
    description=(
        "The bulk lane's brake over the warehouse: its hard-bounce rate (hard_bounced / "
        "accepted) and complaint rate (complained / delivered) over the brake's window, against "
        "the brake's thresholds (EMAIL_PLATFORM_BRAKE_*; docs/lanes.md). A failing check pauses "
        "the bulk lane, as the bulk_brake_sensor does; resume with `email-platform lanes resume "
        "bulk`."
    ),
)
def bulk_brake(email_warehouse: Warehouse, email_database: AppDatabase) -> AssetCheckResult:
    settings = BrakePolicy().settings()
    if not settings.enabled:
        return AssetCheckResult(
            passed=True, description="Brakes are off (EMAIL_PLATFORM_BRAKES=off)."
        )
    path = email_warehouse.resolved_path()

    def from_funnel(since: datetime, now: datetime) -> LaneRates:
        connection = connect_read_only(path)
        try:
            return funnel_rates(connection, brakes.BRAKED_LANE.value, since, now)
        finally:
            connection.close()

    judgement = brakes.judge(email_database, settings, from_funnel)
    metadata = _metadata(judgement, settings)
    if not judgement.tripped:
        return AssetCheckResult(
            passed=True, description=brakes.verdict(judgement, settings), metadata=metadata
        )
    if judgement.paused:
        # Paused already (by the sensor, an operator or an earlier check): left as it is.
        outcome = f"Over threshold; {brakes.pause_reason(judgement.tripped, judgement.since)}."
    else:
        outcome = brakes.apply(email_database, judgement, source="bulk_brake check")
    return AssetCheckResult(
        passed=False,
        severity=AssetCheckSeverity.ERROR,
        description=outcome,
        metadata=metadata,
    )


def _metadata(judgement: brakes.Judgement, settings: BrakeSettings) -> dict[str, MetadataValue]:
    rates = judgement.rates
    entries: dict[str, MetadataValue] = {
        "window_start": MetadataValue.text(isoformat(judgement.since)),
        "window_end": MetadataValue.text(isoformat(judgement.now)),
        "accepted": MetadataValue.int(rates.accepted),
        "delivered": MetadataValue.int(rates.delivered),
        "hard_bounced": MetadataValue.int(rates.hard_bounced),
        "complained": MetadataValue.int(rates.complained),
        "min_messages": MetadataValue.int(settings.min_messages),
        "max_hard_bounce_rate": MetadataValue.float(settings.max_hard_bounce_rate),
        "max_complaint_rate": MetadataValue.float(settings.max_complaint_rate),
    }
    for brake, rate in brakes.BRAKE_RATES.items():
        value = brakes.rate_of(rates, brake)
        if value is not None:
            entries[rate.name] = MetadataValue.float(value)
    return entries
