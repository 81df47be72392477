"""The lane sensors' view of ``email_outbox`` and the claim with its lease: which events are
due, who holds them, until when, and how they are given back."""

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, and_, case, or_, select, update

from email_platform.db.schema import email_outbox as outbox
from email_platform.store.bulk import ids_per_statement, one_of
from email_platform.store.outbox.states import (
    DEAD,
    IN_FLIGHT,
    PENDING,
    chunks,
)


def _requestable(lane: str, now: datetime, request_timeout_s: int) -> Any:
    stale_request = now - timedelta(seconds=request_timeout_s)
    return and_(
        outbox.c.lane == lane,
        or_(
            # Pending and due, and not requested recently (a requested batch waits for its run).
            and_(
                outbox.c.status == PENDING,
                outbox.c.available_at <= now,
                or_(outbox.c.requested_at.is_(None), outbox.c.requested_at < stale_request),
            ),
            # Held by a run that died without telling anyone: its lease ran out.
            and_(outbox.c.status == IN_FLIGHT, outbox.c.lease_expires_at < now),
        ),
    )


def find_requestable(
    connection: Connection, lane: str, now: datetime, request_timeout_s: int, limit: int
) -> Sequence[Row]:
    """Events the lane's sensor should put into run requests, oldest first."""
    query = (
        select(outbox.c.event_id, outbox.c.event_type, outbox.c.request_count)
        .where(_requestable(lane, now, request_timeout_s))
        .order_by(outbox.c.available_at, outbox.c.event_id)
        .limit(limit)
    )
    return connection.execute(query).all()


def find_due(
    connection: Connection,
    lane: str,
    now: datetime,
    limit: int,
    *,
    not_held_by: str | None = None,
) -> list[str]:
    """Event ids a lane worker may claim now, oldest first: due, or held past their lease.

    Unlike the sensor's view this ignores ``requested_at``: the claim, not the request, is the
    gate, so a worker may take an event a sensor requested while the lane ran batch runs.
    ``not_held_by``: leave out what that run holds, even past its lease. A worker's own held
    events are in flight with it or waiting for its retry; found again, they would be sent by a
    second batch beside the first (its lease lapses if its heartbeat cannot write for a lease).
    """
    # Two queries, not one OR: each walks the (lane, status, available_at) index in order and
    # stops at the limit instead of sorting the whole backlog on every poll.
    expired = (
        select(outbox.c.event_id)
        .where(
            outbox.c.lane == lane,
            outbox.c.status == IN_FLIGHT,
            outbox.c.lease_expires_at < now,
            *([outbox.c.claimed_by != not_held_by] if not_held_by is not None else []),
        )
        .order_by(outbox.c.available_at, outbox.c.event_id)
        .limit(limit)
    )
    event_ids = list(connection.execute(expired).scalars())
    if len(event_ids) < limit:
        pending = (
            select(outbox.c.event_id)
            .where(
                outbox.c.lane == lane,
                outbox.c.status == PENDING,
                outbox.c.available_at <= now,
            )
            .order_by(outbox.c.available_at, outbox.c.event_id)
            .limit(limit - len(event_ids))
        )
        event_ids.extend(connection.execute(pending).scalars())
    return event_ids


def mark_requested(connection: Connection, event_ids: Sequence[str], now: datetime) -> None:
    for chunk in chunks(event_ids, ids_per_statement(connection)):
        connection.execute(
            update(outbox)
            .where(one_of(connection, outbox.c.event_id, chunk))
            .values(requested_at=now, request_count=outbox.c.request_count + 1)
        )


def claim(
    connection: Connection,
    event_ids: Sequence[str],
    *,
    run_id: str,
    previous_owners: Sequence[str] = (),
    lease_s: int,
    now: datetime,
    include_dead: bool = False,
) -> list[Row]:
    """Atomically take the events of ``event_ids`` that no live run holds.

    Pending and due rows are taken, and so are rows whose lease expired, rows this run (or the
    run it re-executes) already holds, and with ``include_dead`` (a replay) dead rows. Any other
    row is left alone: that is the gate that keeps an event in one run at a time.
    """
    owners = [run_id, *previous_owners]
    owned = and_(outbox.c.status == IN_FLIGHT, outbox.c.claimed_by.in_(owners))
    free = [
        and_(outbox.c.status == PENDING, outbox.c.available_at <= now),
        and_(
            outbox.c.status == IN_FLIGHT,
            outbox.c.lease_expires_at < now,
            outbox.c.claimed_by.not_in(owners),
        ),
    ]
    if include_dead:
        free.append(outbox.c.status == DEAD)
    take = (
        update(outbox)
        .values(
            status=IN_FLIGHT,
            claimed_by=run_id,
            lease_expires_at=now + timedelta(seconds=lease_s),
            claim_count=outbox.c.claim_count + case((outbox.c.claimed_by == run_id, 0), else_=1),
        )
        .returning(*outbox.c)
    )
    claimed: list[Row] = []
    for chunk in chunks(event_ids, ids_per_statement(connection)):
        in_chunk = one_of(connection, outbox.c.event_id, chunk)
        if connection.dialect.name == "postgresql":
            # What this run already holds is waited for, not skipped: its own lease renewal
            # may lock a row for a moment, and a skipped row would stay held, never sent.
            claimed.extend(connection.execute(take.where(in_chunk, owned)).all())
            # SKIP LOCKED: a row another transaction is claiming right now is simply not ours.
            locked = (
                select(outbox.c.event_id)
                .where(in_chunk, or_(*free))
                .with_for_update(skip_locked=True)
            )
            target = outbox.c.event_id.in_(locked.scalar_subquery())
        else:
            # SQLite serializes writers (BEGIN IMMEDIATE), so the WHERE is re-checked atomically.
            target = and_(in_chunk, or_(owned, *free))
        claimed.extend(connection.execute(take.where(target)).all())
    # Publish order, so the first of two events sharing a dedupe key is the one sent.
    return sorted(claimed, key=lambda row: (row.published_at, row.event_id))


def held_by(connection: Connection, event_ids: Sequence[str], run_id: str) -> set[str]:
    """The given events that ``run_id`` still holds: in flight under its claim."""
    held: set[str] = set()
    for chunk in chunks(event_ids, ids_per_statement(connection)):
        held.update(
            connection.execute(
                select(outbox.c.event_id).where(
                    one_of(connection, outbox.c.event_id, chunk),
                    outbox.c.claimed_by == run_id,
                    outbox.c.status == IN_FLIGHT,
                )
            ).scalars()
        )
    return held


def renew_leases(connection: Connection, run_id: str, until: datetime) -> int:
    """Extend to ``until`` the lease of every event ``run_id`` holds; never shorten one.

    A live run calls this every few seconds, so a short lease frees a dead run's events soon
    while a live run keeps them. A longer lease (held across a retry wait) is left as it is.
    Returns how many leases were extended.
    """
    renewable = and_(
        outbox.c.claimed_by == run_id,
        outbox.c.status == IN_FLIGHT,
        outbox.c.lease_expires_at < until,
    )
    if connection.dialect.name == "postgresql":
        # SKIP LOCKED: a row the run is recording right now waits for the next renewal, so the
        # renewal never blocks on, or deadlocks with, the run's own transactions.
        locked = select(outbox.c.event_id).where(renewable).with_for_update(skip_locked=True)
        target = outbox.c.event_id.in_(locked.scalar_subquery())
    else:
        target = renewable
    return connection.execute(update(outbox).where(target).values(lease_expires_at=until)).rowcount


def extend_lease(
    connection: Connection, event_ids: Sequence[str], run_id: str, until: datetime
) -> None:
    for chunk in chunks(event_ids, ids_per_statement(connection)):
        connection.execute(
            update(outbox)
            .where(
                one_of(connection, outbox.c.event_id, chunk),
                outbox.c.claimed_by == run_id,
                outbox.c.status == IN_FLIGHT,
            )
            .values(lease_expires_at=until)
        )


def finish(
    connection: Connection,
    event_ids: Sequence[str],
    *,
    status: str,
    resolution: str | None,
    now: datetime,
) -> None:
    """Mark events ``done`` or ``dead`` and drop their claim."""
    for chunk in chunks(event_ids, ids_per_statement(connection)):
        connection.execute(
            update(outbox)
            .where(one_of(connection, outbox.c.event_id, chunk))
            .values(status=status, resolution=resolution, done_at=now, lease_expires_at=None)
        )


def defer(connection: Connection, event_ids: Sequence[str], run_id: str, until: datetime) -> int:
    """Give back events ``run_id`` holds, due again at ``until`` (a route's quiet hours).

    The claim that found them too early does not count towards the crash-loop limit.
    """
    return connection.execute(
        update(outbox)
        .where(
            outbox.c.event_id.in_(list(event_ids)),
            outbox.c.status == IN_FLIGHT,
            outbox.c.claimed_by == run_id,
        )
        .values(
            status=PENDING,
            available_at=until,
            claimed_by=None,
            lease_expires_at=None,
            requested_at=None,
            claim_count=outbox.c.claim_count - 1,
        )
    ).rowcount


def release_run(connection: Connection, run_id: str) -> list[str]:
    """Give back what a failed run still holds, so the next sensor tick requests it again."""
    rows = connection.execute(
        update(outbox)
        .where(outbox.c.claimed_by == run_id, outbox.c.status == IN_FLIGHT)
        .values(status=PENDING, lease_expires_at=None, requested_at=None)
        .returning(outbox.c.event_id)
    ).all()
    return [row.event_id for row in rows]


def holders_past_lease(connection: Connection, lane: str, now: datetime) -> list[str]:
    """Runs that hold events of ``lane`` whose lease ran out: a live holder renews its leases,
    so these are dead (or cut off from the database for longer than a lease)."""
    return list(
        connection.execute(
            select(outbox.c.claimed_by)
            .where(
                outbox.c.lane == lane,
                outbox.c.status == IN_FLIGHT,
                outbox.c.lease_expires_at < now,
                outbox.c.claimed_by.is_not(None),
            )
            .distinct()
        ).scalars()
    )


def holding(connection: Connection, run_ids: Sequence[str]) -> set[str]:
    """Which of ``run_ids`` hold at least one event (a claim in flight, retry waits included)."""
    if not run_ids:
        return set()
    return set(
        connection.execute(
            select(outbox.c.claimed_by)
            .where(outbox.c.status == IN_FLIGHT, outbox.c.claimed_by.in_(list(run_ids)))
            .distinct()
        ).scalars()
    )


def make_requestable(connection: Connection, event_ids: Sequence[str], max_requests: int) -> int:
    """Pending events of a run that died before claiming them: requestable again at once.

    Only those requested fewer than ``max_requests`` times: one that keeps failing to start
    waits out its lane's request timeout instead, so doomed runs do not loop tightly.
    """
    total = 0
    for chunk in chunks(event_ids, ids_per_statement(connection)):
        total += connection.execute(
            update(outbox)
            .where(
                one_of(connection, outbox.c.event_id, chunk),
                outbox.c.status == PENDING,
                outbox.c.request_count < max_requests,
            )
            .values(requested_at=None)
        ).rowcount
    return total
