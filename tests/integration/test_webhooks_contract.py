"""What every webhook provider's receiver and ingestion must do, asserted once for all of them
(sandbox, Postmark, SendGrid, Mailgun, Resend, SES), each described by its ``Signer``
(tests/webhook_signers/), on SQLite and PostgreSQL (docs/design.md invariant 7).

* Normalization: every documented fixture normalizes to its expected vocabulary event, with our
  ``event_id`` / ``idempotency_key`` read back from the provider's metadata field; the provider's
  event id is distinct between fixtures and the same on a redelivery or a re-serialization.
* The receiver: an authentic webhook is stored raw before the 2xx; a forged, unsigned, stale or
  future one is refused (401) with nothing stored; missing settings answer 503, an unreachable
  database 503, an oversized body 413; an authentic body that cannot be read is stored as
  malformed and answered 400.
* Ingestion: each fixture lands as one ``email_events`` row linked to its message, moves its
  delivery state and suppresses exactly hard bounces, complaints and unsubscribes; repeated
  requests and redeliveries are applied once; arrival order and duplication do not change the
  final state; replaying stored bodies applies nothing twice.

What is particular to one provider (its signature scheme's edge cases, its mapping tables, SNS
subscriptions, Mailgun token replay, SendGrid batches, ...) stays in that provider's module.
"""

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select

from email_platform.db.engine import make_engine
from email_platform.db.schema import email_events, email_messages, suppressions, webhook_inbox
from email_platform.store import email_events as events_store
from email_platform.store import inbox
from email_platform.webhooks.errors import WebhookMalformed
from email_platform.webhooks.vocabulary import RANK, NormalizedEvent
from tests.webhook_signers import SIGNERS, WITH_FIXTURES
from tests.webhook_support import (
    Ids,
    Signer,
    delivery_status,
    event_rows,
    inbox_rows,
    ingest,
    post,
    reasons,
    receiver,
    seed_sent_message,
)

IDS = Ids(
    event_id="01KE0AB1CD2EF3GH4JK5MN6PQ7",
    idempotency_key="01KE0AB1CD2EF3GH4JK5MN6PQ7:welcome",
    recipient="contract@example.com",
    provider_message_id="contract-message-0001",
)
every_provider = pytest.mark.parametrize("signer", SIGNERS, ids=str)
with_fixtures = pytest.mark.parametrize("signer", WITH_FIXTURES, ids=str)
EVERY_FIXTURE = [
    pytest.param(signer, name, id=f"{signer}-{name}")
    for signer in WITH_FIXTURES
    for name in sorted(signer.expected)
]
EVERY_MALFORMED = [
    pytest.param(signer, body, id=f"{signer}-{index}")
    for signer in SIGNERS
    for index, body in enumerate(signer.malformed)
]


def seed(engine: Engine, signer: Signer, ids: Ids = IDS) -> int:
    return seed_sent_message(
        engine,
        provider=signer.name,
        event_id=ids.event_id,
        recipient=ids.recipient,
        provider_message_id=ids.provider_message_id,
        idempotency_key=ids.idempotency_key,
    )


def normalized(signer: Signer, payload: bytes) -> list[NormalizedEvent]:
    """The events of ``payload`` as the ingestor reads them from an authentic delivery."""
    return signer.provider().normalize(signer.sign(payload)[0])


# --- normalization -----------------------------------------------------------------------------


@with_fixtures
def test_every_fixture_has_an_expectation_and_back(signer: Signer) -> None:
    assert signer.fixtures is not None
    names = {path.stem for path in signer.fixtures.glob("*.json")}
    assert names == set(signer.expected) | set(signer.not_events)


@pytest.mark.parametrize(("signer", "name"), EVERY_FIXTURE)
def test_fixture_normalizes_to_its_vocabulary_entry(signer: Signer, name: str) -> None:
    expected = signer.expected[name]
    (event,) = normalized(signer, signer.fixture(name))
    assert event.provider == signer.name
    assert event.event_type == expected.event_type
    assert event.recipient == expected.recipient
    assert (event.event_id, event.idempotency_key) == (expected.event_id, expected.idempotency_key)
    assert event.provider_message_id == expected.provider_message_id
    assert event.occurred_at == expected.occurred_at
    assert event.bounce_type == expected.bounce_type
    assert event.suppression_reason == expected.suppression
    if expected.reason is None:
        assert event.reject_reason is None
    else:
        assert event.reject_reason is not None
        assert event.reject_reason.startswith(expected.reason)
        assert len(event.reject_reason) <= 255
    assert event.machine_open is expected.machine_open
    assert event.click_url == expected.click_url
    assert (event.user_agent, event.ip) == (expected.user_agent, expected.ip)
    if expected.provider_event_id:
        assert event.provider_event_id == expected.provider_event_id
    else:
        assert event.provider_event_id.startswith("sha256:")
    assert event.raw == signer.raw(json.loads(signer.fixture(name)))


@with_fixtures
def test_fixture_event_ids_are_distinct_between_events(signer: Signer) -> None:
    ids = {
        name: normalized(signer, signer.fixture(name))[0].provider_event_id
        for name in signer.expected
    }
    assert len(set(ids.values())) == len(ids)


@every_provider
def test_an_event_keeps_its_id_when_redelivered_or_reserialized(signer: Signer) -> None:
    """What dedupes a replay at ingestion: same event -> same id; another event -> another."""
    payload = signer.event("opened", IDS)
    (first,) = normalized(signer, payload)
    (again,) = normalized(signer, payload)  # another delivery: new delivery id, new signature
    reformatted = json.dumps(json.loads(payload), indent=2, sort_keys=True).encode()
    (other_bytes,) = normalized(signer, reformatted)
    assert first.provider_event_id == again.provider_event_id == other_bytes.provider_event_id
    (delivered,) = normalized(signer, signer.event("delivered", IDS))
    assert delivered.provider_event_id != first.provider_event_id


# --- the receiver ------------------------------------------------------------------------------


@every_provider
def test_authentic_webhook_is_stored_raw_before_the_2xx(engine: Engine, signer: Signer) -> None:
    request = signer.sign(signer.event("delivered", IDS))
    response = post(receiver(engine, signer), signer, request)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    (row,) = inbox_rows(engine)
    assert response.json()["inbox_id"] == row.inbox_id
    assert row.body.encode() == request[0]  # byte for byte
    assert (row.provider, row.status) == (signer.name, "pending")
    assert row.delivery_id == signer.delivery_id(request)
    sent = {name.lower(): value for name, value in request[1].items()}
    for name in signer.kept_headers:
        assert row.headers[name] == sent[name], name
    for name in signer.secret_headers:
        assert name in sent and name not in row.headers, name


@every_provider
def test_forged_or_unsigned_webhook_is_refused_and_nothing_is_stored(
    engine: Engine, signer: Signer
) -> None:
    payload = signer.event("bounced", IDS)
    client = receiver(engine, signer)
    for case, request in (("forged", signer.forge(payload)), ("unsigned", signer.strip(payload))):
        response = post(client, signer, request)
        assert response.status_code == 401, (case, response.text)
    assert inbox_rows(engine) == []
    # The same payload, authentic, goes through: the refusals were about the signature.
    assert post(client, signer, signer.sign(payload)).status_code == 200


@pytest.mark.parametrize(
    "signer",
    [signer for signer in SIGNERS if signer.sign_at is not None],  # Postmark: no clock at all
    ids=str,
)
def test_stale_and_future_signatures_are_refused_and_nothing_is_stored(
    engine: Engine, signer: Signer
) -> None:
    assert signer.sign_at is not None
    payload = signer.event("bounced", IDS)
    client = receiver(engine, signer)
    oldest, ahead = signer.window
    now = int(time.time())
    stale = signer.sign_at(payload, now - oldest - 1)
    future = signer.sign_at(payload, now + ahead + 60)  # the receiver reads its clock later
    for case, request in (("stale", stale), ("future", future)):
        response = post(client, signer, request)
        assert response.status_code == 401, (case, response.text)
    assert inbox_rows(engine) == []
    inside = signer.sign_at(payload, now - oldest + 60)
    assert post(client, signer, inside).status_code == 200


@every_provider
def test_missing_settings_answer_503_not_an_open_door(engine: Engine, signer: Signer) -> None:
    request = signer.sign(signer.event("delivered", IDS))
    assert post(receiver(engine, signer, settings={}), signer, request).status_code == 503
    assert inbox_rows(engine) == []


@every_provider
def test_oversized_body_is_refused_with_413_and_not_stored(engine: Engine, signer: Signer) -> None:
    request = signer.sign(signer.event("delivered", IDS))
    small = receiver(engine, signer, max_body_bytes=len(request[0]) - 1)
    assert post(small, signer, request).status_code == 413
    assert inbox_rows(engine) == []
    exact = receiver(engine, signer, max_body_bytes=len(request[0]))
    assert post(exact, signer, request).status_code == 200


@every_provider
def test_database_down_answers_503_so_the_provider_retries(signer: Signer) -> None:
    engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    request = signer.sign(signer.event("delivered", IDS))
    assert post(receiver(engine, signer), signer, request).status_code == 503


@pytest.mark.parametrize(("signer", "body"), EVERY_MALFORMED)
def test_authentic_but_unreadable_body_is_stored_as_malformed_and_answered_400(
    engine: Engine, signer: Signer, body: bytes
) -> None:
    request = signer.sign(body)
    with pytest.raises(WebhookMalformed):
        signer.provider().normalize(request[0])
    response = post(receiver(engine, signer), signer, request)
    assert response.status_code == 400
    (row,) = inbox_rows(engine)
    assert (row.status, row.body.encode()) == ("malformed", request[0])
    assert row.error and response.json()["inbox_id"] == row.inbox_id
    assert ingest(engine, signer).claimed == 0  # nothing pending for the ingestor
    assert event_rows(engine) == []


# --- ingestion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("signer", "name"), EVERY_FIXTURE)
def test_every_fixture_is_received_linked_applied_and_suppresses(
    engine: Engine, signer: Signer, name: str
) -> None:
    expected = signer.expected[name]
    message_id = None
    if expected.event_id:  # a record about one of our messages
        message_id = seed_sent_message(
            engine,
            provider=signer.name,
            event_id=expected.event_id,
            recipient=expected.recipient,
            provider_message_id=expected.provider_message_id,
        )
    response = post(receiver(engine, signer), signer, signer.sign(signer.fixture(name)))
    assert response.status_code == 200 and response.json()["status"] == "stored"

    outcome = ingest(engine, signer)
    assert (outcome.claimed, outcome.applied, outcome.duplicates, outcome.malformed) == (1, 1, 0, 0)
    assert outcome.unlinked == (0 if message_id else 1)
    assert outcome.suppressed == (1 if expected.suppression else 0)
    (row,) = event_rows(engine)
    assert (row.provider, row.event_type) == (signer.name, expected.event_type)
    assert (row.message_id, row.inbox_id) == (message_id, response.json()["inbox_id"])
    assert (row.event_id, row.idempotency_key) == (expected.event_id, expected.idempotency_key)
    assert row.provider_message_id == expected.provider_message_id
    assert row.recipient == expected.recipient
    assert row.recipient_domain == expected.recipient.rsplit("@", 1)[1]
    assert (row.bounce_type, row.machine_open) == (expected.bounce_type, expected.machine_open)
    assert (row.click_url, row.user_agent) == (expected.click_url, expected.user_agent)
    if expected.reason is None:
        assert row.reject_reason is None
    else:
        assert row.reject_reason.startswith(expected.reason)
    if message_id is not None:
        assert delivery_status(engine, message_id) == expected.event_type
    suppressed = {expected.recipient: expected.suppression} if expected.suppression else {}
    assert reasons(engine, expected.recipient) == suppressed
    assert ingest(engine, signer).claimed == 0  # all done; a second pass has nothing to do


@with_fixtures
def test_all_fixtures_about_one_message_leave_it_in_the_highest_ranked_state(
    engine: Engine, signer: Signer
) -> None:
    message_id = seed(engine, signer)
    client = receiver(engine, signer)
    for name in signer.expected:
        response = post(client, signer, signer.sign(signer.build(name, IDS)))
        assert response.status_code == 200 and response.json()["status"] == "stored", name
    linked = [e.event_type for e in signer.expected.values() if e.event_id]
    outcome = ingest(engine, signer)
    assert (outcome.applied, outcome.duplicates) == (len(signer.expected), 0)
    assert outcome.unlinked == len(signer.expected) - len(linked)
    assert delivery_status(engine, message_id) == max(linked, key=lambda kind: RANK[kind])


@pytest.mark.parametrize("kind", ["bounced", "opened"])  # with a provider id / often a hash only
@every_provider
def test_a_repeated_request_is_acknowledged_and_applied_once(
    engine: Engine, signer: Signer, kind: str
) -> None:
    message_id = seed(engine, signer)
    request = signer.sign(signer.event(kind, IDS))
    client = receiver(engine, signer)
    # A retry after a lost 2xx, or an attacker who captured one request.
    responses = [post(client, signer, request) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 200]
    statuses = [r.json()["status"] for r in responses]
    if signer.dedupes_deliveries:
        assert statuses == ["stored", "duplicate", "duplicate"]
        assert len(inbox_rows(engine)) == 1
    else:  # no delivery id to dedupe on: stored again, applied once at ingestion
        assert statuses == ["stored", "stored", "stored"]
        assert len(inbox_rows(engine)) == 3
    stored = len(inbox_rows(engine))
    outcome = ingest(engine, signer)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (stored, 1, stored - 1)
    (row,) = event_rows(engine)
    assert (row.message_id, row.event_type) == (message_id, kind)


@every_provider
def test_the_same_event_in_a_new_delivery_is_stored_and_applied_once(
    engine: Engine, signer: Signer
) -> None:
    """The provider's own retry or "replay" button: a fresh signature, the same event."""
    seed(engine, signer)
    payload = signer.event("complained", IDS)
    client = receiver(engine, signer)
    for _ in range(2):
        response = post(client, signer, signer.sign(payload))
        assert response.status_code == 200 and response.json()["status"] == "stored"
    outcome = ingest(engine, signer)
    assert (outcome.claimed, outcome.applied, outcome.duplicates) == (2, 1, 1)
    assert outcome.suppressed == 1
    (row,) = event_rows(engine)
    assert row.event_type == "complained"


@every_provider
def test_replaying_stored_webhooks_applies_nothing_twice(engine: Engine, signer: Signer) -> None:
    message_id = seed(engine, signer)
    client = receiver(engine, signer)
    for kind in ("delivered", "opened"):
        assert post(client, signer, signer.sign(signer.event(kind, IDS))).status_code == 200
    assert ingest(engine, signer).applied == 2
    # A mapping fix: the stored bodies are normalized again from the inbox.
    with engine.begin() as connection:
        ids = inbox.reprocessable_ids(connection)
        events_store.delete_for_inbox_rows(connection, ids)
        assert inbox.requeue(connection, ids) == 2
    assert ingest(engine, signer).applied == 2
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(email_events)).scalar() == 2
    assert delivery_status(engine, message_id) == "opened"


STRONGEST_LAST = (
    ("unsubscribed", "unsubscribe"),
    ("bounced", "hard_bounce"),
    ("complained", "complaint"),
)


def _property_message(engine: Engine, signer: Signer) -> int:
    """The one sent message the generated events are about (created once per test)."""
    with engine.connect() as connection:
        found = connection.execute(
            select(email_messages.c.message_id).where(
                email_messages.c.idempotency_key == IDS.idempotency_key
            )
        ).scalar()
    return found if found is not None else seed(engine, signer)


@every_provider
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_order_and_duplication_gives_the_same_final_state(
    engine: Engine, signer: Signer, data: st.DataObject
) -> None:
    message_id = _property_message(engine, signer)
    with engine.begin() as connection:
        connection.execute(email_events.delete())
        connection.execute(webhook_inbox.delete())
        connection.execute(suppressions.delete())
        connection.execute(email_messages.update().values(delivery_status=None))
    kinds = data.draw(
        st.lists(st.sampled_from(sorted(signer.templates)), min_size=1, max_size=5, unique=True)
    )
    payloads = [signer.event(kind, IDS) for kind in kinds]
    # Any order, each delivered one to three times, each time as a new delivery: the
    # ingestion's own dedupe is what is under test.
    repeats = [data.draw(st.integers(1, 3)) for _ in payloads]
    copies = [p for p, n in zip(payloads, repeats, strict=True) for _ in range(n)]
    client = receiver(engine, signer)
    for payload in data.draw(st.permutations(copies)):
        assert post(client, signer, signer.sign(payload)).status_code == 200
    ingest(engine, signer)

    with engine.connect() as connection:
        stored = sorted(r.event_type for r in connection.execute(select(email_events)))
    assert stored == sorted(kinds)  # each provider event applied exactly once
    assert delivery_status(engine, message_id) == max(kinds, key=lambda kind: RANK[kind])
    expected_reason = None
    for kind, reason in STRONGEST_LAST:
        if kind in kinds:
            expected_reason = reason  # the strongest present wins, whatever the order
    assert reasons(engine, IDS.recipient) == (
        {IDS.recipient: expected_reason} if expected_reason else {}
    )
