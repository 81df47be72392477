"""Brakes: a sensor that pauses the bulk lane when its bounce or complaint rate spikes.

Every minute it measures, over the bulk messages the provider accepted in the last hour (and
never before the lane's last resume), the share a provider reported hard-bounced and the share
complained about. With enough messages and a rate over its threshold it pauses the bulk lane,
``paused_by`` ``brake:bounce_rate`` or ``brake:complaint_rate``, as an operator's
``email-platform lanes pause bulk`` would. It never resumes a lane, and it never touches the
critical or transactional lanes: a password reset must go out whatever a newsletter did.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from dagster import (
    DefaultSensorStatus,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from email_platform.common.lanes import Lane
from email_platform.common.timeutil import as_utc, isoformat, utcnow
from email_platform.observability import logs
from email_platform.resources import AppDatabase
from email_platform.resources.brakes import BrakePolicy, BrakeSettings
from email_platform.store import lane_pauses
from email_platform.store.lane_pauses import LaneRates

#: The one lane brakes may pause.
BRAKED_LANE = Lane.BULK
BRAKE_INTERVAL_S = 60
RESUME_HINT = f"resume with `email-platform lanes resume {BRAKED_LANE.value}`"


@dataclass(frozen=True)
class Trip:
    """One rate over its threshold."""

    brake: str  # bounce_rate | complaint_rate
    what: str
    count: int
    rate: float
    threshold: float

    @property
    def paused_by(self) -> str:
        return f"brake:{self.brake}"


def _percent(value: float) -> str:
    return f"{value * 100:.2f}%"


def measured(rates: LaneRates, since: datetime) -> str:
    """The measurement in words, for every SkipReason of the brake."""
    total = rates.accepted
    bounce = rates.hard_bounced / total if total else 0.0
    complaint = rates.complained / total if total else 0.0
    return (
        f"of {total} {BRAKED_LANE.value} message(s) accepted since {isoformat(since)}: "
        f"{rates.hard_bounced} hard-bounced ({_percent(bounce)}), "
        f"{rates.complained} complained ({_percent(complaint)})"
    )


def trips(rates: LaneRates, settings: BrakeSettings) -> list[Trip]:
    """The rates over their thresholds; none below ``min_messages`` accepted."""
    if rates.accepted < settings.min_messages:
        return []
    found = [
        Trip(
            "bounce_rate",
            "hard-bounce rate",
            rates.hard_bounced,
            rates.hard_bounced / rates.accepted,
            settings.max_hard_bounce_rate,
        ),
        Trip(
            "complaint_rate",
            "complaint rate",
            rates.complained,
            rates.complained / rates.accepted,
            settings.max_complaint_rate,
        ),
    ]
    return [trip for trip in found if trip.rate > trip.threshold]


def pause_reason(tripped: list[Trip], rates: LaneRates, since: datetime) -> str:
    """Why the brake paused the lane: each rate measured, its threshold and its counts."""
    parts = [
        f"{trip.what} {_percent(trip.rate)} is over {_percent(trip.threshold)} "
        f"({trip.count} of {rates.accepted} {BRAKED_LANE.value} message(s) accepted since "
        f"{isoformat(since)})"
        for trip in tripped
    ]
    return "; ".join(parts)


def evaluate_brakes(app_database: AppDatabase, settings: BrakeSettings) -> str:
    """Measure the bulk lane and pause it if a rate is over its threshold; what happened, in
    words (the sensor's SkipReason: the UI shows it on each tick)."""
    lane = BRAKED_LANE.value
    now = utcnow()
    with app_database.get_engine().begin() as connection:
        row = lane_pauses.get(connection, lane)
        if row is not None and row.resumed_at is None:
            return f"{lane_pauses.describe(row)}; {RESUME_HINT}."
        since = now - timedelta(seconds=settings.window_s)
        resumed_at = as_utc(row.resumed_at) if row is not None else None
        if resumed_at is not None and resumed_at > since:
            # Resumed by an operator: what was measured before does not pause the lane again.
            since = resumed_at
        rates = lane_pauses.rates_since(connection, lane, since, now)
        if rates.accepted < settings.min_messages:
            return (
                f"No brake: {measured(rates, since)}; a brake needs at least "
                f"{settings.min_messages} accepted message(s)."
            )
        tripped = trips(rates, settings)
        if not tripped:
            return (
                f"No brake: {measured(rates, since)}; thresholds "
                f"{_percent(settings.max_hard_bounce_rate)} hard bounces, "
                f"{_percent(settings.max_complaint_rate)} complaints."
            )
        paused, made = lane_pauses.pause(
            connection,
            lane,
            paused_by=tripped[0].paused_by,
            reason=pause_reason(tripped, rates, since),
            now=now,
            seen_resumed_at=row.resumed_at if row is not None else None,
        )
    if not made:
        return f"{lane_pauses.describe(paused)}; {RESUME_HINT}."
    return f"BRAKE: {lane_pauses.describe(paused)}; {RESUME_HINT}."


def make_brake_sensor(policy: BrakePolicy | None = None) -> SensorDefinition:
    """The bulk lane's brake; ``policy`` unset reads ``EMAIL_PLATFORM_BRAKE*`` at each tick."""

    @sensor(
        name=f"{BRAKED_LANE.value}_brake_sensor",
        minimum_interval_seconds=BRAKE_INTERVAL_S,
        default_status=DefaultSensorStatus.RUNNING,
        description=(
            f"Pauses the {BRAKED_LANE.value} lane when, over its mail accepted in the last hour "
            "(since its last resume at most), the hard-bounce or complaint rate is over its "
            "threshold (EMAIL_PLATFORM_BRAKE_*; docs/lanes.md). Never resumes by itself and "
            f"never pauses another lane; {RESUME_HINT}. Launches no runs: each tick says what "
            "it measured."
        ),
    )
    def _brake_sensor(context: SensorEvaluationContext, email_database: AppDatabase) -> SkipReason:
        settings = (policy or BrakePolicy()).settings()
        if not settings.enabled:
            return SkipReason("Brakes are off (EMAIL_PLATFORM_BRAKES=off).")
        outcome = evaluate_brakes(email_database, settings)
        if outcome.startswith("BRAKE:"):
            context.log.warning(outcome, **logs.fields(lane=BRAKED_LANE.value))
        return SkipReason(outcome)

    return _brake_sensor


brake_sensors: list[SensorDefinition] = [make_brake_sensor()]
