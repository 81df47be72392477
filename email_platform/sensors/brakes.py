"""The bulk lane's one brake: pauses it when its hard-bounce or complaint rate spikes.

Over the bulk messages the provider accepted in the last hour (never before the lane's last
resume) it judges two rates, each as ``warehouse/rates.py`` defines it for the analysts:
``hard_bounce_rate`` (hard_bounced / accepted) and ``complaint_rate`` (complained / delivered).
With enough messages and a rate over its threshold it pauses the bulk lane, ``paused_by``
``brake:bounce_rate`` or ``brake:complaint_rate``, as an operator's ``email-platform lanes
pause bulk`` would. It never resumes a lane, and it never touches the critical or transactional
lanes: a password reset must go out whatever a newsletter did.

Two callers judge with the same rule (``judge``), the same window and the same settings: the
sensor every minute over the operational tables, and the ``bulk_brake`` asset check over the
warehouse's ``email_funnel`` (``assets/brake_check.py``); either one pauses the lane.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from dagster import (
    DefaultSensorStatus,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)
from sqlalchemy import Row

from email_platform.common.lanes import Lane
from email_platform.common.timeutil import as_utc, isoformat, utcnow
from email_platform.observability import logs
from email_platform.resources import AppDatabase
from email_platform.resources.brakes import BrakePolicy, BrakeSettings
from email_platform.store import lane_pauses
from email_platform.store.lane_pauses import LaneRates
from email_platform.warehouse.rates import RATES_BY_NAME, Rate

#: The one lane brakes may pause.
BRAKED_LANE = Lane.BULK
BRAKE_INTERVAL_S = 60
RESUME_HINT = f"resume with `email-platform lanes resume {BRAKED_LANE.value}`"
#: Each brake and the rate it judges, by the analysts' one definition of that rate.
BRAKE_RATES: dict[str, Rate] = {
    "bounce_rate": RATES_BY_NAME["hard_bounce_rate"],
    "complaint_rate": RATES_BY_NAME["complaint_rate"],
}
#: What the brake measures: the lane's counts of mail accepted in ``[since, now]``.
Measure = Callable[[datetime, datetime], LaneRates]


@dataclass(frozen=True)
class Trip:
    """One rate over its threshold."""

    brake: str  # bounce_rate | complaint_rate
    what: str
    count: int
    of: int  # the rate's denominator
    denominator: str  # accepted | delivered
    rate: float
    threshold: float

    @property
    def paused_by(self) -> str:
        return f"brake:{self.brake}"


def _percent(value: float) -> str:
    return f"{value * 100:.2f}%"


def rate_of(rates: LaneRates, brake: str) -> float | None:
    """``brake``'s rate over ``rates``: its numerator over its denominator (None without one)."""
    rate = BRAKE_RATES[brake]
    denominator = getattr(rates, rate.denominator)
    return getattr(rates, rate.numerator) / denominator if denominator else None


def measured(rates: LaneRates, since: datetime) -> str:
    """The measurement in words, for every SkipReason of the brake."""
    bounce = rate_of(rates, "bounce_rate") or 0.0
    complaint = rate_of(rates, "complaint_rate") or 0.0
    return (
        f"of {rates.accepted} {BRAKED_LANE.value} message(s) accepted since {isoformat(since)}: "
        f"{rates.hard_bounced} hard-bounced ({_percent(bounce)} of accepted), "
        f"{rates.delivered} delivered, {rates.complained} complained "
        f"({_percent(complaint)} of delivered)"
    )


def trips(rates: LaneRates, settings: BrakeSettings) -> list[Trip]:
    """The rates over their thresholds; none below ``min_messages`` accepted."""
    if rates.accepted < settings.min_messages:
        return []
    limits = {
        "bounce_rate": ("hard-bounce rate", settings.max_hard_bounce_rate),
        "complaint_rate": ("complaint rate", settings.max_complaint_rate),
    }
    found = []
    for brake, (what, threshold) in limits.items():
        value = rate_of(rates, brake)
        definition = BRAKE_RATES[brake]
        if value is not None and value > threshold:
            count = getattr(rates, definition.numerator)
            of = getattr(rates, definition.denominator)
            found.append(Trip(brake, what, count, of, definition.denominator, value, threshold))
    return found


def pause_reason(tripped: list[Trip], since: datetime, source: str = "") -> str:
    """Why the brake paused the lane: each rate measured, its threshold and its counts."""
    parts = [
        f"{trip.what} {_percent(trip.rate)} is over {_percent(trip.threshold)} "
        f"({trip.count} of {trip.of} {BRAKED_LANE.value} message(s) {trip.denominator} of those "
        f"accepted since {isoformat(since)})"
        if trip.denominator != "accepted"
        else f"{trip.what} {_percent(trip.rate)} is over {_percent(trip.threshold)} "
        f"({trip.count} of {trip.of} {BRAKED_LANE.value} message(s) accepted since "
        f"{isoformat(since)})"
        for trip in tripped
    ]
    return "; ".join(parts) + (f" [{source}]" if source else "")


@dataclass(frozen=True)
class Judgement:
    """One evaluation of the brake: the window, its counts, and the rates over threshold."""

    since: datetime
    now: datetime
    rates: LaneRates
    tripped: list[Trip]
    pause: Row | None  # the lane's pause row before the evaluation, if any

    @property
    def paused(self) -> bool:
        return self.pause is not None and self.pause.resumed_at is None


def window(pause: Row | None, settings: BrakeSettings, now: datetime) -> datetime:
    """Where the brake's window starts: ``window_s`` ago, never before the lane's last resume
    (what was measured before an operator resumed does not pause the lane again)."""
    since = now - timedelta(seconds=settings.window_s)
    resumed_at = as_utc(pause.resumed_at) if pause is not None and pause.resumed_at else None
    return resumed_at if resumed_at is not None and resumed_at > since else since


def judge(
    app_database: AppDatabase, settings: BrakeSettings, measure: Measure | None = None
) -> Judgement:
    """The brake's verdict on the bulk lane now: over ``measure``'s counts (default: the
    operational tables) of the window ``window`` starts."""
    lane = BRAKED_LANE.value
    now = utcnow()
    with app_database.get_engine().connect() as connection:
        row = lane_pauses.get(connection, lane)
        since = window(row, settings, now)
        if measure is None:
            rates = lane_pauses.rates_since(connection, lane, since, now)
    if measure is not None:
        rates = measure(since, now)
    return Judgement(since, now, rates, trips(rates, settings), row)


def verdict(judgement: Judgement, settings: BrakeSettings) -> str:
    """The judgement in words when it pauses nothing: what was measured and against what."""
    if judgement.rates.accepted < settings.min_messages:
        return (
            f"No brake: {measured(judgement.rates, judgement.since)}; a brake needs at least "
            f"{settings.min_messages} accepted message(s)."
        )
    # Said, so a provider sending no delivery reports does not pass for a clean list.
    unjudged = (
        "; the complaint rate is not judged: no delivery reports yet"
        if not judgement.rates.delivered
        else ""
    )
    return (
        f"No brake: {measured(judgement.rates, judgement.since)}; thresholds "
        f"{_percent(settings.max_hard_bounce_rate)} hard bounces of accepted, "
        f"{_percent(settings.max_complaint_rate)} complaints of delivered{unjudged}."
    )


def apply(app_database: AppDatabase, judgement: Judgement, source: str = "") -> str:
    """Pause the bulk lane for a judgement over its thresholds; what happened, in words."""
    tripped = judgement.tripped
    with app_database.get_engine().begin() as connection:
        paused, made = lane_pauses.pause(
            connection,
            BRAKED_LANE.value,
            paused_by=tripped[0].paused_by,
            reason=pause_reason(tripped, judgement.since, source),
            now=judgement.now,
            seen_resumed_at=judgement.pause.resumed_at if judgement.pause is not None else None,
        )
    if not made:
        return f"{lane_pauses.describe(paused)}; {RESUME_HINT}."
    return f"BRAKE: {lane_pauses.describe(paused)}; {RESUME_HINT}."


def evaluate_brakes(app_database: AppDatabase, settings: BrakeSettings) -> str:
    """Measure the bulk lane and pause it if a rate is over its threshold; what happened, in
    words (the sensor's SkipReason: the UI shows it on each tick)."""
    lane = BRAKED_LANE.value
    with app_database.get_engine().connect() as connection:
        row = lane_pauses.get(connection, lane)
    if row is not None and row.resumed_at is None:
        # A paused lane is not measured: the pause stays as it was until an operator resumes.
        return f"{lane_pauses.describe(row)}; {RESUME_HINT}."
    judgement = judge(app_database, settings)
    if not judgement.tripped:
        return verdict(judgement, settings)
    return apply(app_database, judgement)


def make_brake_sensor(policy: BrakePolicy | None = None) -> SensorDefinition:
    """The bulk lane's brake; ``policy`` unset reads ``EMAIL_PLATFORM_BRAKE*`` at each tick."""

    @sensor(
        name=f"{BRAKED_LANE.value}_brake_sensor",
        minimum_interval_seconds=BRAKE_INTERVAL_S,
        default_status=DefaultSensorStatus.RUNNING,
        description=(
            f"Pauses the {BRAKED_LANE.value} lane when, over its mail accepted in the last hour "
            "(since its last resume at most), the hard-bounce rate (of accepted) or complaint "
            "rate (of delivered) is over its threshold (EMAIL_PLATFORM_BRAKE_*; docs/lanes.md); "
            "the bulk_brake check on email_funnel judges the same. Never resumes by itself and "
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
