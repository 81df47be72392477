"""The funnel is built right: every column of a hand-checked set of messages, incremental loads
that never load twice and equal a full rebuild, checks that go red, and the assets' wiring.

The fixture is written straight into the operational tables on both backends: duplicates,
out-of-order provider events, a machine open, a bounce after delivery, a dead letter, a message
that was never sent and a provider event that matches no message.
"""

import json
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import duckdb
import pytest
from dagster import (
    AssetCheckSeverity,
    AssetKey,
    MarkdownMetadataValue,
    TimestampMetadataValue,
    build_sensor_context,
    materialize,
)
from sqlalchemy import Engine, func, insert, select, update

from email_platform import warehouse
from email_platform.assets import analytics_assets, analytics_checks, analytics_warehouse
from email_platform.assets.analytics import FULL_TAG
from email_platform.db.schema import (
    dead_letters,
    email_attempts,
    email_event_deletions,
    email_events,
    email_messages,
    email_outbox,
)
from email_platform.resources import AppDatabase, Warehouse
from email_platform.sensors.analytics import RECONCILE_S, analytics_refresh_sensor
from email_platform.warehouse import load, refreshing, state
from tests.support import as_loaded

T0 = datetime(2026, 3, 2, 10, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def naive(seconds: float) -> datetime:
    return at(seconds).replace(tzinfo=None)


EVENTS = [
    # event_id, type, version, lane, occurred, published
    ("E1", "user.signed_up", 2, "transactional", 0, 1),
    ("E2", "order.paid", 1, "transactional", 60, 61),
    ("E3", "user.password_reset_requested", 1, "critical", 120, 120.5),
    ("E4", "digest.ready", 1, "bulk", 3598, 3599),
    ("E5", "user.signed_up", 2, "transactional", 7190, 7191),
]
MESSAGES = [
    # id, event, template, version, lane, domain, status, attempts, provider, created, sent_at
    (1, "E1", "welcome", 2, "transactional", "example.com", "sent", 2, "sandbox", 2, 10),
    (2, "E2", "receipt", 1, "transactional", "gmail.com", "sent", 1, "sandbox", 62, 63),
    (3, "E3", "password_reset", 1, "critical", "example.com", "dead", 1, "sandbox", 121, None),
    (4, "E4", "weekly_digest", 1, "bulk", "yahoo.com", "sent", 1, "sandbox", 3600, 3605),
    (5, "E5", "welcome", 2, "transactional", "example.org", "suppressed", 0, None, 7200, None),
]
ATTEMPTS = [
    # id, message, started, finished, outcome, http
    (1, 1, 5, 6, "transient", 503),
    (2, 1, 9, 10, "accepted", 200),
    (3, 2, 62.5, 63, "accepted", 200),
    (4, 3, 122, 123, "permanent", 422),
    (5, 4, 3601, 3605, "accepted", 200),
]
PROVIDER_EVENTS = [
    # provider event id, message, type, occurred, received, extra
    ("p1", 1, "delivered", 20, 21, {}),
    ("p2", 1, "delivered", 25, 26, {}),  # the provider said it twice
    ("p3", 1, "opened", 30, 31, {"machine_open": True}),  # Apple's proxy, not a reader
    ("p4", 1, "opened", 100, 101, {"machine_open": False}),
    ("p5", 1, "opened", 50, 400, {"machine_open": False}),  # earlier open, arrives late
    ("p6", 1, "clicked", 200, 201, {"click_url": "https://app.example.com/a"}),
    ("p7", 1, "clicked", 150, 450, {"click_url": "https://app.example.com/b"}),
    ("p8", 2, "delivered", 70, 71, {}),
    ("p9", 2, "bounced", 300, 301, {"bounce_type": "hard"}),  # bounce after delivery
    ("p10", 4, "complained", 4200, 4201, {}),  # arrives before the delivered event
    ("p11", 4, "delivered", 3610, 4300, {}),
    ("p12", 4, "opened", 4000, 4301, {"machine_open": False}),
    ("p13", 4, "unsubscribed", 4100, 4302, {}),
    ("p14", None, "opened", 500, 501, {"machine_open": False}),  # matches no message
]


def write_fixture(engine: Engine, provider_events: list = PROVIDER_EVENTS) -> None:
    aware = engine.dialect.name == "postgresql"
    ts = at if aware else naive

    def when(seconds: float | None) -> datetime | None:
        return None if seconds is None else ts(seconds)

    with engine.begin() as connection:
        connection.execute(
            insert(email_outbox),
            [
                {
                    "event_id": event_id,
                    "event_type": kind,
                    "event_version": version,
                    "aggregate_id": f"agg_{event_id}",
                    "occurred_at": when(occurred),
                    "published_at": when(published),
                    "payload": {},
                    "event_metadata": {},
                    "lane": lane,
                    "available_at": when(published),
                    "status": "dead" if event_id == "E3" else "done",
                    "resolution": "dead" if event_id == "E3" else "sent",
                    "done_at": when(published + 30),
                }
                for event_id, kind, version, lane, occurred, published in EVENTS
            ],
        )
        connection.execute(
            insert(email_messages),
            [
                {
                    "message_id": mid,
                    "event_id": event_id,
                    "route": template,
                    "template": template,
                    "template_version": version,
                    "lane": lane,
                    "recipient": f"someone@{domain}",
                    "recipient_domain": domain,
                    "idempotency_key": f"{event_id}:{template}",
                    "status": status,
                    "attempts": attempts,
                    "provider": provider,
                    "provider_message_id": f"sbx_{mid}" if sent_at else None,
                    "created_at": when(created),
                    "updated_at": when(sent_at or created + 5),
                    "sent_at": when(sent_at),
                    # The welcome of E1 went out in Portuguese (the locale after fallback).
                    "locale": "pt-BR" if mid == 1 else None,
                }
                for (
                    mid,
                    event_id,
                    template,
                    version,
                    lane,
                    domain,
                    status,
                    attempts,
                    provider,
                    created,
                    sent_at,
                ) in MESSAGES
            ],
        )
        event_of = {m[0]: m[1] for m in MESSAGES}
        connection.execute(
            insert(email_attempts),
            [
                {
                    "attempt_id": aid,
                    "message_id": mid,
                    "event_id": event_of[mid],
                    "run_id": "run-1",
                    "attempt_no": 1 if aid in (1, 3, 4, 5) else 2,
                    "started_at": when(started),
                    "finished_at": when(finished),
                    "outcome": outcome,
                    "http_status": http,
                }
                for aid, mid, started, finished, outcome, http in ATTEMPTS
            ],
        )
        connection.execute(
            insert(dead_letters).values(
                dead_letter_id=1,
                event_id="E3",
                message_id=3,
                lane="critical",
                reason="provider_rejected",
                attempts=1,
                run_id="run-1",
                status="open",
                created_at=when(124),
            )
        )
    write_provider_events(engine, provider_events)


def write_provider_events(engine: Engine, provider_events: list) -> None:
    aware = engine.dialect.name == "postgresql"
    stamp = at if aware else naive
    event_of = {m[0]: m[1] for m in MESSAGES}
    with engine.begin() as connection:
        connection.execute(
            insert(email_events),
            [
                {
                    "provider": "sandbox",
                    "provider_event_id": pid,
                    "event_type": kind,
                    "occurred_at": stamp(occurred),
                    "received_at": stamp(received),
                    "event_id": event_of.get(mid),
                    "message_id": mid,
                    "provider_message_id": f"sbx_{mid}",
                    "recipient": "someone@example.com",
                    "recipient_domain": "example.com",
                    "bounce_type": extra.get("bounce_type"),
                    "click_url": extra.get("click_url"),
                    "machine_open": extra.get("machine_open"),
                }
                for pid, mid, kind, occurred, received, extra in provider_events
            ],
        )


def ts(seconds: float | None) -> datetime | None:
    return None if seconds is None else naive(seconds)


def funnel_row(**overrides) -> dict:  # type: ignore[no-untyped-def]
    row = dict.fromkeys(FUNNEL_COLUMNS)
    row.update(open_count=0, machine_open_count=0, click_count=0, day=date(2026, 3, 2))
    row.update(overrides)
    return row


FUNNEL_COLUMNS = [
    "message_id", "event_id", "event_type", "event_version", "route", "template",
    "template_version", "lane", "provider", "recipient_domain", "day", "event_occurred_at",
    "published_at", "created_at", "first_attempt_at", "accepted_at", "delivered_at",
    "first_open_at", "first_click_at", "bounced_at", "bounce_type", "complained_at",
    "unsubscribed_at", "first_machine_open_at", "dead_lettered_at", "final_status",
    "delivery_status", "attempts", "open_count", "machine_open_count", "click_count",
    "dead_letter_reason", "dead_letter_status", "trace_id", "correlation_id", "producer",
    "locale", "publish_delay_s", "queue_delay_s",
    "send_duration_s", "event_to_accepted_s", "delivery_delay_s", "time_to_open_s",
    "time_to_click_s", "time_to_bounce_s",
]  # fmt: skip

EXPECTED_FUNNEL = [
    funnel_row(
        message_id=1, event_id="E1", event_type="user.signed_up", event_version=2,
        route="welcome", template="welcome", template_version=2, lane="transactional",
        provider="sandbox", recipient_domain="example.com",
        event_occurred_at=ts(0), published_at=ts(1), created_at=ts(2), first_attempt_at=ts(5),
        accepted_at=ts(10), delivered_at=ts(20), first_open_at=ts(50), first_click_at=ts(150),
        first_machine_open_at=ts(30), final_status="sent", attempts=2,
        open_count=2, machine_open_count=1, click_count=2, locale="pt-BR",
        publish_delay_s=1.0, queue_delay_s=4.0, send_duration_s=5.0, event_to_accepted_s=10.0,
        delivery_delay_s=10.0, time_to_open_s=40.0, time_to_click_s=140.0,
    ),
    funnel_row(
        message_id=2, event_id="E2", event_type="order.paid", event_version=1,
        route="receipt", template="receipt", template_version=1, lane="transactional",
        provider="sandbox", recipient_domain="gmail.com",
        event_occurred_at=ts(60), published_at=ts(61), created_at=ts(62),
        first_attempt_at=ts(62.5), accepted_at=ts(63), delivered_at=ts(70), bounced_at=ts(300),
        bounce_type="hard", final_status="sent", attempts=1,
        publish_delay_s=1.0, queue_delay_s=1.5, send_duration_s=0.5, event_to_accepted_s=3.0,
        delivery_delay_s=7.0, time_to_bounce_s=237.0,
    ),
    funnel_row(
        message_id=3, event_id="E3", event_type="user.password_reset_requested",
        event_version=1, route="password_reset", template="password_reset", template_version=1,
        lane="critical", provider="sandbox", recipient_domain="example.com",
        event_occurred_at=ts(120), published_at=ts(120.5), created_at=ts(121),
        first_attempt_at=ts(122), dead_lettered_at=ts(124), final_status="dead", attempts=1,
        dead_letter_reason="provider_rejected", dead_letter_status="open",
        publish_delay_s=0.5, queue_delay_s=1.5,
    ),
    funnel_row(
        message_id=4, event_id="E4", event_type="digest.ready", event_version=1,
        route="weekly_digest", template="weekly_digest", template_version=1, lane="bulk",
        provider="sandbox", recipient_domain="yahoo.com",
        event_occurred_at=ts(3598), published_at=ts(3599), created_at=ts(3600),
        first_attempt_at=ts(3601), accepted_at=ts(3605), delivered_at=ts(3610),
        first_open_at=ts(4000), complained_at=ts(4200), unsubscribed_at=ts(4100),
        final_status="sent", attempts=1, open_count=1,
        publish_delay_s=1.0, queue_delay_s=2.0, send_duration_s=4.0, event_to_accepted_s=7.0,
        delivery_delay_s=5.0, time_to_open_s=395.0,
    ),
    funnel_row(
        message_id=5, event_id="E5", event_type="user.signed_up", event_version=2,
        route="welcome", template="welcome", template_version=2, lane="transactional",
        provider=None, recipient_domain="example.org",
        event_occurred_at=ts(7190), published_at=ts(7191), created_at=ts(7200),
        final_status="suppressed", attempts=0, publish_delay_s=1.0,
    ),
]  # fmt: skip

DAILY_KEYS = ["day", "template", "lane", "provider"]


def rows(path, sql: str) -> list[dict]:  # type: ignore[no-untyped-def]
    connection = warehouse.connect_read_only(path)
    try:
        cursor = connection.execute(sql)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]
    finally:
        connection.close()


@pytest.fixture
def loaded(engine, tmp_path):  # type: ignore[no-untyped-def]
    write_fixture(engine)
    path = tmp_path / "warehouse.duckdb"
    summary = warehouse.refresh(engine, path)
    return engine, path, summary


def test_funnel_matches_the_hand_checked_rows_column_by_column(loaded):
    _, path, summary = loaded
    got = rows(path, "SELECT * FROM email_funnel ORDER BY message_id")
    assert list(got[0]) == FUNNEL_COLUMNS
    for expected, actual in zip(EXPECTED_FUNNEL, got, strict=True):
        for column in FUNNEL_COLUMNS:
            assert actual[column] == expected[column], (expected["message_id"], column)
    assert summary.rows_loaded == {
        "email_outbox": 5,
        "email_messages": 5,
        "email_attempts": 5,
        "dead_letters": 1,
        "email_events": 14,
    }
    # Nothing identifying a person reaches the warehouse.
    columns = rows(path, "SELECT column_name FROM information_schema.columns")
    assert not {"recipient", "payload", "raw", "user_agent"} & {c["column_name"] for c in columns}


def test_provider_events_arriving_later_update_the_hand_checked_rows(engine, tmp_path):
    """The fixture's provider events in two refreshes: a first delivery, opens and a hard
    bounce load with the messages; the rest arrive later: an earlier duplicate delivery, an
    open that happened before the loaded one, clicks, a soft bounce after the hard one, a
    complaint before its message's delivered event, an orphan. The incremental rebuild of the
    messages they reach keeps each step's earliest time, adds the counts up and lets the hard
    bounce win: every column matches the hand-checked rows, the daily table a full build."""
    first = {"p1", "p3", "p4", "p8", "p9"}
    write_fixture(engine, provider_events=[e for e in PROVIDER_EVENTS if e[0] in first])
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(engine, path)
    later = [e for e in PROVIDER_EVENTS if e[0] not in first]
    later.append(("p15", 2, "bounced", 320, 0, {"bounce_type": "soft"}))
    # Received after the first refresh (when they occurred is what the funnel shows).
    later = [
        (pid, m, kind, occurred, 1_000 + i, x)
        for i, (pid, m, kind, occurred, _, x) in enumerate(later)
    ]
    write_provider_events(engine, later)
    summary = warehouse.refresh(engine, path)
    assert not summary.full_build and summary.rows_loaded["email_events"] == len(later)
    # Messages 1 and 2 had loaded events, message 4 none; the orphan reaches no funnel row.
    # Each only got provider events: its old row and the new events are folded together.
    assert (summary.messages_rebuilt, summary.messages_folded) == (3, 3)
    got = rows(path, "SELECT * FROM email_funnel ORDER BY message_id")
    for expected, actual in zip(EXPECTED_FUNNEL, got, strict=True):
        for column in FUNNEL_COLUMNS:
            assert actual[column] == expected[column], (expected["message_id"], column)
    _assert_equals_a_full_build(engine, path, tmp_path)


def test_daily_counts_rates_and_machine_opens_apart(loaded):
    _, path, _ = loaded
    got = {
        (r["template"], r["provider"]): r
        for r in rows(path, "SELECT * FROM email_funnel_daily ORDER BY ALL")
    }
    assert set(got) == {
        ("welcome", "sandbox"),
        ("welcome", None),
        ("receipt", "sandbox"),
        ("password_reset", "sandbox"),
        ("weekly_digest", "sandbox"),
    }
    welcome = got[("welcome", "sandbox")]
    assert {k: welcome[k] for k in list(welcome)[4:20]} == {
        "messages": 1, "accepted": 1, "delivered": 1, "human_opened": 1,
        "machine_opened_only": 0, "machine_opened": 1, "clicked": 1, "bounced": 0,
        "hard_bounced": 0, "complained": 0, "unsubscribed": 0, "suppressed": 0,
        "duplicate": 0, "expired": 0, "dead": 0, "pending": 0,
    }  # fmt: skip
    assert (welcome["open_rate"], welcome["machine_open_rate"], welcome["click_rate"]) == (1, 1, 1)
    assert welcome["event_to_accepted_p50_s"] == 10.0 and welcome["time_to_open_p50_s"] == 40.0
    receipt = got[("receipt", "sandbox")]
    assert (receipt["delivered"], receipt["bounced"], receipt["hard_bounced"]) == (1, 1, 1)
    assert (receipt["delivery_rate"], receipt["bounce_rate"], receipt["open_rate"]) == (1, 1, 0)
    reset = got[("password_reset", "sandbox")]
    assert (reset["accepted"], reset["dead"], reset["delivery_rate"]) == (0, 1, None)
    digest = got[("weekly_digest", "sandbox")]
    assert (digest["complained"], digest["unsubscribed"], digest["complaint_rate"]) == (1, 1, 1)
    assert got[("welcome", None)]["suppressed"] == 1
    assert got[("welcome", None)]["lane"] == "transactional"


def test_a_rerun_loads_nothing_and_changes_nothing(loaded):
    engine, path, _ = loaded
    before = rows(path, "SELECT * FROM email_funnel ORDER BY message_id")
    again = warehouse.refresh(engine, path)
    assert again.total_loaded == 0 and not again.full_build
    assert again.messages_rebuilt == 0
    assert sum(again.rows_read.values()) > 0  # the look-back window was re-read ...
    assert (
        rows(path, "SELECT * FROM email_funnel ORDER BY message_id") == before
    )  # ... to no effect


def test_a_rerun_with_nothing_new_leaves_the_snapshot_and_writer_file_alone(loaded):
    """Nothing to load: no checkpoint, no new snapshot, no patch. Both files stay byte for
    byte (and inode for inode) what they were, and the next refresh with news goes on."""
    engine, path, _ = loaded
    files = (path, warehouse.writer_path(path))

    def state() -> list[tuple[int, int, bytes]]:
        return [(f.stat().st_ino, f.stat().st_mtime_ns, f.read_bytes()) for f in files]

    before = state()
    again = warehouse.refresh(engine, path)
    assert again.total_loaded == 0 and again.next_writer == "unchanged"
    assert again.funnel["messages"] == 5 and again.table_rows["email_funnel"] == 5
    assert state() == before
    aware = engine.dialect.name == "postgresql"
    with engine.begin() as connection:
        connection.execute(
            insert(email_events).values(
                provider="sandbox", provider_event_id="p16", event_type="clicked",
                occurred_at=(at if aware else naive)(8000),
                received_at=datetime.now(UTC) if aware else datetime.now(UTC).replace(tzinfo=None),
                event_id="E4", message_id=4, click_url="https://app.example.com/late",
            )
        )  # fmt: skip
    news = warehouse.refresh(engine, path)
    assert news.rows_loaded["email_events"] == 1 and news.next_writer in ("patched", "copied")
    assert rows(path, "SELECT click_count FROM email_funnel WHERE message_id = 4") == [
        {"click_count": 1}
    ]


def test_changed_and_new_rows_are_loaded_once_and_match_a_full_rebuild(loaded, tmp_path):
    engine, path, _ = loaded
    aware = engine.dialect.name == "postgresql"
    when = at if aware else naive
    with engine.begin() as connection:
        # An operator replays the dead letter and the message goes out.
        connection.execute(
            update(dead_letters)
            .where(dead_letters.c.dead_letter_id == 1)
            .values(status="replayed", resolved_at=when(9000))
        )
        connection.execute(
            update(email_messages)
            .where(email_messages.c.message_id == 3)
            .values(status="sent", sent_at=when(9001), updated_at=when(9001), attempts=2)
        )
        connection.execute(
            insert(email_attempts).values(
                attempt_id=6, message_id=3, event_id="E3", run_id="run-2", attempt_no=2,
                started_at=when(9000), finished_at=when(9001), outcome="accepted",
                http_status=200,
            )
        )  # fmt: skip
        # A late click on the digest, received now.
        connection.execute(
            insert(email_events).values(
                provider="sandbox", provider_event_id="p15", event_type="clicked",
                occurred_at=when(8000), received_at=when(9002), event_id="E4", message_id=4,
                click_url="https://app.example.com/digest",
            )
        )  # fmt: skip
    summary = warehouse.refresh(engine, path)
    assert summary.rows_loaded == {
        "email_outbox": 0,
        "email_messages": 1,
        "email_attempts": 1,
        "dead_letters": 1,
        "email_events": 1,
    }
    assert (summary.messages_rebuilt, summary.days_rebuilt, summary.full_build) == (2, 1, False)
    # The digest's late click is folded into its old row; the replayed message is rebuilt.
    assert summary.messages_folded == 1
    got = {r["message_id"]: r for r in rows(path, "SELECT * FROM email_funnel")}
    assert got[3]["final_status"] == "sent" and got[3]["accepted_at"] == naive(9001)
    assert got[3]["dead_letter_status"] == "replayed"
    assert got[3]["event_to_accepted_s"] == 8881.0
    assert got[4]["click_count"] == 1 and got[4]["first_click_at"] == naive(8000)
    assert warehouse.refresh(engine, path).total_loaded == 0
    # The incremental result is exactly what a build from scratch gives.
    fresh = tmp_path / "fresh.duckdb"
    warehouse.refresh(engine, fresh, full=True)
    for table in ("email_funnel", "email_funnel_daily"):
        sql = f"SELECT * FROM {table} ORDER BY ALL"
        assert rows(path, sql) == rows(fresh, sql), table


def test_incremental_refreshes_of_a_generated_history_equal_a_full_build(engine, tmp_path):
    """Generated history (both backends): new messages plus late opens and clicks for old ones,
    loaded in three incremental refreshes, equal a build from scratch, table by table."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=600, days=2, end=now - timedelta(hours=1))
    first = warehouse.refresh(engine, path)
    assert first.full_build and first.table_rows["email_funnel"] == 600
    for round_ in range(2):
        batch = generate(
            engine,
            messages=150,
            # Each round's rows are newer than the last refresh, as committed rows are.
            days=0.005,
            end=now + timedelta(minutes=20 * round_),
            seed=50 + round_,
            late_events_for_existing=40,
        )
        summary = warehouse.refresh(engine, path)
        assert not summary.full_build
        # The new messages and the older ones whose status a late open raised.
        assert summary.rows_loaded["email_messages"] == 150 + batch.statuses_raised
        # The new messages, plus the old ones that got late events (at most 40), which are
        # folded: they got only provider events and a raised delivery status.
        assert 150 <= summary.messages_rebuilt <= 190
        assert summary.messages_rebuilt - summary.messages_folded == 150
        assert summary.messages_folded > 0
    assert warehouse.refresh(engine, path).total_loaded == 0
    fresh = tmp_path / "fresh.duckdb"
    warehouse.refresh(engine, fresh, full=True)
    tables = [source.raw_table for source in warehouse.SOURCES]
    for table in (*tables, "email_funnel", "email_funnel_daily"):
        sql = as_loaded(table)
        incremental, built = rows(path, sql), rows(fresh, sql)
        assert len(incremental) > 0 and incremental == built, table
    assert len(rows(path, "SELECT * FROM email_funnel")) == 900


def test_a_refresh_stopped_before_preparing_its_next_writer_continues_from_the_snapshot(
    engine, tmp_path
):
    """The snapshot is the last writer file, renamed; if the copy for the next refresh never
    happened, the next refresh starts from the snapshot (incrementally, nothing reloaded)."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=200, days=1, end=now - timedelta(hours=1))
    warehouse.refresh(engine, path)
    assert warehouse.writer_path(path).exists()  # prepared for the next refresh
    warehouse.writer_path(path).unlink()  # as if the process died right after publishing
    generate(engine, messages=50, days=0.005, end=now, seed=3)
    summary = warehouse.refresh(engine, path)
    assert not summary.full_build
    assert summary.rows_loaded["email_messages"] == 50
    assert summary.table_rows["email_funnel"] == 250
    assert rows(path, "SELECT count(*) AS n FROM email_funnel") == [{"n": 250}]


def _assert_equals_a_full_build(engine, path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fresh = tmp_path / "fresh.duckdb"
    warehouse.refresh(engine, fresh, full=True)
    tables = [source.raw_table for source in warehouse.SOURCES]
    for table in (*tables, "email_funnel", "email_funnel_daily"):
        sql = as_loaded(table)
        assert rows(path, sql) == rows(fresh, sql), table


def test_a_refresh_that_fails_half_way_leaves_nothing_half_done(engine, tmp_path, monkeypatch):
    """Loads and rebuild commit together: after a failed refresh the next one loads the same
    rows again and rebuilds what they touch, instead of skipping them as already loaded."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=300, days=1, end=now - timedelta(hours=1))
    warehouse.refresh(engine, path)
    batch = generate(engine, messages=50, days=0.005, end=now, seed=9, late_events_for_existing=20)
    build = refreshing.build_models

    def fail_after_the_loads(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("killed during the build")

    monkeypatch.setattr(refreshing, "build_models", fail_after_the_loads)
    with pytest.raises(RuntimeError, match="killed during the build"):
        warehouse.refresh(engine, path)
    monkeypatch.setattr(refreshing, "build_models", build)
    retry = warehouse.refresh(engine, path)
    assert retry.rows_loaded["email_messages"] == 50 + batch.statuses_raised
    assert not retry.full_build
    assert retry.table_rows["email_funnel"] == 350
    _assert_equals_a_full_build(engine, path, tmp_path)


def test_a_source_failing_to_stage_fails_the_refresh_and_the_next_one_loads_it(
    engine, tmp_path, monkeypatch
):
    """Sources are staged on two connections at once. One failing (the messages, while the
    provider events are read on the other) fails the whole refresh before anything is written:
    the snapshot and its high-water marks stay as they were, and the next refresh opens the
    writer file again and loads everything the failed one would have."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=300, days=1, end=now - timedelta(hours=1))
    first = warehouse.refresh(engine, path)
    batch = generate(engine, messages=50, days=0.005, end=now, seed=9, late_events_for_existing=20)
    stage = load._stage_source
    staged: list[str] = []

    def messages_fail(connection, attached, source, since):  # type: ignore[no-untyped-def]
        if source.name == "email_messages":
            raise RuntimeError("the messages could not be read")
        staged.append(source.name)
        return stage(connection, attached, source, since)

    monkeypatch.setattr(load, "_stage_source", messages_fail)
    with pytest.raises(RuntimeError, match="the messages could not be read"):
        warehouse.refresh(engine, path)
    assert "email_events" in staged  # the other connection was reading meanwhile
    assert rows(path, "SELECT count(*) AS n FROM email_funnel") == [{"n": 300}]
    marks = "SELECT name, high_water_mark FROM warehouse_state WHERE high_water_mark IS NOT NULL"
    assert dict((r["name"], r["high_water_mark"]) for r in rows(path, marks)) == {
        name: mark.replace(tzinfo=None)
        for name, mark in first.high_water_marks.items()
        if mark is not None
    }
    monkeypatch.setattr(load, "_stage_source", stage)
    retry = warehouse.refresh(engine, path)
    assert retry.rows_loaded["email_messages"] == 50 + batch.statuses_raised
    assert retry.table_rows["email_funnel"] == 350
    _assert_equals_a_full_build(engine, path, tmp_path)


def test_a_provider_event_moved_to_another_message_rebuilds_both_rows(engine, tmp_path):
    """A webhook re-normalized after a mapping fix comes back as a new row (new id, new
    received_at) linked to another message: the old message's funnel row loses it."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=200, days=1, end=now - timedelta(hours=1))
    warehouse.refresh(engine, path)
    aware = engine.dialect.name == "postgresql"
    with engine.begin() as connection:
        opened = connection.execute(
            select(email_events).where(email_events.c.event_type == "opened").limit(1)
        ).one()
        other = connection.execute(
            select(email_messages.c.message_id, email_messages.c.event_id)
            .where(email_messages.c.message_id != opened.message_id)
            .limit(1)
        ).one()
        # A new id, as re-ingestion gives (the generator wrote ids without the sequence).
        newest = connection.execute(select(func.max(email_events.c.email_event_id))).scalar()
        values = {**opened._mapping, "email_event_id": newest + 1}
        connection.execute(
            email_events.delete().where(email_events.c.email_event_id == opened.email_event_id)
        )
        values.update(
            message_id=other.message_id,
            event_id=other.event_id,
            received_at=now if aware else now.replace(tzinfo=None),
        )
        connection.execute(insert(email_events).values(**values))
    summary = warehouse.refresh(engine, path)
    assert summary.rows_loaded["email_events"] == 1
    assert summary.messages_rebuilt == 2  # the message it left and the one it joined
    # The one it joined only got a provider event; the one it left lost one: rebuilt.
    assert summary.messages_folded == 1
    _assert_equals_a_full_build(engine, path, tmp_path)


def test_a_provider_event_deleted_at_the_source_leaves_the_warehouse(engine, tmp_path):
    """A provider event row deleted and not re-created (by hand, or a reprocessed webhook that
    no longer maps to an event) is removed from the warehouse by the next refresh, through the
    deletion record the trigger wrote; re-reading that record later removes nothing more."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=200, days=1, end=now - timedelta(hours=1))
    warehouse.refresh(engine, path)
    with engine.begin() as connection:
        click = connection.execute(
            select(email_events).where(email_events.c.event_type == "clicked").limit(1)
        ).one()
        connection.execute(
            email_events.delete().where(email_events.c.email_event_id == click.email_event_id)
        )
        recorded = connection.execute(select(email_event_deletions)).all()
    assert [(r.email_event_id, r.received_at.replace(tzinfo=None)) for r in recorded] == [
        (click.email_event_id, click.received_at.replace(tzinfo=None))
    ]
    funnel = f"SELECT click_count FROM email_funnel WHERE message_id = {click.message_id}"
    clicks_before = rows(path, funnel)[0]["click_count"]

    summary = warehouse.refresh(engine, path)
    assert summary.rows_removed["email_events"] == 1
    assert summary.total_loaded == 0 and summary.messages_rebuilt == 1
    assert summary.messages_folded == 0  # a removed event is not folded: rebuilt
    assert summary.next_writer != "unchanged"
    assert rows(path, funnel)[0]["click_count"] == clicks_before - 1
    gone = (
        f"SELECT count(*) AS n FROM raw_email_events WHERE email_event_id = {click.email_event_id}"
    )
    assert rows(path, gone)[0]["n"] == 0
    _assert_equals_a_full_build(engine, path, tmp_path)

    again = warehouse.refresh(engine, path)  # the record is re-read in the look-back window
    assert again.rows_removed["email_events"] == 0 and again.next_writer == "unchanged"


def test_a_reused_id_is_a_new_row_not_a_deleted_one(engine, tmp_path):
    """SQLite gives a deleted newest id to the next row. The deletion record names the version
    (id and received_at), so the new row under the old id is loaded and kept, now and when a
    later refresh re-reads the record. (PostgreSQL never reuses ids: the test gives it one.)"""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=200, days=1, end=now - timedelta(hours=1))
    warehouse.refresh(engine, path)
    sqlite = engine.dialect.name == "sqlite"
    with engine.begin() as connection:
        newest = connection.execute(
            select(email_events).order_by(email_events.c.email_event_id.desc()).limit(1)
        ).one()
        other = connection.execute(
            select(email_messages.c.message_id, email_messages.c.event_id)
            .where(
                email_messages.c.message_id != newest.message_id, email_messages.c.status == "sent"
            )
            .limit(1)
        ).one()
        connection.execute(
            email_events.delete().where(email_events.c.email_event_id == newest.email_event_id)
        )
        values = {
            **newest._mapping,
            "provider_event_id": "evt_new_one",
            "event_type": "opened",
            "machine_open": False,
            "message_id": other.message_id,
            "event_id": other.event_id,
            "received_at": now if not sqlite else now.replace(tzinfo=None),
        }
        if sqlite:
            del values["email_event_id"]  # SQLite picks max(id) + 1: the deleted row's id
        new_id = connection.execute(insert(email_events).values(**values)).inserted_primary_key[0]
    assert new_id == newest.email_event_id

    summary = warehouse.refresh(engine, path)
    assert summary.rows_loaded["email_events"] == 1
    assert summary.messages_rebuilt == 2  # the message the old row left, the one it joined
    # The message the old version left is rebuilt; the one the new row joined gained an event.
    assert summary.messages_folded == 1
    loaded = f"SELECT provider_event_id FROM raw_email_events WHERE email_event_id = {new_id}"
    assert rows(path, loaded) == [{"provider_event_id": "evt_new_one"}]
    _assert_equals_a_full_build(engine, path, tmp_path)

    again = warehouse.refresh(engine, path)  # re-reads the record and the new row
    assert again.rows_removed["email_events"] == 0 and again.next_writer == "unchanged"
    assert rows(path, loaded) == [{"provider_event_id": "evt_new_one"}]


def test_deleted_rows_are_compacted_after_publishing_once_they_add_up(
    engine, tmp_path, monkeypatch
):
    """Rows a refresh replaces are deleted; its commit never compacts them (compacting rewrites
    whole row groups, and analysts would wait for it). Once they add up to VACUUM_SHARE of the
    funnel, the next writer file is compacted after the new snapshot is published. Until
    then the warehouse counts them, and the data is the same either way."""
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    writer = warehouse.writer_path(path)
    generate(engine, messages=300, days=1, end=now - timedelta(hours=1))
    assert warehouse.refresh(engine, path).rows_deleted == 0  # a full build deletes nothing

    def unvacuumed(file: Path) -> int:
        found = rows(file, "SELECT value FROM warehouse_state WHERE name = 'unvacuumed_rows'")
        return int(found[0]["value"])

    def add_messages(round_: int) -> None:
        generate(engine, messages=30, days=0.005, end=now + timedelta(minutes=10 * round_),
                 seed=20 + round_, late_events_for_existing=30)  # fmt: skip

    monkeypatch.setattr(state, "VACUUM_SHARE", 10.0)  # never reached
    deleted = []
    for round_ in range(2):
        add_messages(round_)
        summary = warehouse.refresh(engine, path)
        # Late opens rebuild old messages' funnel rows (and their days' daily rows).
        assert summary.rows_deleted > 0 and not summary.compacted
        deleted.append(summary.rows_deleted)
        assert unvacuumed(path) == unvacuumed(writer) == sum(deleted)
    monkeypatch.setattr(state, "VACUUM_SHARE", 0.0)  # any deleted row is enough
    add_messages(2)
    summary = warehouse.refresh(engine, path)
    assert summary.rows_deleted > 0 and summary.compacted
    # The published snapshot is as the commit left it; the next refresh's file is compacted.
    assert unvacuumed(path) == sum(deleted) + summary.rows_deleted
    assert unvacuumed(writer) == 0
    _assert_equals_a_full_build(engine, path, tmp_path)
    # The next refresh starts from the compacted file: only its own deletions are counted.
    add_messages(3)
    summary = warehouse.refresh(engine, path)
    assert unvacuumed(path) == summary.rows_deleted > 0
    _assert_equals_a_full_build(engine, path, tmp_path)


def test_strings_are_written_without_fsst(engine, tmp_path):
    """The writer leaves FSST out of refreshes (a quarter of the cost of inserting new rows;
    see warehouse.files.connect), a full build (refresh(full=True)) not: at this size DuckDB
    picks it for event ids when allowed."""
    from bench.generate import generate

    generate(engine, messages=2000, days=1, end=datetime.now(UTC) - timedelta(hours=1))
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(engine, path)
    tables = (*(source.raw_table for source in warehouse.SOURCES), "email_funnel")
    found = rows(
        path,
        " UNION ALL ".join(
            f"SELECT DISTINCT '{t}' AS t, compression FROM pragma_storage_info('{t}')"
            for t in tables
        ),
    )
    assert {r["compression"] for r in found} >= {"Dictionary"}  # still compressed
    assert [r for r in found if r["compression"] == "FSST"] == []
    warehouse.refresh(engine, path, full=True)
    found = rows(
        path,
        " UNION ALL ".join(
            f"SELECT DISTINCT '{t}' AS t, compression FROM pragma_storage_info('{t}')"
            for t in tables
        ),
    )
    assert [r for r in found if r["compression"] == "FSST"] != []


def test_a_warehouse_from_the_first_state_table_keeps_its_high_water_marks(engine, tmp_path):
    from bench.generate import generate

    now = datetime.now(UTC).replace(microsecond=0)
    path = tmp_path / "warehouse.duckdb"
    generate(engine, messages=100, days=1, end=now - timedelta(hours=1))
    warehouse.refresh(engine, path)
    # The first layout: the same rows under the old name, with a primary key.
    writer = duckdb.connect(str(warehouse.writer_path(path)))
    writer.execute(
        "CREATE TABLE warehouse_load_state (name VARCHAR PRIMARY KEY, high_water_mark "
        "TIMESTAMP, value VARCHAR, rows_loaded BIGINT, loaded_at TIMESTAMP)"
    )
    writer.execute("INSERT INTO warehouse_load_state SELECT * FROM warehouse_state")
    writer.execute("DROP TABLE warehouse_state")
    writer.close()
    generate(engine, messages=20, days=0.005, end=now, seed=4)
    summary = warehouse.refresh(engine, path)
    assert not summary.full_build and summary.rows_loaded["email_messages"] == 20
    tables = {r["name"] for r in rows(path, "SHOW TABLES")}
    assert "warehouse_state" in tables and "warehouse_load_state" not in tables


def test_question_files_run_read_only_against_the_snapshot(loaded):
    _, path, _ = loaded
    names = warehouse.question_names()
    assert names == [
        "bounce_rate_by_domain",
        "dead_letters_by_reason",
        "funnel_by_template",
        "open_rate_by_locale",
        "rates_by_template_last_7_days",
        "time_to_open_distribution",
        "welcome_open_rate_last_7_days",
        "welcome_open_rate_weekly",
    ]
    answers = {name: warehouse.run_question(path, name) for name in names}
    weekly = answers["welcome_open_rate_weekly"]
    assert weekly.iloc[0]["human_opened"] == 1 and weekly.iloc[0]["delivered"] == 1
    assert weekly.iloc[0]["open_rate"] == 1.0 and weekly.iloc[0]["machine_opened"] == 1
    by_reason = answers["dead_letters_by_reason"]
    assert by_reason.iloc[0]["reason"] == "provider_rejected" and by_reason.iloc[0]["open"] == 1
    by_template = answers["funnel_by_template"].set_index("template")
    assert (
        by_template.loc["welcome", "messages"] == 2 and by_template.loc["welcome", "accepted"] == 1
    )
    assert by_template.loc["welcome", "acceptance_rate"] == 0.5
    assert by_template.loc["welcome", "open_rate"] == 1.0
    assert by_template.loc["receipt", "event_to_accepted_p50_s"] == 3.0
    by_domain = answers["bounce_rate_by_domain"].set_index("recipient_domain")
    assert by_domain.loc["gmail.com", "bounce_rate"] == 1.0
    assert by_domain.loc["gmail.com", "hard_bounce_rate"] == 1.0
    assert by_domain.loc["example.com", "bounce_rate"] == 0.0
    assert not answers["time_to_open_distribution"].empty
    by_locale = answers["open_rate_by_locale"].set_index(["template", "locale"])
    assert by_locale.loc[("welcome", "pt-BR"), "open_rate"] == 1.0
    assert by_locale.loc[("welcome", "default"), "messages"] == 1  # E5, suppressed


def test_funnel_report_for_the_demo(loaded):
    _, path, _ = loaded
    report = warehouse.funnel_report(path, event_ids=["E1", "E5", "E2"])
    assert [r["template"] for r in report.rows] == ["receipt", "welcome"]
    welcome = report.rows[1]
    assert (welcome["messages"], welcome["human_opened"], welcome["machine_opened"]) == (2, 1, 1)
    assert report.welcome_open_rate == 1.0
    # Only these events: message 4's open (weekly_digest) is not counted.
    assert report.rates.overall["human_opened"] == 1 and report.rates.overall["delivered"] == 2
    text = report.to_text()
    assert "Welcome email human open rate: 100.0% (last 7 days;" in text
    assert "last 7 days, 2026-02-24 to 2026-03-02" in text
    assert warehouse.funnel_row(path, "E2")[0]["bounce_type"] == "hard"


def test_checks_pass_and_fail_with_the_right_severity(loaded):
    _, path, _ = loaded
    connection = warehouse.connect_read_only(path)
    try:
        strict = warehouse.Thresholds(min_messages=1)
        one_row = warehouse.check_one_row_per_message(connection)
        orphans = warehouse.check_provider_events_joined(connection)
        latencies = warehouse.check_no_negative_latencies(connection)
        letters = warehouse.check_open_dead_letters(connection)
        bounce = warehouse.check_daily_rate(connection, "bounce_rate", 0.05, strict)
        quiet = warehouse.check_daily_rate(connection, "bounce_rate", 0.05)  # too few to judge
        complaints = warehouse.check_daily_rate(connection, "complaint_rate", 0.003, strict)
    finally:
        connection.close()
    assert one_row.passed and latencies.passed
    assert (orphans.passed, orphans.severity, orphans.metadata["orphans"]) == (False, "WARN", 1)
    assert orphans.metadata["orphans_opened"] == 1
    assert (letters.passed, letters.metadata["open_provider_rejected"]) == (False, 1)
    assert letters.metadata["oldest_open_at"] == at(124)  # a datetime, not an epoch number
    assert (bounce.passed, bounce.severity, bounce.metadata["rows_breaching"]) == (
        False,
        "ERROR",
        1,
    )
    assert "receipt/transactional/sandbox" in bounce.description
    assert quiet.passed and quiet.metadata["rows_checked"] == 0
    assert quiet.metadata["min_messages"] == 1000 and quiet.metadata["rows_not_judged"] == 5
    assert "not judged" in quiet.description
    assert not complaints.passed
    assert complaints.metadata["rate_definition"] == "complained / delivered"
    assert complaints.metadata["worst_complaint_rate"] == 1.0


def test_a_rate_is_judged_only_on_enough_messages(loaded):
    """One complaint among 190 delivered (0.53%, over the 0.3% threshold) is too few messages
    to judge a rate by: the check passes at the default minimum and says why; with a minimum
    the row meets, it fails."""
    _, path, _ = loaded
    writer = duckdb.connect(str(path))  # a doctored copy; no refresh runs here
    try:
        writer.execute(
            "UPDATE email_funnel_daily SET accepted = 190, delivered = 190, complained = 1, "
            "complaint_rate = 1 / 190 WHERE template = 'weekly_digest'"
        )
        demo = warehouse.check_daily_rate(writer, "complaint_rate", 0.003)
        smaller = warehouse.Thresholds(min_messages=190)
        judged = warehouse.check_daily_rate(writer, "complaint_rate", 0.003, smaller)
    finally:
        writer.close()
    assert (demo.passed, demo.metadata["rows_checked"], demo.metadata["min_messages"]) == (
        True,
        0,
        1000,
    )
    assert demo.metadata["largest_delivered"] == 190 and "worst_complaint_rate" not in demo.metadata
    assert demo.description == (
        "No day x template x lane x provider in the last 7 days has at least 1,000 delivered "
        "messages (the most is 190); the complaint rate is not judged on so few."
    )
    assert (judged.passed, judged.metadata["rows_checked"]) == (False, 1)
    assert judged.metadata["worst_complaint_rate"] == pytest.approx(1 / 190)
    assert "0.53% on 2026-03-02 for weekly_digest/bulk/sandbox (190 delivered)" in (
        judged.description
    )
    assert Warehouse().thresholds().min_messages == 1000
    assert Warehouse(rate_check_min_messages=5).thresholds().min_messages == 5


def test_open_dead_letters_name_the_runs_that_hold_them(engine, tmp_path):
    write_fixture(engine)
    stamp = at if engine.dialect.name == "postgresql" else naive
    with engine.begin() as connection:
        connection.execute(
            insert(dead_letters),
            [
                {
                    "dead_letter_id": dead_letter_id,
                    "event_id": "E3",
                    "lane": "critical",
                    "reason": reason,
                    "attempts": 1,
                    "run_id": run,
                    "status": status,
                    "created_at": stamp(seconds),
                }
                for dead_letter_id, (reason, run, status, seconds) in enumerate(
                    [
                        ("render_failed", "run-2", "open", 200),
                        ("render_failed", "run-2", "open", 100),
                        ("provider_rejected", "run-3", "replayed", 50),  # closed: not listed
                        ("unknown_version", None, "open", 300),
                    ],
                    start=2,
                )
            ],
        )
    path = tmp_path / "warehouse.duckdb"
    warehouse.refresh(engine, path)
    connection = warehouse.connect_read_only(path)
    try:
        letters = warehouse.check_open_dead_letters(connection)
    finally:
        connection.close()
    metadata = letters.metadata
    assert (metadata["open_dead_letters"], metadata["runs_with_open"]) == (4, 3)
    assert metadata["oldest_open_at"] == at(100)
    table = metadata["runs_with_open_dead_letters"]
    assert isinstance(table, warehouse.Markdown)
    assert table.splitlines()[2:] == [
        f"| [`run-2`](/runs/run-2) | 2 | {naive(100):%Y-%m-%d %H:%M:%S} UTC |",
        f"| [`run-1`](/runs/run-1) | 1 | {naive(124):%Y-%m-%d %H:%M:%S} UTC |",
        f"| (no run) | 1 | {naive(300):%Y-%m-%d %H:%M:%S} UTC |",
    ]
    assert "run-3" not in table
    assert "most by run-2 (2), run-1 (1), (no run) (1)" in letters.description
    assert "`email-platform dlq replay`" in letters.description


def test_a_negative_latency_and_a_doubled_row_fail_as_errors(loaded):
    _, path, _ = loaded
    writer = duckdb.connect(str(path))  # a doctored copy; no refresh runs here
    try:
        writer.execute("UPDATE email_funnel SET delivery_delay_s = -30 WHERE message_id = 1")
        writer.execute("INSERT INTO email_funnel SELECT * FROM email_funnel WHERE message_id = 2")
        latencies = warehouse.check_no_negative_latencies(writer)
        one_row = warehouse.check_one_row_per_message(writer)
    finally:
        writer.close()
    assert (latencies.passed, latencies.severity) == (False, "ERROR")
    assert latencies.metadata["negative_delivery_delay_s"] == 1
    assert (one_row.passed, one_row.severity) == (False, "ERROR")


def test_assets_materialize_with_metadata_and_checks_in_dagster(engine, database_url, tmp_path):
    write_fixture(engine)
    path = tmp_path / "warehouse.duckdb"
    result = materialize(
        [analytics_warehouse, *analytics_checks],
        resources={
            "email_database": AppDatabase(url=database_url),
            "email_warehouse": Warehouse(path=str(path), rate_check_min_messages=1),
        },
    )
    assert result.success
    materialized = {m.asset_key.path[-1]: m for m in result.get_asset_materialization_events()}
    assert set(materialized) == set(warehouse.MODEL_NAMES)
    funnel = materialized["email_funnel"].materialization.metadata
    assert next(iter(funnel)) == "funnel" and "66.7% of delivered" in funnel["funnel"].value
    assert funnel["dagster/row_count"].value == 5 and funnel["accepted"].value == 3
    # One open rate, stated with its window: email_funnel_daily's, not an all-time one here.
    assert not any(key.endswith("_rate") for key in funnel)
    daily = materialized["email_funnel_daily"].materialization.metadata
    assert daily["1 open rate, all, 7d (%)"].value == pytest.approx(66.67)
    assert daily["2 open rate, welcome, 7d (%)"].value == 100.0
    assert daily["2 open rate, receipt, 7d (%)"].value == 0.0
    assert daily["3 bounce rate, all, 7d (%)"].value == pytest.approx(100 / 3, abs=0.005)
    assert not any("password_reset" in key for key in daily)  # nothing delivered: no rate
    assert daily["rates_window"].value == (
        "last 7 days, 2026-02-24 to 2026-03-02 (UTC, by the day each message was created)"
    )
    assert "open_rate = human_opened / delivered" in daily["rate_definitions"].value
    assert "data:image/svg+xml;base64," in daily["funnel_chart"].value
    assert "| welcome | 2 | 1 | 1 | 1 | 1 | 1 | 100.0% | 100.0% |" in daily["funnel_chart"].value
    svg = (tmp_path / "warehouse.duckdb.funnel.svg").read_text()
    assert svg.startswith("<svg")
    # Each step labelled with its rate: opened of delivered (the open rate), not of every
    # message (1 of welcome's 2); accepted of messages.
    assert "1 (100.0% of delivered)" in svg and "1 (50.0% of messages)" in svg
    assert "(50.0%)" not in svg
    sends = materialized["stg_sends"].materialization.metadata
    assert sends["rows_loaded"].value == 5 and sends["data_through"].value > 0
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert set(checks) == {
        "one_row_per_message",
        "provider_events_joined",
        "no_negative_latencies",
        "open_dead_letters",
        "bounce_rate_under_threshold",
        "complaint_rate_under_threshold",
    }
    assert checks["one_row_per_message"].passed
    assert checks["bounce_rate_under_threshold"].passed is False
    assert checks["bounce_rate_under_threshold"].severity == AssetCheckSeverity.ERROR
    assert checks["provider_events_joined"].severity == AssetCheckSeverity.WARN
    assert checks["provider_events_joined"].metadata["orphans"].value == 1
    letters = checks["open_dead_letters"].metadata
    assert isinstance(letters["oldest_open_at"], TimestampMetadataValue)
    assert letters["oldest_open_at"].value == at(124).timestamp()
    assert isinstance(letters["runs_with_open_dead_letters"], MarkdownMetadataValue)
    assert "[`run-1`](/runs/run-1) | 1 |" in letters["runs_with_open_dead_letters"].value
    complaints = checks["complaint_rate_under_threshold"].metadata
    assert (complaints["min_messages"].value, complaints["rows_checked"].value) == (1, 3)
    # Again: nothing new loads; with the reconcile tag, everything is rebuilt from scratch.
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_warehouse": Warehouse(path=str(path)),
    }
    again = materialize([analytics_warehouse], resources=resources)
    sends = {m.asset_key.path[-1]: m for m in again.get_asset_materialization_events()}["stg_sends"]
    assert sends.materialization.metadata["rows_loaded"].value == 0
    assert sends.materialization.metadata["full_build"].value is False
    full = materialize([analytics_warehouse], resources=resources, tags={FULL_TAG: "true"})
    sends = {m.asset_key.path[-1]: m for m in full.get_asset_materialization_events()}["stg_sends"]
    assert sends.materialization.metadata["rows_loaded"].value == 5
    assert sends.materialization.metadata["full_build"].value is True


def test_code_location_registers_assets_checks_sensor_and_resource():
    from email_platform.definitions import defs

    repository = defs.get_repository_def()
    keys = {key.path[-1] for key in repository.asset_graph.get_all_asset_keys()}
    assert set(warehouse.MODEL_NAMES) <= keys
    assert {"email_outbox", "email_messages", "email_events"} <= keys
    # Every asset under the platform's prefix, in its one group: nothing a project's own
    # assets could collide with when the definitions are merged.
    assert all(
        key.path[0] == "email_platform" for key in repository.asset_graph.get_all_asset_keys()
    )
    funnel = AssetKey(["email_platform", "email_funnel"])
    node = repository.assets_defs_by_key[funnel]
    assert {spec.group_name for spec in node.specs} == {"email_platform"}
    for spec in node.specs:
        assert spec.description and len(spec.description) > 20
    check_keys = repository.asset_graph.asset_check_keys
    # The analysts' checks and the bulk lane's brake over the warehouse.
    assert len(check_keys) == len(analytics_checks) + 1
    assert "bulk_brake" in {key.name for key in check_keys}
    sensor = repository.get_sensor_def("analytics_refresh_sensor")
    assert sensor.default_status.value == "RUNNING" and sensor.description
    assert "email_warehouse" in repository.get_top_level_resources()
    assert analytics_assets[0] is analytics_warehouse


def test_sensor_requests_a_refresh_only_when_something_changed(engine, database_url):
    write_fixture(engine)
    from dagster import DagsterInstance

    instance = DagsterInstance.ephemeral()
    aware = engine.dialect.name == "postgresql"

    def tick(cursor, interval_s=0.001):  # type: ignore[no-untyped-def]
        resources = {
            "email_database": AppDatabase(url=database_url),
            "email_warehouse": Warehouse(refresh_interval_s=interval_s),
        }
        with build_sensor_context(instance=instance, resources=resources, cursor=cursor) as ctx:
            return analytics_refresh_sensor(ctx), ctx.cursor

    def touch(seconds: float) -> None:
        with engine.begin() as connection:
            connection.execute(
                update(email_messages)
                .where(email_messages.c.message_id == 5)
                .values(updated_at=(at if aware else naive)(seconds))
            )

    first, cursor = tick(None)
    assert first.run_key and first.tags["email/job"] == "analytics"
    assert {k.path[-1] for k in first.asset_selection} == set(warehouse.MODEL_NAMES)
    skipped, cursor = tick(cursor)
    assert "Nothing new" in skipped.skip_message
    # A provider event deleted, not the newest: only its deletion record moves the digest.
    with engine.begin() as connection:
        connection.execute(email_events.delete().where(email_events.c.provider_event_id == "p3"))
    deleted, cursor = tick(cursor)
    assert deleted.run_key and deleted.run_key != first.run_key
    touch(10_000)
    again, cursor = tick(cursor)
    assert again.run_key != first.run_key
    # New data within the refresh interval waits for it; the cursor keeps the last request.
    touch(10_001)
    waiting, waiting_cursor = tick(cursor, interval_s=3600)
    assert "next refresh may start in" in waiting.skip_message
    assert waiting_cursor == cursor
    later, cursor = tick(cursor, interval_s=0.001)
    assert later.run_key not in (first.run_key, again.run_key)
    assert FULL_TAG not in later.tags
    # A day after the last full build, the next refresh is a full rebuild (a reconcile).
    state = json.loads(cursor)
    state["full_at"] -= RECONCILE_S
    touch(10_002)
    reconcile, cursor = tick(json.dumps(state))
    assert reconcile.tags[FULL_TAG] == "true"
    assert json.loads(cursor)["full_at"] > state["full_at"]
    # That run failed: with nothing new, the next tick asks for the full rebuild again.
    from dagster import DagsterRun, DagsterRunStatus

    instance.add_run(
        DagsterRun(
            job_name="email_analytics_job",
            run_id="f" * 36,
            tags=reconcile.tags,
            status=DagsterRunStatus.FAILURE,
        )
    )
    retried, cursor = tick(cursor)
    assert retried.tags[FULL_TAG] == "true"
    # Not in a tight loop: a failing refresh is retried once per refresh interval.
    assert "next refresh may start in" in tick(cursor, interval_s=3600)[0].skip_message


def test_refresh_interval_comes_from_the_environment_and_is_validated(monkeypatch):
    monkeypatch.delenv("EMAIL_PLATFORM_ANALYTICS_REFRESH_S", raising=False)
    assert Warehouse().resolved_refresh_interval_s() == 60
    monkeypatch.setenv("EMAIL_PLATFORM_ANALYTICS_REFRESH_S", "15")
    assert Warehouse().resolved_refresh_interval_s() == 15
    assert Warehouse(refresh_interval_s=5).resolved_refresh_interval_s() == 5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv("EMAIL_PLATFORM_ANALYTICS_REFRESH_S", bad)
        with pytest.raises(ValueError, match="ANALYTICS_REFRESH_S must be a positive number"):
            Warehouse().resolved_refresh_interval_s()
