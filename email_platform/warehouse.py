"""The analytics warehouse: operational tables loaded incrementally into DuckDB, then the funnel.

Framework-free: plain functions the Dagster assets, the demo, the benchmark and the tests call.

**Load.** The operational database is attached to DuckDB read-only (``warehouse_sources``:
DuckDB's SQLite and PostgreSQL scanners, both backends). A first load scans each table in
parallel straight into its ``raw_*`` table. After that only rows whose change marker
(``updated_at`` / ``delivery_updated_at`` for messages, ``published_at`` / ``done_at`` for the
outbox, ``created_at`` / ``resolved_at`` for dead letters, ``received_at`` for provider events,
``finished_at`` for attempts) is at or after the table's high-water mark minus ``lookback_s``
are read, by a query the source database runs itself so its marker indexes serve it. The
look-back re-reads a short window so a transaction that committed a little after a later one is
not missed; the re-read rows are compared with what is loaded by key and change markers (the
application moves a marker with every write), and only rows that are new or differ are
written (delete + insert by primary key). So a re-run writes nothing, and
a changed message or dead letter replaces its old version. Provider event rows are only ever
inserted or deleted at the source (``webhooks reprocess`` deletes a webhook's events and
normalizes it again, under new ids); a trigger records each deleted row in
``email_event_deletions``, which is loaded the same way and removes the deleted versions.
High-water marks live in the DuckDB table ``warehouse_state``.

**Build.** ``analytics/stg_*.sql`` are views over the raw tables (they cost nothing to refresh
and cannot drift from the load). ``email_funnel`` and ``email_funnel_daily`` are tables: a full
build runs their SQL; an incremental build recomputes only the funnel rows of messages touched by
the load (the message changed, or it got an attempt, provider event or dead letter) and only the
daily rows of the days those messages belong to. A change to a model's SQL file triggers a full
build of the models.

**Readers and the single writer.** DuckDB allows one writing process per file, and a read-only
connection in another process holds a lock that stops any writer from opening the file. So the
assets never write a file analysts can open. They load and build in a private writer file
(``<warehouse>.writer``), checkpoint and close it, and ``os.replace`` it over ``<warehouse>``:
the writer file itself becomes the snapshot, and is not written while it is one. A reader that
already has the old file open keeps a consistent view of it (the old inode lives until it
closes); a new reader sees the new snapshot. Nobody ever sees a half-built table, and no reader
can block or break a materialization. The next refresh needs a private file again, equal to the new
snapshot. Right after publishing, the snapshot just replaced is patched into it: the two differ
only in the blocks this refresh's checkpoint wrote, so only those are written and flushed (about
a tenth of the file at 1M messages; copying the whole file cost 0.22 s for 320 MB and grew with
the warehouse). An analyst may still have the replaced snapshot open, and their view must never
change: it is then left alone and the new snapshot is copied instead. Whether anyone has it
open is read from the locks DuckDB holds on it (``/proc/locks``: this process's readers count
too), and the patch takes the writer's lock itself, so a reader that opens the file in between
gets a lock error, never a changing file. Building in place would be cheaper but is not
correct with readers around. Refreshes are
serialized by an ``flock`` on ``<warehouse>.lock``.

**Compaction.** Replacing a row deletes its old version, which stays in its row group until a
checkpoint compacts it. A refresh's own commit never compacts (analysts would wait for it);
once the deleted rows add up to ``VACUUM_SHARE`` of the funnel, the next writer file is
compacted after the new snapshot is published, so the snapshot after next is compact.
"""

import fcntl
import glob
import hashlib
import os
import queue
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import duckdb
from sqlalchemy import Engine, Table, func, select

from email_platform.db.engine import make_engine
from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_event_deletions,
    email_events,
    email_messages,
    email_outbox,
)
from email_platform.warehouse_sources import (
    SCANNER_HOST_CONFIG,
    AttachedSource,
    attach,
    detach,
    sql_string,
)

if TYPE_CHECKING:  # pandas costs 0.2 s to import, and every launched run imports this module
    import pandas as pd

ANALYTICS_DIR = Path(__file__).resolve().parents[1] / "analytics"
QUESTIONS_DIR = ANALYTICS_DIR / "questions"

STAGING_MODELS = (
    "stg_events",
    "stg_sends",
    "stg_attempts",
    "stg_provider_events",
    "stg_deliveries",
    "stg_opens",
    "stg_clicks",
    "stg_bounces",
    "stg_complaints",
    "stg_unsubscribes",
    "stg_dead_letters",
)
FUNNEL = "email_funnel"
FUNNEL_DAILY = "email_funnel_daily"
MODELS = (*STAGING_MODELS, FUNNEL, FUNNEL_DAILY)
STATE_TABLE = "warehouse_state"
# The state row counting the deleted rows not compacted yet (see _vacuum_policy, _compact).
UNVACUUMED_STATE = "unvacuumed_rows"
VACUUM_SHARE = 0.05
# Its first version had a primary key; touching that index first thing in a refresh cost
# 0.15-0.2 s on a 300 MB file. The few rows are replaced as a whole instead.
_OLD_STATE_TABLE = "warehouse_load_state"

DEFAULT_LOOKBACK_S = 120
LOCK_TIMEOUT_S = 600.0
WRITER_CATALOG = "warehouse"
AFFECTED = "_affected"
# In-memory catalog for what a refresh reads before it writes (shared by its connections).
STAGE = "stage"
ROW_GROUP_ROWS = 16_384


@dataclass(frozen=True)
class Source:
    """One operational table as the warehouse loads it."""

    table: Table
    raw_table: str
    key: tuple[str, ...]
    # (column, DuckDB type). Addresses, payloads, error texts and raw bodies are left behind.
    columns: tuple[tuple[str, str], ...]
    # Columns whose greatest value is the row's change marker.
    markers: tuple[str, ...]
    # The column naming whose funnel row a version feeds: a replaced version's owner is
    # rebuilt too (see _mark_affected).
    owner: tuple[str, ...] = ("message_id",)

    @property
    def name(self) -> str:
        return self.table.name

    def marker_sql(self) -> str:
        """The change marker over the raw table's columns, as DuckDB SQL (column names only)."""
        if len(self.markers) == 1:
            return self.markers[0]
        return "greatest(" + ", ".join(self.markers) + ")"


TS = "TIMESTAMP"
SOURCES: tuple[Source, ...] = (
    Source(
        email_outbox,
        "raw_email_outbox",
        ("event_id",),
        (
            ("event_id", "VARCHAR"),
            ("event_type", "VARCHAR"),
            ("event_version", "INTEGER"),
            ("lane", "VARCHAR"),
            ("occurred_at", TS),
            ("published_at", TS),
            ("status", "VARCHAR"),
            ("resolution", "VARCHAR"),
            ("done_at", TS),
        ),
        ("published_at", "done_at"),
        ("event_id",),
    ),
    Source(
        email_messages,
        "raw_email_messages",
        ("message_id",),
        (
            ("message_id", "BIGINT"),
            ("event_id", "VARCHAR"),
            ("route", "VARCHAR"),
            ("template", "VARCHAR"),
            ("template_version", "INTEGER"),
            ("lane", "VARCHAR"),
            ("recipient_domain", "VARCHAR"),
            ("status", "VARCHAR"),
            ("attempts", "INTEGER"),
            ("provider", "VARCHAR"),
            ("provider_message_id", "VARCHAR"),
            ("created_at", TS),
            ("updated_at", TS),
            ("sent_at", TS),
            ("delivery_status", "VARCHAR"),
            ("delivery_updated_at", TS),
        ),
        ("updated_at", "delivery_updated_at"),
    ),
    Source(
        email_attempts,
        "raw_email_attempts",
        ("attempt_id",),
        (
            ("attempt_id", "BIGINT"),
            ("message_id", "BIGINT"),
            ("event_id", "VARCHAR"),
            ("run_id", "VARCHAR"),
            ("attempt_no", "INTEGER"),
            ("started_at", TS),
            ("finished_at", TS),
            ("outcome", "VARCHAR"),
            ("http_status", "INTEGER"),
        ),
        ("finished_at",),
    ),
    Source(
        dead_letters,
        "raw_dead_letters",
        ("dead_letter_id",),
        (
            ("dead_letter_id", "BIGINT"),
            ("event_id", "VARCHAR"),
            ("message_id", "BIGINT"),
            ("lane", "VARCHAR"),
            ("reason", "VARCHAR"),
            ("error_code", "VARCHAR"),
            ("attempts", "INTEGER"),
            ("run_id", "VARCHAR"),
            ("status", "VARCHAR"),
            ("created_at", TS),
            ("resolved_at", TS),
        ),
        ("created_at", "resolved_at"),
    ),
    Source(
        email_events,
        "raw_email_events",
        # The source's id: a cheap key to probe (recent ids sit in the last row groups, so
        # zone maps skip the rest; the natural key (provider, provider_event_id) is two strings
        # to compare against every loaded row). A re-normalized webhook comes back with a new
        # id; its old row is removed by its deletion record (see DELETIONS).
        ("email_event_id",),
        (
            ("provider", "VARCHAR"),
            ("provider_event_id", "VARCHAR"),
            ("email_event_id", "BIGINT"),
            ("event_type", "VARCHAR"),
            ("occurred_at", TS),
            ("received_at", TS),
            ("event_id", "VARCHAR"),
            ("message_id", "BIGINT"),
            ("provider_message_id", "VARCHAR"),
            ("recipient_domain", "VARCHAR"),
            ("reject_reason", "VARCHAR"),
            ("bounce_type", "VARCHAR"),
            ("click_url", "VARCHAR"),
            ("machine_open", "BOOLEAN"),
        ),
        ("received_at",),
    ),
)
SOURCES_BY_NAME = {source.name: source for source in SOURCES}
# Rows deleted from email_events, recorded by a trigger: each names the deleted version (id and
# received_at), which a refresh removes from raw_email_events. Loaded like a source (change
# marker deleted_at, same look-back); re-reading a record removes nothing twice.
DELETIONS = email_event_deletions.name


# ---------------------------------------------------------------------------------------------
# Paths, locking, connections


def writer_path(warehouse_path: str | os.PathLike[str]) -> Path:
    """The private file the assets build in; analysts never open it."""
    return Path(f"{os.fspath(warehouse_path)}.writer")


def lock_path(warehouse_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(warehouse_path)}.lock")


@contextmanager
def writer_lock(warehouse_path: str | os.PathLike[str], timeout_s: float = LOCK_TIMEOUT_S):
    """One refresh at a time per warehouse, across processes; waits up to ``timeout_s``."""
    path = lock_path(warehouse_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another refresh of {warehouse_path} held the lock for {timeout_s}s"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _connect(path: str | os.PathLike[str], *, read_only: bool) -> duckdb.DuckDBPyConnection:
    if read_only:
        connection = duckdb.connect(os.fspath(path), read_only=True)
    else:
        # The writer file is attached to an in-memory host so it can take a row group size:
        # a checkpoint rewrites the row group each table's new rows were appended to, so small
        # row groups make a refresh's checkpoint small (measured at 1M messages: 0.13-0.22 s
        # instead of 0.15-0.9 s with DuckDB's 122,880 rows).
        # Loads the source's scanner without hashing it first (see SCANNER_HOST_CONFIG).
        connection = duckdb.connect(config=SCANNER_HOST_CONFIG)
        options = f"ROW_GROUP_SIZE {ROW_GROUP_ROWS}"
        connection.execute(f"ATTACH {sql_string(os.fspath(path))} AS {WRITER_CATALOG} ({options})")
        # Loads may write rows in any order (every model query says ORDER BY where it matters):
        # measured 1.8x faster bulk loads on two cores.
        connection.execute("SET preserve_insertion_order = false")
        # Every refresh ends in a checkpoint anyway. With a zero threshold the commit itself
        # checkpoints and skips the write-ahead log: each change is written to disk once, not
        # to the log and then again to the file (measured: the commit no longer writes 3.3 MB
        # of log before a 2.6 MB checkpoint). A crash mid-checkpoint leaves the file as the
        # last checkpoint left it, as a crash before the commit would.
        connection.execute("SET checkpoint_threshold = '0b'")
        # No FSST for strings: analysing and compressing with it was about a quarter of what
        # inserting new rows cost, and the warehouse's strings are mostly unique ids (ULIDs,
        # provider ids) it shrinks by a third at best. Measured at 1M messages: file 419 ->
        # 561 MB, full build 17.6 -> 14.7 s, an incremental refresh ~10% faster (median of
        # five pairs 1.29 -> 1.13 s), analyst questions as fast or faster (no decompression).
        # Dictionary compression still serves repeated strings (templates, lanes, statuses).
        connection.execute("SET disabled_compression_methods = 'fsst'")
    _configure_session(connection)
    return connection


def _configure_session(connection: duckdb.DuckDBPyConnection) -> None:
    """Per-connection settings; also for the cursors a refresh opens on its writer."""
    if connection.execute("SELECT current_database()").fetchone()[0] == "memory":
        connection.execute(f"USE {WRITER_CATALOG}")
    # Every timestamp in the warehouse is naive UTC; keep functions from applying a local zone.
    connection.execute("SET TimeZone = 'UTC'")


def connect_read_only(warehouse_path: str | os.PathLike[str]) -> duckdb.DuckDBPyConnection:
    """What an analyst opens: the published snapshot, read-only. Never blocks a refresh."""
    return _connect(warehouse_path, read_only=True)


# ---------------------------------------------------------------------------------------------
# SQL files


def model_sql(name: str) -> str:
    """The SELECT of one model, from ``analytics/<name>.sql``."""
    return (ANALYTICS_DIR / f"{name}.sql").read_text()


def question_names() -> list[str]:
    return sorted(path.stem for path in QUESTIONS_DIR.glob("*.sql"))


def question_sql(name: str) -> str:
    return (QUESTIONS_DIR / f"{name}.sql").read_text()


def run_question(warehouse_path: str | os.PathLike[str], name: str) -> "pd.DataFrame":
    """Answer one analyst question (``analytics/questions/<name>.sql``) as a DataFrame."""
    connection = connect_read_only(warehouse_path)
    try:
        return connection.execute(question_sql(name)).df()
    finally:
        connection.close()


def _models_fingerprint() -> str:
    digest = hashlib.sha256()
    for name in MODELS:
        digest.update(name.encode())
        digest.update(model_sql(name).encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Refresh


@dataclass
class RefreshSummary:
    """What one refresh did: rows read and written per source, the build, the timings."""

    warehouse_path: str
    full_build: bool
    rows_read: dict[str, int] = field(default_factory=dict)
    rows_loaded: dict[str, int] = field(default_factory=dict)
    # Loaded rows removed because the source deleted them (provider events: see DELETIONS).
    rows_removed: dict[str, int] = field(default_factory=dict)
    high_water_marks: dict[str, datetime | None] = field(default_factory=dict)
    messages_rebuilt: int = 0
    days_rebuilt: int = 0
    # Rows deleted to replace them (loaded rows that changed, rebuilt funnel and daily rows).
    rows_deleted: int = 0
    table_rows: dict[str, int] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)
    funnel: dict[str, float | int | None] = field(default_factory=dict)
    # How the next refresh's writer file was made: "patched" (the replaced snapshot) or
    # "copied" (see _prepare_next_writer).
    next_writer: str | None = None
    # Whether deleted rows were compacted out of the writer file after publishing (_compact).
    compacted: bool = False
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def total_loaded(self) -> int:
        return sum(self.rows_loaded.values())


def refresh(
    database: str | Engine,
    warehouse_path: str | os.PathLike[str],
    *,
    full: bool = False,
    lookback_s: float = DEFAULT_LOOKBACK_S,
    publish: bool = True,
) -> RefreshSummary:
    """Load what changed since the last refresh, rebuild the affected funnel rows, publish.

    ``database`` is a SQLAlchemy URL or engine. ``full`` forgets the high-water marks and
    rebuilds everything from scratch. Safe to call from several processes: they take turns.
    """
    engine = make_engine(database) if isinstance(database, str) else database
    try:
        with writer_lock(warehouse_path):
            return _refresh_locked(
                engine, Path(warehouse_path), full=full, lookback_s=lookback_s, publish=publish
            )
    finally:
        if isinstance(database, str):
            engine.dispose()


def _refresh_locked(
    engine: Engine, warehouse_path: Path, *, full: bool, lookback_s: float, publish: bool
) -> RefreshSummary:
    started = time.perf_counter()
    summary = RefreshSummary(
        warehouse_path=str(warehouse_path), full_build=full, started_at=datetime.now(UTC)
    )
    writer = writer_path(warehouse_path)
    _remove_leftovers(warehouse_path)
    if full and writer.exists():
        writer.unlink()
    elif not full and warehouse_path.exists() and (not writer.exists() or _held_open(writer)):
        # Either the last refresh published and stopped before preparing the next writer file,
        # or the writer file is a former snapshot an analyst still has open: continue from a
        # copy of the snapshot (it holds everything, its state included).
        _copy_durably(warehouse_path, writer)
    connection = _connect_writer(warehouse_path, writer, full=full)
    try:
        _ensure_schema(connection)
        state = _load_state(connection)
        state_deleted = int(_state_value(connection, UNVACUUMED_STATE) or 0)
        if full:
            state = {}
        phase = time.perf_counter()
        fingerprint = _models_fingerprint()
        rebuild = full or _state_value(connection, "models") != fingerprint
        attached = attach(connection, engine)
        connection.execute(f"ATTACH ':memory:' AS {STAGE}")
        since = {
            source.name: (mark - timedelta(seconds=lookback_s))
            if (mark := state.get(source.name)) is not None
            else None
            for source in SOURCES
        }
        deletions_mark = state.get(DELETIONS)
        since[DELETIONS] = (
            deletions_mark - timedelta(seconds=lookback_s) if deletions_mark is not None else None
        )
        # One transaction from the first load to the saved high-water marks: a refresh that
        # fails or is killed half-way leaves the writer file as the last refresh left it, so
        # the next one loads the same rows again and rebuilds the funnel rows they touch.
        # (Committed loads with an uncommitted rebuild would be skipped as "already loaded".)
        # What to write is found before it, read-only (the writer lock keeps other writers out).
        try:
            staged = _stage_all(connection, attached, since)
            connection.execute("BEGIN TRANSACTION")
        except BaseException:
            detach(connection, attached)
            raise
        try:
            connection.execute(f"CREATE OR REPLACE TEMP TABLE {AFFECTED} (message_id BIGINT)")
            loads = {
                source.name: _write_source(
                    connection, attached, staged[source.name], mark_affected=not rebuild
                )
                for source in SOURCES
            }
            deleted = 0
            for source in SOURCES:
                read, loaded, hwm, replaced = loads[source.name]
                deleted += replaced
                summary.rows_read[source.name] = read
                summary.rows_loaded[source.name] = loaded
                summary.high_water_marks[source.name] = hwm or state.get(source.name)
            events = staged[email_events.name]
            summary.rows_removed[email_events.name] = events.removed
            summary.high_water_marks[DELETIONS] = events.deletions_hwm or deletions_mark
            summary.timings_s["extract_load"] = time.perf_counter() - phase

            phase = time.perf_counter()
            summary.full_build = rebuild
            summary.messages_rebuilt, summary.days_rebuilt, rebuilt = _build_models(
                connection, rebuild
            )
            summary.rows_deleted = deleted + rebuilt
            unvacuumed = _vacuum_policy(connection, summary, state_deleted, rebuild)
            _save_state(connection, summary, fingerprint, unvacuumed)
            summary.timings_s["build"] = time.perf_counter() - phase
            phase = time.perf_counter()
            # Nothing new or changed (the look-back window re-read only what is loaded): the
            # published snapshot already holds everything, so it stays as it is, and so does
            # the writer file, equal to it. No checkpoint, no new snapshot, no patch.
            unchanged = (
                publish
                and not rebuild
                and summary.total_loaded == 0
                and not summary.rows_removed[email_events.name]
                and warehouse_path.exists()
            )
            connection.execute("ROLLBACK" if unchanged else "COMMIT")  # commit checkpoints
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        finally:
            detach(connection, attached)
            connection.execute(f"DETACH {STAGE}")
        # A no-op after the commit's checkpoint; here in case the commit could not take one.
        connection.execute("CHECKPOINT")
        summary.timings_s["checkpoint"] = time.perf_counter() - phase
    finally:
        connection.close()
    built = writer
    if unchanged:
        built = warehouse_path
        summary.timings_s.update(publish=0.0, prepare_next=0.0)
        summary.timings_s["visible"] = time.perf_counter() - started
        summary.next_writer = "unchanged"
    elif publish:
        phase = time.perf_counter()
        warehouse_path.parent.mkdir(parents=True, exist_ok=True)
        # The old snapshot keeps a second name through the swap: it becomes the next writer
        # file (or is unlinked) after the new data is visible.
        retired = _retire(warehouse_path)
        # The closed, checkpointed writer file becomes the snapshot in one rename: readers see
        # the new data now, and nothing writes that file again.
        os.replace(writer, warehouse_path)
        built = warehouse_path
        summary.timings_s["publish"] = time.perf_counter() - phase
        summary.timings_s["visible"] = time.perf_counter() - started
        phase = time.perf_counter()
        summary.next_writer = _prepare_next_writer(warehouse_path, writer, retired)
        summary.timings_s["prepare_next"] = time.perf_counter() - phase
    # Numbers for the UI, read from what was just built: readers already have it.
    reader = _connect(built, read_only=True)
    try:
        summary.table_rows = {
            name: reader.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0]
            for name in (*(s.raw_table for s in SOURCES), FUNNEL, FUNNEL_DAILY)
        }
        summary.funnel = funnel_totals(reader)
    finally:
        reader.close()
    # The private writer file (the next refresh's, or this one's when not publishing) is
    # compacted once deleted rows add up: readers have the new data already.
    summary.compacted = not unchanged and _needs_compacting(summary, unvacuumed)
    if summary.compacted:
        phase = time.perf_counter()
        _compact(writer)
        summary.timings_s["compact"] = time.perf_counter() - phase
    summary.timings_s["total"] = time.perf_counter() - started
    summary.finished_at = datetime.now(UTC)
    return summary


def _connect_writer(warehouse_path: Path, writer: Path, *, full: bool) -> duckdb.DuckDBPyConnection:
    """Open the writer file read-write. If a reader in another process locked it between the
    check and here (it is a former snapshot), start over from a copy of the snapshot: DuckDB's
    lock refuses the writer, so the reader's file is never written under it."""
    try:
        return _connect(writer, read_only=False)
    except duckdb.IOException as error:
        if full or not warehouse_path.exists() or "lock" not in str(error).lower():
            raise
    _copy_durably(warehouse_path, writer)
    return _connect(writer, read_only=False)


def _prepare_next_writer(snapshot: Path, writer: Path, retired: Path | None) -> str:
    """Give the next refresh a private writer file equal to the new snapshot; returns how it
    was made: "patched" or "copied".

    The snapshot this refresh replaced (``retired``) differs from the new one only in the
    blocks this refresh's checkpoint wrote (about a tenth of the file at 1M messages): patching
    those into it reads both files but writes and flushes only the difference, where a copy
    writes and flushes the whole file. It is copied instead when an analyst still has the old
    snapshot open: their view must never change under them.
    """
    if retired is not None:
        try:
            if not _held_open(retired):
                _patch_durably(snapshot, writer, retired)
                return "patched"
        except _HeldOpenError:
            pass  # a reader locked it after the check; the patch wrote nothing
        retired.unlink(missing_ok=True)
    # Flushed, so the next checkpoint only syncs its own writes.
    _copy_durably(snapshot, writer)
    return "copied"


class _HeldOpenError(Exception):
    """A reader holds the file that was to be patched."""


PATCH_CHUNK = 256 * 1024  # DuckDB's block size: a changed block costs one chunk written


def _patch_durably(source: Path, target: Path, stale: Path) -> None:
    """Make ``stale`` byte-identical to ``source`` by writing only the chunks that differ, and
    rename it to ``target``. Like ``_copy_durably``, a crash leaves no ``target`` or a whole
    one: the patch happens under a temporary name that the next refresh removes."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    os.replace(stale, temporary)
    try:
        with open(source, "rb", buffering=0) as reader, open(temporary, "r+b") as patched:
            try:
                # The same lock DuckDB's writer takes: a reader in another process that opened
                # the old snapshot just before it was replaced cannot lock it while it changes.
                fcntl.lockf(patched, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise _HeldOpenError(stale) from None
            _write_differences(reader, patched)
            os.fsync(patched.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _write_differences(source: BinaryIO, target: BinaryIO) -> None:
    """Overwrite the chunks of ``target`` that differ from ``source``; end it where it ends."""
    theirs, ours = bytearray(PATCH_CHUNK), bytearray(PATCH_CHUNK)
    descriptor = target.fileno()
    offset = 0
    while read := source.readinto(theirs):
        present = os.preadv(descriptor, [ours], offset)
        # bytearray == bytearray is one memcmp; slicing copies, so only for the last chunk.
        if read == present == PATCH_CHUNK:
            same = theirs == ours
        else:
            same = present >= read and theirs[:read] == ours[:read]
        if not same:
            os.pwrite(descriptor, memoryview(theirs)[:read], offset)
        offset += read
    os.ftruncate(descriptor, offset)


def _held_open(path: Path) -> bool:
    """Whether any process (this one included) holds a lock on ``path``'s file: DuckDB takes a
    shared ``fcntl`` lock on the whole file for each read-only connection, for as long as it
    is open. Read from ``/proc/locks`` rather than by trying a lock: POSIX record locks do not
    conflict within one process, and closing a probe's descriptor would drop this process's
    readers' locks. Unknown (no ``/proc/locks``) counts as held: copying is always safe.
    Matches on the inode number alone; a false match only costs a copy."""
    inode = os.stat(path).st_ino
    try:
        with open("/proc/locks") as handle:
            table = handle.read()
    except OSError:
        return True
    # Lines read "1: POSIX  ADVISORY  READ 5668 fe:00:2147563 0 EOF" (major:minor:inode).
    suffix = f":{inode}"
    return any(
        field.endswith(suffix) and field.count(":") == 2
        for line in table.splitlines()
        for field in line.split()
    )


def _retire(snapshot: Path) -> Path | None:
    """Give the current snapshot a second name to unlink later."""
    if not snapshot.exists():
        return None
    retired = snapshot.with_name(f".{snapshot.name}.{os.getpid()}.retired")
    os.link(snapshot, retired)
    return retired


def _remove_leftovers(warehouse_path: Path) -> None:
    """Files a killed refresh left behind: an old snapshot's second name, a half-made copy
    (as big as the warehouse). Refreshes hold the lock, so none of these is in use."""
    folder, name = warehouse_path.parent, glob.escape(warehouse_path.name)
    for pattern in (f".{name}.*.retired", f".{name}.writer.*.tmp"):
        for leftover in folder.glob(pattern):
            leftover.unlink(missing_ok=True)


def _copy_durably(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a flushed temporary file and a rename, so a crash
    leaves either no ``target`` or a whole one."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(source, temporary)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()


def _ensure_schema(connection: duckdb.DuckDBPyConnection) -> None:
    connection.execute(
        f"CREATE TABLE IF NOT EXISTS {STATE_TABLE} ("
        "name VARCHAR NOT NULL, high_water_mark TIMESTAMP, value VARCHAR, "
        "rows_loaded BIGINT, loaded_at TIMESTAMP)"
    )
    tables = {row[0] for row in connection.execute("SHOW TABLES").fetchall()}
    if _OLD_STATE_TABLE in tables:
        connection.execute(f"INSERT INTO {STATE_TABLE} SELECT * FROM {_OLD_STATE_TABLE}")
        connection.execute(f"DROP TABLE {_OLD_STATE_TABLE}")
    for source in SOURCES:
        columns = ", ".join(f"{name} {kind}" for name, kind in source.columns)
        connection.execute(f"CREATE TABLE IF NOT EXISTS {source.raw_table} ({columns})")


def _load_state(connection: duckdb.DuckDBPyConnection) -> dict[str, datetime]:
    rows = connection.execute(
        f"SELECT name, high_water_mark FROM {STATE_TABLE} WHERE high_water_mark IS NOT NULL"
    ).fetchall()
    return {name: mark.replace(tzinfo=UTC) for name, mark in rows}


def _vacuum_policy(
    connection: duckdb.DuckDBPyConnection,
    summary: RefreshSummary,
    deleted_before: int,
    rebuild: bool,
) -> int:
    """Keep the refresh's own commit from compacting; returns the deleted rows left
    uncompacted after it (``_compact`` removes them once they add up).

    Compacting (DuckDB's vacuum) rewrites whole row groups to drop the rows a refresh replaced
    (the funnel rows of touched messages, changed messages). A realistic refresh at 1M messages
    replaces ~28,000 funnel rows, so a commit allowed to compact did so every second refresh,
    for 0.3-0.5 s that analysts waited for. Deleted rows cost nothing but space (a scan skips
    them) until they are compacted after publishing; a full build starts from compact tables.
    """
    if rebuild:
        connection.execute("RESET max_vacuum_tasks")
        return 0
    connection.execute("SET max_vacuum_tasks = 0")
    return deleted_before + summary.rows_deleted


def _needs_compacting(summary: RefreshSummary, unvacuumed: int) -> bool:
    return unvacuumed > VACUUM_SHARE * summary.table_rows.get(FUNNEL, 0)


def _compact(path: Path) -> None:
    """Compact the deleted rows out of a warehouse file no reader holds (the next writer file,
    after publishing): what the refresh's commit left undone, off the path to visibility.

    DuckDB compacts a table's row groups only in a checkpoint that writes the table, and a
    checkpoint writes only tables changed since the last one; so each table is changed by
    taking its last row out and putting the same row back, which leaves its content and order
    as they were. One transaction: a crash leaves the file as it was, still uncompacted, and
    the next refresh's publish compacts it then.
    """
    connection = _connect(path, read_only=False)
    try:
        connection.execute("RESET max_vacuum_tasks")
        connection.execute("BEGIN TRANSACTION")
        for table in (*(source.raw_table for source in SOURCES), FUNNEL, FUNNEL_DAILY):
            last = f"(SELECT max(rowid) FROM {table})"
            connection.execute(
                f"CREATE OR REPLACE TEMP TABLE _last AS SELECT * FROM {table} WHERE rowid = {last}"
            )
            connection.execute(f"DELETE FROM {table} WHERE rowid = {last}")
            connection.execute(f"INSERT INTO {table} SELECT * FROM _last")
        connection.execute(
            f"UPDATE {STATE_TABLE} SET value = '0' WHERE name = {_literal(UNVACUUMED_STATE)}"
        )
        connection.execute("COMMIT")  # checkpoints, compacting as it writes each table
    finally:
        connection.close()


def _state_value(connection: duckdb.DuckDBPyConnection, name: str) -> str | None:
    row = connection.execute(
        f"SELECT value FROM {STATE_TABLE} WHERE name = {_literal(name)}"
    ).fetchone()
    return row[0] if row else None


def _save_state(
    connection: duckdb.DuckDBPyConnection,
    summary: RefreshSummary,
    fingerprint: str,
    unvacuumed: int,
) -> None:
    now = datetime.now(UTC).replace(tzinfo=None)
    rows = [
        (name, _naive(mark), None, summary.rows_loaded.get(name, 0), now)
        for name, mark in summary.high_water_marks.items()
    ]
    rows.append(("models", None, fingerprint, summary.messages_rebuilt, now))
    rows.append((UNVACUUMED_STATE, None, str(unvacuumed), summary.rows_deleted, now))
    connection.execute(f"DELETE FROM {STATE_TABLE}")
    values = ", ".join("(" + ", ".join(_literal(v) for v in row) + ")" for row in rows)
    connection.execute(f"INSERT INTO {STATE_TABLE} VALUES {values}")


def _literal(value: str | int | datetime | None) -> str:
    """A SQL literal for the refresh's own statements. They bind no parameters: DuckDB's
    Python client imports pandas on the first bound parameter, 0.18 s of every refresh run."""
    if value is None:
        return "NULL"
    if isinstance(value, datetime):
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, int):
        return str(int(value))
    return sql_string(str(value))


def _naive(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value


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
    sources are staged on two connections at once (see ``_stage_all``) before the refresh's
    transaction writes them.
    """
    raw = source.raw_table
    staged = _Staged(source)
    if since is None and not connection.execute(f"SELECT 1 FROM {raw} LIMIT 1").fetchone():
        staged.first_load = True  # loaded straight from the source by _write_source
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
        f"WHERE r.{key} BETWEEN {_literal(lowest)} AND {_literal(highest)}"
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


def _stage_all(
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
        _configure_session(cursor)
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


def _write_source(
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
        casts = ", ".join(f'CAST("{n}" AS {kind}) AS "{n}"' for n, kind in source.columns)
        connection.execute(f"INSERT INTO {raw} SELECT {casts} FROM {attached.table(source.name)}")
        read = connection.execute(f"SELECT count(*) FROM {raw}").fetchone()[0]
        hwm = connection.execute(f"SELECT max({source.marker_sql()}) FROM {raw}").fetchone()[0]
        if read and mark_affected:
            _mark_affected(connection, source, raw)
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
            _mark_affected(connection, source, replaced)
        doomed.append(f"SELECT _row FROM {replaced}")
    if staged.gone:
        if mark_affected:
            _mark_affected(connection, source, staged.gone)
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
            _mark_affected(connection, source, staged.rows)
    return staged.read, loaded, staged.hwm, deleted


def _mark_affected(connection: duckdb.DuckDBPyConnection, source: Source, rows: str) -> None:
    """Remember which messages' funnel rows the ``rows`` just loaded can change."""
    if source.table is email_outbox:
        connection.execute(
            f"INSERT INTO {AFFECTED} SELECT m.message_id FROM raw_email_messages AS m "
            f"WHERE {_event_id_range(connection, rows, 'm.event_id')} "
            f"AND m.event_id IN (SELECT event_id FROM {rows})"
        )
    else:
        connection.execute(
            f"INSERT INTO {AFFECTED} SELECT message_id FROM {rows} WHERE message_id IS NOT NULL"
        )


def _build_models(connection: duckdb.DuckDBPyConnection, full: bool) -> tuple[int, int, int]:
    """Staging views, then the funnel and the daily table: whole, or only what changed.
    Returns the messages and days rebuilt and the rows deleted to rebuild them."""
    for name in STAGING_MODELS:
        connection.execute(f"CREATE OR REPLACE VIEW {name} AS\n{model_sql(name)}")
    exists = {
        row[0]
        for row in connection.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'"
        ).fetchall()
    }
    if full or FUNNEL not in exists or FUNNEL_DAILY not in exists:
        connection.execute(
            f"CREATE OR REPLACE TABLE {FUNNEL} AS\n"
            f"SELECT * FROM (\n{model_sql(FUNNEL)}\n) ORDER BY message_id"
        )
        connection.execute(
            f"CREATE OR REPLACE TABLE {FUNNEL_DAILY} AS\n"
            f"SELECT * FROM (\n{model_sql(FUNNEL_DAILY)}\n) ORDER BY ALL"
        )
        messages = connection.execute(f"SELECT count(*) FROM {FUNNEL}").fetchone()[0]
        days = connection.execute(f"SELECT count(DISTINCT day) FROM {FUNNEL_DAILY}").fetchone()[0]
        return messages, days, 0
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _scope AS "
        f"SELECT DISTINCT message_id FROM {AFFECTED} ORDER BY message_id"
    )
    messages = connection.execute("SELECT count(*) FROM _scope").fetchone()[0]
    if not messages:
        return 0, 0, 0
    connection.execute(
        f"CREATE OR REPLACE TEMP TABLE _old_days AS SELECT DISTINCT day FROM {FUNNEL} "
        "WHERE message_id IN (SELECT message_id FROM _scope)"
    )
    deleted = connection.execute(
        f"DELETE FROM {FUNNEL} WHERE message_id IN (SELECT message_id FROM _scope)"
    ).fetchone()[0]
    # Not sorted (0.02 s at 1M): the rows are a mix of new messages and old ones spread over
    # weeks, so sorting would not narrow the zone maps of the row groups they fill.
    with _shadowed(connection, _scope_filters(connection)):
        connection.execute(
            f"INSERT INTO {FUNNEL} SELECT * FROM (\n{model_sql(FUNNEL)}\n) "
            "WHERE message_id IN (SELECT message_id FROM _scope)"
        )
    connection.execute(
        "CREATE OR REPLACE TEMP TABLE _days AS SELECT day FROM _old_days UNION "
        f"SELECT DISTINCT day FROM {FUNNEL} WHERE message_id IN (SELECT message_id FROM _scope)"
    )
    days = connection.execute("SELECT count(*) FROM _days").fetchone()[0]
    deleted += connection.execute(
        f"DELETE FROM {FUNNEL_DAILY} WHERE day IN (SELECT day FROM _days)"
    ).fetchone()[0]
    with _shadowed(connection, {FUNNEL: "day IN (SELECT day FROM _days)"}):
        connection.execute(
            f"INSERT INTO {FUNNEL_DAILY} SELECT * FROM (\n{model_sql(FUNNEL_DAILY)}\n) "
            "WHERE day IN (SELECT day FROM _days) ORDER BY ALL"
        )
    return messages, days, deleted


def _scope_filters(connection: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """The raw rows the funnel rows of the messages in ``_scope`` read, per raw table (the
    outbox row via its event); a message's funnel row depends on nothing else."""
    scoped = "message_id IN (SELECT message_id FROM _scope)"
    events = f"(SELECT event_id FROM raw_email_messages WHERE {scoped})"
    return {
        "raw_email_messages": scoped,
        "raw_email_attempts": scoped,
        "raw_email_events": scoped,
        "raw_dead_letters": scoped,
        "raw_email_outbox": f"{_event_id_range(connection, events, 'event_id')} "
        "AND event_id IN (SELECT event_id FROM temp.main.raw_email_messages)",
    }


def _event_id_range(connection: duckdb.DuckDBPyConnection, rows: str, column: str) -> str:
    """``column`` within the range of ``rows``' event ids, as literals: zone maps then skip the
    row groups outside it (DuckDB derives no range from a join on strings, so matching events
    by id read every row of a 1M-row table). Correct for any ids; ULIDs, sortable by time,
    make it narrow."""
    lowest, highest = connection.execute(
        f"SELECT min(event_id), max(event_id) FROM {rows}"
    ).fetchone()
    if lowest is None:
        return "false"
    return f"{column} BETWEEN {_literal(lowest)} AND {_literal(highest)}"


@contextmanager
def _shadowed(connection: duckdb.DuckDBPyConnection, filters: dict[str, str]) -> Iterator[None]:
    """Shadow each named table with a temp view of only its rows matching the filter, for the
    duration of the block.

    DuckDB binds the unqualified names inside a view when it is queried, temp schema first, so
    the staging views and the model SQL run unchanged over the rows that can change instead of
    aggregating everything and filtering afterwards (the filter does not push through their
    GROUP BYs). Views, not tables: each reader then scans only the columns it needs, and zone
    maps skip the row groups the filter rules out.
    """
    # Fully qualified: inside the temp catalog, a bare ``main.`` names the temp schema itself.
    database = connection.execute("SELECT current_database()").fetchone()[0]
    created = []
    try:
        for table, condition in filters.items():
            connection.execute(
                f'CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM "{database}".main.{table} '
                f"WHERE {condition}"
            )
            created.append(table)
        yield
    finally:
        for table in reversed(created):
            connection.execute(f"DROP VIEW IF EXISTS temp.main.{table}")


def operational_fingerprint(engine: Engine) -> str:
    """A cheap digest of the operational tables' change markers: it moves when a refresh would
    load something (a send, an attempt, a webhook, a dead letter resolved), else stays put.

    Appended tables use their primary key (an index lookup); the others their markers. One
    statement of nine indexed max() subqueries: the sensor asks every 10 s.
    """
    parts = [
        select(func.max(email_outbox.c.published_at)),
        select(func.max(email_outbox.c.done_at)),
        select(func.max(email_messages.c.updated_at)),
        select(func.max(email_messages.c.delivery_updated_at)),
        select(func.max(email_attempts.c.attempt_id)),
        select(func.max(dead_letters.c.dead_letter_id)),
        select(func.max(dead_letters.c.resolved_at)),
        select(func.max(email_events.c.email_event_id)),
        select(func.max(email_event_deletions.c.deletion_id)),
    ]
    with engine.connect() as connection:
        values = connection.execute(select(*(part.scalar_subquery() for part in parts))).one()
    return hashlib.sha256(repr([str(v) for v in values]).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Numbers for metadata, checks and reports


def funnel_totals(
    connection: duckdb.DuckDBPyConnection, *, latency_days: int = 7
) -> dict[str, float | int | None]:
    """Whole-warehouse counts and rates, and latency percentiles over the newest
    ``latency_days`` days: what the UI plots over time (recent latencies move with the system;
    all-time ones would barely move, and cost a sort of every row on each refresh).

    The counts are sums of ``email_funnel_daily``, which counts every funnel row exactly once:
    a few hundred rows instead of a scan of every message (0.03-0.06 s at 1M, on each refresh).
    """
    counts = (
        "messages",
        "accepted",
        "delivered",
        "human_opened",
        "machine_opened",
        "clicked",
        "bounced",
        "complained",
        "unsubscribed",
        "dead",
    )
    sums = ", ".join(f"coalesce(sum({name}), 0)::BIGINT AS {name}" for name in counts)
    row = connection.execute(
        f"""
        WITH recent AS (
            SELECT event_to_accepted_s, delivery_delay_s, time_to_open_s FROM {FUNNEL}
            WHERE day > (SELECT max(day) FROM {FUNNEL}) - {int(latency_days)}
        ),
        latencies AS (
            SELECT
                quantile_cont(event_to_accepted_s, [0.5, 0.95]) AS accepted,
                quantile_cont(delivery_delay_s, 0.5) AS delivery,
                quantile_cont(time_to_open_s, [0.5, 0.95]) AS open
            FROM recent
        ),
        t AS (SELECT {sums} FROM {FUNNEL_DAILY})
        SELECT
            {", ".join(f"t.{name}" for name in counts)},
            t.delivered / nullif(t.accepted, 0),
            t.human_opened / nullif(t.delivered, 0),
            t.machine_opened / nullif(t.delivered, 0),
            t.clicked / nullif(t.delivered, 0),
            t.bounced / nullif(t.accepted, 0),
            t.complained / nullif(t.delivered, 0),
            l.accepted[1], l.accepted[2], l.delivery, l.open[1], l.open[2]
        FROM t, latencies AS l
        """
    ).fetchone()
    names = (
        *counts,
        "delivery_rate",
        "open_rate",
        "machine_open_rate",
        "click_rate",
        "bounce_rate",
        "complaint_rate",
        "event_to_accepted_p50_s",
        "event_to_accepted_p95_s",
        "delivery_delay_p50_s",
        "time_to_open_p50_s",
        "time_to_open_p95_s",
    )
    return dict(zip(names, row, strict=True))


@dataclass(frozen=True)
class CheckOutcome:
    """One asset check's verdict; ``severity`` is what a failure means ("ERROR" or "WARN")."""

    name: str
    passed: bool
    severity: str
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    bounce_rate: float = 0.05
    complaint_rate: float = 0.003
    # Rows with fewer accepted messages than this are too small to judge a rate by.
    min_accepted: int = 50
    # The most recent days (ending at the newest day in the data) the rate checks look at.
    window_days: int = 7
    # Provider-side latencies compare two clocks; within this much below zero is skew.
    clock_skew_s: float = 2.0


LATENCY_COLUMNS = (
    "publish_delay_s",
    "queue_delay_s",
    "send_duration_s",
    "event_to_accepted_s",
    "delivery_delay_s",
    "time_to_open_s",
    "time_to_click_s",
    "time_to_bounce_s",
)


def check_one_row_per_message(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    rows, distinct, messages = connection.execute(
        f"SELECT count(*), count(DISTINCT message_id), "
        f"(SELECT count(*) FROM stg_sends) FROM {FUNNEL}"
    ).fetchone()
    missing = connection.execute(
        f"SELECT count(*) FROM stg_sends WHERE message_id NOT IN (SELECT message_id FROM {FUNNEL})"
    ).fetchone()[0]
    passed = rows == distinct == messages and missing == 0
    return CheckOutcome(
        "one_row_per_message",
        passed,
        "ERROR",
        "Every message has exactly one funnel row."
        if passed
        else f"{rows} funnel rows, {distinct} distinct messages, {messages} messages loaded, "
        f"{missing} messages without a row.",
        {
            "funnel_rows": rows,
            "distinct_messages": distinct,
            "messages": messages,
            "missing": missing,
        },
    )


def check_provider_events_joined(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    total, orphans = connection.execute(
        "SELECT count(*), count(*) FILTER (WHERE message_id IS NULL OR message_id NOT IN "
        "(SELECT message_id FROM stg_sends)) FROM stg_provider_events"
    ).fetchone()
    by_type = dict(
        connection.execute(
            "SELECT event_type, count(*) FROM stg_provider_events WHERE message_id IS NULL "
            "OR message_id NOT IN (SELECT message_id FROM stg_sends) GROUP BY 1 ORDER BY 2 DESC"
        ).fetchall()
    )
    return CheckOutcome(
        "provider_events_joined",
        orphans == 0,
        "WARN",
        f"{orphans} of {total} provider events match no message"
        + (f" ({', '.join(f'{k}: {v}' for k, v in by_type.items())})." if by_type else "."),
        {
            "provider_events": total,
            "orphans": orphans,
            "orphan_share": orphans / total if total else 0.0,
            **{f"orphans_{kind}": n for kind, n in by_type.items()},
        },
    )


def check_no_negative_latencies(
    connection: duckdb.DuckDBPyConnection, thresholds: Thresholds = Thresholds()
) -> CheckOutcome:
    counts = connection.execute(
        "SELECT "
        + ", ".join(f"count(*) FILTER (WHERE {c} < ?)" for c in LATENCY_COLUMNS)
        + f" FROM {FUNNEL}",
        [-thresholds.clock_skew_s] * len(LATENCY_COLUMNS),
    ).fetchone()
    negative = {name: n for name, n in zip(LATENCY_COLUMNS, counts, strict=True) if n}
    return CheckOutcome(
        "no_negative_latencies",
        not negative,
        "ERROR",
        "No latency is negative beyond clock skew."
        if not negative
        else "Negative latencies: " + ", ".join(f"{k}: {v} rows" for k, v in negative.items()),
        {"negative_rows": sum(negative.values()), "clock_skew_s": thresholds.clock_skew_s}
        | {f"negative_{name}": n for name, n in negative.items()},
    )


def check_open_dead_letters(connection: duckdb.DuckDBPyConnection) -> CheckOutcome:
    by_reason = dict(
        connection.execute(
            "SELECT reason, count(*) FROM stg_dead_letters WHERE status = 'open' "
            "GROUP BY 1 ORDER BY 2 DESC, 1"
        ).fetchall()
    )
    oldest = connection.execute(
        "SELECT min(created_at) FROM stg_dead_letters WHERE status = 'open'"
    ).fetchone()[0]
    total = sum(by_reason.values())
    return CheckOutcome(
        "open_dead_letters",
        total == 0,
        "WARN",
        "No open dead letters."
        if not total
        else f"{total} open dead letters: "
        + ", ".join(f"{k}: {v}" for k, v in by_reason.items())
        + ". Replay or discard them with `email-platform dlq`.",
        {"open_dead_letters": total}
        | {f"open_{reason}": n for reason, n in by_reason.items()}
        | ({"oldest_open_at": oldest.replace(tzinfo=UTC).timestamp()} if oldest else {}),
    )


def check_daily_rate(
    connection: duckdb.DuckDBPyConnection,
    rate: str,
    threshold: float,
    thresholds: Thresholds = Thresholds(),
) -> CheckOutcome:
    """``rate`` (bounce_rate or complaint_rate) of each recent daily row against ``threshold``."""
    if rate not in ("bounce_rate", "complaint_rate"):
        raise ValueError(f"not a checked rate: {rate}")
    volume = "accepted"
    rows = connection.execute(
        f"""
        SELECT day, template, lane, provider, {volume}, {rate}
        FROM {FUNNEL_DAILY}
        WHERE day > (SELECT max(day) FROM {FUNNEL_DAILY}) - ?::INTEGER
          AND {volume} >= ?
        ORDER BY {rate} DESC NULLS LAST, day DESC
        """,
        [thresholds.window_days, thresholds.min_accepted],
    ).fetchall()
    breaches = [r for r in rows if r[5] is not None and r[5] > threshold]
    worst = max((r[5] for r in rows if r[5] is not None), default=None)
    label = rate.replace("_", " ")
    if breaches:
        day, template, lane, provider, n, value = breaches[0]
        description = (
            f"{len(breaches)} daily rows over the {label} threshold {threshold:.2%}; worst "
            f"{value:.2%} on {day} for {template}/{lane}/{provider} ({n} accepted)."
        )
    else:
        description = (
            f"Every day x template x lane x provider with at least {thresholds.min_accepted} "
            f"accepted in the last {thresholds.window_days} days is under {threshold:.2%}."
        )
    return CheckOutcome(
        f"{rate}_under_threshold",
        not breaches,
        "ERROR",
        description,
        {
            "threshold": threshold,
            f"worst_{rate}": worst if worst is not None else 0.0,
            "rows_checked": len(rows),
            "rows_breaching": len(breaches),
        },
    )


# ---------------------------------------------------------------------------------------------
# Reports for the demo and the CLI


@dataclass
class FunnelReport:
    """The funnel per template, plus the welcome email's human open rate."""

    rows: list[dict[str, Any]]
    welcome_open_rate: float | None

    def to_text(self) -> str:
        header = (
            f"{'template':<16}{'messages':>9}{'accepted':>9}{'delivered':>10}{'opened':>8}"
            f"{'clicked':>8}{'bounced':>8}{'open rate':>10}{'machine':>9}"
        )
        lines = ["Funnel by template (opens are human opens; machine opens apart)", header]
        for row in self.rows:
            lines.append(
                f"{row['template']:<16}{row['messages']:>9}{row['accepted']:>9}"
                f"{row['delivered']:>10}{row['human_opened']:>8}{row['clicked']:>8}"
                f"{row['bounced']:>8}{_pct(row['open_rate']):>10}{row['machine_opened']:>9}"
            )
        lines.append(f"Welcome email human open rate: {_pct(self.welcome_open_rate)}")
        return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def funnel_report(
    warehouse_path: str | os.PathLike[str], *, event_ids: Sequence[str] | None = None
) -> FunnelReport:
    """The funnel per template from the published snapshot, optionally for some events only."""
    connection = connect_read_only(warehouse_path)
    try:
        where, params = ("", [])
        if event_ids is not None:
            where, params = ("WHERE event_id IN (SELECT unnest(?::VARCHAR[]))", [list(event_ids)])
        cursor = connection.execute(
            f"""
            SELECT template, count(*) AS messages, count(accepted_at) AS accepted,
                count(delivered_at) AS delivered, count(first_open_at) AS human_opened,
                count(first_machine_open_at) AS machine_opened, count(first_click_at) AS clicked,
                count(bounced_at) AS bounced,
                count(first_open_at) / nullif(count(delivered_at), 0) AS open_rate
            FROM {FUNNEL} {where}
            GROUP BY template ORDER BY template
            """,
            params,
        )
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.close()
    welcome = next((r["open_rate"] for r in rows if r["template"] == "welcome"), None)
    return FunnelReport(rows=rows, welcome_open_rate=welcome)


def funnel_row(warehouse_path: str | os.PathLike[str], event_id: str) -> list[dict[str, Any]]:
    """The funnel rows of one event (one per message), for ``email-platform trace``."""
    connection = connect_read_only(warehouse_path)
    try:
        cursor = connection.execute(
            f"SELECT * FROM {FUNNEL} WHERE event_id = ? ORDER BY message_id", [event_id]
        )
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.close()


FUNNEL_STEPS = (
    ("event", "messages", "#5b6b7f"),
    ("accepted", "accepted", "#3a7bd5"),
    ("delivered", "delivered", "#2a9d8f"),
    ("opened", "human_opened", "#e9a23b"),
    ("clicked", "clicked", "#d1495b"),
)


def funnel_by_template(
    connection: duckdb.DuckDBPyConnection, *, days: int = 7
) -> list[dict[str, Any]]:
    """Per template over the newest ``days`` days of ``email_funnel_daily``: the funnel steps."""
    cursor = connection.execute(
        f"""
        SELECT template, sum(messages) AS messages, sum(accepted) AS accepted,
            sum(delivered) AS delivered, sum(human_opened) AS human_opened,
            sum(machine_opened) AS machine_opened, sum(clicked) AS clicked
        FROM {FUNNEL_DAILY}
        WHERE day > (SELECT max(day) FROM {FUNNEL_DAILY}) - ?::INTEGER
        GROUP BY template ORDER BY messages DESC, template
        """,
        [days],
    )
    names = [d[0] for d in cursor.description]
    return [
        {k: (int(v) if isinstance(v, int | float) else v) for k, v in zip(names, r, strict=True)}
        for r in cursor.fetchall()
    ]


def funnel_chart_svg(rows: Sequence[dict[str, Any]], *, title: str) -> str:
    """A funnel chart (event -> accepted -> delivered -> opened -> clicked) per template, as SVG.

    Plain SVG text: no plotting library, no network, and the Dagster UI shows it inline.
    """
    bar_x, bar_w, row_h, width = 110, 330, 17, 600
    block_h = 24 + row_h * len(FUNNEL_STEPS) + 10
    height = 34 + block_h * max(len(rows), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="10" y="20" font-size="14" font-weight="bold">{_xml(title)}</text>',
    ]
    if not rows:
        parts.append('<text x="10" y="50" fill="#777">No messages yet.</text>')
    for index, row in enumerate(rows):
        top = 34 + index * block_h
        parts.append(
            f'<text x="10" y="{top + 14}" font-weight="bold">{_xml(str(row["template"]))}</text>'
        )
        base = row["messages"] or 0
        for step, (label, key, color) in enumerate(FUNNEL_STEPS):
            y = top + 22 + step * row_h
            value = row.get(key) or 0
            share = value / base if base else 0.0
            parts.append(f'<text x="20" y="{y + 11}" fill="#333">{label}</text>')
            parts.append(
                f'<rect x="{bar_x}" y="{y}" width="{bar_w}" height="{row_h - 4}" fill="#eef1f5"/>'
            )
            parts.append(
                f'<rect x="{bar_x}" y="{y}" width="{bar_w * share:.1f}" height="{row_h - 4}" '
                f'fill="{color}"/>'
            )
            parts.append(
                f'<text x="{bar_x + bar_w + 8}" y="{y + 11}" fill="#333">'
                f"{value:,} ({share:.1%})</text>"
            )
    parts.append("</svg>")
    return "\n".join(parts)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
