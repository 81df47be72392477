"""Reads and writes of ``email_messages``: one row per event x route, and its status machine."""

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from email_platform.db.schema import email_attempts
from email_platform.db.schema import email_messages as messages
from email_platform.store.bulk import (
    ids_per_statement,
    insert_rows,
    on_postgresql,
    one_of,
    rows_in,
    unnest,
)

PENDING, SENT, SUPPRESSED, EXPIRED, DUPLICATE, DEAD = (
    "pending",
    "sent",
    "suppressed",
    "expired",
    "duplicate",
    "dead",
)
MESSAGE_STATUSES = (PENDING, SENT, SUPPRESSED, EXPIRED, DUPLICATE, DEAD)
TERMINAL = frozenset({SENT, SUPPRESSED, EXPIRED, DUPLICATE, DEAD})


def for_events(connection: Connection, event_ids: Sequence[str]) -> list[Row]:
    rows: list[Row] = []
    size = ids_per_statement(connection)
    for start in range(0, len(event_ids), size):
        chunk = list(event_ids[start : start + size])
        rows.extend(
            connection.execute(
                select(messages)
                .where(one_of(connection, messages.c.event_id, chunk))
                .order_by(messages.c.message_id)
            ).all()
        )
    return rows


def statuses_for_events(connection: Connection, event_ids: Sequence[str]) -> list[Row]:
    """``(event_id, status)`` of these events' messages, in message order: what settling an
    event reads, without the rest of each row."""
    rows: list[Row] = []
    size = ids_per_statement(connection)
    for start in range(0, len(event_ids), size):
        chunk = list(event_ids[start : start + size])
        rows.extend(
            connection.execute(
                select(messages.c.event_id, messages.c.status)
                .where(one_of(connection, messages.c.event_id, chunk))
                .order_by(messages.c.message_id)
            ).all()
        )
    return rows


def get(connection: Connection, message_id: int) -> Row | None:
    return connection.execute(select(messages).where(messages.c.message_id == message_id)).first()


def create(connection: Connection, values: dict[str, Any]) -> Row:
    """Insert a message; a taken dedupe key or idempotency key makes it a ``duplicate``.

    The unique indexes are the arbiters, so two runs racing on the same key cannot both win.
    A producer that published twice with the same ``idempotency_key`` gets one mail. The
    savepoint keeps the caller's transaction usable after the conflict.
    """
    try:
        with connection.begin_nested():
            return _insert(connection, values)
    except IntegrityError:
        holder, key_kind = _holder(connection, values)
        if holder is None:
            raise
    return _insert(
        connection,
        {
            **values,
            "dedupe_key": None,
            # Unique per event and route, so the duplicate row itself never collides.
            "idempotency_key": f"{values['event_id']}:{values['route']}:duplicate",
            "status": DUPLICATE,
            "last_error": f"{key_kind} already used by message {holder}",
        },
    )


def create_many(connection: Connection, rows: Sequence[dict[str, Any]]) -> list[Row]:
    """``create`` for many messages, in order, with one INSERT in the common case (from
    ``unnest`` of the columns' arrays on PostgreSQL, multi-row VALUES on SQLite).

    The rows go in under one savepoint; if any of them hits a unique index (a dedupe key or an
    idempotency key already taken, or two rows of this batch sharing one), the savepoint rolls
    the whole insert back and the rows are created one by one with ``create``, so the first
    in order wins exactly as it would have one at a time.
    """
    if not rows:
        return []
    columns = sorted(set().union(*(row.keys() for row in rows)))
    try:
        with connection.begin_nested():
            if on_postgresql(connection):
                source = unnest(messages, columns, rows)
                inserted = connection.execute(
                    insert(messages)
                    .from_select(columns, select(*(source.c[name] for name in columns)))
                    .returning(*messages.c)
                ).all()
                # Each row's idempotency key is unique, so it says which input a row is.
                by_key = {row.idempotency_key: row for row in inserted}
                return [by_key[row["idempotency_key"]] for row in rows]
            uniform = [{column: row.get(column) for column in columns} for row in rows]
            return list(
                connection.execute(
                    insert(messages).returning(*messages.c, sort_by_parameter_order=True),
                    uniform,
                ).all()
            )
    except IntegrityError:
        return [create(connection, row) for row in rows]


def record_accepted_many(
    connection: Connection, accepted: Sequence[tuple[int, str | None]], now: datetime, provider: str
) -> None:
    """``record_attempt(accepted=True)`` for many messages in one executemany UPDATE.

    ``accepted`` holds ``(message_id, provider_message_id)`` pairs.
    """
    if not accepted:
        return
    values: dict[str, Any] = {
        "attempts": messages.c.attempts + 1,
        "updated_at": now,
        "provider": provider,
        "last_error": None,
        "status": SENT,
        "sent_at": now,
    }
    if on_postgresql(connection):
        source = unnest(
            messages,
            ["message_id", "provider_message_id"],
            [{"message_id": m, "provider_message_id": p} for m, p in accepted],
        )
        connection.execute(
            update(messages)
            .where(messages.c.message_id == source.c.message_id)
            .values(**values, provider_message_id=source.c.provider_message_id)
        )
        return
    connection.execute(
        update(messages)
        .where(messages.c.message_id == bindparam("b_message_id"))
        .values(**values, provider_message_id=bindparam("b_provider_message_id")),
        [{"b_message_id": m, "b_provider_message_id": p} for m, p in accepted],
    )


def record_accepted_calls(
    connection: Connection, attempt_rows: Sequence[dict[str, Any]], now: datetime
) -> None:
    """Accepted provider calls: their ``email_attempts`` rows, and each message marked sent
    with the provider and message id of its row (``record_accepted_many``).

    On PostgreSQL one statement does both (the UPDATE in a WITH clause of the attempts'
    INSERT, from one row source); elsewhere, an insert and an update per provider.
    """
    if not attempt_rows:
        return
    if not on_postgresql(connection):
        insert_rows(connection, email_attempts, attempt_rows)
        by_provider: dict[str, list[tuple[int, str | None]]] = {}
        for row in attempt_rows:
            by_provider.setdefault(row["provider"], []).append(
                (row["message_id"], row["provider_message_id"])
            )
        for provider, accepted in by_provider.items():
            record_accepted_many(connection, accepted, now, provider)
        return
    columns = sorted(set().union(*(row.keys() for row in attempt_rows)))
    source = unnest(email_attempts, columns, attempt_rows)
    calls = select(*(source.c[name] for name in columns)).cte("calls")
    marked = (
        update(messages)
        .where(messages.c.message_id == calls.c.message_id)
        .values(
            attempts=messages.c.attempts + 1,
            updated_at=now,
            provider=calls.c.provider,
            last_error=None,
            status=SENT,
            sent_at=now,
            provider_message_id=calls.c.provider_message_id,
        )
        .cte("marked")
    )
    connection.execute(
        insert(email_attempts)
        .from_select(columns, select(*(calls.c[name] for name in columns)))
        .add_cte(marked)
    )


def _holder(connection: Connection, values: dict[str, Any]) -> tuple[int | None, str]:
    if values.get("dedupe_key") is not None:
        holder = connection.execute(
            select(messages.c.message_id).where(messages.c.dedupe_key == values["dedupe_key"])
        ).scalar()
        if holder is not None:
            return holder, f"dedupe key {values['dedupe_key']!r}"
    holder = connection.execute(
        select(messages.c.message_id).where(messages.c.idempotency_key == values["idempotency_key"])
    ).scalar()
    return holder, f"idempotency key {values['idempotency_key']!r}"


def _insert(connection: Connection, values: dict[str, Any]) -> Row:
    return connection.execute(insert(messages).values(**values).returning(*messages.c)).one()


def set_status(
    connection: Connection,
    message_id: int,
    status: str,
    now: datetime,
    *,
    last_error: str | None = None,
    **extra: Any,
) -> None:
    connection.execute(
        update(messages)
        .where(messages.c.message_id == message_id)
        .values(status=status, updated_at=now, last_error=last_error, **extra)
    )


def record_attempt(
    connection: Connection,
    message_id: int,
    now: datetime,
    *,
    accepted: bool,
    provider: str,
    provider_message_id: str | None,
    error: str | None,
) -> None:
    values: dict[str, Any] = {
        "attempts": messages.c.attempts + 1,
        "updated_at": now,
        "provider": provider,
        "last_error": error,
    }
    if accepted:
        values.update(status=SENT, provider_message_id=provider_message_id, sent_at=now)
    connection.execute(update(messages).where(messages.c.message_id == message_id).values(**values))


def set_recipient(connection: Connection, message_id: int, recipient: str, now: datetime) -> None:
    """A recipient found on a replay, for a message that had none."""
    connection.execute(
        update(messages)
        .where(messages.c.message_id == message_id)
        .values(
            recipient=recipient,
            recipient_domain=recipient.rsplit("@", 1)[-1].lower(),
            updated_at=now,
        )
    )


def reopen(connection: Connection, message_ids: Sequence[int], now: datetime) -> int:
    """A replay gives dead messages another go, with the idempotency key they already have."""
    if not message_ids:
        return 0
    return connection.execute(
        update(messages)
        .where(one_of(connection, messages.c.message_id, message_ids), messages.c.status == DEAD)
        .values(status=PENDING, updated_at=now)
    ).rowcount


def counts_by_status(connection: Connection) -> dict[str, int]:
    rows = connection.execute(
        select(messages.c.status, func.count()).group_by(messages.c.status)
    ).all()
    counts = dict.fromkeys(MESSAGE_STATUSES, 0)
    counts.update({status: n for status, n in rows})
    return counts


def find_for_provider_event(
    connection: Connection,
    *,
    idempotency_key: str | None,
    event_id: str | None,
    provider_message_id: str | None,
) -> Row | None:
    """The message a provider event is about: by our key, else our event id, else theirs."""
    if idempotency_key:
        row = connection.execute(
            select(messages).where(messages.c.idempotency_key == idempotency_key)
        ).first()
        if row is not None:
            return row
    if provider_message_id:
        row = connection.execute(
            select(messages).where(messages.c.provider_message_id == provider_message_id)
        ).first()
        if row is not None:
            return row
    if event_id:
        rows = connection.execute(
            select(messages).where(messages.c.event_id == event_id, messages.c.status == SENT)
        ).all()
        if len(rows) == 1:
            return rows[0]
    return None


def lock_delivery_status(connection: Connection, message_id: int) -> str | None:
    """Lock the message's row until commit (PostgreSQL; SQLite's writer lock already holds)
    and return its delivery status as of then."""
    return connection.execute(
        select(messages.c.delivery_status)
        .where(messages.c.message_id == message_id)
        .with_for_update()
    ).scalar()


def set_delivery_status(
    connection: Connection, message_id: int, delivery_status: str, now: datetime
) -> None:
    connection.execute(
        update(messages)
        .where(messages.c.message_id == message_id)
        .values(delivery_status=delivery_status, delivery_updated_at=now)
    )


# ---- erasure (email_platform.operating.erasure) --------------------------------------------------

#: An erased person's message that was never sent: final, but deliberately not in TERMINAL,
#: so the send path never settles its (cancelled) event as done. Not in MESSAGE_STATUSES (the
#: zero-filled counts of ``status --json``); counted wherever one exists.
CANCELLED = "cancelled"


def to_addresses(connection: Connection, addresses: Sequence[str]) -> list[Row]:
    """Messages whose recipient is one of ``addresses`` (normalized; a scan of the table)."""
    rows: list[Row] = []
    wanted = sorted(set(addresses))
    for start in range(0, len(wanted), 500):
        rows.extend(
            connection.execute(
                select(messages).where(
                    func.lower(messages.c.recipient).in_(wanted[start : start + 500])
                )
            ).all()
        )
    return rows


def for_ids(connection: Connection, message_ids: Sequence[int]) -> list[Row]:
    return rows_in(connection, messages, "message_id", message_ids)


def cancel_pending(
    connection: Connection,
    message_ids: Sequence[int],
    now: datetime,
    reason: str = "cancelled: recipient erased",
) -> int:
    total = 0
    for start in range(0, len(message_ids), 500):
        chunk = list(message_ids[start : start + 500])
        total += connection.execute(
            update(messages)
            .where(one_of(connection, messages.c.message_id, chunk), messages.c.status == PENDING)
            .values(status=CANCELLED, updated_at=now, last_error=reason)
        ).rowcount
    return total


def anonymize(connection: Connection, message_id: int, values: dict[str, Any]) -> None:
    connection.execute(update(messages).where(messages.c.message_id == message_id).values(**values))


# ---- metrics (email_platform.observability.metrics, email-platform status) -----------------------


def _accepted_since(connection: Connection, since: datetime) -> Any:
    """Messages accepted at or after ``since``: lane, and seconds from when the event was due
    (published, or its ``send_after`` when later: a deliberate delay is not latency).

    The ``updated_at`` index bounds the read (a message is updated when it is accepted).
    """
    from sqlalchemy import Float, cast, extract  # only the metrics need these

    from email_platform.db.schema import email_outbox as outbox

    if on_postgresql(connection):
        due = func.greatest(outbox.c.published_at, outbox.c.available_at)
        seconds = cast(extract("epoch", messages.c.sent_at - due), Float)
    else:  # SQLite keeps UTC text; julianday() reads it, in days
        due = func.max(func.julianday(outbox.c.published_at), func.julianday(outbox.c.available_at))
        seconds = (func.julianday(messages.c.sent_at) - due) * 86400.0
    return (
        select(messages.c.lane.label("lane"), seconds.label("seconds"))
        .select_from(messages.join(outbox, outbox.c.event_id == messages.c.event_id))
        .where(
            messages.c.status == SENT,
            messages.c.updated_at >= since,
            messages.c.sent_at >= since,
        )
        .subquery()
    )


def accepted_latency_histogram(
    connection: Connection, since: datetime, bounds: Sequence[float]
) -> dict[str, tuple[list[int], int, float]]:
    """Per lane, over messages accepted since ``since``: how many took at most each of
    ``bounds`` seconds (cumulative, as Prometheus buckets are), how many in all, their sum."""
    from sqlalchemy import case

    window = _accepted_since(connection, since)
    rows = connection.execute(
        select(
            window.c.lane,
            func.count(),
            func.sum(window.c.seconds),
            *[func.sum(case((window.c.seconds <= bound, 1), else_=0)) for bound in bounds],
        ).group_by(window.c.lane)
    ).all()
    return {
        lane: ([int(n or 0) for n in buckets], int(count), float(total or 0.0))
        for lane, count, total, *buckets in rows
    }


def accepted_latency_percentiles(
    connection: Connection, since: datetime, percents: Sequence[int]
) -> dict[str, tuple[int, dict[int, float]]]:
    """Per lane, over messages accepted since ``since``: how many, and the nearest-rank
    percentile (the value at rank ceil(p * n / 100)) for each integer p of ``percents``.

    The database ranks the rows (window functions, on SQLite and PostgreSQL alike) and
    returns only the ranked ones asked for, whatever the window holds.
    """
    from sqlalchemy import or_

    window = _accepted_since(connection, since)
    ranked = select(
        window.c.lane,
        window.c.seconds,
        func.row_number()
        .over(partition_by=window.c.lane, order_by=window.c.seconds)
        .label("position"),
        func.count().over(partition_by=window.c.lane).label("n"),
    ).subquery()
    wanted = [(p * ranked.c.n + 99) // 100 for p in percents]
    rows = connection.execute(
        select(ranked.c.lane, ranked.c.n, ranked.c.position, ranked.c.seconds).where(
            or_(*[ranked.c.position == rank for rank in wanted])
        )
    ).all()
    found: dict[str, tuple[int, dict[int, float]]] = {}
    for lane, n, position, seconds in rows:
        values = found.setdefault(lane, (int(n), {}))[1]
        for p in percents:
            if (p * int(n) + 99) // 100 == position:
                values[p] = float(seconds)
    return found


# ---- retention (email_platform.operating.retention) ----------------------------------------------


def ids_query(events: Any) -> Any:
    """``SELECT message_id`` of the messages of the events an id query selects."""
    return select(messages.c.message_id).where(messages.c.event_id.in_(events.scalar_subquery()))


def ids_for_events(connection: Connection, event_ids: Sequence[str]) -> list[int]:
    if not event_ids:
        return []
    return list(
        connection.execute(
            select(messages.c.message_id).where(one_of(connection, messages.c.event_id, event_ids))
        ).scalars()
    )


def count_for_events(connection: Connection, events: Any) -> int:
    """How many messages the events of an id query (``outbox.purgeable_query``) have."""
    return int(
        connection.execute(
            select(func.count()).where(messages.c.event_id.in_(events.scalar_subquery()))
        ).scalar()
    )


def delete_for_events(connection: Connection, event_ids: Sequence[str]) -> int:
    """Delete the messages of these events; their attempts (foreign key) must be gone."""
    from sqlalchemy import delete

    if not event_ids:
        return 0
    return connection.execute(
        delete(messages).where(one_of(connection, messages.c.event_id, event_ids))
    ).rowcount


def expire_dead(
    connection: Connection, expiries: Sequence[tuple[int, datetime]], now: datetime
) -> int:
    """Dead messages past their ``expires_at`` become ``expired``, as a replay would make
    them; one a replay reopened meanwhile is left to the replay."""
    total = 0
    for message_id, expires_at in expiries:
        total += connection.execute(
            update(messages)
            .where(messages.c.message_id == message_id, messages.c.status == DEAD)
            .values(
                status=EXPIRED,
                updated_at=now,
                last_error=f"expired at {_utc(expires_at).isoformat()}",
            )
        ).rowcount
    return total


def _utc(value: datetime) -> datetime:
    from email_platform.common.timeutil import as_utc

    return as_utc(value) or value
