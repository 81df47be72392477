"""Reads and writes of ``email_attempts``: one row per provider call, kept forever for trace."""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, func, select, update

from email_platform.db.schema import email_attempts as attempts
from email_platform.store.bulk import insert_rows, rows_in


def add(connection: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Record provider calls, a whole group of them in one statement."""
    insert_rows(connection, attempts, rows)


def for_event(connection: Connection, event_id: str) -> list[Row]:
    return list(
        connection.execute(
            select(attempts).where(attempts.c.event_id == event_id).order_by(attempts.c.attempt_id)
        ).all()
    )


def count_by_outcome(connection: Connection) -> dict[str, int]:
    rows = connection.execute(
        select(attempts.c.outcome, func.count()).group_by(attempts.c.outcome)
    ).all()
    return {outcome: n for outcome, n in rows}


def for_erasure(
    connection: Connection, message_ids: Sequence[int], event_ids: Sequence[str]
) -> list[Row]:
    """The attempts of these messages, and of these events."""
    rows = {
        row.attempt_id: row
        for row in [
            *rows_in(connection, attempts, "message_id", message_ids),
            *rows_in(connection, attempts, "event_id", event_ids),
        ]
    }
    return [rows[key] for key in sorted(rows)]


def set_error(connection: Connection, attempt_id: int, error: str | None) -> None:
    connection.execute(
        update(attempts).where(attempts.c.attempt_id == attempt_id).values(error=error)
    )


# ---- metrics (email_platform.observability.metrics) ----------------------------------------------


def counts_in_range(
    connection: Connection, after_id: int, upto_id: int | None
) -> dict[tuple[str, str, int | None, str | None], int]:
    """Attempts with ``after_id < attempt_id <= upto_id`` (no upper end with None), by
    (lane, outcome, HTTP status, provider): a primary-key range, joined to each message."""
    from email_platform.db.schema import email_messages as messages  # only the metrics join

    # The attempt's own provider (a failover's secondary names itself); the message's for
    # attempts recorded before attempts had the column.
    provider = func.coalesce(attempts.c.provider, messages.c.provider)
    query = (
        select(
            messages.c.lane,
            attempts.c.outcome,
            attempts.c.http_status,
            provider,
            func.count(),
        )
        .select_from(attempts.join(messages, messages.c.message_id == attempts.c.message_id))
        .where(attempts.c.attempt_id > after_id)
    )
    if upto_id is not None:
        query = query.where(attempts.c.attempt_id <= upto_id)
    rows = connection.execute(
        query.group_by(messages.c.lane, attempts.c.outcome, attempts.c.http_status, provider)
    ).all()
    return {(lane, outcome, code, provider): int(n) for lane, outcome, code, provider, n in rows}


# ---- retention (email_platform.operating.retention) ----------------------------------------------


def count_for_events(connection: Connection, events: Any) -> int:
    """How many attempts the messages of an id query's events (``outbox.purgeable_query``)
    have."""
    from email_platform.db.schema import email_messages

    of_events = select(email_messages.c.message_id).where(
        email_messages.c.event_id.in_(events.scalar_subquery())
    )
    return int(
        connection.execute(
            select(func.count()).where(attempts.c.message_id.in_(of_events.scalar_subquery()))
        ).scalar()
    )


def delete_for_messages(connection: Connection, message_ids: Sequence[int]) -> int:
    """Delete the attempts of these messages (before the messages: foreign key)."""
    from sqlalchemy import delete

    from email_platform.store.bulk import one_of

    total = 0
    for start in range(0, len(message_ids), 5000):
        chunk = list(message_ids[start : start + 5000])
        total += connection.execute(
            delete(attempts).where(one_of(connection, attempts.c.message_id, chunk))
        ).rowcount
    return total
