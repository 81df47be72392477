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
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import Engine

from email_platform import tracing
from email_platform.db.engine import make_engine
from email_platform.db.schema import email_events
from email_platform.warehouse.build import (
    AFFECTED,
    FUNNEL,
    FUNNEL_DAILY,
    _build_models,
    _models_fingerprint,
)
from email_platform.warehouse.files import (
    _connect,
    _connect_writer,
    _copy_durably,
    _held_open,
    _prepare_next_writer,
    _remove_leftovers,
    _retire,
    writer_lock,
    writer_path,
)
from email_platform.warehouse.load import STAGE, _stage_all, _write_source
from email_platform.warehouse.report import funnel_totals
from email_platform.warehouse.scanners import attach, detach
from email_platform.warehouse.sources import DELETIONS, SOURCES
from email_platform.warehouse.state import (
    UNVACUUMED_STATE,
    _compact,
    _ensure_schema,
    _load_state,
    _needs_compacting,
    _save_state,
    _state_value,
    _vacuum_policy,
)

DEFAULT_LOOKBACK_S = 120


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
        # One span per refresh, linked to no event: a refresh loads thousands of traces' rows,
        # and those rows carry their trace_id (stg_events, email_funnel) to join on instead.
        with (
            tracing.start_span(
                "email_platform.warehouse.refresh", attributes={"warehouse.full": full}
            ) as span,
            writer_lock(warehouse_path),
        ):
            summary = _refresh_locked(
                engine, Path(warehouse_path), full=full, lookback_s=lookback_s, publish=publish
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
