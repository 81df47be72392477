"""One poisoned event among good ones costs only itself (docs/design.md invariant 9).

Each test puts events that cannot be sent into a batch of good ones and asserts the one
outcome that matters: every good event is sent exactly once (one acceptance by the sandbox,
one ``accepted`` attempt, the event ``done``), and each bad one is a dead letter of its own
with a reason naming the cause. The poison is written the way old producers or hand-written
SQL would leave it, past ``publish()``'s checks: a value the database refuses, text UTF-8
cannot encode, an RFC 2047 encoded line break, an address mail systems refuse, a route that
writes a value the column cannot hold, an adapter that raises on one message of a batch call,
a provider answer the database cannot store. Both modes (one launched run per batch, and the
resident lane worker), the sandbox's batch endpoint and one call per message, on SQLite and
PostgreSQL.
"""

import dataclasses
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, update

from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane, LaneConfig
from email_platform.common.timeutil import as_utc
from email_platform.db.schema import email_outbox
from email_platform.mail.routes import RouteTable, default_routes
from email_platform.observability import logs
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.sandbox import SandboxProvider
from email_platform.resources import EmailProviderResource, RoutingResource
from email_platform.sending.batch import build_sender
from email_platform.sending.worker import LaneWorker
from tests.support import (
    attempts_of,
    dead_letters_of,
    event,
    messages_of,
    publish_one,
    run_send,
    sandbox_messages,
    signup,
)

#: How each poison is applied to a good signup's payload, and the dead letter it must become.
POISONS = {
    # welcome's dedupe key is "welcome:{user_id}": 308 characters, the column holds 255.
    "long_dedupe_key": ({"user_id": "u" * 300}, "value_too_long"),
    "lone_surrogate": ({"first_name": "Ja\ud800ne"}, "unencodable_text"),
    "encoded_line_break": (
        {"first_name": "=?utf-8?q?Jane=0D=0ABcc:_evil@attacker.example?="},
        "header_injection",
    ),
    "invalid_recipient": ({"email": "jane..doe@example.com"}, "invalid_recipient"),
}
GOOD = 20


def _lane(**changes) -> LaneConfig:  # type: ignore[no-untyped-def]
    base = dict(
        batch_size=100,
        concurrency=4,
        worker_poll_s=0.02,
        worker_idle_s=0.5,
        worker_lifetime_s=60,
        retry_delay_s=0.05,
        max_retry_delay_s=1.0,
        max_retries=3,
    )
    return dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], **{**base, **changes})


def _poison(engine: Engine, event_id: str, changes: dict) -> None:
    """Rewrite a committed event's payload directly, as a producer bypassing publish() would."""
    with engine.begin() as connection:
        row = connection.execute(
            email_outbox.select().where(email_outbox.c.event_id == event_id)
        ).one()
        connection.execute(
            update(email_outbox)
            .where(email_outbox.c.event_id == event_id)
            .values(payload={**row.payload, **changes})
        )


def _batch(engine: Engine) -> tuple[list[str], dict[str, str]]:
    good = [signup(engine, f"good{i}") for i in range(GOOD)]
    bad: dict[str, str] = {}
    for name, (changes, _) in POISONS.items():
        event_id = signup(engine, f"bad_{name}")
        _poison(engine, event_id, changes)
        bad[name] = event_id
    return good, bad


def _assert_sent_once(engine: Engine, base_url: str, good: list[str]) -> None:
    accepted = sandbox_messages(base_url)
    keys = [m["idempotency_key"] for m in accepted]
    assert len(keys) == len(set(keys)), "an idempotency key was accepted twice"
    by_event: dict[str, int] = {}
    for message in accepted:
        by_event[message["metadata"]["event_id"]] = (
            by_event.get(message["metadata"]["event_id"], 0) + 1
        )
    for event_id in good:
        assert by_event.get(event_id) == 1, event_id
        (message,) = messages_of(engine, event_id)
        assert message.status == "sent"
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["accepted"]
        assert event(engine, event_id).status == "done"
        assert dead_letters_of(engine, event_id) == []


def _assert_poison_dead(engine: Engine, base_url: str, bad: dict[str, str]) -> None:
    accepted_events = {m["metadata"]["event_id"] for m in sandbox_messages(base_url)}
    for name, event_id in bad.items():
        expected_code = POISONS[name][1]
        assert event_id not in accepted_events, name
        letters = dead_letters_of(engine, event_id)
        assert len(letters) == 1, (name, letters)
        assert letters[0].error_code == expected_code, (name, letters[0].last_error)
        assert letters[0].last_error, name
        assert event(engine, event_id).status == "dead", name


@pytest.mark.parametrize("batch_max", [100, 1], ids=["batch-endpoint", "one-call-each"])
def test_poison_in_a_batch_run_costs_only_itself(engine, database_url, sandbox, batch_max):
    good, bad = _batch(engine)
    provider = EmailProviderResource(
        provider="sandbox",
        base_url=sandbox.base_url,
        timeout_s=5,
        options_json=json.dumps({"batch_max": batch_max}),
    )
    result = run_send(
        database_url, sandbox.base_url, "transactional", [*good, *bad.values()], provider=provider
    )
    assert not result.success  # the run fails on purpose: it left open dead letters
    _assert_sent_once(engine, sandbox.base_url, good)
    _assert_poison_dead(engine, sandbox.base_url, bad)


@pytest.mark.parametrize("batch_max", [100, 1], ids=["batch-endpoint", "one-call-each"])
def test_poison_before_a_lane_worker_costs_only_itself(engine, sandbox, batch_max):
    good, bad = _batch(engine)
    provider = SandboxProvider(sandbox.base_url, batch_max=batch_max, max_connections=4)
    lane = _lane()
    sender = build_sender(
        engine=engine, provider=provider, lane=lane, sender_address="Example <a@example.com>"
    )
    result = LaneWorker(sender=sender, engine=engine, lane=lane, run_id="worker-1").run()
    provider.close()
    assert result.totals["sent"] == GOOD
    assert result.totals["dead_lettered"] == len(POISONS)
    _assert_sent_once(engine, sandbox.base_url, good)
    _assert_poison_dead(engine, sandbox.base_url, bad)


# ---- a value the database refuses in a statement the send path does not pre-check -------------


def poison_routes() -> RouteTable:
    """Shipped routes plus one whose pinned template version no integer column holds."""
    table = default_routes()
    welcome = next(r for r in table.routes if r.name == "welcome")
    oversized = dataclasses.replace(
        welcome, event_type="user.imported", event_version=1, name="imported", dedupe_key=None
    )
    oversized = dataclasses.replace(oversized, template_version=2**63)
    schemas = {**table.schemas, ("user.imported", 1): table.schemas[("user.signed_up", 2)]}
    return dataclasses.replace(table, routes=[*table.routes, oversized], schemas=schemas)


def _imported(engine: Engine, user_id: str) -> str:
    return publish_one(
        engine,
        event_type="user.imported",
        aggregate_id=user_id,
        payload={"user_id": user_id, "email": f"{user_id}@example.com", "first_name": "Ann"},
        routes=poison_routes(),
    )


def test_a_statement_the_database_refuses_is_narrowed_to_its_event(engine, sandbox):
    good = [signup(engine, f"good{i}") for i in range(9)]
    bad = _imported(engine, "imported1")
    good += [signup(engine, f"late{i}") for i in range(9)]
    provider = SandboxProvider(sandbox.base_url, batch_max=100, max_connections=4)
    lane = _lane()
    sender = build_sender(
        engine=engine,
        provider=provider,
        lane=lane,
        sender_address="Example <a@example.com>",
        routes=poison_routes(),
    )
    outcome = sender.run([*good, bad], run_id="run-1")
    provider.close()
    assert outcome.sent == len(good) and outcome.dead == 1
    _assert_sent_once(engine, sandbox.base_url, good)
    (letter,) = dead_letters_of(engine, bad)
    assert letter.error_code == "database_refused" and letter.reason == "unstorable"
    assert event(engine, bad).status == "dead"


def test_a_refused_statement_in_a_batch_run_narrows_too(engine, database_url, sandbox):
    good = [signup(engine, f"good{i}") for i in range(6)]
    bad = _imported(engine, "imported1")
    result = run_send(
        database_url,
        sandbox.base_url,
        "transactional",
        [*good, bad],
        routing=RoutingResource(routes_factory="tests.integration.test_poison:poison_routes"),
    )
    assert not result.success
    _assert_sent_once(engine, sandbox.base_url, good)
    (letter,) = dead_letters_of(engine, bad)
    assert letter.error_code == "database_refused"


# ---- the adapter and the provider's answer -------------------------------------------------------


class _ChokesOn(SandboxProvider):
    """An adapter with a bug: it raises while encoding one particular message."""

    def _body(self, email: OutgoingEmail):  # type: ignore[no-untyped-def]
        if email.to.startswith("boom"):
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "the adapter cannot encode this")
        return super()._body(email)


class _OddAnswer(SandboxProvider):
    """A provider whose answer for one message carries a status no integer column holds."""

    def send_many(self, emails):  # type: ignore[no-untyped-def]
        results = super().send_many(emails)
        return [
            Accepted(r.provider_message_id, status_code=2**63)
            if isinstance(r, Accepted) and e.to.startswith("odd")
            else r
            for e, r in zip(emails, results, strict=True)
        ]


@pytest.mark.parametrize("batch_max", [100, 1], ids=["batch-endpoint", "one-call-each"])
def test_an_adapter_that_raises_on_one_message_fails_only_that_message(engine, sandbox, batch_max):
    good = [signup(engine, f"good{i}") for i in range(12)]
    bad = signup(engine, "boom1", email="boom1@example.com")
    provider = _ChokesOn(sandbox.base_url, batch_max=batch_max, max_connections=2)
    lane = _lane(concurrency=2)
    sender = build_sender(
        engine=engine, provider=provider, lane=lane, sender_address="Example <a@example.com>"
    )
    outcome = sender.run([*good, bad], run_id="run-1")
    provider.close()
    assert outcome.sent == len(good) and outcome.dead == 1
    _assert_sent_once(engine, sandbox.base_url, good)
    (letter,) = dead_letters_of(engine, bad)
    assert letter.reason == "permanent_failure" and "UnicodeEncodeError" in letter.last_error


def test_an_answer_the_database_cannot_store_fails_only_its_message(engine, sandbox, caplog):
    good = [signup(engine, f"good{i}") for i in range(12)]
    odd = signup(engine, "odd1", email="odd1@example.com")
    provider = _OddAnswer(sandbox.base_url, batch_max=100, max_connections=1)
    lane = _lane(concurrency=1)
    sender = build_sender(
        engine=engine, provider=provider, lane=lane, sender_address="Example <a@example.com>"
    )
    with caplog.at_level(logging.INFO, logger=logs.MESSAGES_LOGGER):
        outcome = sender.run([*good, odd], run_id="run-1")
    provider.close()
    # One "accepted" line per message recorded as sent, after its commit: none for the
    # refused group's first try, none for the odd one.
    accepted = [
        logs.fields_of(r)["event_id"]
        for r in caplog.records
        if r.getMessage() == "accepted by the provider"
    ]
    assert sorted(accepted) == sorted(good)
    # All thirteen were in one call and one recording group: the group was refused, recorded
    # again one answer at a time, and only the odd answer's message became a dead letter.
    assert outcome.sent == len(good) and outcome.dead == 1
    _assert_sent_once(engine, sandbox.base_url, good)
    (letter,) = dead_letters_of(engine, odd)
    assert letter.reason == "unstorable" and letter.error_code == "database_refused"
    assert "accepted by the provider" in letter.last_error


# ---- timestamps keep their instant on both databases ------------------------------------------


@pytest.fixture
def pacific() -> Iterator[timezone]:
    yield timezone(timedelta(hours=-8))


def test_offsets_are_kept_as_instants(engine, pacific):
    send_after = (datetime.now(UTC) + timedelta(hours=3)).astimezone(pacific)
    expires_at = send_after + timedelta(hours=1)
    occurred_at = datetime(2026, 11, 29, 6, 22, 18, 42000, tzinfo=pacific)
    event_id = signup(
        engine, "tz1", send_after=send_after, expires_at=expires_at, occurred_at=occurred_at
    )
    row = event(engine, event_id)
    assert as_utc(row.available_at) == send_after
    assert as_utc(row.expires_at) == expires_at
    assert as_utc(row.occurred_at) == occurred_at
    # Not due for three hours: a sender finds nothing to claim yet.
    assert as_utc(row.available_at) > datetime.now(UTC) + timedelta(hours=2, minutes=59)


# ---- webhooks: one stored body never holds up the others --------------------------------------


def test_a_webhook_the_database_cannot_take_as_is_does_not_hold_up_the_others(engine):
    from starlette.testclient import TestClient

    from email_platform.webhooks.ingest import WebhookIngestor
    from email_platform.webhooks.receiver import create_receiver_app
    from tests.webhook_support import SETTINGS, sandbox_event, signed

    client = TestClient(create_receiver_app(engine, settings=SETTINGS))
    good = [sandbox_event("email.delivered", message_id=f"sbx_{i}") for i in range(5)]
    odd = sandbox_event(
        "email.bounced",
        message_id="sbx_\u0000odd",  # NUL: PostgreSQL text cannot hold it
        event_id="E" * 300,  # no event id is 300 characters long
        idempotency_key="k" * 1000,
        to="bounce@example.com",
        bounce_type="hard",
    )
    odd["id"] = "evt_" + "x" * 400  # over-long provider event id
    inbox_ids = []
    for webhook in [*good[:2], odd, *good[2:]]:
        body, headers = signed(webhook)
        answer = client.post("/webhooks/sandbox", content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        inbox_ids.append(answer.json()["inbox_id"])
    outcome = WebhookIngestor(engine).run(inbox_ids, run_id="ingest-1")
    assert outcome.claimed == 6 and outcome.failed == 0 and outcome.malformed == 0
    assert outcome.applied == 6  # the odd one too, with the ids no column can hold left out
    from email_platform.db.schema import email_events, webhook_inbox

    with engine.connect() as connection:
        statuses = {r.status for r in connection.execute(webhook_inbox.select()).all()}
        events = connection.execute(email_events.select()).all()
    assert statuses == {"processed"}
    (bounce,) = [e for e in events if e.event_type == "bounced"]
    assert bounce.event_id is None and bounce.idempotency_key is None
    assert bounce.provider_message_id is None
    assert bounce.provider_event_id.startswith("sha256:")
