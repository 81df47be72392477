"""What operators and the admin read from ``email_outbox``: counts, backlogs, traces."""

from collections.abc import Sequence

from sqlalchemy import Connection, Row, func, select

from email_platform.db.schema import email_outbox as outbox
from email_platform.store.bulk import one_of
from email_platform.store.outbox.states import (
    EVENT_STATUSES,
    chunks,
)


def lanes_of(connection: Connection, event_ids: Sequence[str]) -> dict[str, list[str]]:
    """The given events that exist, grouped by lane, each lane's ids in order."""
    by_lane: dict[str, list[str]] = {}
    for chunk in chunks(sorted(event_ids), 500):
        rows = connection.execute(
            select(outbox.c.event_id, outbox.c.lane)
            .where(one_of(connection, outbox.c.event_id, chunk))
            .order_by(outbox.c.event_id)
        ).all()
        for row in rows:
            by_lane.setdefault(row.lane, []).append(row.event_id)
    return by_lane


def counts_for(connection: Connection, event_ids: Sequence[str]) -> dict[str, int]:
    """Status counts of the given events only."""
    counts: dict[str, int] = {}
    for chunk in chunks(event_ids, 500):
        rows = connection.execute(
            select(outbox.c.status, func.count())
            .where(one_of(connection, outbox.c.event_id, chunk))
            .group_by(outbox.c.status)
        ).all()
        for status, n in rows:
            counts[status] = counts.get(status, 0) + n
    return counts


def events_by_trace(
    connection: Connection,
    *,
    trace_id: str | None = None,
    correlation_id: str | None = None,
    limit: int = 100,
) -> list[Row]:
    """The events of one request (its trace id, its correlation id, or both), in publish order;
    each lookup walks its own index."""
    if trace_id is None and correlation_id is None:
        raise ValueError("give a trace_id or a correlation_id")
    conditions = []
    if trace_id is not None:
        conditions.append(outbox.c.trace_id == trace_id)
    if correlation_id is not None:
        conditions.append(outbox.c.correlation_id == correlation_id)
    return list(
        connection.execute(
            select(outbox)
            .where(*conditions)
            .order_by(outbox.c.published_at, outbox.c.event_id)
            .limit(limit)
        ).all()
    )


def trace_fields(connection: Connection, event_ids: Sequence[str]) -> dict[str, Row]:
    """``event_id``, ``trace_id``, ``correlation_id`` and ``trace_context`` of the given events
    (for spans and log lines of code that holds only a message)."""
    found: dict[str, Row] = {}
    for chunk in chunks(sorted(set(event_ids)), 500):
        rows = connection.execute(
            select(
                outbox.c.event_id,
                outbox.c.trace_id,
                outbox.c.correlation_id,
                outbox.c.trace_context,
            ).where(one_of(connection, outbox.c.event_id, chunk))
        ).all()
        found.update((row.event_id, row) for row in rows)
    return found


def counts_by_status(connection: Connection) -> dict[str, int]:
    rows = connection.execute(select(outbox.c.status, func.count()).group_by(outbox.c.status)).all()
    counts = dict.fromkeys(EVENT_STATUSES, 0)
    counts.update({status: n for status, n in rows})
    return counts
