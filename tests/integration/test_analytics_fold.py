"""Funnel rows folded from their old row and only the loaded rows (``warehouse.fold``) are the
rows a build from scratch gives: late provider events of every kind, in any order, over several
refreshes; a message turned into a test send; a message row naming another event; an edited
model. Both backends."""

import random

import pytest
from sqlalchemy import update

from email_platform import warehouse
from email_platform.db.schema import email_messages
from email_platform.warehouse import build, fold
from tests.integration.test_analytics import (
    MESSAGES,
    _assert_equals_a_full_build,
    at,
    naive,
    rows,
    write_fixture,
    write_provider_events,
)


@pytest.fixture
def fixture_warehouse(engine, tmp_path):  # type: ignore[no-untyped-def]
    write_fixture(engine)
    path = tmp_path / "warehouse.duckdb"
    assert warehouse.refresh(engine, path).full_build
    return path


def _touch_message(engine, message_id: int, seconds: float, **values) -> None:  # type: ignore[no-untyped-def]
    """A new version of a message row, as the application writes one (its marker moves)."""
    stamp = at if engine.dialect.name == "postgresql" else naive
    with engine.begin() as connection:
        connection.execute(
            update(email_messages)
            .where(email_messages.c.message_id == message_id)
            .values(updated_at=stamp(seconds), **values)
        )


def test_the_fold_mirrors_the_funnel_models_as_they_are(fixture_warehouse):
    """The fold's rules were checked against these models: an edit to
    analytics/email_funnel.sql or email_funnel_daily.sql turns folding off (every row rebuilt,
    every daily row re-aggregated) until its rules are checked again and FOLDED_MODELS updated.
    Every funnel column has exactly one rule."""
    funnel, daily = build.model_sql(build.FUNNEL), build.model_sql(build.FUNNEL_DAILY)
    assert fold.mirrors(funnel, daily), (
        "analytics/email_funnel.sql or email_funnel_daily.sql changed: check "
        "warehouse/fold.py's rules against them, then set FOLDED_MODELS to "
        f"{fold.models_digest(funnel, daily)!r}"
    )
    columns = [r["column_name"] for r in rows(fixture_warehouse, "DESCRIBE email_funnel")]
    assert sorted(fold.COLUMNS) == sorted(columns)
    assert len(set(fold.COLUMNS)) == len(fold.COLUMNS)


KINDS = [
    ("delivered", {}),
    ("opened", {}),
    ("opened", {"machine_open": True}),
    ("clicked", {"click_url": "https://app.example.com/x"}),
    ("bounced", {"bounce_type": "soft"}),
    ("bounced", {"bounce_type": "hard"}),
    ("complained", {}),
    ("unsubscribed", {}),
]


def test_late_events_of_every_kind_fold_into_the_rows_a_full_build_gives(
    engine, fixture_warehouse, tmp_path
):
    """Four refreshes of random late provider events (every kind, times before and after the
    loaded ones, duplicates), some with a new version of their message row: each refresh folds
    the messages it reaches, and the funnel and daily tables equal a build from scratch."""
    chance = random.Random(42)
    received = 20_000
    for round_ in range(4):
        reached = set()
        late = []
        for index in range(12):
            message = chance.choice(MESSAGES)[0]
            kind, extra = chance.choice(KINDS)
            received += 1
            occurred = chance.uniform(0, 12_000)
            late.append((f"late{round_}_{index}", message, kind, occurred, received, extra))
            reached.add(message)
        write_provider_events(engine, late)
        raised = sorted(reached)[: round_ % 3]
        for message in raised:
            _touch_message(engine, message, received + 1, delivery_status=f"status{round_}")
        summary = warehouse.refresh(engine, fixture_warehouse)
        assert not summary.full_build
        assert summary.messages_rebuilt == summary.messages_folded == len(reached)
        # The fixture's one day: its percentiles of event_to_accepted_s are kept.
        assert summary.daily_rows_kept == summary.daily_rows_changed > 0
        _assert_equals_a_full_build(engine, fixture_warehouse, tmp_path)


def test_a_folded_row_with_a_new_accepted_at_re_aggregates_its_day(
    engine, fixture_warehouse, tmp_path
):
    """A message row whose sent_at moved, with a late open for another message: both rows are
    folded, but the day's event_to_accepted percentiles moved, so its daily rows are
    re-aggregated whole, as a build from scratch gives them."""
    stamp = at if engine.dialect.name == "postgresql" else naive
    _touch_message(engine, 2, 9_000, sent_at=stamp(70))
    write_provider_events(engine, [("lateopen", 1, "opened", 8_000, 9_001, {})])
    summary = warehouse.refresh(engine, fixture_warehouse)
    assert (summary.messages_rebuilt, summary.messages_folded) == (2, 2)
    assert summary.daily_rows_kept == 0 and summary.daily_rows_changed > 0
    got = rows(
        fixture_warehouse, "SELECT event_to_accepted_s FROM email_funnel WHERE message_id = 2"
    )
    assert got == [{"event_to_accepted_s": 10.0}]
    _assert_equals_a_full_build(engine, fixture_warehouse, tmp_path)


def test_a_message_turned_into_a_test_send_leaves_the_funnel(engine, fixture_warehouse, tmp_path):
    """A message row now marked a test send, with a late click: its funnel row goes, as a
    build from scratch leaves test sends out."""
    _touch_message(engine, 4, 9_000, is_test=True)
    write_provider_events(engine, [("lateclick", 4, "clicked", 8_000, 9_001, {})])
    summary = warehouse.refresh(engine, fixture_warehouse)
    assert summary.messages_folded == 1
    assert rows(fixture_warehouse, "SELECT count(*) AS n FROM email_funnel WHERE message_id = 4")[
        0
    ] == {"n": 0}
    _assert_equals_a_full_build(engine, fixture_warehouse, tmp_path)


def test_a_message_row_naming_another_event_is_rebuilt_not_folded(
    engine, fixture_warehouse, tmp_path
):
    """The old row's event columns are another event's: the message is rebuilt from its raw
    rows, not folded."""
    _touch_message(engine, 4, 9_000, event_id="E2")
    write_provider_events(engine, [("lateopen", 4, "opened", 8_000, 9_001, {})])
    summary = warehouse.refresh(engine, fixture_warehouse)
    assert (summary.messages_rebuilt, summary.messages_folded) == (1, 0)
    got = rows(fixture_warehouse, "SELECT event_type FROM email_funnel WHERE message_id = 4")
    assert got == [{"event_type": "order.paid"}]
    fresh = tmp_path / "fresh.duckdb"
    warehouse.refresh(engine, fresh, full=True)
    for table in ("email_funnel", "email_funnel_daily"):
        sql = f"SELECT * FROM {table} ORDER BY ALL"
        assert rows(fixture_warehouse, sql) == rows(fresh, sql), table


def test_an_edited_model_is_rebuilt_not_folded(engine, fixture_warehouse, tmp_path, monkeypatch):
    """A model the fold's rules were not checked against (its digest differs) rebuilds every
    touched row from its raw rows."""
    monkeypatch.setattr(fold, "FOLDED_MODELS", "edited models")
    write_provider_events(engine, [("lateopen", 2, "opened", 8_000, 9_001, {})])
    summary = warehouse.refresh(engine, fixture_warehouse)
    assert (summary.messages_rebuilt, summary.messages_folded) == (1, 0)
    _assert_equals_a_full_build(engine, fixture_warehouse, tmp_path)
