"""What is wrong right now, read from the operational tables: one ``Condition`` per problem.

A condition's ``key`` names the problem, not the moment: while the problem lasts every
evaluation yields the same key, so the alert it raises is raised once (``store.alerts``).
The Dagster-side problems (a failed run, a provider that cannot be configured) are found by the
alerts sensor, which passes them in as conditions of their own.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from email_platform.common.lanes import LaneConfig
from email_platform.common.timeutil import as_utc
from email_platform.store import circuits, lane_pauses
from email_platform.store.metrics_queries import lane_queues, open_dead_letters

#: Kinds of alert, each with the part of its key after the colon.
DEAD_LETTERS = "dead_letters"  # :<reason>
LANE_LATE = "lane_late"  # :<lane>
WORKER_SILENT = "worker_silent"  # :<lane>
BRAKE = "brake"  # :<lane>
RUN_FAILED = "run_failed"  # :<run id>
CONFIGURATION = "configuration"  # :provider
CIRCUIT_OPEN = "circuit_open"  # :<provider>
KINDS = (DEAD_LETTERS, LANE_LATE, WORKER_SILENT, BRAKE, RUN_FAILED, CONFIGURATION, CIRCUIT_OPEN)


@dataclass(frozen=True)
class Condition:
    key: str
    kind: str
    summary: str
    lane: str | None = None
    severity: str = "error"  # error | warning


def _age(now: datetime, then: datetime) -> float:
    return (now - as_utc(then)).total_seconds()


def dead_letter_conditions(connection: Connection) -> list[Condition]:
    """One per dead-letter reason while letters of that reason are open."""
    by_reason: dict[str, dict[str, int]] = {}
    for (lane, reason), count in open_dead_letters(connection).items():
        by_reason.setdefault(reason, {})[lane] = count
    return [
        Condition(
            key=f"{DEAD_LETTERS}:{reason}",
            kind=DEAD_LETTERS,
            summary=(
                f"{sum(lanes.values())} open dead letter(s) for {reason} ("
                + ", ".join(f"{lane} {n}" for lane, n in sorted(lanes.items()))
                + "); see `email-platform dlq list --reason "
                + reason
                + "`"
            ),
            lane=next(iter(lanes)) if len(lanes) == 1 else None,
        )
        for reason, lanes in sorted(by_reason.items())
    ]


def late_lane_conditions(
    connection: Connection, lanes: Sequence[LaneConfig], now: datetime
) -> list[Condition]:
    """One per lane whose oldest due event has waited longer than the lane's target."""
    queues = lane_queues(connection, [lane.lane.value for lane in lanes], now)
    found = []
    for lane in lanes:
        queue = queues.get(lane.lane.value)
        if queue is None or queue.oldest_due_at is None:
            continue
        age = _age(now, queue.oldest_due_at)
        if age > lane.target_s:
            found.append(
                Condition(
                    key=f"{LANE_LATE}:{lane.lane.value}",
                    kind=LANE_LATE,
                    lane=lane.lane.value,
                    summary=(
                        f"{lane.lane.value}: the oldest of {queue.due} due event(s) has waited "
                        f"{age:.0f} s, over the lane's target of {lane.target_s:.0f} s"
                    ),
                )
            )
    return found


def silent_worker_conditions(
    workers: Mapping[str, Sequence[datetime]], now: datetime, stale_s: float
) -> list[Condition]:
    """One per lane with a worker run not ended whose last heartbeat is older than ``stale_s``.

    ``workers``: per lane, the last heartbeats of the worker runs Dagster still shows running
    (the sensor asks Dagster, so a run that was ended or canceled is not counted).
    """
    found = []
    for lane, beats in sorted(workers.items()):
        stale = [beat for beat in beats if _age(now, beat) > stale_s]
        if stale:
            found.append(
                Condition(
                    key=f"{WORKER_SILENT}:{lane}",
                    kind=WORKER_SILENT,
                    lane=lane,
                    summary=(
                        f"{lane}: {len(stale)} worker run(s) stopped heart-beating (last beat "
                        f"{max(_age(now, b) for b in stale):.0f} s ago); their claims are "
                        "recovered when their leases run out"
                    ),
                )
            )
    return found


def brake_conditions(connection: Connection) -> list[Condition]:
    """One per lane a brake has paused (an operator's pause is not an alert)."""
    found = []
    for lane, row in sorted(lane_pauses.all_rows(connection).items()):
        if row.resumed_at is None and row.paused_by.startswith("brake:"):
            found.append(
                Condition(
                    key=f"{BRAKE}:{lane}",
                    kind=BRAKE,
                    lane=lane,
                    summary=(
                        f"{lane} paused by {row.paused_by}: {row.reason or 'no reason given'}; "
                        f"`email-platform lanes resume {lane}` once the cause is fixed"
                    ),
                )
            )
    return found


def failed_run_condition(run_id: str, job_name: str, lane: str | None, why: str) -> Condition:
    return Condition(
        key=f"{RUN_FAILED}:{run_id}",
        kind=RUN_FAILED,
        lane=lane,
        summary=f"run {run_id} of {job_name} failed: {why}"[:500],
    )


def configuration_condition(error: str) -> Condition:
    return Condition(
        key=f"{CONFIGURATION}:provider",
        kind=CONFIGURATION,
        summary=f"no lane can send: the provider is misconfigured: {error}"[:500],
    )


def circuit_conditions(connection: Connection, now: datetime) -> list[Condition]:
    """One per provider whose circuit breaker is open or probing in a live sending process."""
    found: dict[str, list[circuits.CircuitView]] = {}
    for view in circuits.not_closed(connection, now):
        found.setdefault(view.provider, []).append(view)
    conditions = []
    for provider, views in sorted(found.items()):
        opened = [as_utc(v.opened_at) for v in views if v.opened_at is not None]
        since = f", open for {_age(now, min(opened)):.0f} s" if opened else ""
        lanes = sorted({v.lane for v in views if v.lane})
        conditions.append(
            Condition(
                key=f"{CIRCUIT_OPEN}:{provider}",
                kind=CIRCUIT_OPEN,
                lane=lanes[0] if len(lanes) == 1 else None,
                summary=(
                    f"provider {provider}: the circuit breaker of {len(views)} sending "
                    f"process(es) ({', '.join(lanes) or 'no lane'}) is "
                    + "/".join(sorted({v.state for v in views}))
                    + f"{since}; sends wait (or go to the failover provider) until a probe "
                    "succeeds"
                ),
            )
        )
    return conditions
