"""Reads and writes of ``lane_pauses``: which lanes are paused, by whom, why and since when,
and what the bulk lane's brakes measure to decide a pause.

A lane is paused while its row has no ``resumed_at``. Resuming keeps the row, so the last pause
and the resume stay on record and a brake measures only mail accepted after the resume.
"""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Row, and_, distinct, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.common.timeutil import as_utc, isoformat
from email_platform.db.schema import email_events, email_messages, lane_pauses

#: ``pause(..., seen_resumed_at=ANY)``: pause whatever the row looked like before.
ANY = object()


def get(connection: Connection, lane: str) -> Row | None:
    """The lane's row, paused or resumed; None if it was never paused."""
    return connection.execute(select(lane_pauses).where(lane_pauses.c.lane == lane)).one_or_none()


def active(connection: Connection, lane: str) -> Row | None:
    """The lane's pause if it is paused now."""
    row = get(connection, lane)
    return row if row is not None and row.resumed_at is None else None


def all_rows(connection: Connection) -> dict[str, Row]:
    """Every lane ever paused, keyed by lane."""
    return {row.lane: row for row in connection.execute(select(lane_pauses)).all()}


def pause(
    connection: Connection,
    lane: str,
    *,
    paused_by: str,
    reason: str | None,
    now: datetime,
    seen_resumed_at: object = ANY,
) -> tuple[Row, bool]:
    """Pause ``lane``; returns its pause and whether this call made it.

    A lane already paused stays paused as it was (the first pause says who and since when).
    ``seen_resumed_at``: pause only if the row still has this ``resumed_at`` (None: the lane
    was never paused), so a brake that measured before an operator's resume does not pause
    again on what it measured.
    """
    current = get(connection, lane)
    if current is not None and current.resumed_at is None:
        return current, False
    if seen_resumed_at is not ANY:
        seen = as_utc(seen_resumed_at) if isinstance(seen_resumed_at, datetime) else None
        if seen != (as_utc(current.resumed_at) if current is not None else None):
            return _unchanged(connection, lane, current)
    values = {
        "paused_by": paused_by,
        "reason": reason,
        "paused_at": now,
        "resumed_by": None,
        "resumed_at": None,
    }
    if current is None:
        try:
            with connection.begin_nested():
                connection.execute(insert(lane_pauses).values(lane=lane, **values))
        except IntegrityError:  # paused at the same moment by someone else
            return _unchanged(connection, lane, None)
    else:
        # Only over the resume this call saw: a concurrent pause or resume wins.
        changed = connection.execute(
            update(lane_pauses)
            .where(
                and_(
                    lane_pauses.c.lane == lane,
                    lane_pauses.c.resumed_at.is_not(None),
                    lane_pauses.c.paused_at == current.paused_at,
                )
            )
            .values(**values)
        ).rowcount
        if not changed:
            return _unchanged(connection, lane, current)
    made = get(connection, lane)
    assert made is not None
    return made, True


def _unchanged(connection: Connection, lane: str, fallback: Row | None) -> tuple[Row, bool]:
    row = get(connection, lane) or fallback
    assert row is not None
    return row, False


def resume(connection: Connection, lane: str, *, resumed_by: str, now: datetime) -> Row | None:
    """Lift the lane's pause; returns the pause lifted, None if the lane was not paused."""
    current = active(connection, lane)
    if current is None:
        return None
    changed = connection.execute(
        update(lane_pauses)
        .where(and_(lane_pauses.c.lane == lane, lane_pauses.c.resumed_at.is_(None)))
        .values(resumed_by=resumed_by, resumed_at=now)
    ).rowcount
    return current if changed else None


def describe(row: Row) -> str:
    """One line for log lines, SkipReasons and the CLI: who paused the lane, since when, why."""
    text = f"{row.lane} lane paused by {row.paused_by} since {isoformat(row.paused_at)}"
    return f"{text}: {row.reason}" if row.reason else text


# ---- what the brakes measure --------------------------------------------------------------


@dataclass(frozen=True)
class LaneRates:
    """Of the lane's messages accepted by the provider in a window: how many, and how many of
    those a provider reported delivered, hard-bounced or complained about (each message
    counted once): the counts of ``email_funnel_daily`` the brake's rates divide."""

    accepted: int
    hard_bounced: int
    complained: int
    delivered: int = 0


def rates_since(connection: Connection, lane: str, since: datetime, now: datetime) -> LaneRates:
    """What ``lane``'s mail accepted in ``[since, now]`` led to.

    A cohort: the numerators count only messages of the denominator, so a bounce reported now
    about mail accepted before ``since`` (before an operator's resume, say) does not count.
    """
    m = email_messages
    # updated_at >= sent_at always (set together at acceptance, only later after): it lets
    # the planner range-scan ix_email_messages_updated_at instead of the whole table.
    window = and_(
        m.c.lane == lane,
        m.c.sent_at.is_not(None),
        m.c.sent_at >= since,
        m.c.sent_at <= now,
        m.c.updated_at >= since,
    )
    accepted = connection.execute(select(func.count()).select_from(m).where(window)).scalar_one()
    if not accepted:
        return LaneRates(0, 0, 0, 0)
    e = email_events
    hard = and_(e.c.event_type == "bounced", e.c.bounce_type == "hard")
    rows = connection.execute(
        select(
            func.count(distinct(e.c.message_id)).filter(hard),
            func.count(distinct(e.c.message_id)).filter(e.c.event_type == "complained"),
            func.count(distinct(e.c.message_id)).filter(e.c.event_type == "delivered"),
        )
        .select_from(e.join(m, m.c.message_id == e.c.message_id))
        .where(window, e.c.event_type.in_(("bounced", "complained", "delivered")))
    ).one()
    return LaneRates(
        accepted=accepted,
        hard_bounced=rows[0] or 0,
        complained=rows[1] or 0,
        delivered=rows[2] or 0,
    )
