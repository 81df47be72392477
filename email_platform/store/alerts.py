"""Reads and writes of ``alerts``: which alerts are open, and the transitions of one evaluation."""

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Row, insert, select, update

from email_platform.db.schema import alerts
from email_platform.operating.alerts.conditions import Condition


@dataclass(frozen=True)
class Transition:
    """An alert that was raised or resolved by one evaluation."""

    key: str
    kind: str
    lane: str | None
    severity: str
    summary: str
    state: str  # raised | resolved
    raised_at: datetime
    raise_count: int


def open_alerts(connection: Connection) -> list[Row]:
    return list(
        connection.execute(
            select(alerts).where(alerts.c.resolved_at.is_(None)).order_by(alerts.c.raised_at)
        ).all()
    )


def all_alerts(connection: Connection, limit: int = 100) -> list[Row]:
    return list(
        connection.execute(select(alerts).order_by(alerts.c.raised_at.desc()).limit(limit)).all()
    )


def reconcile(
    connection: Connection,
    conditions: Sequence[Condition],
    evaluated_kinds: Collection[str],
    now: datetime,
) -> list[Transition]:
    """Record what one evaluation found; return the alerts it raised and resolved.

    An open alert whose condition is still there only has ``last_seen_at`` moved (no second
    alert); one whose kind was evaluated and whose condition is gone is resolved. Kinds not in
    ``evaluated_kinds`` (their check could not run this time) are left as they are.
    """
    found = {condition.key: condition for condition in conditions}
    rows = {row.key: row for row in connection.execute(select(alerts)).all()}
    transitions: list[Transition] = []
    for key, condition in found.items():
        row = rows.get(key)
        if row is not None and row.resolved_at is None:
            connection.execute(
                update(alerts)
                .where(alerts.c.key == key)
                .values(last_seen_at=now, summary=condition.summary)
            )
            continue
        values = {
            "kind": condition.kind,
            "lane": condition.lane,
            "severity": condition.severity,
            "summary": condition.summary,
            "raised_at": now,
            "last_seen_at": now,
            "resolved_at": None,
        }
        count = 1 if row is None else row.raise_count + 1
        if row is None:
            connection.execute(insert(alerts).values(key=key, raise_count=1, **values))
        else:
            connection.execute(
                update(alerts).where(alerts.c.key == key).values(raise_count=count, **values)
            )
        transitions.append(_transition(condition, "raised", now, count))
    for key, row in rows.items():
        if row.resolved_at is None and key not in found and row.kind in evaluated_kinds:
            connection.execute(update(alerts).where(alerts.c.key == key).values(resolved_at=now))
            transitions.append(
                Transition(
                    key=key,
                    kind=row.kind,
                    lane=row.lane,
                    severity=row.severity,
                    summary=row.summary,
                    state="resolved",
                    raised_at=row.raised_at,
                    raise_count=row.raise_count,
                )
            )
    return transitions


def _transition(condition: Condition, state: str, raised_at: datetime, count: int) -> Transition:
    return Transition(
        key=condition.key,
        kind=condition.kind,
        lane=condition.lane,
        severity=condition.severity,
        summary=condition.summary,
        state=state,
        raised_at=raised_at,
        raise_count=count,
    )
