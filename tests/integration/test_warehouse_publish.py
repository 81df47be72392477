"""Preparing the next refresh's writer file: the snapshot a refresh replaced is patched into the
next writer file (only the blocks that differ are written) unless an analyst still has it open,
in this process or another; a crash at any step of publishing leaves a warehouse the next
refresh continues from, with nothing left behind.
"""

import hashlib
import os
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench.generate import generate
from email_platform import warehouse
from email_platform.warehouse import files, refreshing, state
from tests.support import as_loaded

TABLES = (*(source.raw_table for source in warehouse.SOURCES), "email_funnel", "email_funnel_daily")


def rows(path: Path, sql: str) -> list[tuple]:
    connection = warehouse.connect_read_only(path)
    try:
        return connection.execute(sql).fetchall()
    finally:
        connection.close()


def unseen_by_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a reader holds a file is asked before opening the writer file (``refreshing``) and
    before patching the replaced snapshot (``files``): make both answers "no one"."""
    for module in (refreshing, files):
        monkeypatch.setattr(module, "held_open", lambda path: False)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_equals_a_full_build(url: str, path: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.duckdb"
    warehouse.refresh(url, fresh, full=True)
    for table in TABLES:
        sql = as_loaded(table)
        assert rows(path, sql) == rows(fresh, sql), table


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}"))


class History:
    """An application database that gets new messages and late events on each ``grow``."""

    def __init__(self, tmp_path: Path) -> None:
        self.url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
        self.now = datetime.now(UTC).replace(microsecond=0)
        self.rounds = 0
        generate(self.url, messages=600, days=2, end=self.now - timedelta(hours=1), seed=1)

    def grow(self, messages: int = 100) -> None:
        self.rounds += 1
        generate(
            self.url,
            messages=messages,
            days=0.005,
            # Each round's rows are newer than the last refresh, as committed rows are.
            end=self.now + timedelta(minutes=20 * self.rounds),
            seed=50 + self.rounds,
            late_events_for_existing=30,
        )


@pytest.fixture
def history(tmp_path: Path) -> History:
    return History(tmp_path)


# A reader in another process: it opens the snapshot read-only, answers each line it reads on
# stdin with a digest of every table (as it sees them), and stays open until stdin closes.
READER = textwrap.dedent(
    """
    import hashlib, sys
    import duckdb

    path, tables = sys.argv[1], sys.argv[2:]
    connection = duckdb.connect(path, read_only=True)
    for _ in sys.stdin:
        digest = hashlib.sha256()
        for table in tables:
            rows = connection.execute(f"SELECT * FROM {table} ORDER BY ALL").fetchall()
            digest.update(repr(rows).encode())
        print(digest.hexdigest(), flush=True)
    """
)


class Reader:
    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", READER, str(path), *TABLES],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> str:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write("read\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def test_the_replaced_snapshot_is_patched_into_the_next_writer_file(history, tmp_path, monkeypatch):
    # Compacting after publishing changes the writer file on purpose (same data, fewer row
    # groups: test_analytics covers it); here deleted rows never add up to it.
    monkeypatch.setattr(state, "VACUUM_SHARE", 10.0)
    path = tmp_path / "warehouse.duckdb"
    first = warehouse.refresh(history.url, path)
    assert first.next_writer == "copied"  # nothing replaced yet
    for _ in range(3):
        history.grow()
        summary = warehouse.refresh(history.url, path)
        assert summary.next_writer == "patched"
        # The next refresh starts from exactly what analysts see now.
        assert digest(warehouse.writer_path(path)) == digest(path)
        assert leftovers(path) == []
    assert_equals_a_full_build(history.url, path, tmp_path)


@pytest.mark.parametrize(
    ("tail", "chunks_written"),
    [
        (0, [2]),  # same length: only the chunk with the changed byte
        (-1000, [2, 4, 5]),  # the stale file is shorter: the chunks it lacks are written too
        (1000, [2]),  # longer: cut at the source's end
        (warehouse.PATCH_CHUNK + 5, [2]),
    ],
)
def test_a_patch_writes_only_the_chunks_that_differ(tmp_path, monkeypatch, tail, chunks_written):
    chunk = warehouse.PATCH_CHUNK
    source = bytes(range(256)) * (chunk * 5 // 256) + b"end" * 100  # five chunks and a bit
    stale = bytearray(source[: len(source) + tail] if tail <= 0 else source + b"x" * tail)
    stale[chunk * 2 + 7] ^= 0xFF  # one byte in the third chunk
    (tmp_path / "source").write_bytes(source)
    (tmp_path / "stale").write_bytes(stale)
    writes = []
    pwrite = os.pwrite

    def counted(fd: int, data: memoryview, offset: int) -> int:
        writes.append(offset // chunk)
        return pwrite(fd, data, offset)

    monkeypatch.setattr(files.os, "pwrite", counted)
    files._patch_durably(tmp_path / "source", tmp_path / "target", tmp_path / "stale")
    assert (tmp_path / "target").read_bytes() == source
    assert writes == chunks_written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "target"]


def test_a_reader_in_another_process_keeps_its_snapshot_and_the_refresh_copies(history, tmp_path):
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    history.grow()
    warehouse.refresh(history.url, path)
    reader = Reader(path)
    try:
        before = reader.read()
        # The first refresh replaces the reader's file and must not patch it; the second
        # replaces a file nobody holds.
        for expected in ("copied", "patched"):
            history.grow()
            summary = warehouse.refresh(history.url, path)
            assert summary.total_loaded > 0 and summary.next_writer == expected
            assert reader.read() == before
    finally:
        reader.close()
    assert leftovers(path) == []
    assert_equals_a_full_build(history.url, path, tmp_path)


def test_a_reader_in_this_process_keeps_its_snapshot(history, tmp_path):
    """POSIX record locks never conflict within one process, so DuckDB's own lock would let a
    writer in: the refresh must see this process's reader too."""
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    reader = warehouse.connect_read_only(path)
    try:
        sql = "SELECT count(*), sum(hash(message_id, final_status)) FROM email_funnel"
        before = reader.execute(sql).fetchone()
        # The first refresh replaces the reader's file and must not patch it; the second
        # replaces a file nobody holds.
        for expected in ("copied", "patched"):
            history.grow()
            summary = warehouse.refresh(history.url, path)
            assert summary.next_writer == expected
            assert reader.execute(sql).fetchone() == before
    finally:
        reader.close()
    assert_equals_a_full_build(history.url, path, tmp_path)


def test_asking_whether_a_file_is_held_keeps_this_process_readers_locks(tmp_path):
    """Closing any descriptor of a file drops all of this process's POSIX locks on it: the check
    must not open one while a reader here holds the file, or another process could write
    under that reader."""
    path = tmp_path / "warehouse.duckdb"
    connection = files.connect(path, read_only=False)
    try:
        state.ensure_schema(connection)  # the tables the other process's reader reads
        for table in ("email_funnel", "email_funnel_daily"):
            connection.execute(f"CREATE TABLE {table} (message_id BIGINT)")
    finally:
        connection.close()
    assert not files.held_open(path)
    reader = warehouse.connect_read_only(path)
    try:
        assert files.held_open(path) and files.held_open(path)
        writer = subprocess.run(
            [sys.executable, "-c", "import duckdb, sys; duckdb.connect(sys.argv[1])", str(path)],
            capture_output=True,
            text=True,
        )
        assert writer.returncode != 0 and "lock" in writer.stderr.lower()
    finally:
        reader.close()
    assert not files.held_open(path)
    other = Reader(path)
    try:
        other.read()  # the other process has the file open
        assert files.held_open(path)
    finally:
        other.close()
    assert not files.held_open(path)


@pytest.mark.parametrize("cursor_in_a_transaction", [False, True])
def test_a_detached_writer_file_is_closed_before_it_is_published(tmp_path, cursor_in_a_transaction):
    """A refresh publishes its writer file after detaching it. DETACH leaves the file open while
    another cursor's transaction read it: the connection is then closed whole."""
    path = tmp_path / "warehouse.duckdb.writer"
    connection = files.connect(path, read_only=False)
    cursor = connection.cursor()
    try:
        connection.execute("CREATE TABLE t AS SELECT range AS i FROM range(1000)")
        files.configure_session(cursor)
        if cursor_in_a_transaction:
            cursor.execute("BEGIN TRANSACTION")
            assert cursor.execute("SELECT count(*) FROM t").fetchone() == (1000,)
        files.detach_writer(connection, path)
        assert not files.held_open(path)
    finally:
        cursor.close()
        connection.close()


def test_a_reader_that_locks_after_the_check_gets_a_copy_made_instead(
    history, tmp_path, monkeypatch
):
    """A reader that opened the old snapshot just before it was replaced may take its lock after
    the check: the patch's own lock fails, nothing is written, and the refresh copies."""
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    reader = Reader(path)
    try:
        before = reader.read()
        unseen_by_the_check(monkeypatch)  # the check missed it
        history.grow()
        summary = warehouse.refresh(history.url, path)
        assert summary.next_writer == "copied"
        assert reader.read() == before
    finally:
        reader.close()
    assert leftovers(path) == []


def test_a_writer_file_an_analyst_opened_is_replaced_by_a_copy(history, tmp_path, monkeypatch):
    """Analysts never open ``<warehouse>.writer``; if one does anyway, the refresh neither
    writes under them nor fails: it starts from a copy of the snapshot."""
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    for check_sees_it in (True, False):  # seen by the check, or only by DuckDB's lock
        if not check_sees_it:
            unseen_by_the_check(monkeypatch)
        reader = Reader(warehouse.writer_path(path))
        try:
            before = reader.read()
            history.grow()
            assert warehouse.refresh(history.url, path).total_loaded > 0
            assert reader.read() == before
        finally:
            reader.close()
    assert_equals_a_full_build(history.url, path, tmp_path)


# A refresh in a child process that is SIGKILLed at one step of publishing: nothing on the way
# out runs (no ``finally``, no cleanup), as when the machine or the run worker dies.
KILLED_REFRESH = textwrap.dedent(
    """
    import os, signal, sys
    from email_platform import warehouse
    from email_platform.warehouse import files, refreshing

    url, path, module, name, when = sys.argv[1:]
    target = {"files": files, "refreshing": refreshing, "os": os}[module]
    original = getattr(target, name)

    def dying(*args, **kwargs):
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(target, name, dying)
    warehouse.refresh(url, path)
    """
)

CRASH_POINTS = {
    # before the swap: the writer file holds the new build, the snapshot the old data
    "after the old snapshot got its second name": ("refreshing", "retire", "after"),
    # after the swap: no writer file, the old snapshot only under its second name
    "right after publishing": ("refreshing", "prepare_next_writer", "before"),
    # half-way through the patch: a half-patched file under a temporary name
    "during the patch": ("os", "pwrite", "after"),
    # patched and flushed, not yet renamed into place
    "before the patched file is renamed": ("files", "_write_differences", "after"),
}


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_a_crash_at_any_step_of_publishing_leaves_a_usable_warehouse(
    history, tmp_path, point, monkeypatch
):
    monkeypatch.setattr(state, "VACUUM_SHARE", 10.0)  # the last refresh leaves no compaction
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    history.grow()
    warehouse.refresh(history.url, path)
    history.grow()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_REFRESH, history.url, str(path), *CRASH_POINTS[point]],
        check=False,
    )
    assert killed.returncode == -9
    assert leftovers(path) != []  # the dead refresh left a file behind
    # Analysts can read whichever snapshot is in place.
    assert rows(path, "SELECT count(*) FROM email_funnel")[0][0] in (700, 800)
    history.grow()
    summary = warehouse.refresh(history.url, path)
    assert not summary.full_build
    assert summary.table_rows["email_funnel"] == 900
    assert leftovers(path) == []  # the dead refresh's files are gone
    assert digest(warehouse.writer_path(path)) == digest(path)
    assert_equals_a_full_build(history.url, path, tmp_path)


# A refresh in a child process that compacts after publishing and is SIGKILLed inside the
# compaction, right before its commit: every table has lost and regained its last row.
KILLED_COMPACTION = textwrap.dedent(
    """
    import os, signal, sys
    from email_platform import warehouse
    from email_platform.warehouse import refreshing, state

    url, path = sys.argv[1:]
    state.VACUUM_SHARE = 0.0
    connect = state.connect

    class Dying:
        def __init__(self, connection):
            self.connection = connection

        def execute(self, sql, *args):
            if sql == "COMMIT":
                os.kill(os.getpid(), signal.SIGKILL)
            return self.connection.execute(sql, *args)

        def close(self):
            self.connection.close()

    compact = refreshing.compact

    def dying_compact(file):
        state.connect = lambda *args, **kwargs: Dying(connect(*args, **kwargs))
        compact(file)

    refreshing.compact = dying_compact
    warehouse.refresh(url, path)
    """
)


def test_a_crash_while_compacting_after_publishing_loses_nothing(history, tmp_path):
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    history.grow()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_COMPACTION, history.url, str(path)], check=False
    )
    assert killed.returncode == -9  # it got as far as compacting
    # The new snapshot was published before compacting began.
    assert rows(path, "SELECT count(*) FROM email_funnel")[0][0] == 700
    # The writer file is as the patch left it: the snapshot, uncompacted.
    assert digest(warehouse.writer_path(path)) == digest(path)
    history.grow()
    summary = warehouse.refresh(history.url, path)
    assert summary.table_rows["email_funnel"] == 800 and not summary.full_build
    assert summary.compacted  # the deleted rows still add up, so this refresh compacts them
    assert_equals_a_full_build(history.url, path, tmp_path)


def test_funnel_totals_from_the_daily_table_equal_counts_over_every_funnel_row(history, tmp_path):
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(history.url, path)
    history.grow()
    summary = warehouse.refresh(history.url, path)
    direct = rows(
        path,
        "SELECT count(*), count(accepted_at), count(delivered_at), count(first_open_at), "
        "count(first_machine_open_at), count(first_click_at), count(bounced_at), "
        "count(complained_at), count(unsubscribed_at), "
        "count(*) FILTER (WHERE final_status = 'dead') FROM email_funnel",
    )[0]
    names = (
        "messages", "accepted", "delivered", "human_opened", "machine_opened", "clicked",
        "bounced", "complained", "unsubscribed", "dead",
    )  # fmt: skip
    assert tuple(summary.funnel[name] for name in names) == direct
    assert summary.funnel["messages"] == 700 and summary.funnel["dead"] > 0
    # No rates here: template_rates' over a stated window are the only ones in the UI.
    assert not any(name.endswith("_rate") for name in summary.funnel)


def test_template_rates_equal_counts_over_the_funnel_rows_of_their_window(tmp_path):
    """Three weeks of generated mail: per template and overall, over the last 7 days, every
    day and a subset of events, the rates are the funnel rows' counts over counts."""
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    generate(url, messages=3_000, days=21, end=datetime.now(UTC), seed=3)
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(url, path)
    events = [r[0] for r in rows(path, "SELECT event_id FROM email_funnel USING SAMPLE 300 ROWS")]

    def ratio(numerator: int, denominator: int) -> float | None:
        return numerator / denominator if denominator else None

    def direct(where: str, params: list) -> dict[str | None, tuple]:
        connection = warehouse.connect_read_only(path)
        try:
            counted = connection.execute(
                "SELECT template, count(*), count(accepted_at), count(delivered_at), "
                "count(first_open_at), count(first_machine_open_at), count(bounced_at), "
                f"count(complained_at) FROM email_funnel WHERE {where} "
                "GROUP BY ROLLUP (template)",
                params,
            ).fetchall()
        finally:
            connection.close()
        return {
            template: (messages, ratio(opened, delivered), ratio(machine, delivered),
                       ratio(bounced, accepted), ratio(complained, delivered))
            for template, messages, accepted, delivered, opened, machine, bounced, complained
            in counted
        }  # fmt: skip

    def of(rates: warehouse.FunnelRates) -> dict[str | None, tuple]:
        return {
            row["template"]: (row["messages"], row["open_rate"], row["machine_open_rate"],
                              row["bounce_rate"], row["complaint_rate"])
            for row in (rates.overall, *rates.templates)
        }  # fmt: skip

    week = warehouse.template_rates(path)
    assert of(week) == direct("day > (SELECT max(day) FROM email_funnel) - 7", [])
    assert 0 < week.overall["messages"] < 3_000 and len(week.templates) >= 3
    assert week.overall["open_rate"] > 0
    assert of(warehouse.template_rates(path, days=None)) == direct("true", [])
    subset = warehouse.template_rates(path, days=None, event_ids=events)
    assert of(subset) == direct("event_id IN (SELECT unnest(?::VARCHAR[]))", [events])


def test_funnel_totals_of_an_empty_warehouse(tmp_path):
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    generate(url, messages=0, days=1, end=datetime.now(UTC))
    totals = warehouse.refresh(url, tmp_path / "warehouse.duckdb").funnel
    assert totals["messages"] == 0 and totals["dead"] == 0
    assert totals["event_to_accepted_p50_s"] is None
    rates = warehouse.template_rates(tmp_path / "warehouse.duckdb")
    assert (rates.overall["messages"], rates.overall["open_rate"], rates.templates) == (0, None, [])
    assert rates.metadata_entries() == {} and rates.window == "no messages yet"


def row_groups(path: Path, table: str) -> int:
    sql = f"SELECT count(DISTINCT row_group_id) FROM pragma_storage_info('{table}')"
    return rows(path, sql)[0][0]


def test_the_history_stays_in_large_row_groups_and_refreshes_append_small_ones(
    history, tmp_path, monkeypatch
):
    """A checkpoint rewrites the list of every row group of each table it writes: a full build
    and a compaction keep the history in DuckDB's large row groups, so that list does not grow
    with the history, and only refreshes append small ones (the last one is what the next
    checkpoint rewrites). Small here means 2,048 rows: the 600 messages' ~2,500 provider
    events would fill two."""
    monkeypatch.setattr(files, "ROW_GROUP_ROWS", 2048)
    monkeypatch.setattr(state, "VACUUM_SHARE", 10.0)  # compacted below, when the test says
    path = tmp_path / "warehouse.duckdb"
    events = "raw_email_events"
    built = warehouse.refresh(history.url, path)
    assert built.full_build and built.table_rows[events] > 2048
    assert row_groups(path, events) == 1
    for _ in range(4):
        history.grow()
        summary = warehouse.refresh(history.url, path)
        assert not summary.full_build and summary.rows_loaded["email_events"] > 0
    # Each refresh appended its own small row group.
    assert row_groups(path, events) == 5
    state.compact(warehouse.writer_path(path))
    # The refreshes' small row groups merged into one large one beside the history's.
    assert row_groups(warehouse.writer_path(path), events) == 2
    # A warehouse started afresh (no file yet) is a full build: large row groups too.
    fresh = tmp_path / "fresh.duckdb"
    warehouse.refresh(history.url, fresh)
    assert row_groups(fresh, events) == 1
    assert_equals_a_full_build(history.url, path, tmp_path)


def test_a_compaction_writes_what_it_rewrites_with_fsst(tmp_path):
    """A refresh writes strings without FSST (off the path to visibility it costs nothing to
    use it): the row groups a compaction rewrites get it back, so compacting does not grow
    the file it is to shrink."""
    path = tmp_path / "warehouse.duckdb"
    connection = files.connect(path, read_only=False)
    try:
        state.ensure_schema(connection)
        for table in ("email_funnel", "email_funnel_daily"):
            connection.execute(f"CREATE TABLE {table} (message_id BIGINT)")
        # Unique URLs sharing a prefix: FSST's case, and no dictionary's.
        connection.execute(
            "INSERT INTO raw_email_events (email_event_id, click_url) SELECT i, "
            "'https://shop.example.com/orders/track?order=' || i || '&utm_source=email' "
            "FROM range(60000) AS r(i)"
        )
        connection.execute("DELETE FROM raw_email_events WHERE email_event_id % 3 = 0")
    finally:
        connection.close()

    def fsst_segments() -> int:
        sql = (
            "SELECT count(*) FROM pragma_storage_info('raw_email_events') "
            "WHERE column_name = 'click_url' AND compression = 'FSST'"
        )
        return rows(path, sql)[0][0]

    assert fsst_segments() == 0
    state.compact(path)
    assert fsst_segments() > 0
    assert rows(path, "SELECT count(*) FROM raw_email_events")[0][0] == 40000
