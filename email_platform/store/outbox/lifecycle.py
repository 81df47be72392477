"""The end of an event's life in ``email_outbox``: requeued for a replay, cancelled and
anonymized by erasure (``email_platform.operating.erasure``), purged by retention
(``email_platform.operating.retention``)."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, and_, func, or_, select, update

from email_platform.db.schema import email_outbox as outbox
from email_platform.store.bulk import one_of, rows_in, text_holds_any
from email_platform.store.outbox.states import (
    CANCELLED,
    DEAD,
    DONE,
    FINISHED,
    IN_FLIGHT,
    PENDING,
    chunks,
)


def requeue(connection: Connection, event_ids: Sequence[str]) -> int:
    """Dead events back to pending for a replay; the lane sensor picks them up."""
    total = 0
    for chunk in chunks(event_ids, 500):
        total += connection.execute(
            update(outbox)
            .where(one_of(connection, outbox.c.event_id, chunk), outbox.c.status == DEAD)
            .values(
                status=PENDING,
                resolution=None,
                done_at=None,
                claimed_by=None,
                lease_expires_at=None,
                requested_at=None,
                claim_count=0,
            )
        ).rowcount
    return total


# ---- erasure (email_platform.operating.erasure) --------------------------------------------------

#: Terminal, like done and dead: an erased person's event, never sent. Not in EVENT_STATUSES
#: (the zero-filled counts of ``status --json``); counted wherever one exists.


def ids_for_aggregate(connection: Connection, aggregate_id: str) -> list[str]:
    return list(
        connection.execute(
            select(outbox.c.event_id).where(outbox.c.aggregate_id == aggregate_id)
        ).scalars()
    )


def mentioning(connection: Connection, terms: Sequence[str]) -> list[Row]:
    """Events whose payload or metadata holds one of ``terms`` somewhere (a scan; the caller
    reads the values to be sure)."""
    if not terms:
        return []
    where = or_(
        text_holds_any(outbox.c.payload, terms), text_holds_any(outbox.c.event_metadata, terms)
    )
    return list(
        connection.execute(
            select(outbox.c.event_id, outbox.c.payload, outbox.c.event_metadata).where(where)
        ).all()
    )


def for_ids(connection: Connection, event_ids: Sequence[str]) -> list[Row]:
    return rows_in(connection, outbox, "event_id", event_ids)


def cancel(connection: Connection, event_ids: Sequence[str], now: datetime) -> tuple[int, int]:
    """Events not yet sent (pending, or in flight in a run) become ``cancelled`` for good.

    Returns ``(cancelled, were_in_flight)``. A run holding one no longer holds it (it is not
    in flight), so ``BatchSender`` fences it off before any provider call, and no claim, lease
    renewal, release or replay touches it again. The rows are locked first (PostgreSQL), so a
    claim racing this one waits or skips them.
    """
    cancelled = in_flight = 0
    for chunk in chunks(sorted(event_ids), 500):
        query = select(outbox.c.event_id, outbox.c.status).where(
            one_of(connection, outbox.c.event_id, chunk),
            outbox.c.status.in_([PENDING, IN_FLIGHT]),
        )
        if connection.dialect.name == "postgresql":
            query = query.with_for_update()
        rows = connection.execute(query).all()
        if not rows:
            continue
        connection.execute(
            update(outbox)
            .where(one_of(connection, outbox.c.event_id, [row.event_id for row in rows]))
            .values(
                status=CANCELLED,
                resolution="erased",
                done_at=now,
                lease_expires_at=None,
                requested_at=None,
            )
        )
        cancelled += len(rows)
        in_flight += sum(1 for row in rows if row.status == IN_FLIGHT)
    return cancelled, in_flight


def anonymize(connection: Connection, event_id: str, values: dict[str, Any]) -> None:
    connection.execute(update(outbox).where(outbox.c.event_id == event_id).values(**values))


# ---- retention (email_platform.operating.retention) ----------------------------------------------


def purgeable_query(
    *,
    finished_before: datetime,
    letters_resolved_before: datetime,
    dedupe_before: datetime | None,
) -> Any:
    """``SELECT event_id`` of the events the purge may delete, oldest first.

    Finished before ``finished_before``; no dead letter of theirs that the purge keeps (open,
    or resolved since ``letters_resolved_before``), so a letter never outlives the event its
    listing and replay read; and no message holding a route's dedupe key unless the event also
    finished before ``dedupe_before`` (None: those are kept, so the key keeps deduplicating).
    """
    from sqlalchemy import exists, or_

    from email_platform.db.schema import dead_letters, email_messages

    kept_letter = exists().where(
        dead_letters.c.event_id == outbox.c.event_id,
        or_(
            dead_letters.c.status == "open",
            dead_letters.c.resolved_at.is_(None),
            dead_letters.c.resolved_at >= letters_resolved_before,
        ),
    )
    holds_key = exists().where(
        email_messages.c.event_id == outbox.c.event_id, email_messages.c.dedupe_key.is_not(None)
    )
    keep_for_key = (
        holds_key if dedupe_before is None else and_(holds_key, outbox.c.done_at >= dedupe_before)
    )
    return (
        select(outbox.c.event_id)
        .where(
            outbox.c.status.in_(FINISHED),
            outbox.c.done_at < finished_before,
            ~kept_letter,
            ~keep_for_key,
        )
        .order_by(outbox.c.done_at, outbox.c.event_id)
    )


def purgeable_ids(connection: Connection, query: Any, limit: int) -> list[str]:
    """The next ``limit`` ids of ``purgeable_query``; on PostgreSQL locked for this
    transaction, skipping rows another transaction holds (a replay's claim wins)."""
    query = query.limit(limit)
    if connection.dialect.name == "postgresql":
        query = query.with_for_update(of=outbox, skip_locked=True)
    return list(connection.execute(query).scalars())


def count_of(connection: Connection, query: Any) -> int:
    """How many rows an id query (``purgeable_query``) selects."""
    return int(connection.execute(select(func.count()).select_from(query.subquery())).scalar())


def delete_events(connection: Connection, event_ids: Sequence[str]) -> int:
    """Delete these outbox rows; their messages (foreign key) must be gone already."""
    from sqlalchemy import delete

    if not event_ids:
        return 0
    return connection.execute(
        delete(outbox).where(one_of(connection, outbox.c.event_id, event_ids))
    ).rowcount


def finish_dead(
    connection: Connection, event_ids: Sequence[str], *, resolution: str, now: datetime
) -> int:
    """Dead events whose dead letters all closed without a send (expired) become done; an
    event a replay took back meanwhile (pending, in flight) is left to it."""
    total = 0
    for chunk in chunks(event_ids, 500):
        total += connection.execute(
            update(outbox)
            .where(one_of(connection, outbox.c.event_id, chunk), outbox.c.status == DEAD)
            .values(status=DONE, resolution=resolution, done_at=now, lease_expires_at=None)
        ).rowcount
    return total
