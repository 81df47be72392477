"""Reads and writes of ``email_outbox``: publish, the sensor's view, the claim, its lease."""

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, and_, case, func, insert, or_, select, update

from email_platform.db.schema import email_outbox as outbox
from email_platform.store.bulk import one_of, rows_in, text_holds_any

PENDING, IN_FLIGHT, DONE, DEAD = "pending", "in_flight", "done", "dead"
EVENT_STATUSES = (PENDING, IN_FLIGHT, DONE, DEAD)


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
    for chunk in _chunks(event_ids, 500):
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
    for chunk in _chunks(event_ids, 500):
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
    for chunk in _chunks(event_ids, 500):
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
    for chunk in _chunks(event_ids, 500):
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
    for chunk in _chunks(event_ids, 500):
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
    for chunk in _chunks(event_ids, 500):
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


def lanes_of(connection: Connection, event_ids: Sequence[str]) -> dict[str, list[str]]:
    """The given events that exist, grouped by lane, each lane's ids in order."""
    by_lane: dict[str, list[str]] = {}
    for chunk in _chunks(sorted(event_ids), 500):
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
    for chunk in _chunks(event_ids, 500):
        rows = connection.execute(
            select(outbox.c.status, func.count())
            .where(one_of(connection, outbox.c.event_id, chunk))
            .group_by(outbox.c.status)
        ).all()
        for status, n in rows:
            counts[status] = counts.get(status, 0) + n
    return counts


def requeue(connection: Connection, event_ids: Sequence[str]) -> int:
    """Dead events back to pending for a replay; the lane sensor picks them up."""
    total = 0
    for chunk in _chunks(event_ids, 500):
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
    for chunk in _chunks(sorted(set(event_ids)), 500):
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


def lane_backlog(connection: Connection) -> dict[str, tuple[int, datetime | None]]:
    """Per lane: events not yet done (pending or in flight) and the oldest one's publish time."""
    rows = connection.execute(
        select(outbox.c.lane, func.count(), func.min(outbox.c.published_at))
        .where(outbox.c.status.in_([PENDING, IN_FLIGHT]))
        .group_by(outbox.c.lane)
    ).all()
    return {lane: (n, oldest) for lane, n, oldest in rows}


def _chunks(items: Iterable[str], size: int) -> Iterable[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ---- erasure (email_platform.erasure) -------------------------------------------------------

#: Terminal, like done and dead: an erased person's event, never sent. Not in EVENT_STATUSES
#: (the zero-filled counts of ``status --json``); counted wherever one exists.
CANCELLED = "cancelled"


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
    for chunk in _chunks(sorted(event_ids), 500):
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


# ---- retention (email_platform.retention) ---------------------------------------------------

#: What the purge may delete once old enough: nothing here is pending, in flight or replayable
#: (a dead event with an open dead letter is kept by ``purgeable_query``).
FINISHED = (DONE, DEAD, CANCELLED)


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
    for chunk in _chunks(event_ids, 500):
        total += connection.execute(
            update(outbox)
            .where(one_of(connection, outbox.c.event_id, chunk), outbox.c.status == DEAD)
            .values(status=DONE, resolution=resolution, done_at=now, lease_expires_at=None)
        ).rowcount
    return total
