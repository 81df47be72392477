"""Realistic email history written straight into an application database, for the benchmark.

``python -m bench.generate --database-url sqlite:///h.sqlite3 --messages 100000 --days 30``

Each message is one event x route of a shipped template, in that template's lane, with the
status mix of a real system (sent, suppressed, duplicate, expired, dead after retries), one or
more attempts (transient failures retried), and the provider events a real provider sends
back: queued, sent, delivered or a bounce (hard or soft, sometimes after delivery), human and
machine opens (several per reader), clicks, complaints, unsubscribes, plus a few orphans that
match no message.
About five provider events per message with the defaults. Seeded, so runs are comparable.
Messages are made and written a chunk at a time (100,000 by default), oldest first, so memory
stays bounded at any size; provider events wait in numpy arrays until everything received
before them is made, so their ids follow arrival. Rows are written with the database's own
bulk path (``bench.history_rows``: sqlite3 ``executemany``, PostgreSQL ``COPY``), bypassing the
send path: this measures the warehouse, not the sender.
"""

import argparse
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import Engine, bindparam, event, func, select, update

from bench.history_rows import (
    EVENT_TYPES,
    TYPE_CODE,
    Ids,
    Pending,
    bulk_pragmas,
    drop_indexes,
    make_indexes,
    write_attempts,
    write_events,
    write_messages,
)
from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_events,
    email_messages,
)
from email_platform.webhooks.vocabulary import RANK, combine

TEMPLATES = (
    # template, event type, lane, share of traffic
    ("welcome", "user.signed_up", "transactional", 0.25),
    ("password_reset", "user.password_reset_requested", "critical", 0.10),
    ("receipt", "order.paid", "transactional", 0.25),
    ("weekly_digest", "digest.ready", "bulk", 0.40),
)
DOMAINS = ("gmail.com", "yahoo.com", "outlook.com", "icloud.com", "example.com", "corp.example")
DOMAIN_SHARES = (0.4, 0.15, 0.15, 0.15, 0.1, 0.05)


@dataclass
class Rates:
    """Fault and engagement rates; defaults give about five provider events per message."""

    suppressed: float = 0.01
    duplicate: float = 0.005
    expired: float = 0.002
    dead: float = 0.01
    transient_retry: float = 0.05
    delivered: float = 0.97
    bounce: float = 0.02
    hard_bounce_share: float = 0.7
    bounce_after_delivery: float = 0.002
    open: float = 0.45
    machine_open: float = 0.25
    opens_per_reader: float = 4.0
    click: float = 0.3
    clicks_per_clicker: float = 1.5
    complaint: float = 0.002
    unsubscribe: float = 0.003
    orphan: float = 0.001


@dataclass
class Generated:
    messages: int = 0
    attempts: int = 0
    provider_events: int = 0
    dead_letters: int = 0
    # Provider events of these messages that would be received after ``end`` (not written).
    deferred: int = 0
    # Older messages whose delivery status their late events raised (opened, say).
    statuses_raised: int = 0
    seconds: float = 0.0


def _next_id(engine: Engine, column) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return (connection.execute(select(func.max(column))).scalar() or 0) + 1


def generate(
    database: str | Engine,
    *,
    messages: int,
    days: float = 30,
    end: datetime | None = None,
    seed: int = 7,
    rates: Rates | None = None,
    late_events_for_existing: int = 0,
    late_recency_days: float | None = 2.0,
    steady_state: bool = False,
    chunk: int = 100_000,
    progress: Callable[[int, int], None] | None = None,
) -> Generated:
    """Append ``messages`` messages spread over ``days`` days ending at ``end`` (default now).

    Each provider event is received 0.05-3 s after it occurred, and only those received by
    ``end`` are written: an open hours after a send has not happened yet at ``end``.

    ``late_events_for_existing`` adds that many provider events (human opens) for messages
    that already existed: the late engagement an incremental refresh must pick up, received
    over the same ``days``. ``steady_state`` adds as many as this batch's messages still have
    to come (``Generated.deferred``): in a steady flow, older messages' late events arrive at
    the rate new messages defer theirs. Real late engagement is mostly recent (people open
    mail within days): the message's age is drawn from an exponential distribution with mean
    ``late_recency_days``; ``None`` picks messages uniformly over the whole history (the worst
    case for an incremental refresh).

    Messages are made and written ``chunk`` at a time, oldest first, one transaction each, so
    memory stays bounded at any size; a history of one chunk is the rows this seed always
    made. ``progress(done, total)`` is called after each chunk.
    """
    started = time.perf_counter()
    engine = make_engine(database) if isinstance(database, str) else database
    if isinstance(database, str) and engine.dialect.name == "sqlite":
        event.listen(engine, "connect", bulk_pragmas)
    upgrade(engine)
    rates = rates or Rates()
    end = (end or datetime.now(UTC)).astimezone(UTC).replace(tzinfo=None)
    first_message = _next_id(engine, email_messages.c.message_id)
    next_ids = Ids(
        _next_id(engine, email_attempts.c.attempt_id),
        _next_id(engine, email_events.c.email_event_id),
        _next_id(engine, dead_letters.c.dead_letter_id),
    )
    result = Generated(messages=messages)
    # Into empty tables, many chunks: indexes built once at the end sort instead of inserting
    # row by row into ever bigger B-trees.
    dropped = drop_indexes(engine) if first_message == 1 and messages > chunk else []
    pending = Pending.empty()
    end64 = np.datetime64(end, "us")
    span_us = days * 86_400e6
    bounds = (list(range(0, messages, max(chunk, 1))) or [0]) + [messages]
    whole = max(messages, 1)
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = b == messages
        # The first chunk draws from the seed's own streams: one chunk is today's history.
        rng = np.random.default_rng(seed if k == 0 else [seed, 2, k])
        ulid_rng = np.random.default_rng([seed, 1] if k == 0 else [seed, 3, k])
        window_end = end64 - np.int64(span_us * (messages - b) / whole) * US
        made = _chunk(
            engine, rng, ulid_rng, rates, first_message, first_message + a, b - a,
            window_end, days * (b - a) / whole, end64, next_ids, result,
            late=(late_events_for_existing if last else 0), steady_state=steady_state and last,
            late_recency_days=late_recency_days, days=days,
        )  # fmt: skip
        # Later chunks' messages occur after this window: their events arrive after it too.
        pending = pending.add(made)
        ready, pending = pending.split(None if last else window_end)
        with engine.begin() as connection:
            result.provider_events += write_events(connection, ready, next_ids, DOMAINS)
        if progress:
            progress(b, messages)
    if dropped:
        make_indexes(engine, dropped)
    if isinstance(database, str):
        engine.dispose()
    result.seconds = time.perf_counter() - started
    return result


US = np.timedelta64(1, "us")


def _chunk(
    engine: Engine,
    rng: np.random.Generator,
    ulid_rng: np.random.Generator,
    rates: Rates,
    call_first: int,
    first_message: int,
    n: int,
    window_end: np.datetime64,
    window_days: float,
    end64: np.datetime64,
    next_ids: Ids,
    result: Generated,
    *,
    late: int,
    steady_state: bool,
    late_recency_days: float | None,
    days: float,
) -> Pending:
    """Make ``n`` messages occurring in the ``window_days`` before ``window_end``, write them
    (outbox, messages, attempts, dead letters), and return their provider events (plus the
    late ones for older messages) for the caller to write in arrival order."""
    sqlite = engine.dialect.name == "sqlite"
    us = US
    ids = np.arange(first_message, first_message + n)
    occurred = window_end - (rng.random(n) * window_days * 86_400e6).astype(np.int64) * us
    occurred.sort()
    published = occurred + rng.integers(1_000, 50_000, n) * us
    created = published + rng.integers(200_000, 4_000_000, n) * us
    shares = np.array([t[3] for t in TEMPLATES])
    template_index = rng.choice(len(TEMPLATES), n, p=shares / shares.sum())
    domain = np.array(DOMAINS, dtype=object)[rng.choice(len(DOMAINS), n, p=DOMAIN_SHARES)]
    # Their own random stream: the rest of the history stays what the seed made it before.
    ulids = _ulids(published, ulid_rng)

    roll = rng.random(n)
    status = np.full(n, "sent", dtype=object)
    cuts = np.cumsum([rates.suppressed, rates.duplicate, rates.expired, rates.dead])
    status[roll < cuts[3]] = "dead"
    status[roll < cuts[2]] = "expired"
    status[roll < cuts[1]] = "duplicate"
    status[roll < cuts[0]] = "suppressed"
    tried = (status == "sent") | (status == "dead")
    retries = np.where(tried & (rng.random(n) < rates.transient_retry), rng.integers(1, 4, n), 0)
    attempts_n = np.where(tried, 1 + retries, 0)
    attempts_n = np.where(status == "dead", np.maximum(attempts_n, 4), attempts_n)
    first_attempt_at = created + rng.integers(5_000, 2_000_000, n) * us
    sent = status == "sent"
    accepted = first_attempt_at + (retries * 2_000_000 + rng.integers(50_000, 600_000, n)) * us
    updated = np.where(tried, accepted, created)

    # Provider events for accepted messages.
    ev_message: list[np.ndarray] = []
    ev_type: list[np.ndarray] = []
    ev_time: list[np.ndarray] = []
    ev_extra: list[np.ndarray] = []

    def add(mask: np.ndarray, kind: str, when: np.ndarray, extra: np.ndarray | int = 0) -> None:
        idx = np.flatnonzero(mask)
        ev_message.append(ids[idx])
        ev_type.append(np.full(idx.size, TYPE_CODE[kind], dtype=np.int8))
        ev_time.append(when[idx])
        ev_extra.append(
            extra[idx].astype(np.int8)
            if isinstance(extra, np.ndarray)
            else np.full(idx.size, extra, np.int8)
        )

    add(sent, "queued", accepted + rng.integers(1_000, 50_000, n) * us)
    add(sent, "sent", accepted + rng.integers(50_000, 900_000, n) * us)  # handed to the MX
    bounce_roll = rng.random(n)
    bounced = sent & (bounce_roll < rates.bounce)
    delivered = sent & ~bounced & (rng.random(n) < rates.delivered / (1 - rates.bounce))
    delivered_at = accepted + rng.integers(300_000, 20_000_000, n) * us
    bounce_type = np.where(rng.random(n) < rates.hard_bounce_share, 1, 2)
    add(delivered, "delivered", delivered_at)
    add(bounced, "bounced", accepted + rng.integers(1_000_000, 60_000_000, n) * us, bounce_type)
    late_bounce = delivered & (rng.random(n) < rates.bounce_after_delivery)
    add(late_bounce, "bounced", delivered_at + rng.integers(60, 7200, n) * 1_000_000 * us,
        bounce_type)  # fmt: skip
    machine = delivered & (rng.random(n) < rates.machine_open)
    add(machine, "opened", delivered_at + rng.integers(1, 30, n) * 1_000_000 * us, 3)
    reader = delivered & (rng.random(n) < rates.open)
    first_open = delivered_at + (rng.exponential(3 * 3600, n) * 1e6).astype(np.int64) * us
    opens_n = np.where(reader, 1 + rng.poisson(rates.opens_per_reader - 1, n), 0)
    for k in range(int(opens_n.max(initial=0))):
        when = first_open + (k * rng.exponential(86_400, n) * 1e6).astype(np.int64) * us
        add(opens_n > k, "opened", when, 4)
    clicker = reader & (rng.random(n) < rates.click)
    clicks_n = np.where(clicker, 1 + rng.poisson(rates.clicks_per_clicker - 1, n), 0)
    for k in range(int(clicks_n.max(initial=0))):
        when = first_open + ((30 + k * 600) * 1e6 + rng.exponential(300e6, n)).astype(np.int64) * us
        add(clicks_n > k, "clicked", when, 5)
    complained = delivered & (rng.random(n) < rates.complaint)
    add(complained, "complained", first_open + 3_600_000_000 * us)
    unsubscribed = delivered & ~complained & (rng.random(n) < rates.unsubscribe)
    add(unsubscribed, "unsubscribed", first_open + 1_800_000_000 * us)

    ev_m = np.concatenate(ev_message)
    ev_t = np.concatenate(ev_type)
    ev_at = np.concatenate(ev_time)
    ev_x = np.concatenate(ev_extra)
    received = ev_at + rng.integers(50_000, 3_000_000, ev_at.size) * us
    arrived = received <= end64
    deferred = int(ev_at.size - arrived.sum())
    result.deferred += deferred
    ev_m, ev_t, ev_at, ev_x, received = (a[arrived] for a in (ev_m, ev_t, ev_at, ev_x, received))
    ev_ulid = ulids[ev_m - first_message]
    # Late engagement for messages that already existed, received over this batch's span.
    late += result.deferred if steady_state else 0
    if late and call_first > 1:
        late_m, late_created, late_event_ids = _late_messages(
            engine, call_first, late, late_recency_days, end64.astype(datetime), rng
        )
        late_received = end64 - (rng.random(late_m.size) * days * 86_400e6).astype(np.int64) * us
        # Not before the message could have been opened (a minute after it was created).
        late_received = np.maximum(late_received, late_created + 60_000_000 * us)
        keep = late_received <= end64
        late_m, late_received = late_m[keep], late_received[keep]
        late_at = late_received - rng.integers(50_000, 3_000_000, late_m.size) * us
        ev_m = np.concatenate([ev_m, late_m])
        ev_t = np.concatenate([ev_t, np.full(late_m.size, TYPE_CODE["opened"], np.int8)])
        ev_at = np.concatenate([ev_at, late_at])
        ev_x = np.concatenate([ev_x, np.full(late_m.size, 4, np.int8)])
        received = np.concatenate([received, late_received])
        late_ulids = np.array([late_event_ids[m] for m in late_m.tolist()], dtype="S26")
        ev_ulid = np.concatenate([ev_ulid, late_ulids])
    orphan = rng.random(ev_m.size) < rates.orphan
    ev_ulid[orphan] = b""
    # Each message's delivery status as ingestion keeps it: its highest-ranked arrived event,
    # set when that event was received; late events raise older messages' status.
    rank = RANKS[ev_t]
    received_us = received.astype(np.int64)
    position = ev_m - first_message
    own = ~orphan & (position >= 0)
    top = np.zeros(n, dtype=np.int64)
    np.maximum.at(top, position[own], rank[own])
    reached = own.copy()
    reached[own] = rank[own] == top[position[own]]
    status_since = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(status_since, position[reached], received_us[reached])
    # Ranks are not unique (delivered and subscribed share one): name them by the types here.
    kinds = set(EVENT_TYPES[np.unique(ev_t)].tolist())
    status_names = {value: name for name, value in RANK.items() if name in kinds}
    delivery_status = np.array([status_names.get(r) for r in top.tolist()], dtype=object)
    status_at = status_since.astype("datetime64[us]")
    status_at[top == 0] = np.datetime64("NaT")
    older = ~orphan & (position < 0)
    raised = _raised_statuses(engine, ev_m[older], EVENT_TYPES[ev_t[older]], received[older])
    result.statuses_raised += len(raised)

    with engine.begin() as connection:
        if not sqlite:
            connection.exec_driver_sql("SET LOCAL TIME ZONE 'UTC'")
        write_messages(
            connection, sqlite, TEMPLATES, ids, ulids, occurred, published, template_index,
            domain, status, tried, sent, attempts_n, created, updated, accepted,
            delivery_status, status_at,
        )  # fmt: skip
        attempts, dead = write_attempts(
            connection, sqlite, ids, ulids, LANE_OF[template_index], tried, sent, attempts_n,
            first_attempt_at, accepted, next_ids,
        )  # fmt: skip
        result.attempts += attempts
        result.dead_letters += dead
        if raised:
            connection.execute(
                update(email_messages)
                .where(email_messages.c.message_id == bindparam("m"))
                .values(delivery_status=bindparam("s"), delivery_updated_at=bindparam("at")),
                raised,
            )
    return Pending(ev_m, ev_t, ev_at, received, ev_x, ev_ulid)


LANE_OF = np.array([t[2] for t in TEMPLATES], dtype=object)
RANKS = np.array([RANK[t] for t in EVENT_TYPES.tolist()], dtype=np.int64)


CROCKFORD = np.frombuffer(b"0123456789ABCDEFGHJKMNPQRSTVWXYZ", dtype=np.uint8)


def _ulids(at: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """ULIDs as the publisher makes them (``email_platform.common.ids``): the millisecond of ``at``
    in the first ten characters, then 80 random bits (from ``rng``, so a seed repeats them).
    Their first characters move with time, as real event ids' do: the warehouse's zone maps
    on event ids depend on it (ids that shared their first eight characters defeated them)."""
    ms = at.astype("datetime64[ms]").astype(np.int64).astype(np.uint64)
    shifts = np.arange(45, -1, -5, dtype=np.uint64)  # ten 5-bit groups of 48 bits (top 2 zero)
    time_chars = (ms[:, None] >> shifts) & np.uint64(31)
    random_chars = rng.integers(0, 32, (ms.size, 16), dtype=np.uint64)
    codes = CROCKFORD[np.concatenate([time_chars, random_chars], axis=1)]
    return np.ascontiguousarray(codes).view("S26").ravel()


def _late_messages(
    engine: Engine,
    first_message: int,
    count: int,
    recency_days: float | None,
    end: datetime,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Existing messages that get a late open, with when each was created: delivered ones only
    (sent, not bounced), uniformly over the history or weighted towards recent ones."""
    delivered = (email_messages.c.status == "sent") & (
        email_messages.c.delivery_status.is_(None) | (email_messages.c.delivery_status != "bounced")
    )
    query = select(
        email_messages.c.message_id, email_messages.c.created_at, email_messages.c.event_id
    ).where(delivered, email_messages.c.message_id < first_message)
    if recency_days is not None:
        since = end - timedelta(days=recency_days * 5)
        if engine.dialect.name == "postgresql":
            since = since.replace(tzinfo=UTC)
        query = query.where(email_messages.c.created_at >= since)
    with engine.connect() as connection:
        rows = connection.execute(query).all()
    if not rows:
        return np.array([], dtype=np.int64), np.array([], dtype="datetime64[us]"), {}
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    created = _naive64([r[1] for r in rows])
    if recency_days is None:
        chosen = rng.choice(ids.size, count)
    else:
        ages_days = (np.datetime64(end, "us") - created) / np.timedelta64(1, "D")
        weights = np.exp(-np.clip(ages_days, 0, None) / recency_days)
        chosen = rng.choice(ids.size, count, p=weights / weights.sum())
    event_ids = {int(ids[k]): rows[k][2] for k in set(chosen.tolist())}
    return ids[chosen], created[chosen], event_ids


def _raised_statuses(
    engine: Engine, messages: np.ndarray, types: np.ndarray, received: np.ndarray
) -> list[dict]:
    """Status updates for existing messages that got late events, in arrival order through
    ingestion's own ``combine``: the new status and when the event that set it arrived."""
    if not messages.size:
        return []
    current = _message_values(engine, messages, email_messages.c.delivery_status)
    raised: dict[int, tuple[str, np.datetime64]] = {}
    arrivals = zip(messages.tolist(), types.tolist(), received, strict=True)
    for m, kind, at in sorted(arrivals, key=lambda r: r[2]):
        before = raised[m][0] if m in raised else current.get(m)
        after = combine(before, kind)
        if after != before:
            raised[m] = (after, at)
    aware = engine.dialect.name == "postgresql"
    updates = []
    for m, (status, at) in raised.items():
        when = at.astype("datetime64[us]").astype(datetime)
        updates.append({"m": m, "s": status, "at": when.replace(tzinfo=UTC) if aware else when})
    return updates


def _naive64(values: list[datetime]) -> np.ndarray:
    naive = [v.astimezone(UTC).replace(tzinfo=None) if v.tzinfo else v for v in values]
    return np.array(naive, dtype="datetime64[us]")


def _message_values(engine: Engine, ids: np.ndarray, column) -> dict:  # type: ignore[no-untyped-def]
    """``column`` of each message in ``ids``, by message id."""
    found = {}
    unique = np.unique(ids).tolist()
    with engine.connect() as connection:
        for start in range(0, len(unique), 900):  # under SQLite's bound-parameter limit
            chunk = unique[start : start + 900]
            found.update(
                connection.execute(
                    select(email_messages.c.message_id, column).where(
                        email_messages.c.message_id.in_(chunk)
                    )
                ).all()
            )
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--days", type=float, default=30)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    result = generate(args.database_url, messages=args.messages, days=args.days, seed=args.seed)
    print(result)


if __name__ == "__main__":
    main()
