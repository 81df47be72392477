"""Provider outcomes offered back to the product (docs/outcomes.md), on SQLite and PostgreSQL:
the feed end to end (publish -> send -> the sandbox's signed webhooks -> the receiver ->
ingestion -> ``read_outcomes``), its stable ids, erasure, a cursor that skips nothing while
ingestion commits out of order, and the sensor's at-least-once contract with its registration."""

import threading
import time
from collections.abc import Iterator

import pytest
from dagster import SkipReason, build_sensor_context
from sqlalchemy import Engine, select, text

from email_platform import Outcome, read_outcomes
from email_platform.common.config import OUTCOME_HANDLER_SETTING
from email_platform.db.schema import email_events, webhook_inbox
from email_platform.operating.erasure import erase
from email_platform.publishing.outcomes import OutcomePage, outcome_id
from email_platform.resources import AppDatabase
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.emitter import WebhookPlan
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sensors.outcomes import OutcomeHandlerError, make_outcomes_sensor
from email_platform.store import email_events as email_events_store
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from email_platform.webhooks.reprocess import reprocess
from tests.support import messages_of, run_send, sandbox_stats, signup
from tests.webhook_support import SECRET, SETTINGS

#: Sandbox tags -> what the provider reports: every outcome kind, and opens in between.
PEOPLE = {
    "u1": ("u1@example.com", ["delivered"]),
    "u2": ("u2+bounce@example.com", ["bounced"]),
    "u3": ("u3+complaint@example.com", ["delivered", "complained"]),
    "u4": ("u4+unsubscribe@example.com", ["delivered", "unsubscribed"]),
}


def _wait(predicate, timeout_s: float = 30) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _ingest_everything(engine: Engine) -> None:
    with engine.connect() as connection:
        ids = list(
            connection.execute(
                select(webhook_inbox.c.inbox_id).where(webhook_inbox.c.status == "pending")
            ).scalars()
        )
    WebhookIngestor(engine).run(ids, run_id="test-ingest")


@pytest.fixture
def receiver_url(engine: Engine) -> Iterator[str]:
    """The webhook receiver over real HTTP, storing into the test's database."""
    with BackgroundServer(create_receiver_app(engine, settings=SETTINGS)) as url:
        yield url


def _sent_and_reported(engine: Engine, database_url: str, receiver_url: str) -> dict[str, str]:
    """Publish one signup per person, send them through the sandbox, let it post its signed
    webhooks to the receiver, ingest them; the event id of each person."""
    ids = {user: signup(engine, user, email=email) for user, (email, _) in PEOPLE.items()}
    plan = WebhookPlan(
        webhook_url=f"{receiver_url}/webhooks/sandbox",
        secret=SECRET,
        delivered_rate=1.0,
        bounce_rate=0.0,
        complaint_rate=0.0,
        unsubscribe_rate=0.0,
        open_rate=1.0,
        click_rate=0.0,
        machine_open_rate=0.0,
        duplicate_rate=0.0,
        delay_s=0.0,
    )
    with SandboxServer(SandboxConfig(webhooks=plan, seed=7)) as sandbox_url:
        assert run_send(database_url, sandbox_url, "transactional", list(ids.values())).success

        def posted() -> bool:
            stats = sandbox_stats(sandbox_url)
            return (
                stats["webhooks_planned"] > 0
                and stats["webhooks_delivered"] == (stats["webhooks_planned"])
            )

        assert _wait(posted)
    _ingest_everything(engine)
    return ids


def _read(engine: Engine, after: int = 0, limit: int = 500) -> OutcomePage:
    with engine.connect() as connection:
        return read_outcomes(connection, after=after, limit=limit)


def test_outcomes_come_back_with_the_event_aggregate_and_route(engine, database_url, receiver_url):
    ids = _sent_and_reported(engine, database_url, receiver_url)
    page = _read(engine)
    by_event: dict[str, list[Outcome]] = {}
    for outcome in page.outcomes:
        by_event.setdefault(outcome.event_id, []).append(outcome)
    assert set(by_event) == set(ids.values())
    for user, (email, kinds) in PEOPLE.items():
        outcomes = by_event[ids[user]]
        assert [o.kind for o in outcomes] == kinds  # opens are not outcomes
        (message,) = messages_of(engine, ids[user])
        for outcome in outcomes:
            assert (outcome.aggregate_id, outcome.route, outcome.event_type) == (
                user,
                "welcome",
                "user.signed_up",
            )
            assert (outcome.message_id, outcome.provider_message_id) == (
                message.message_id,
                message.provider_message_id,
            )
            assert outcome.recipient == email and outcome.provider == "sandbox"
            assert outcome.occurred_at.tzinfo is not None
    (bounce,) = by_event[ids["u2"]]
    assert bounce.bounce_type == "hard"
    # In feed order, each once, and the cursor is past everything read (opens included).
    positions = [o.position for o in page.outcomes]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert len({o.outcome_id for o in page.outcomes}) == len(page.outcomes) == 6
    with engine.connect() as connection:
        highest = connection.execute(select(email_events.c.email_event_id)).scalars().all()
    assert page.cursor == max(highest) and len(highest) > len(positions)  # opens skipped
    assert _read(engine, after=page.cursor) == OutcomePage([], page.cursor)
    # Pages: a full page stops at its last outcome, and the next goes on from there.
    first = _read(engine, limit=3)
    second = _read(engine, after=first.cursor, limit=500)
    assert first.outcomes + second.outcomes == page.outcomes
    assert first.cursor == first.outcomes[-1].position


def test_a_renormalized_webhook_keeps_its_outcome_id(engine, database_url, receiver_url):
    _sent_and_reported(engine, database_url, receiver_url)
    before = _read(engine)
    reprocess(engine)  # an operator re-normalizes every stored webhook: new rows, new ids
    _ingest_everything(engine)
    after = _read(engine)
    assert sorted(o.outcome_id for o in after.outcomes) == sorted(
        o.outcome_id for o in before.outcomes
    )
    if engine.dialect.name == "postgresql":
        assert min(o.position for o in after.outcomes) > before.cursor
        # A sequence never gives an id twice: a consumer past the old rows is offered the new
        # ones again, and its idempotency on outcome_id makes them no news.
        again = _read(engine, after=before.cursor)
        assert {o.outcome_id for o in again.outcomes} == {o.outcome_id for o in before.outcomes}


def test_an_erased_person_yields_no_address(engine, database_url, receiver_url):
    ids = _sent_and_reported(engine, database_url, receiver_url)
    erase(engine, email="u3+complaint@example.com")
    outcomes = _read(engine).outcomes
    erased = [o for o in outcomes if o.event_id == ids["u3"]]
    assert [o.kind for o in erased] == ["delivered", "complained"]
    assert all(o.recipient is None for o in erased)
    assert {o.recipient for o in outcomes if o.event_id == ids["u1"]} == {"u1@example.com"}


def _provider_event(n: str, event_id: str = "01JOUTCOME0000000000000000") -> dict:
    from email_platform.common.timeutil import utcnow

    now = utcnow()
    return {
        "provider": "sandbox",
        "provider_event_id": f"evt_{n}",
        "event_type": "delivered",
        "occurred_at": now,
        "received_at": now,
        "event_id": event_id,
        "recipient": f"{n}@example.com",
    }


def test_a_cursor_skips_nothing_an_earlier_transaction_commits_later(engine):
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: its ids commit in order")
    slow = engine.connect()
    slow.begin()
    assert email_events_store.add(slow, _provider_event("early"))  # takes the smaller id
    with engine.begin() as connection:
        assert email_events_store.add(connection, _provider_event("late"))  # commits first
    pages: list[OutcomePage] = []
    reader = threading.Thread(target=lambda: pages.append(_read(engine)))
    reader.start()
    try:

        def reader_waits() -> bool:
            with engine.connect() as connection:
                return bool(
                    connection.execute(
                        text(
                            "SELECT count(*) FROM pg_locks "
                            "WHERE locktype = 'advisory' AND NOT granted"
                        )
                    ).scalar()
                )

        assert _wait(reader_waits, 10)  # the reader waits for the open transaction ...
        assert not pages
    finally:
        slow.commit()  # ... which commits the earlier id now
        slow.close()
        reader.join(10)
    (page,) = pages
    assert [o.outcome_id for o in page.outcomes] == [
        outcome_id("sandbox", "evt_early"),
        outcome_id("sandbox", "evt_late"),
    ]


# ---- the sensor --------------------------------------------------------------------------------


class Flaky:
    """A product's handler that fails its first call, then records what it is handed."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.failures = 1

    def __call__(self, outcomes: list[Outcome]) -> None:
        self.calls.append([o.outcome_id for o in outcomes])
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the product's database is down")


def _seed(engine: Engine, *names: str) -> None:
    with engine.begin() as connection:
        for name in names:
            assert email_events_store.add(connection, _provider_event(name))


def _tick(sensor, database_url: str, cursor: str | None):  # type: ignore[no-untyped-def]
    resources = {"email_database": AppDatabase(url=database_url)}
    with build_sensor_context(resources=resources, cursor=cursor) as context:
        try:
            result = sensor(context)
        except OutcomeHandlerError as exc:
            return exc, context.cursor
    return result, context.cursor


def test_the_sensor_hands_outcomes_at_least_once_with_stable_ids(engine, database_url):
    _seed(engine, "a", "b")
    handler = Flaky()
    sensor = make_outcomes_sensor(handler)
    failed, cursor = _tick(sensor, database_url, None)
    assert isinstance(failed, OutcomeHandlerError) and "database is down" in str(failed)
    assert cursor is None  # not acknowledged: the next tick offers the same outcomes
    handed, cursor = _tick(sensor, database_url, cursor)
    assert isinstance(handed, SkipReason) and cursor is not None
    assert (
        handler.calls[0]
        == handler.calls[1]
        == [
            outcome_id("sandbox", "evt_a"),
            outcome_id("sandbox", "evt_b"),
        ]
    )
    _, same = _tick(sensor, database_url, cursor)
    assert len(handler.calls) == 2 and same == cursor  # nothing new: the handler is not called
    _seed(engine, "c")
    _tick(sensor, database_url, cursor)
    assert handler.calls[2] == [outcome_id("sandbox", "evt_c")]  # nothing skipped, nothing again


def handle_nothing(outcomes: list[Outcome]) -> None:
    """A handler named by the setting (``tests.integration.test_outcomes:handle_nothing``)."""
    SEEN.extend(o.outcome_id for o in outcomes)


SEEN: list[str] = []


def test_the_sensor_is_registered_and_reads_its_handler_from_the_setting(
    engine, database_url, monkeypatch
):
    from email_platform.definitions import build_definitions

    defs = build_definitions(email_database=AppDatabase(url=database_url))
    sensor = defs.resolve_sensor_def("email_outcomes_sensor")
    monkeypatch.delenv(OUTCOME_HANDLER_SETTING, raising=False)
    skipped, _ = _tick(sensor, database_url, None)
    assert isinstance(skipped, SkipReason) and OUTCOME_HANDLER_SETTING in skipped.skip_message
    _seed(engine, "d")
    SEEN.clear()
    monkeypatch.setenv(OUTCOME_HANDLER_SETTING, f"{__name__}:handle_nothing")
    _, cursor = _tick(sensor, database_url, None)
    assert [outcome_id("sandbox", "evt_d")] == SEEN and cursor is not None
    # Or given to build_definitions directly.
    given = Flaky()
    given.failures = 0
    named = build_definitions(outcome_handler=given).resolve_sensor_def("email_outcomes_sensor")
    _tick(named, database_url, None)
    assert given.calls == [[outcome_id("sandbox", "evt_d")]]


def test_the_component_names_the_handler(engine, database_url):
    import dagster as dg

    from email_platform.component import EmailPlatformComponent

    _seed(engine, "e")
    SEEN.clear()
    component = EmailPlatformComponent.from_attributes_dict(
        attributes={"outcome_handler": f"{__name__}:handle_nothing"}
    )
    sensor = dg.component_defs(component=component).resolve_sensor_def("email_outcomes_sensor")
    _tick(sensor, database_url, None)
    assert [outcome_id("sandbox", "evt_e")] == SEEN
