"""Publishing's side of ``email_outbox``: the insert in the caller's transaction and the reads
its guards make (idempotency keys, rate limits)."""

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, func, insert, select

from email_platform.db.schema import email_outbox as outbox


def insert_event(connection: Connection, values: dict[str, Any]) -> None:
    connection.execute(insert(outbox).values(**values))


def insert_events(connection: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Many events in one statement (the driver batches the rows into multi-row inserts)."""
    if rows:
        connection.execute(insert(outbox), list(rows))


def get_event(connection: Connection, event_id: str) -> Row | None:
    return connection.execute(select(outbox).where(outbox.c.event_id == event_id)).first()


def first_events_with_keys(connection: Connection, keys: Iterable[str]) -> dict[str, str]:
    """The first event (ids sort by time) published with each of the callers' ``keys``."""
    keys = sorted(set(keys))
    if not keys:
        return {}
    rows = connection.execute(
        select(outbox.c.idempotency_key, func.min(outbox.c.event_id))
        .where(outbox.c.idempotency_key.in_(keys))
        .group_by(outbox.c.idempotency_key)
    )
    return {key: event_id for key, event_id in rows}


def recent_publications(
    connection: Connection, event_types: Sequence[str], aggregate_id: str, since: datetime
) -> tuple[int, datetime | None]:
    """How many events of ``event_types`` for ``aggregate_id`` were published after ``since``,
    and when the oldest of them was (a rate limit's window)."""
    count, oldest = connection.execute(
        select(func.count(), func.min(outbox.c.published_at)).where(
            outbox.c.aggregate_id == aggregate_id,
            outbox.c.event_type.in_(list(event_types)),
            outbox.c.published_at > since,
        )
    ).one()
    return int(count), oldest
