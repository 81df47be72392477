"""Reads and writes of ``provider_rates``: the send slots every worker of a provider shares.

A bucket's ``next_slot`` is the first moment (epoch seconds) no sender has been handed yet. A
grant of ``count`` slots at ``per_s`` is one ``UPDATE … RETURNING`` that moves it on by
``count / per_s`` from the later of itself, the caller's now and the bucket's hold: whoever
updates the row first gets the earlier slots, and no two senders get the same one. SQLite
serializes it with the engine's ``BEGIN IMMEDIATE``, PostgreSQL with the row's lock.
"""

from collections.abc import Sequence

from sqlalchemy import ColumnElement, Connection, func, literal, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from email_platform.db.schema import provider_rates


def _greatest(connection: Connection, *values: ColumnElement | float) -> ColumnElement:
    # SQLite's many-argument max() is a scalar function; PostgreSQL spells it greatest().
    if connection.dialect.name == "sqlite":
        return func.max(*values)
    return func.greatest(*values)


def ensure(connection: Connection, buckets: Sequence[str], *, now: float) -> None:
    """Create the rows of ``buckets`` that do not exist yet (free from ``now``)."""
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    for bucket in buckets:
        connection.execute(
            dialect.insert(provider_rates)
            .values(bucket=bucket, next_slot=now, held_until=0.0)
            .on_conflict_do_nothing(index_elements=["bucket"])
        )


def take(
    connection: Connection, bucket: str, *, count: int, per_s: float, now: float
) -> float | None:
    """Hand out ``count`` slots of ``bucket`` at ``per_s``; the first one's time, or None if
    the bucket has no row yet (``ensure`` it)."""
    span = take_span(connection, bucket, count=count, per_s=per_s, now=now)
    return None if span is None else span[0]


def take_span(
    connection: Connection, bucket: str, *, count: int, per_s: float, now: float
) -> tuple[float, float] | None:
    """``take``, with where the grant ended as the row holds it (what ``give_back`` compares
    exactly: recomputed, the sum can differ in its last bit)."""
    start = _greatest(
        connection,
        provider_rates.c.next_slot,
        provider_rates.c.held_until,
        literal(now, provider_rates.c.next_slot.type),
    )
    row = connection.execute(
        update(provider_rates)
        .where(provider_rates.c.bucket == bucket)
        .values(next_slot=start + count / per_s)
        .returning(provider_rates.c.next_slot)
    ).one_or_none()
    return None if row is None else (row.next_slot - count / per_s, row.next_slot)


def starts(connection: Connection, buckets: Sequence[str], *, now: float) -> dict[str, float]:
    """When each of ``buckets`` could hand out its next slot, locking their rows until the
    transaction ends (in name order, so two senders never wait on each other)."""
    query = (
        select(provider_rates.c.bucket, provider_rates.c.next_slot, provider_rates.c.held_until)
        .where(provider_rates.c.bucket.in_(sorted(buckets)))
        .order_by(provider_rates.c.bucket)
        .with_for_update()
    )
    return {
        row.bucket: max(row.next_slot, row.held_until, now)
        for row in connection.execute(query).all()
    }


def hold(connection: Connection, provider: str, *, until: float, now: float) -> None:
    """Every bucket of ``provider`` hands out nothing before ``until`` (a provider's 429)."""
    ensure(connection, [provider], now=now)
    of_provider = or_(
        provider_rates.c.bucket == provider,
        provider_rates.c.bucket.startswith(provider + ":", autoescape=True),
    )
    # Lock the rows in name order first, as ``starts`` does: one UPDATE locks them in the
    # order it finds them on disk, and a grant holding one while waiting for another would
    # deadlock with it on PostgreSQL.
    connection.execute(
        select(provider_rates.c.bucket)
        .where(of_provider)
        .order_by(provider_rates.c.bucket)
        .with_for_update()
    ).all()
    connection.execute(
        update(provider_rates)
        .where(of_provider)
        .values(held_until=_greatest(connection, provider_rates.c.held_until, until))
    )


def give_back(
    connection: Connection, bucket: str, *, granted_until: float, unused_from: float
) -> bool:
    """Return a sender's unused slots ``[unused_from, granted_until)`` if nobody was handed a
    slot after them (a stopping worker's last grant); whether they were returned."""
    result = connection.execute(
        update(provider_rates)
        .where(provider_rates.c.bucket == bucket, provider_rates.c.next_slot == granted_until)
        .values(next_slot=unused_from)
    )
    return result.rowcount == 1


def snapshot(connection: Connection) -> dict[str, tuple[float, float]]:
    """Every bucket's ``(next_slot, held_until)``: what ``status`` and the tests read."""
    return {
        row.bucket: (row.next_slot, row.held_until)
        for row in connection.execute(select(provider_rates)).all()
    }
