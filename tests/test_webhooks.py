"""Webhooks are verified, stored raw before 2xx, normalized once and applied in any order
(DESIGN.md invariant 7), on SQLite and PostgreSQL.
"""

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from starlette.testclient import TestClient

from email_platform.db.engine import make_engine
from email_platform.db.schema import email_event_deletions, email_events, webhook_inbox
from email_platform.store import suppressions
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from email_platform.webhooks.vocabulary import RANK
from tests.support import messages_of, run_send, sandbox_messages, signup
from tests.webhook_support import SECRET, SETTINGS, sandbox_event, signed


def _client(engine, **kwargs) -> TestClient:  # type: ignore[no-untyped-def]
    return TestClient(create_receiver_app(engine, settings=SETTINGS, **kwargs))


def _inbox(engine) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return list(connection.execute(select(webhook_inbox).order_by(webhook_inbox.c.inbox_id)))


def test_authentic_webhook_is_stored_raw_before_the_2xx(engine):
    body, headers = signed(sandbox_event("email.delivered"))
    response = _client(engine).post("/webhooks/sandbox", content=body, headers=headers)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    (row,) = _inbox(engine)
    assert row.body.encode() == body  # byte for byte
    assert row.provider == "sandbox" and row.status == "pending"
    assert row.delivery_id == headers["webhook-id"]
    assert row.headers["webhook-signature"] == headers["webhook-signature"]


def test_forged_stale_future_and_incomplete_webhooks_are_refused_and_not_stored(engine):
    client = _client(engine)
    event = sandbox_event("email.bounced", bounce={"type": "hard"})
    forged_body, forged = signed(event, secret="whsec_" + "d3Jvbmcta2V5")
    stale_body, stale = signed(event, timestamp=int(time.time()) - 600)
    future_body, future = signed(event, timestamp=int(time.time()) + 600)
    body, good = signed(event)
    tampered = body.replace(b"bounced", b"delivered")
    cases = [
        (forged_body, forged),
        (stale_body, stale),
        (future_body, future),
        (tampered, good),
        (body, {k: v for k, v in good.items() if k != "webhook-signature"}),
        (body, {k: v for k, v in good.items() if k != "webhook-timestamp"}),
        (body, {**good, "webhook-signature": "v1,"}),
    ]
    for case_body, case_headers in cases:
        response = client.post("/webhooks/sandbox", content=case_body, headers=case_headers)
        assert response.status_code == 401, (case_headers, response.text)
    assert _inbox(engine) == []


def test_duplicate_delivery_is_acknowledged_and_stored_once(engine):
    client = _client(engine)
    body, headers = signed(sandbox_event("email.opened"))
    assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    again = client.post("/webhooks/sandbox", content=body, headers=headers)
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    assert len(_inbox(engine)) == 1


def test_oversized_malformed_and_unknown_provider(engine):
    client = _client(engine, max_body_bytes=2048)
    big = sandbox_event("email.delivered", padding="x" * 4096)
    body, headers = signed(big)
    assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 413
    assert _inbox(engine) == []
    garbage = b"{not json"
    timestamp = int(time.time())
    from email_platform.webhooks.standard import sign

    response = client.post(
        "/webhooks/sandbox",
        content=garbage,
        headers={
            "webhook-id": "msg_1",
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(SECRET, "msg_1", timestamp, garbage),
        },
    )
    assert response.status_code == 400
    (row,) = _inbox(engine)
    assert row.status == "malformed" and row.body == "{not json"
    assert client.post("/webhooks/nosuch", content=body, headers=headers).status_code == 404


def test_database_down_answers_503_so_the_provider_retries():
    engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    body, headers = signed(sandbox_event("email.delivered"))
    response = _client(engine).post("/webhooks/sandbox", content=body, headers=headers)
    assert response.status_code == 503


def test_missing_secret_is_a_503_not_an_open_door(engine):
    client = TestClient(create_receiver_app(engine, settings={}))
    body, headers = signed(sandbox_event("email.delivered"))
    assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 503
    assert _inbox(engine) == []


def _post_all(engine, events) -> None:  # type: ignore[no-untyped-def]
    client = _client(engine)
    for event in events:
        body, headers = signed(event)
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200


def _ingest(engine) -> object:  # type: ignore[no-untyped-def]
    ids = [row.inbox_id for row in _inbox(engine) if row.status == "pending"]
    return WebhookIngestor(engine).run(ids, run_id="test-run")


def test_ingestion_links_events_to_the_message_and_suppresses(engine, database_url, sandbox):
    bounced = signup(engine, "u1")
    complained = signup(engine, "u2")
    assert run_send(database_url, sandbox.base_url, "transactional", [bounced, complained]).success
    sent = {m["metadata"]["event_id"]: m for m in sandbox_messages(sandbox.base_url)}

    def event_for(event_id: str, kind: str, **data):  # type: ignore[no-untyped-def]
        m = sent[event_id]
        return sandbox_event(
            kind,
            message_id=m["id"],
            to=m["to"],
            event_id=event_id,
            idempotency_key=m["idempotency_key"],
            **data,
        )

    events = [
        event_for(bounced, "email.bounced", bounce={"type": "hard", "reason": "550 unknown"}),
        event_for(bounced, "email.delivered"),  # late and out of order
        event_for(complained, "email.delivered"),
        event_for(complained, "email.opened", user_agent="Mozilla/5.0", ip="17.1.2.3"),
        event_for(complained, "email.clicked", click={"url": "https://x.example/a"}),
        event_for(complained, "email.complained"),
        sandbox_event("email.delivered", message_id="sbx_unknown"),  # not ours
    ]
    _post_all(engine, events)
    outcome = _ingest(engine)
    assert (outcome.claimed, outcome.applied, outcome.unlinked, outcome.suppressed) == (7, 7, 1, 2)
    assert messages_of(engine, bounced)[0].delivery_status == "bounced"
    assert messages_of(engine, complained)[0].delivery_status == "complained"
    with engine.connect() as connection:
        rows = connection.execute(select(email_events).order_by(email_events.c.email_event_id))
        by_type = {(r.event_id, r.event_type): r for r in rows}
        reasons = suppressions.reasons_for(connection, ["u1@example.com", "U2@example.com"])
    assert by_type[(bounced, "bounced")].bounce_type == "hard"
    assert by_type[(bounced, "bounced")].reject_reason == "550 unknown"
    assert by_type[(complained, "opened")].machine_open is True  # Apple proxy
    assert by_type[(complained, "clicked")].click_url == "https://x.example/a"
    assert by_type[(complained, "clicked")].recipient_domain == "example.com"
    assert reasons == {"u1@example.com": "hard_bounce", "u2@example.com": "complaint"}
    # The suppression list is read on the next send: nothing goes out to u1.
    again = signup(engine, "u1b", email="u1@example.com")
    run_send(database_url, sandbox.base_url, "transactional", [again])
    assert messages_of(engine, again)[0].status == "suppressed"
    # Everything already applied: a second pass finds nothing to do.
    assert _ingest(engine).claimed == 0


def test_soft_bounce_does_not_suppress(engine):
    _post_all(
        engine,
        [
            sandbox_event(
                "email.bounced",
                to="soft@example.com",
                bounce={"type": "soft", "reason": "452 full"},
            )
        ],
    )
    assert _ingest(engine).suppressed == 0
    with engine.connect() as connection:
        assert suppressions.reasons_for(connection, ["soft@example.com"]) == {}


def test_replaying_stored_webhooks_applies_nothing_twice(engine):
    events = [sandbox_event("email.delivered"), sandbox_event("email.opened")]
    _post_all(engine, events)
    _ingest(engine)
    # A mapping fix: the stored bodies are normalized again from the inbox.
    from email_platform.store import email_events as events_store
    from email_platform.store import inbox

    with engine.begin() as connection:
        ids = inbox.reprocessable_ids(connection)
        events_store.delete_for_inbox_rows(connection, ids)
        assert inbox.requeue(connection, ids) == 2
    assert _ingest(engine).applied == 2
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(email_events)).scalar() == 2


KINDS = [
    "email.delivered",
    "email.opened",
    "email.clicked",
    "email.bounced",
    "email.complained",
    "email.delivery_delayed",
    "email.unsubscribed",
]
VOCABULARY = {
    "email.delivered": "delivered",
    "email.opened": "opened",
    "email.clicked": "clicked",
    "email.bounced": "bounced",
    "email.complained": "complained",
    "email.delivery_delayed": "deferred",
    "email.unsubscribed": "unsubscribed",
}


def _property_message(engine) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """One sent message the generated events are about (created once per test)."""
    from email_platform.db.schema import email_messages
    from email_platform.store import messages
    from email_platform.timeutil import utcnow

    with engine.begin() as connection:
        row = connection.execute(
            select(email_messages).where(email_messages.c.idempotency_key == "prop:welcome")
        ).first()
    if row is not None:
        return row.event_id, row.idempotency_key
    event_id = signup(engine, "prop", email="prop@example.com")
    now = utcnow()
    with engine.begin() as connection:
        messages.create(
            connection,
            {
                "event_id": event_id,
                "route": "welcome",
                "template": "welcome",
                "template_version": 1,
                "lane": "transactional",
                "recipient": "prop@example.com",
                "recipient_domain": "example.com",
                "idempotency_key": "prop:welcome",
                "status": "sent",
                "created_at": now,
                "updated_at": now,
                "provider": "sandbox",
                "provider_message_id": "sbx_prop",
            },
        )
    return event_id, "prop:welcome"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=5, unique=True),
    data=st.data(),
)
def test_any_order_and_duplication_gives_the_same_final_state(engine, kinds, data):
    from email_platform.db.schema import email_messages
    from email_platform.db.schema import suppressions as suppression_table

    event_id, key = _property_message(engine)
    with engine.begin() as connection:
        connection.execute(email_events.delete())
        connection.execute(webhook_inbox.delete())
        connection.execute(suppression_table.delete())
        connection.execute(email_messages.update().values(delivery_status=None))
    events = [
        sandbox_event(
            k,
            to="prop@example.com",
            message_id="sbx_prop",
            event_id=event_id,
            idempotency_key=key,
            bounce={"type": "hard", "reason": "550"},
        )
        for k in kinds
    ]
    # Any order, each delivered one to three times.
    repeats = [data.draw(st.integers(1, 3)) for _ in events]
    copies = [e for e, n in zip(events, repeats, strict=True) for _ in range(n)]
    deliveries = data.draw(st.permutations(copies))
    client = _client(engine)
    for index, event in enumerate(deliveries):
        # A fresh delivery id each time: the ingestion's own dedupe is what is under test.
        body, headers = signed(event, webhook_id=f"d{index}")
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    _ingest(engine)

    types = sorted(VOCABULARY[k] for k in kinds)
    with engine.connect() as connection:
        stored = sorted(r.event_type for r in connection.execute(select(email_events)))
        reasons = suppressions.reasons_for(connection, ["prop@example.com"])
    (message,) = messages_of(engine, event_id)
    assert stored == types  # each provider event applied exactly once
    assert message.delivery_status == max(types, key=lambda t: RANK[t])
    expected_reason = None
    for kind, reason in (
        ("unsubscribed", "unsubscribe"),
        ("bounced", "hard_bounce"),
        ("complained", "complaint"),
    ):
        if kind in types:
            expected_reason = reason  # the strongest present wins, whatever the order
    assert reasons == ({"prop@example.com": expected_reason} if expected_reason else {})


def test_ingestion_job_applies_the_batch_and_purges_past_retention(
    engine, database_url, monkeypatch
):
    from datetime import timedelta

    from dagster import DagsterInstance

    from email_platform.definitions import build_definitions
    from email_platform.resources import AppDatabase

    old = sandbox_event("email.delivered", to="old@example.com")
    _post_all(engine, [old])
    _ingest(engine)
    from email_platform.timeutil import utcnow

    with engine.begin() as connection:  # received long ago
        connection.execute(webhook_inbox.update().values(received_at=utcnow() - timedelta(days=91)))
    fresh = [
        sandbox_event("email.delivered"),
        sandbox_event("email.clicked", click={"url": "https://a.example"}),
    ]
    _post_all(engine, fresh)
    pending = [r.inbox_id for r in _inbox(engine) if r.status == "pending"]
    with engine.begin() as connection:  # records of deleted provider events, one past retention
        connection.execute(
            email_event_deletions.insert(),
            [
                {"email_event_id": 7, "received_at": utcnow(), "deleted_at": utcnow() - age}
                for age in (timedelta(days=91), timedelta(days=1))
            ],
        )
    monkeypatch.setenv("EMAIL_PLATFORM_WEBHOOK_RETENTION_DAYS", "90")
    job = build_definitions(app_database=AppDatabase(url=database_url)).get_job_def(
        "ingest_webhooks_job"
    )
    result = job.execute_in_process(
        run_config={"ops": {"ingest_webhook_batch": {"config": {"inbox_ids": pending}}}},
        instance=DagsterInstance.ephemeral(),
    )
    assert result.success
    summary = result.output_for_node("ingest_webhook_batch")
    assert (summary["claimed"], summary["applied"], summary["purged"]) == (2, 2, 1)
    assert summary["deletion_records_purged"] == 1
    assert [r.status for r in _inbox(engine)] == ["processed", "processed"]
    with engine.connect() as connection:
        # The raw body went; the normalized event it produced stays for analytics.
        assert connection.execute(select(func.count()).select_from(email_events)).scalar() == 3
        kept = connection.execute(select(email_event_deletions.c.deleted_at)).scalars().all()
        assert len(kept) == 1 and kept[0].replace(tzinfo=None) > (
            utcnow() - timedelta(days=2)
        ).replace(tzinfo=None)


def test_trace_shows_the_provider_events_of_an_event(engine, database_url, sandbox):
    from email_platform.admin import trace

    event_id = signup(engine, "t1")
    assert run_send(database_url, sandbox.base_url, "transactional", [event_id]).success
    (sent,) = sandbox_messages(sandbox.base_url)
    _post_all(
        engine,
        [
            sandbox_event(
                kind,
                message_id=sent["id"],
                to=sent["to"],
                event_id=event_id,
                idempotency_key=sent["idempotency_key"],
            )
            for kind in ("email.delivered", "email.opened")
        ],
    )
    _ingest(engine)
    chain = trace(engine, event_id)
    assert [e["event_type"] for e in chain["provider_events"]] == ["delivered", "opened"]
    assert {e["message_id"] for e in chain["provider_events"]} == {
        chain["messages"][0]["message_id"]
    }
