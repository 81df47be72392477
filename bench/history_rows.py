"""How the bench's generated history is written: rows made by column in numpy, formatted
in bulk, and handed to the driver's bulk path (sqlite3 ``executemany``, PostgreSQL ``COPY``),
one chunk per transaction. ``bench.generate`` decides what happens; this writes it down."""

import itertools
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Engine

from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_events,
    email_messages,
    email_outbox,
)

# Provider events wait in numpy arrays until every event received before them is made, so
# ids follow arrival as they do in a live database; extras and types travel as small codes.
EVENT_TYPES = np.array(
    ["queued", "sent", "delivered", "bounced", "opened", "clicked", "complained", "unsubscribed"],
    dtype=object,
)
TYPE_CODE = {name: code for code, name in enumerate(EVENT_TYPES.tolist())}
# extra codes: 0 none, 1/2 hard/soft bounce, 3/4 machine/human open, 5 a click's url
BOUNCE_OF = np.array([None, "hard", "soft", None, None, None], dtype=object)
MACHINE_OF = np.array([None, None, None, True, False, None], dtype=object)
CLICK_URL = "https://app.example.com/start"


REASONS = np.array(["provider_rejected", "retries_exhausted", "template_error"], dtype=object)


def ts(values: np.ndarray, sqlite: bool) -> list:
    """datetime64[us] -> text the database reads as that instant (UTC): SQLite gets
    SQLAlchemy's own format; PostgreSQL's COPY parses ISO text in the session's UTC."""
    text = np.datetime_as_string(values.astype("datetime64[us]"), unit="us")
    if sqlite and text.size:
        text.view(np.uint32).reshape(text.size, -1)[:, 10] = ord(" ")  # the "T"
    out = text.astype(object)
    out[np.isnat(values)] = None
    return out.tolist()


@dataclass
class Pending:
    """Provider events made but not yet written (received after the next chunk begins)."""

    message: np.ndarray
    kind: np.ndarray  # TYPE_CODE
    occurred: np.ndarray  # datetime64[us]
    received: np.ndarray
    extra: np.ndarray  # extra code
    event_id: np.ndarray  # S26, empty for orphans

    @classmethod
    def empty(cls) -> "Pending":
        return cls(
            np.array([], np.int64), np.array([], np.int8), np.array([], "datetime64[us]"),
            np.array([], "datetime64[us]"), np.array([], np.int8), np.array([], "S26"),
        )  # fmt: skip

    def add(self, other: "Pending") -> "Pending":
        # Stable on received: what was made first stays first among equals, as in one pass.
        merged = [np.concatenate([a, b]) for a, b in zip(self.parts(), other.parts(), strict=True)]
        order = np.argsort(merged[3], kind="stable")
        return Pending(*(a[order] for a in merged))

    def parts(self) -> tuple[np.ndarray, ...]:
        return (self.message, self.kind, self.occurred, self.received, self.extra, self.event_id)

    def split(self, until: np.datetime64 | None) -> tuple["Pending", "Pending"]:
        """(received by ``until``, the rest); all of it when ``until`` is None."""
        cut = (
            self.received.size
            if until is None
            else int(np.searchsorted(self.received, until, "right"))
        )
        return Pending(*(a[:cut] for a in self.parts())), Pending(*(a[cut:] for a in self.parts()))


@dataclass
class Ids:
    """The next ids of a generate call's rows (its dead letters count from the first)."""

    attempt: int
    event_row: int
    first_dead: int
    dead_made: int = 0


BULK_TABLES = ("email_outbox", "email_messages", "email_attempts", "dead_letters", "email_events")


def drop_indexes(engine: Engine) -> list[str]:
    """Drop the secondary indexes of the tables written here and return the statements that
    make them again as the migrations made them (constraints' own indexes stay)."""
    tables = ", ".join(f"'{t}'" for t in BULK_TABLES)
    if engine.dialect.name == "sqlite":
        query = (
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
            f"AND tbl_name IN ({tables})"
        )
    else:
        query = (
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            f"AND tablename IN ({tables}) AND indexname NOT IN (SELECT conname FROM pg_constraint)"
        )
    with engine.begin() as connection:
        found = connection.exec_driver_sql(query).all()
        for name, _ in found:
            connection.exec_driver_sql(f'DROP INDEX "{name}"')
    return [ddl for _, ddl in found]


def make_indexes(engine: Engine, statements: list[str]) -> None:
    """Make the dropped indexes again. SQLite's sorter holds up to a page cache's worth of
    keys per thread before spilling, on top of the cache itself: a smaller cache here keeps
    the peak RSS of a large history's index build under the load's (bench/README.md)."""
    with engine.begin() as connection:
        if engine.dialect.name == "sqlite":
            connection.exec_driver_sql("PRAGMA cache_size=-262144")
        for ddl in statements:
            connection.exec_driver_sql(ddl)


def bulk_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    """SQLite settings for a bulk load into a database this generator opened: no fsync per
    chunk (a crash loses a bench history, nothing else), a page cache that holds the growing
    indexes' hot pages (the default 2 MB thrashes past a million rows), sorts for the indexes
    made at the end spilling to temporary files (in memory they would hold a whole index),
    on two threads, and no foreign-key lookups (the rows are consistent by construction)."""
    cursor = dbapi_connection.cursor()
    for pragma in (
        "synchronous=OFF",
        "cache_size=-1048576",
        "temp_store=FILE",
        "threads=2",
        "foreign_keys=OFF",
    ):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def write_messages(connection, sqlite: bool, templates, ids, ulids, occurred, published,  # type: ignore[no-untyped-def]
                   template_index, domain, status, tried, sent, attempts_n, created, updated,
                   accepted, delivery_status, status_at) -> None:  # fmt: skip
    """A chunk's outbox events and messages (``templates``: name, event type, lane, share)."""
    n = ids.size
    event_ids = ulids.astype(str).tolist()
    template = np.array([t[0] for t in templates], dtype=object)[template_index].tolist()
    etype = np.array([t[1] for t in templates], dtype=object)[template_index]
    lane = np.array([t[2] for t in templates], dtype=object)[template_index].tolist()
    ids_l, domain_l, status_l = ids.tolist(), domain.tolist(), status.tolist()
    published_s, updated_s = ts(published, sqlite), ts(updated, sqlite)
    repeat = itertools.repeat
    copy_rows(connection, sqlite, email_outbox, {
        "event_id": event_ids,
        "event_type": etype.tolist(),
        "event_version": np.where(etype == "user.signed_up", 2, 1).tolist(),
        "aggregate_id": [f"agg_{i}" for i in ids_l],
        "occurred_at": ts(occurred, sqlite),
        "published_at": published_s,
        "payload": repeat("{}", n),
        "event_metadata": repeat("{}", n),
        "lane": lane,
        "available_at": published_s,
        "status": np.where(status == "dead", "dead", "done").tolist(),
        "resolution": status_l,
        "claim_count": repeat(1, n),
        "request_count": repeat(1, n),
        "done_at": updated_s,
    })  # fmt: skip
    copy_rows(connection, sqlite, email_messages, {
        "message_id": ids_l,
        "event_id": event_ids,
        "route": template,
        "template": template,
        "template_version": repeat(1, n),
        "lane": lane,
        "recipient": [f"user{i}@{d}" for i, d in zip(ids_l, domain_l, strict=True)],
        "recipient_domain": domain_l,
        "idempotency_key": [f"{e}:{t}" for e, t in zip(event_ids, template, strict=True)],
        "status": status_l,
        "attempts": attempts_n.tolist(),
        "provider": np.where(tried, "sandbox", None).tolist(),
        "provider_message_id": [
            f"sbx_{i}" if s else None for i, s in zip(ids_l, sent.tolist(), strict=True)
        ],
        "created_at": ts(created, sqlite),
        "updated_at": updated_s,
        "sent_at": ts(np.where(sent, accepted, np.datetime64("NaT")), sqlite),
        "delivery_status": delivery_status.tolist(),
        "delivery_updated_at": ts(status_at, sqlite),
    })  # fmt: skip


def write_attempts(  # type: ignore[no-untyped-def]
    connection, sqlite: bool, ids, ulids, lane, tried, sent, attempts_n, first_attempt_at,
    accepted, next_ids: Ids,
) -> tuple[int, int]:  # fmt: skip
    """Every attempt of every tried message, in message order (then attempt number), and a
    dead letter per dead message; ids continue the call's. Returns how many of each."""
    tried_at = np.flatnonzero(tried)
    per = attempts_n[tried_at]
    of = np.repeat(tried_at, per)
    number = np.arange(of.size) - np.repeat(np.cumsum(per) - per, per)
    last = number == attempts_n[of] - 1
    won = last & sent[of]
    outcome = np.where(won, "accepted", np.where(last, "permanent", "transient"))
    started = ts(first_attempt_at[of], sqlite)
    finished = ts(np.where(won, accepted[of], first_attempt_at[of]), sqlite)
    first = next_ids.attempt
    message_ids = ids[of].tolist()
    run_ids = [f"run_{m // 100}" for m in message_ids]
    copy_rows(connection, sqlite, email_attempts, {
        "attempt_id": range(first, first + of.size),
        "message_id": message_ids,
        "event_id": ulids[of].astype(str).tolist(),
        "run_id": run_ids,
        "attempt_no": (number + 1).tolist(),
        "started_at": started,
        "finished_at": finished,
        "outcome": outcome.tolist(),
        "http_status": np.where(won, 200, np.where(last, 422, 503)).tolist(),
    })  # fmt: skip
    next_ids.attempt += of.size
    dead = np.flatnonzero(~sent & tried)
    k = np.arange(next_ids.dead_made, next_ids.dead_made + dead.size)
    created = ts(accepted[dead], sqlite)
    discarded = k % 4 == 0
    copy_rows(connection, sqlite, dead_letters, {
        "dead_letter_id": (next_ids.first_dead + k).tolist(),
        "event_id": ulids[dead].astype(str).tolist(),
        "message_id": ids[dead].tolist(),
        "lane": lane[dead].tolist(),
        "reason": REASONS[k % 3].tolist(),
        "attempts": attempts_n[dead].tolist(),
        "run_id": [f"run_{m // 100}" for m in ids[dead].tolist()],
        "status": np.where(discarded, "discarded", "open").tolist(),
        "created_at": created,
        "resolved_at": np.where(discarded, np.array(created, dtype=object), None).tolist(),
    })  # fmt: skip
    next_ids.dead_made += dead.size
    return of.size, dead.size


def write_events(connection, ready: Pending, next_ids: Ids, domains: tuple[str, ...]) -> int:  # type: ignore[no-untyped-def]
    """Provider event rows, ids in the order given (arrival order); how many."""
    sqlite = connection.dialect.name == "sqlite"
    if not sqlite:
        connection.exec_driver_sql("SET LOCAL TIME ZONE 'UTC'")
    n = ready.message.size
    first = next_ids.event_row
    m = ready.message.tolist()
    lost = ready.event_id == b""
    event_ids = ready.event_id.astype(str).astype(object)
    event_ids[lost] = None
    message_ids = ready.message.astype(object)
    message_ids[lost] = None
    kind = EVENT_TYPES[ready.kind]
    copy_rows(connection, sqlite, email_events, {
        "email_event_id": range(first, first + n),
        "provider": itertools.repeat("sandbox", n),
        "provider_event_id": [f"evt_{i:012d}" for i in range(first, first + n)],
        "event_type": kind.tolist(),
        "occurred_at": ts(ready.occurred, sqlite),
        "received_at": ts(ready.received, sqlite),
        "event_id": event_ids.tolist(),
        "message_id": message_ids.tolist(),
        "provider_message_id": [f"sbx_{i}" for i in m],
        "recipient_domain": np.array(domains, dtype=object)[ready.message % len(domains)].tolist(),
        "bounce_type": BOUNCE_OF[ready.extra].tolist(),
        "click_url": np.where(kind == "clicked", CLICK_URL, None).tolist(),
        "machine_open": MACHINE_OF[ready.extra].tolist(),
    })  # fmt: skip
    next_ids.event_row += n
    return n


def copy_rows(connection, sqlite: bool, table, columns: dict) -> None:  # type: ignore[no-untyped-def]
    """Rows given by column, through the driver's bulk path: sqlite3 ``executemany``,
    PostgreSQL ``COPY`` (both take pre-formatted values, several times SQLAlchemy's binds)."""
    names = ", ".join(columns)
    rows = zip(*columns.values(), strict=False)
    raw = connection.connection.driver_connection
    if sqlite:
        marks = ", ".join("?" for _ in columns)
        raw.executemany(f"INSERT INTO {table.name} ({names}) VALUES ({marks})", rows)
        return
    with raw.cursor() as cursor, cursor.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
