"""The load: what changed in the operational tables, into the warehouse's ``raw_*`` tables.

The operational database is attached to DuckDB read-only (``scanners``: DuckDB's SQLite and
PostgreSQL scanners, both backends). A first load scans each table in parallel straight into its
``raw_*`` table. After that only rows whose change marker (``updated_at`` /
``delivery_updated_at`` for messages, ``published_at`` / ``done_at`` for the outbox,
``created_at`` / ``resolved_at`` for dead letters, ``received_at`` for provider events,
``finished_at`` for attempts) is at or after the table's high-water mark minus ``lookback_s``
are read, by a query the source database runs itself so its marker indexes serve it. The
look-back re-reads a short window so a transaction that committed a little after a later one is
not missed; the re-read rows are compared with what is loaded by key and change markers (the
application moves a marker with every write), and only rows that are new or differ are written
(delete + insert by primary key). So a re-run writes nothing, and a changed message or dead
letter replaces its old version. Provider event rows are only ever inserted or deleted at the
source (``webhooks reprocess`` deletes a webhook's events and normalizes it again, under new
ids); a trigger records each deleted row in ``email_event_deletions``, which is loaded the same
way and removes the deleted versions.

What to write is found first, read-only, in the in-memory ``stage`` catalog, two sources at a
time (``stage_all``); ``write_source`` then writes it in the refresh's transaction and
remembers which messages' funnel rows it touched (``build.AFFECTED``).
"""

import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import duckdb

from email_platform.db.schema import email_attempts, email_events, email_messages, email_outbox
from email_platform.warehouse import fold
from email_platform.warehouse.build import AFFECTED, event_id_range
from email_platform.warehouse.files import configure_session, literal
from email_platform.warehouse.scanners import AttachedSource
from email_platform.warehouse.sources import DELETIONS, SOURCES_BY_NAME, Source

# In-memory catalog for what a refresh reads before it writes (shared by its connections).
STAGE = "stage"


@dataclass
class _Staged:
    """What the read-only stage found for one source (tables in the ``stage`` catalog)."""

    source: Source
    read: int = 0
    hwm: datetime | None = None
    # "" when nothing is to be written; else the stage table holding the rows to write, and
    # whether some of them replace loaded versions (listed in the ``_existing`` table).
    rows: str = ""
    replaces: bool = False
    first_load: bool = False
    # Provider events only: the loaded rows whose source row was deleted (stage table of row
    # ids and message ids, "" when none), how many, and the deletion records' high-water mark.
    gone: str = ""
    removed: int = 0
    deletions_hwm: datetime | None = None

    def table(self, kind: str) -> str:
        return f"{STAGE}.{self.source.raw_table}{kind}"


def _stage_source(
    connection: duckdb.DuckDBPyConnection,
    attached: AttachedSource,
    source: Source,
    since: datetime | None,
) -> _Staged:
    """Read the source's rows changed since ``since`` and find the new or different ones.

    Read-only towards the warehouse: its tables go to the in-memory ``stage`` catalog, so the
    sources are staged on two connections at once (see ``stage_all``) before the refresh's
    transaction writes them.
    """
    raw = source.raw_table
    staged = _Staged(source)
    if since is None and not connection.execute(f"SELECT 1 FROM {raw} LIMIT 1").fetchone():
        staged.first_load = True  # loaded straight from the source by write_source
        return staged
    incoming, existing, changed = (
        staged.table("_incoming"),
        staged.table("_existing"),
        staged.table("_changed"),
    )
    casts = ", ".join(f'CAST("{name}" AS {kind}) AS "{name}"' for name, kind in source.columns)
    columns = ", ".join(f'"{name}"' for name, _ in source.columns)
    query = f'SELECT {columns} FROM "{source.name}"'
    if since is not None:
        bound = attached.timestamp_literal(since)
        query += " WHERE " + " OR ".join(f'"{m}" >= {bound}' for m in source.markers)
    # The source database runs the query itself, so its marker indexes pick the few rows.
    connection.execute(
        f"CREATE OR REPLACE TABLE {incoming} AS SELECT {casts} FROM {attached.native_query(query)}"
    )
    (key,) = source.key
    staged.read, hwm, lowest, highest = connection.execute(
        f"SELECT count(*), max({source.marker_sql()}), min({key}), max({key}) FROM {incoming}"
    ).fetchone()
    if not staged.read:
        return staged
    staged.hwm = hwm.replace(tzinfo=UTC) if hwm else None
    # The loaded versions of the incoming keys: row id, key and change markers (and the message
    # a replaced version belonged to), one pass over a few columns of the raw table. A version
    # is its key and markers: every write the application makes moves a marker (it is how the
    # load finds changes at all), so equal markers mean the row is already loaded as it is.
    # (Comparing every column cost 0.1-0.2 s at 1M messages; the probe of whole rows 0.1 s.)
    # The key's range as literals lets zone maps skip row groups: DuckDB derives one from the
    # join for integer keys, not for the outbox's string event ids (it scanned all 1M).
    kept = dict.fromkeys((*source.key, *source.markers, *source.owner))
    connection.execute(
        f"CREATE OR REPLACE TABLE {existing} AS SELECT r.rowid AS _row, "
        + ", ".join(f"r.{name}" for name in kept)
        + f" FROM {raw} AS r SEMI JOIN {incoming} AS i ON {_key_match(source)} "
        f"WHERE r.{key} BETWEEN {literal(lowest)} AND {literal(highest)}"
    )
    if connection.execute(f"SELECT 1 FROM {existing} LIMIT 1").fetchone():
        same_version = " AND ".join(
            f"r.{name} IS NOT DISTINCT FROM i.{name}" for name in source.markers
        )
        connection.execute(
            f"CREATE OR REPLACE VIEW {changed} AS SELECT i.* FROM {incoming} AS i "
            f"ANTI JOIN {existing} AS r ON {_key_match(source)} AND {same_version}"
        )
        if connection.execute(f"SELECT 1 FROM {changed} LIMIT 1").fetchone():
            staged.rows, staged.replaces = changed, True
    else:
        staged.rows = incoming  # every key is new: nothing to compare or replace
    return staged


def _key_match(source: Source) -> str:
    return " AND ".join(f"r.{k} = i.{k}" for k in source.key)


def _stage_events(
    connection: duckdb.DuckDBPyConnection,
    attached: AttachedSource,
    since: dict[str, datetime | None],
) -> _Staged:
    """Stage the provider events, then the deletion records, in that order: a row re-created
    with a new id is inserted after its old version's record, so reading the records second
    never sees the new row without the record that removes the old one."""
    events = SOURCES_BY_NAME[email_events.name]
    staged = _stage_source(connection, attached, events, since[events.name])
    records = staged.table("_deletions")
    query = f'SELECT "email_event_id", "received_at", "deleted_at" FROM "{DELETIONS}"'
    if since[DELETIONS] is not None:
        query += f' WHERE "deleted_at" >= {attached.timestamp_literal(since[DELETIONS])}'
    connection.execute(
        f"CREATE OR REPLACE TABLE {records} AS SELECT CAST(email_event_id AS BIGINT) AS "
        "email_event_id, CAST(received_at AS TIMESTAMP) AS received_at, "
        f"CAST(deleted_at AS TIMESTAMP) AS deleted_at FROM {attached.native_query(query)}"
    )
    count, hwm = connection.execute(f"SELECT count(*), max(deleted_at) FROM {records}").fetchone()
    if not count:
        return staged
    staged.deletions_hwm = hwm.replace(tzinfo=UTC)
    if staged.first_load:
        return staged  # nothing loaded yet: the first load reads only what the source holds
    # The record names the deleted version by id and received_at, so a newer row that SQLite
    # gave the same id (it reuses a deleted newest id) stays.
    staged.gone = staged.table("_gone")
    connection.execute(
        f"CREATE OR REPLACE TABLE {staged.gone} AS SELECT r.rowid AS _row, r.message_id "
        f"FROM {events.raw_table} AS r SEMI JOIN {records} AS d "
        "ON r.email_event_id = d.email_event_id AND r.received_at = d.received_at"
    )
    staged.removed = connection.execute(f"SELECT count(*) FROM {staged.gone}").fetchone()[0]
    if not staged.removed:
        staged.gone = ""
    return staged


def stage_all(
    connection: duckdb.DuckDBPyConnection,
    attached: AttachedSource,
    since: dict[str, datetime | None],
) -> dict[str, _Staged]:
    """Stage every source on two connections at once, one per core.

    Reading a source goes through its scanner on one thread (SQLite's is single-threaded), so
    two sources read at a time keep both cores busy. Largest first, each connection taking the
    next source when it is done: the provider events (at 1M messages about 65,000 rows read per
    refresh) and the messages (about 22,000, fetched by row id from two indexes) take most of
    the time, and the smaller ones fill in behind whichever finishes first.
    """
    order = (email_events.name, email_messages.name, email_outbox.name, email_attempts.name)
    names = sorted(SOURCES_BY_NAME, key=lambda n: order.index(n) if n in order else len(order))
    cursors = [connection.cursor() for _ in range(2)]
    free: queue.SimpleQueue[duckdb.DuckDBPyConnection] = queue.SimpleQueue()
    for cursor in cursors:
        configure_session(cursor)
        free.put(cursor)

    def stage(name: str) -> _Staged:
        cursor = free.get()  # a thread's connection for this source; returned when done
        try:
            if name == email_events.name:
                return _stage_events(cursor, attached, since)
            return _stage_source(cursor, attached, SOURCES_BY_NAME[name], since[name])
        finally:
            free.put(cursor)

    # One DuckDB thread per query while staging: the two connections are the parallelism, and
    # DuckDB's own worker thread would make three threads contend for two cores (on one
    # restored 1M state, 18 interleaved pairs: visible median 0.79 -> 0.75 s, 15 pairs faster).
    connection.execute("SET threads = 1")
    try:
        with ThreadPoolExecutor(max_workers=len(cursors)) as pool:
            pending = {name: pool.submit(stage, name) for name in names}
            return {name: pending[name].result() for name in SOURCES_BY_NAME}
    finally:
        connection.execute("RESET threads")
        for cursor in cursors:
            cursor.close()


def write_source(
    connection: duckdb.DuckDBPyConnection,
    attached: AttachedSource,
    staged: _Staged,
    *,
    mark_affected: bool,
) -> tuple[int, int, datetime | None, int]:
    """Write what ``_stage_source`` found, in the refresh's transaction: (read, loaded, hwm,
    rows deleted)."""
    source = staged.source
    raw = source.raw_table
    if staged.first_load:
        # First load: DuckDB scans the whole table in parallel, straight into the raw table.
        casts = ", ".join(_first_load_column(source, n, kind) for n, kind in source.columns)
        rows = f"{attached.table(source.name)} AS s"
        if source.as_message:
            # The messages are loaded first (SOURCES order).
            rows += " LEFT JOIN raw_email_messages AS m ON m.message_id = s.message_id"
        connection.execute(f"INSERT INTO {raw} SELECT {casts} FROM {rows}")
        read = connection.execute(f"SELECT count(*) FROM {raw}").fetchone()[0]
        hwm = connection.execute(f"SELECT max({source.marker_sql()}) FROM {raw}").fetchone()[0]
        if read and mark_affected:
            _mark_affected(connection, source, raw, foldable=False)
        return read, read, hwm.replace(tzinfo=UTC) if hwm else None, 0
    if not staged.rows and not staged.gone:
        return staged.read, 0, staged.hwm, 0
    # Loaded versions to delete, by row id: no second pass over the raw table. (Nothing was
    # written since the ids were read: the writer lock keeps other refreshes out.)
    doomed = []
    if staged.replaces:
        key_match = _key_match(source)
        replaced = (
            f"(SELECT r.* FROM {staged.table('_existing')} AS r "
            f"SEMI JOIN {staged.rows} AS i ON {key_match})"
        )
        if mark_affected:
            # A replaced version may have belonged to another message: that message's funnel
            # row changes too.
            _mark_affected(connection, source, replaced, fold.foldable(raw, removed=True))
        doomed.append(f"SELECT _row FROM {replaced}")
    if staged.gone:
        if mark_affected:
            _mark_affected(connection, source, staged.gone, fold.foldable(raw, removed=True))
        doomed.append(f"SELECT _row FROM {staged.gone}")
    deleted = 0
    if doomed:
        deleted = connection.execute(
            f"DELETE FROM {raw} WHERE rowid IN ({' UNION '.join(doomed)})"
        ).fetchone()[0]
    loaded = 0
    if staged.rows:
        # The insert's own count: the rows to write are a view, evaluated anew by each read.
        loaded = connection.execute(f"INSERT INTO {raw} SELECT * FROM {staged.rows}").fetchone()[0]
        if mark_affected:
            _mark_affected(connection, source, staged.rows, fold.foldable(raw, removed=False))
    return staged.read, loaded, staged.hwm, deleted


def _first_load_column(source: Source, name: str, kind: str) -> str:
    value = f'CAST(s."{name}" AS {kind})'
    if name in source.as_message:
        # NULL only where both are set and equal: a NULL or a different value is kept.
        value = f'CASE WHEN {value} = m."{name}" THEN NULL ELSE {value} END'
    return f'{value} AS "{name}"'


def _mark_affected(
    connection: duckdb.DuckDBPyConnection, source: Source, rows: str, foldable: bool
) -> None:
    """Remember which messages' funnel rows the ``rows`` just loaded can change, and whether
    those rows leave them foldable (``fold``)."""
    if source.table is email_outbox:
        connection.execute(
            f"INSERT INTO {AFFECTED} SELECT m.message_id, {foldable} FROM raw_email_messages AS m "
            f"WHERE {event_id_range(connection, rows, 'm.event_id')} "
            f"AND m.event_id IN (SELECT event_id FROM {rows})"
        )
    else:
        connection.execute(
            f"INSERT INTO {AFFECTED} SELECT message_id, {foldable} FROM {rows} "
            "WHERE message_id IS NOT NULL"
        )
