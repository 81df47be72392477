"""A refresh's work follows the new rows, not the history (counted, never timed), and the
warehouse it keeps answers the analysts' questions as a build from scratch does, including a
full build made in many slices. Both backends."""

from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pytest
from sqlalchemy import Engine, create_engine

from bench.generate import generate
from email_platform import warehouse
from email_platform.warehouse import build
from email_platform.warehouse.report import question_names, question_sql
from tests.support import fresh_pg_database

NOW = datetime.now(UTC).replace(microsecond=0)
# The same recent history in both warehouses: two days of 400 messages, same seed, same end.
RECENT = {"messages": 400, "days": 2, "seed": 7}


def _increment(engine: Engine) -> None:
    """100 new messages and 30 late opens for messages of the last day: the same rows in both
    histories (the same seed picks the same recent messages, offset by the older history)."""
    generate(
        engine,
        messages=100,
        days=0.005,
        end=NOW + timedelta(minutes=10),
        seed=11,
        late_events_for_existing=30,
        late_recency_days=0.2,
    )


def _work(summary: warehouse.RefreshSummary) -> dict:
    """Everything a refresh counts about its work."""
    return {
        "rows_read": summary.rows_read,
        "rows_loaded": summary.rows_loaded,
        "messages_rebuilt": summary.messages_rebuilt,
        "messages_folded": summary.messages_folded,
        "days_rebuilt": summary.days_rebuilt,
        "daily_rows_changed": summary.daily_rows_changed,
        "daily_rows_kept": summary.daily_rows_kept,
        "daily_rows_read": summary.daily_rows_read,
    }


def _history(url: str, older_messages: int, path: Path) -> tuple[Engine, int]:
    engine = create_engine(url)
    if older_messages:
        generate(engine, messages=older_messages, days=6, end=NOW - timedelta(days=2), seed=1)
    generate(engine, end=NOW, **RECENT)
    full = warehouse.refresh(engine, path)
    assert full.full_build
    return engine, full.table_rows["email_funnel"]


@contextmanager
def _second_database(database_url: str, request: pytest.FixtureRequest, tmp_path: Path):
    """Another empty database on the same backend (generate() migrates it)."""
    if database_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path / 'long.sqlite3'}"
        return
    admin = request.getfixturevalue("postgres_admin_url")
    template = request.getfixturevalue("postgres_template")
    with fresh_pg_database(admin, "ep_test", template) as url:
        yield url.render_as_string(hide_password=False)


def test_the_same_new_rows_cost_the_same_work_on_a_history_four_times_longer(
    database_url, request, tmp_path
):
    """Two histories, two days and eight days long, end in the same two days; the same new
    messages and late opens cost both refreshes the same rows read, loaded and rebuilt."""
    short_path, long_path = tmp_path / "short.duckdb", tmp_path / "long.duckdb"
    with _second_database(database_url, request, tmp_path) as long_url:
        short, short_rows = _history(database_url, 0, short_path)
        long, long_rows = _history(long_url, 1200, long_path)
        try:
            assert long_rows == short_rows + 1200
            _increment(short)
            _increment(long)
            on_short = warehouse.refresh(short, short_path)
            on_long = warehouse.refresh(long, long_path)
        finally:
            short.dispose()
            long.dispose()
    assert not on_short.full_build and not on_long.full_build
    work = _work(on_short)
    assert _work(on_long) == work
    # The new messages and the old ones their late opens touched, not the history.
    assert 100 < work["messages_rebuilt"] <= 130
    # The old ones only got late opens: folded from their old rows, not read from raw rows.
    assert work["messages_rebuilt"] - work["messages_folded"] == 100
    assert work["rows_loaded"]["email_messages"] >= 100
    # The daily rows of the days touched, re-aggregated from those days' funnel rows alone:
    # at most the last two days' (the same in both histories), never the older six.
    assert work["daily_rows_changed"] > 0
    assert 0 < work["daily_rows_read"] <= short_rows + 100


def _answers(path: Path) -> dict[str, list[tuple]]:
    connection = duckdb.connect(str(path), read_only=True)
    try:
        return {
            name: connection.execute(question_sql(name)).fetchall() for name in question_names()
        }
    finally:
        connection.close()


def test_questions_answer_after_incremental_refreshes_as_after_a_full_build_in_slices(
    engine, tmp_path, monkeypatch
):
    """Three incremental refreshes (new messages, late opens, raised statuses), then the same
    data built from scratch in slices of 128 messages: every question, every table equal."""
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=600, days=3, end=NOW - timedelta(hours=1))
    warehouse.refresh(engine, path)
    for round_ in range(3):
        generate(
            engine,
            messages=150,
            days=0.005,
            end=NOW + timedelta(minutes=20 * round_),
            seed=50 + round_,
            late_events_for_existing=60,
            late_recency_days=1.0,
        )
        summary = warehouse.refresh(engine, path)
        assert not summary.full_build and summary.daily_rows_changed > 0
    monkeypatch.setattr(build, "SLICE_MESSAGES", 128)
    fresh = tmp_path / "fresh.duckdb"
    full = warehouse.refresh(engine, fresh, full=True)
    assert full.slices == -(-1050 // 128)  # 1,050 messages, 128 a slice
    incremental, built = _answers(path), _answers(fresh)
    assert all(incremental.values()) and incremental == built
    connection = duckdb.connect(str(path), read_only=True)
    connection.execute(f"ATTACH '{fresh}' AS fresh (READ_ONLY)")
    try:
        for table in ("email_funnel", "email_funnel_daily"):
            differing = connection.execute(
                f"SELECT count(*) FROM ((FROM {table} EXCEPT ALL FROM fresh.{table}) "
                f"UNION ALL (FROM fresh.{table} EXCEPT ALL FROM {table}))"
            ).fetchone()[0]
            assert differing == 0, table
    finally:
        connection.close()
