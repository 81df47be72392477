"""``refresh()``: one refresh of the warehouse, from the lock to the published snapshot.

Under the writer lock (``files``), a refresh opens the private writer file (a copy of the
snapshot when there is none, or when a reader holds it), reads the high-water marks
(``state``) and stages what changed on two connections at once (``load``). Then, in one
transaction from the first load to the saved high-water marks, it writes what it staged,
rebuilds the models it touched (``build``) and saves the new marks: a refresh that fails or is
killed half-way leaves the writer file as the last refresh left it. The commit checkpoints; the
writer file is published as the new snapshot in one rename, the snapshot it replaced is patched
into the next writer file (or the new one is copied, while a reader holds the old one:
``files``), and deleted rows are compacted out of that file once they add up (``state``). When
nothing was new or changed, the snapshot and the writer file stay as they are.
``RefreshSummary`` says what the refresh did, for the assets' metadata and the benchmark.
"""

import os
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
from sqlalchemy import URL, Engine, make_url

from email_platform.common import config
from email_platform.db.schema import email_events
from email_platform.observability import tracing
from email_platform.warehouse.build import (
    AFFECTED,
    FUNNEL,
    FUNNEL_DAILY,
    build_models,
    models_fingerprint,
)
from email_platform.warehouse.files import (
    connect,
    connect_writer,
    copy_durably,
    detach_writer,
    held_open,
    literal,
    prepare_next_writer,
    remove_leftovers,
    retire,
    spill_path,
    writer_lock,
    writer_path,
)
from email_platform.warehouse.load import STAGE, stage_all, write_source
from email_platform.warehouse.report import funnel_totals
from email_platform.warehouse.scanners import attach, detach
from email_platform.warehouse.sources import DELETIONS, SOURCES
from email_platform.warehouse.state import (
    UNVACUUMED_STATE,
    compact,
    ensure_schema,
    load_state,
    needs_compacting,
    save_state,
    state_value,
    vacuum_policy,
)
from email_platform.warehouse.summary import RefreshSummary

DEFAULT_LOOKBACK_S = 120


def refresh(
    database: str | Engine,
    warehouse_path: str | os.PathLike[str],
    *,
    full: bool = False,
    lookback_s: float = DEFAULT_LOOKBACK_S,
    publish: bool = True,
    memory_limit: str | None = None,
) -> RefreshSummary:
    """Load what changed since the last refresh, rebuild the affected funnel rows, publish.

    ``database`` is a SQLAlchemy URL or engine. ``full`` forgets the high-water marks and
    rebuilds everything from scratch. ``memory_limit`` bounds DuckDB's memory (a DuckDB size;
    unset: ``EMAIL_PLATFORM_WAREHOUSE_MEMORY``, default 2GB); it spills next to the file past
    it. Safe to call from several processes: they take turns.
    """
    memory_limit = (
        config.warehouse_memory()
        if memory_limit is None
        else config.checked_memory(memory_limit, "memory_limit")
    )
    # The scanners read the database themselves: only its URL is needed (making an engine
    # here cost a SQLAlchemy dialect's import on the way to visibility).
    source = make_url(database) if isinstance(database, str) else database.url
    # One span per refresh, linked to no event: a refresh loads thousands of traces' rows,
    # and those rows carry their trace_id (stg_events, email_funnel) to join on instead.
    with (
        tracing.start_span(
            "email_platform.warehouse.refresh", attributes={"warehouse.full": full}
        ) as span,
        writer_lock(warehouse_path),
    ):
        summary = _refresh_locked(
            source,
            Path(warehouse_path),
            full=full,
            lookback_s=lookback_s,
            publish=publish,
            memory_limit=memory_limit,
        )
        tracing.set_attributes(
            span,
            {
                "warehouse.full_build": summary.full_build,
                "warehouse.rows_loaded": summary.total_loaded,
                "warehouse.messages_rebuilt": summary.messages_rebuilt,
                "warehouse.next_writer": summary.next_writer,
            },
        )
        return summary


def _refresh_locked(
    source: URL,
    warehouse_path: Path,
    *,
    full: bool,
    lookback_s: float,
    publish: bool,
    memory_limit: str,
) -> RefreshSummary:
    started = time.perf_counter()
    summary = RefreshSummary(
        warehouse_path=str(warehouse_path), full_build=full, started_at=datetime.now(UTC)
    )
    writer = writer_path(warehouse_path)
    remove_leftovers(warehouse_path)
    if full and writer.exists():
        writer.unlink()
    elif not full and warehouse_path.exists() and (not writer.exists() or held_open(writer)):
        # Either the last refresh published and stopped before preparing the next writer file,
        # or the writer file is a former snapshot an analyst still has open: continue from a
        # copy of the snapshot (it holds everything, its state included).
        copy_durably(warehouse_path, writer)
    # A new warehouse (no writer file, no snapshot to copy) is written whole, as a full build.
    connection = connect_writer(warehouse_path, writer, whole=full or not writer.exists())
    if full:
        # A full load writes every string once: FSST's cost (see files.connect) is paid once a
        # day for a file about a third smaller; incremental loads stay without it.
        connection.execute("RESET disabled_compression_methods")
    # Every refresh within the bound, the loads included (a first load of 10M messages went to
    # 5 GB with the bound set for the build alone); DuckDB spills past it next to the file.
    # An incremental refresh stays far below it.
    try:
        # Inside the try: a refused setting still closes the writer and removes the spill dir.
        connection.execute(f"SET memory_limit = {literal(memory_limit)}")
        connection.execute(f"SET temp_directory = {literal(str(spill_path(warehouse_path)))}")
        ensure_schema(connection)
        state = load_state(connection)
        state_deleted = int(state_value(connection, UNVACUUMED_STATE) or 0)
        if full:
            state = {}
        phase = time.perf_counter()
        fingerprint = models_fingerprint()
        rebuild = full or state_value(connection, "models") != fingerprint
        attached = attach(connection, source)
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
            staged = stage_all(connection, attached, since)
            connection.execute("BEGIN TRANSACTION")
        except BaseException:
            detach(connection, attached)
            raise
        try:
            connection.execute(
                f"CREATE OR REPLACE TEMP TABLE {AFFECTED} (message_id BIGINT, foldable BOOLEAN)"
            )
            loads = {
                source.name: write_source(
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
            # The rows each load wrote (stage tables), for the funnel rows folded from them.
            written = {s.source.raw_table: s.rows for s in staged.values() if s.rows}
            built_counts = build_models(connection, rebuild, written)
            summary.messages_rebuilt = built_counts.messages
            summary.messages_folded = built_counts.folded
            summary.days_rebuilt = built_counts.days
            summary.daily_rows_changed = built_counts.daily_rows
            summary.daily_rows_kept = built_counts.daily_rows_kept
            summary.daily_rows_read = built_counts.daily_rows_read
            summary.slices = built_counts.slices
            summary.rows_deleted = deleted + built_counts.rows_deleted
            unvacuumed = vacuum_policy(connection, summary, state_deleted, rebuild)
            save_state(connection, summary, fingerprint, unvacuumed)
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
        # The writer file is closed here, its lock with it; the connection's own teardown
        # (freeing what the refresh held in memory) waits until the new snapshot is visible.
        detach_writer(connection, writer)
        summary.timings_s["checkpoint"] = time.perf_counter() - phase
    except BaseException:
        _close(connection, warehouse_path)
        raise
    built, retired = writer, None
    try:
        if unchanged:
            built = warehouse_path
            summary.timings_s.update(publish=0.0, prepare_next=0.0)
            summary.timings_s["visible"] = time.perf_counter() - started
            summary.next_writer = "unchanged"
        elif publish:
            phase = time.perf_counter()
            warehouse_path.parent.mkdir(parents=True, exist_ok=True)
            # The old snapshot keeps a second name through the swap: it becomes the next
            # writer file (or is unlinked) after the new data is visible.
            retired = retire(warehouse_path)
            # The closed, checkpointed writer file becomes the snapshot in one rename: readers
            # see the new data now, and nothing writes that file again.
            os.replace(writer, warehouse_path)
            built = warehouse_path
            summary.timings_s["publish"] = time.perf_counter() - phase
            summary.timings_s["visible"] = time.perf_counter() - started
    finally:
        _close(connection, warehouse_path)
    if publish and not unchanged:
        phase = time.perf_counter()
        summary.next_writer = prepare_next_writer(warehouse_path, writer, retired)
        summary.timings_s["prepare_next"] = time.perf_counter() - phase
    # Numbers for the UI, read from what was just built: readers already have it.
    reader = connect(built, read_only=True)
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
    summary.compacted = not unchanged and needs_compacting(summary, unvacuumed)
    if summary.compacted:
        phase = time.perf_counter()
        compact(writer)
        summary.timings_s["compact"] = time.perf_counter() - phase
    summary.timings_s["total"] = time.perf_counter() - started
    summary.finished_at = datetime.now(UTC)
    return summary


def _close(connection: duckdb.DuckDBPyConnection, warehouse_path: Path) -> None:
    try:
        connection.close()
    finally:
        # DuckDB removes what it spilled, not the directory it made for it.
        shutil.rmtree(spill_path(warehouse_path), ignore_errors=True)
