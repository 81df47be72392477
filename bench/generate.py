"""Realistic email history written straight into an application database, for the benchmark.

``python -m bench.generate --database-url sqlite:///h.sqlite3 --messages 100000 --days 30``

Each message is one event x route of a shipped template, in that template's lane, with the
status mix of a real system (sent, suppressed, duplicate, expired, dead after retries), one or
more attempts (transient failures retried), and the provider events a real provider sends
back: queued, sent, delivered or a bounce (hard or soft, sometimes after delivery), human and
machine opens (several per reader), clicks, complaints, unsubscribes, plus a few orphans that
match no message.
About five provider events per message with the defaults. Seeded, so runs are comparable.
Rows are written with the database's own bulk path (sqlite3 ``executemany``; SQLAlchemy
``insertmanyvalues`` for PostgreSQL), bypassing the send path: this measures the warehouse, not
the sender.
"""

import argparse
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
from sqlalchemy import Engine, bindparam, func, insert, select, update

from email_platform.db.engine import make_engine, upgrade
from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_events,
    email_messages,
    email_outbox,
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


def _ts(values: np.ndarray, sqlite: bool) -> list:
    """datetime64[us] -> what the driver stores (SQLite: SQLAlchemy's text format)."""
    if sqlite:
        text = np.datetime_as_string(values, unit="us")
        return [None if t == "NaT" else t.replace("T", " ") for t in text.tolist()]
    return [None if np.isnat(v) else v.astype(datetime).replace(tzinfo=UTC) for v in values]


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
    """
    started = time.perf_counter()
    engine = make_engine(database) if isinstance(database, str) else database
    upgrade(engine)
    rates = rates or Rates()
    rng = np.random.default_rng(seed)
    sqlite = engine.dialect.name == "sqlite"
    end = (end or datetime.now(UTC)).astimezone(UTC).replace(tzinfo=None)
    first_message = _next_id(engine, email_messages.c.message_id)
    first_attempt = _next_id(engine, email_attempts.c.attempt_id)
    first_event_row = _next_id(engine, email_events.c.email_event_id)
    first_dead = _next_id(engine, dead_letters.c.dead_letter_id)
    n = messages
    us = np.timedelta64(1, "us")
    ids = np.arange(first_message, first_message + n)
    end64 = np.datetime64(end, "us")
    occurred = end64 - (rng.random(n) * days * 86_400e6).astype(np.int64) * us
    occurred.sort()
    published = occurred + rng.integers(1_000, 50_000, n) * us
    created = published + rng.integers(200_000, 4_000_000, n) * us
    shares = np.array([t[3] for t in TEMPLATES])
    template_index = rng.choice(len(TEMPLATES), n, p=shares / shares.sum())
    domain = np.array(DOMAINS)[rng.choice(len(DOMAINS), n, p=DOMAIN_SHARES)]
    # Their own random stream: the rest of the history stays what the seed made it before.
    event_ids = _ulids(published, np.random.default_rng([seed, 1]))
    event_id_of = dict(zip(ids.tolist(), event_ids, strict=True))

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
    ev_extra: list[np.ndarray] = []  # bounce type / machine flag / url marker

    def add(mask: np.ndarray, kind: str, when: np.ndarray, extra: np.ndarray | None = None):
        idx = np.flatnonzero(mask)
        ev_message.append(ids[idx])
        ev_type.append(np.full(idx.size, kind, dtype=object))
        ev_time.append(when[idx])
        ev_extra.append(extra[idx] if extra is not None else np.full(idx.size, None, object))

    add(sent, "queued", accepted + rng.integers(1_000, 50_000, n) * us)
    add(sent, "sent", accepted + rng.integers(50_000, 900_000, n) * us)  # handed to the MX
    bounce_roll = rng.random(n)
    bounced = sent & (bounce_roll < rates.bounce)
    delivered = sent & ~bounced & (rng.random(n) < rates.delivered / (1 - rates.bounce))
    delivered_at = accepted + rng.integers(300_000, 20_000_000, n) * us
    bounce_type = np.where(rng.random(n) < rates.hard_bounce_share, "hard", "soft").astype(object)
    add(delivered, "delivered", delivered_at)
    add(bounced, "bounced", accepted + rng.integers(1_000_000, 60_000_000, n) * us, bounce_type)
    late_bounce = delivered & (rng.random(n) < rates.bounce_after_delivery)
    add(
        late_bounce,
        "bounced",
        delivered_at + rng.integers(60, 7200, n) * 1_000_000 * us,
        bounce_type,
    )
    machine = delivered & (rng.random(n) < rates.machine_open)
    add(
        machine,
        "opened",
        delivered_at + rng.integers(1, 30, n) * 1_000_000 * us,
        np.full(n, True, dtype=object),
    )
    reader = delivered & (rng.random(n) < rates.open)
    first_open = delivered_at + (rng.exponential(3 * 3600, n) * 1e6).astype(np.int64) * us
    opens_n = np.where(reader, 1 + rng.poisson(rates.opens_per_reader - 1, n), 0)
    for k in range(int(opens_n.max(initial=0))):
        when = first_open + (k * rng.exponential(86_400, n) * 1e6).astype(np.int64) * us
        add(opens_n > k, "opened", when, np.full(n, False, dtype=object))
    clicker = reader & (rng.random(n) < rates.click)
    clicks_n = np.where(clicker, 1 + rng.poisson(rates.clicks_per_clicker - 1, n), 0)
    for k in range(int(clicks_n.max(initial=0))):
        when = first_open + ((30 + k * 600) * 1e6 + rng.exponential(300e6, n)).astype(np.int64) * us
        add(clicks_n > k, "clicked", when, np.full(n, "url", dtype=object))
    complained = delivered & (rng.random(n) < rates.complaint)
    add(complained, "complained", first_open + 3_600_000_000 * us)
    unsubscribed = delivered & ~complained & (rng.random(n) < rates.unsubscribe)
    add(unsubscribed, "unsubscribed", first_open + 1_800_000_000 * us)

    ev_m = np.concatenate(ev_message) if ev_message else np.array([], dtype=np.int64)
    ev_t = np.concatenate(ev_type) if ev_type else np.array([], dtype=object)
    ev_at = np.concatenate(ev_time) if ev_time else np.array([], dtype="datetime64[us]")
    ev_x = np.concatenate(ev_extra) if ev_extra else np.array([], dtype=object)
    received = ev_at + rng.integers(50_000, 3_000_000, ev_at.size) * us
    arrived = received <= end64
    deferred = int(ev_at.size - arrived.sum())
    ev_m, ev_t, ev_at, ev_x, received = (a[arrived] for a in (ev_m, ev_t, ev_at, ev_x, received))
    # Late engagement for messages that already existed, received over this batch's span.
    late = late_events_for_existing + (deferred if steady_state else 0)
    if late and first_message > 1:
        late_m, late_created, late_event_ids = _late_messages(
            engine, first_message, late, late_recency_days, end, rng
        )
        event_id_of.update(late_event_ids)
        late_received = end64 - (rng.random(late_m.size) * days * 86_400e6).astype(np.int64) * us
        # Not before the message could have been opened (a minute after it was created).
        late_received = np.maximum(late_received, late_created + 60_000_000 * us)
        keep = late_received <= end64
        late_m, late_received = late_m[keep], late_received[keep]
        late_at = late_received - rng.integers(50_000, 3_000_000, late_m.size) * us
        ev_m = np.concatenate([ev_m, late_m])
        ev_t = np.concatenate([ev_t, np.full(late_m.size, "opened", dtype=object)])
        ev_at = np.concatenate([ev_at, late_at])
        ev_x = np.concatenate([ev_x, np.full(late_m.size, False, dtype=object)])
        received = np.concatenate([received, late_received])
    orphan = rng.random(ev_m.size) < rates.orphan
    order = np.argsort(received, kind="stable")
    # Each message's delivery status as ingestion keeps it: its highest-ranked arrived event,
    # set when that event was received; late events raise older messages' status.
    rank = np.array([RANK[t] for t in ev_t.tolist()], dtype=np.int64)
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
    kinds = set(ev_t.tolist())
    status_names = {value: name for name, value in RANK.items() if name in kinds}
    delivery_status = np.array([status_names.get(r) for r in top.tolist()], dtype=object)
    status_at = status_since.astype("datetime64[us]")
    status_at[top == 0] = np.datetime64("NaT")
    status_updated = _ts(status_at, sqlite)
    older = ~orphan & (position < 0)
    raised = _raised_statuses(engine, ev_m[older], ev_t[older], received[older])

    template = np.array([t[0] for t in TEMPLATES], dtype=object)[template_index]
    etype = np.array([t[1] for t in TEMPLATES], dtype=object)[template_index]
    lane = np.array([t[2] for t in TEMPLATES], dtype=object)[template_index]
    occurred_s, published_s, created_s = (_ts(a, sqlite) for a in (occurred, published, created))
    updated_s = _ts(updated, sqlite)
    accepted_s = _ts(np.where(sent, accepted, np.datetime64("NaT")), sqlite)
    done_s = updated_s
    ids_l, template_l, lane_l, domain_l = ids.tolist(), template.tolist(), lane.tolist(), domain
    outbox_rows = [
        {
            "event_id": event_ids[i],
            "event_type": etype[i],
            "event_version": 2 if etype[i] == "user.signed_up" else 1,
            "aggregate_id": f"agg_{ids_l[i]}",
            "occurred_at": occurred_s[i],
            "published_at": published_s[i],
            "payload": "{}" if sqlite else {},
            "event_metadata": "{}" if sqlite else {},
            "lane": lane_l[i],
            "available_at": published_s[i],
            "status": "dead" if status[i] == "dead" else "done",
            "resolution": status[i],
            "claim_count": 1,
            "request_count": 1,
            "done_at": done_s[i],
        }
        for i in range(n)
    ]
    message_rows = [
        {
            "message_id": ids_l[i],
            "event_id": event_ids[i],
            "route": template_l[i],
            "template": template_l[i],
            "template_version": 1,
            "lane": lane_l[i],
            "recipient": f"user{ids_l[i]}@{domain_l[i]}",
            "recipient_domain": domain_l[i],
            "idempotency_key": f"{event_ids[i]}:{template_l[i]}",
            "status": status[i],
            "attempts": int(attempts_n[i]),
            "provider": "sandbox" if tried[i] else None,
            "provider_message_id": f"sbx_{ids_l[i]}" if sent[i] else None,
            "created_at": created_s[i],
            "updated_at": updated_s[i],
            "sent_at": accepted_s[i],
            "delivery_status": delivery_status[i],
            "delivery_updated_at": status_updated[i] if delivery_status[i] else None,
        }
        for i in range(n)
    ]
    attempt_rows = []
    next_attempt = first_attempt
    attempt_start = _ts(first_attempt_at, sqlite)
    for i in np.flatnonzero(tried).tolist():
        k = int(attempts_n[i])
        for j in range(k):
            last = j == k - 1
            outcome = "accepted" if (last and sent[i]) else ("permanent" if last else "transient")
            attempt_rows.append(
                {
                    "attempt_id": next_attempt,
                    "message_id": ids_l[i],
                    "event_id": event_ids[i],
                    "run_id": f"run_{ids_l[i] // 100}",
                    "attempt_no": j + 1,
                    "started_at": attempt_start[i],
                    "finished_at": accepted_s[i] if last and sent[i] else attempt_start[i],
                    "outcome": outcome,
                    "http_status": 200
                    if outcome == "accepted"
                    else (503 if outcome == "transient" else 422),
                }
            )
            next_attempt += 1
    dead_rows = [
        {
            "dead_letter_id": first_dead + k,
            "event_id": event_ids[i],
            "message_id": ids_l[i],
            "lane": lane_l[i],
            "reason": ("provider_rejected", "retries_exhausted", "template_error")[k % 3],
            "attempts": int(attempts_n[i]),
            "run_id": f"run_{ids_l[i] // 100}",
            "status": "open" if k % 4 else "discarded",
            "created_at": updated_s[i],
            "resolved_at": None if k % 4 else updated_s[i],
        }
        for k, i in enumerate(np.flatnonzero(status == "dead").tolist())
    ]
    ev_at_s, received_s = _ts(ev_at[order], sqlite), _ts(received[order], sqlite)
    ev_m_l, ev_t_l, ev_x_l = ev_m[order].tolist(), ev_t[order].tolist(), ev_x[order].tolist()
    orphan_l = orphan[order].tolist()
    event_rows = []
    for k in range(len(ev_m_l)):
        m, kind, extra = ev_m_l[k], ev_t_l[k], ev_x_l[k]
        lost = orphan_l[k]
        event_rows.append(
            {
                "email_event_id": first_event_row + k,
                "provider": "sandbox",
                "provider_event_id": f"evt_{first_event_row + k:012d}",
                "event_type": kind,
                "occurred_at": ev_at_s[k],
                "received_at": received_s[k],
                "event_id": None if lost else event_id_of[m],
                "message_id": None if lost else m,
                "provider_message_id": f"sbx_{m}",
                "recipient_domain": DOMAINS[m % len(DOMAINS)],
                "bounce_type": extra if kind == "bounced" else None,
                "click_url": "https://app.example.com/start" if kind == "clicked" else None,
                "machine_open": extra if kind == "opened" else None,
            }
        )
    with engine.begin() as connection:
        for table, rows in (
            (email_outbox, outbox_rows),
            (email_messages, message_rows),
            (email_attempts, attempt_rows),
            (dead_letters, dead_rows),
            (email_events, event_rows),
        ):
            _bulk_insert(connection, table, rows, sqlite)
        if raised:
            connection.execute(
                update(email_messages)
                .where(email_messages.c.message_id == bindparam("m"))
                .values(delivery_status=bindparam("s"), delivery_updated_at=bindparam("at")),
                raised,
            )
    if isinstance(database, str):
        engine.dispose()
    return Generated(
        messages=n,
        attempts=len(attempt_rows),
        provider_events=len(event_rows),
        dead_letters=len(dead_rows),
        deferred=deferred,
        statuses_raised=len(raised),
        seconds=time.perf_counter() - started,
    )


def _bulk_insert(connection, table, rows: list[dict], sqlite: bool) -> None:  # type: ignore[no-untyped-def]
    if not rows:
        return
    names = list(rows[0])
    if sqlite:
        # The driver's executemany with pre-formatted values: ~10x SQLAlchemy's per-row binds.
        raw = connection.connection.driver_connection
        statement = (
            f"INSERT INTO {table.name} ({', '.join(names)}) "
            f"VALUES ({', '.join('?' for _ in names)})"
        )
        raw.executemany(statement, [tuple(r[k] for k in names) for r in rows])
        return
    for start in range(0, len(rows), 50_000):
        connection.execute(insert(table), rows[start : start + 50_000])


CROCKFORD = np.frombuffer(b"0123456789ABCDEFGHJKMNPQRSTVWXYZ", dtype=np.uint8)


def _ulids(at: np.ndarray, rng: np.random.Generator) -> list[str]:
    """ULIDs as the publisher makes them (``email_platform.common.ids``): the millisecond of ``at``
    in the first ten characters, then 80 random bits (from ``rng``, so a seed repeats them).
    Their first characters move with time, as real event ids' do: the warehouse's zone maps
    on event ids depend on it (ids that shared their first eight characters defeated them)."""
    ms = at.astype("datetime64[ms]").astype(np.int64).astype(np.uint64)
    shifts = np.arange(45, -1, -5, dtype=np.uint64)  # ten 5-bit groups of 48 bits (top 2 zero)
    time_chars = (ms[:, None] >> shifts) & np.uint64(31)
    random_chars = rng.integers(0, 32, (ms.size, 16), dtype=np.uint64)
    codes = CROCKFORD[np.concatenate([time_chars, random_chars], axis=1)]
    return np.ascontiguousarray(codes).view("S26").ravel().astype(str).tolist()


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
