"""Sandbox webhooks through the real send path, the receiver's routing, the ingestion job and
the trace, on SQLite and PostgreSQL (docs/design.md invariant 7). What every provider must do -
verification, raw storage before the 2xx, dedupe, any arrival order, replays - is asserted once
for all of them, the sandbox included, in tests/integration/test_webhooks_contract.py.

* The rest of the Standard Webhooks headers (tampered body, missing or garbled fields) is
  refused with nothing stored; an unknown provider is 404.
* Events about messages the send job really sent link to them, carry bounce, open and click
  details and suppress; the next send skips the suppressed address; a soft bounce does not.
* The ingestion job applies its batch and purges raw bodies and deletion records past
  retention; the trace of an event lists its provider events.
"""

from sqlalchemy import func, select
from starlette.testclient import TestClient

from email_platform.db.schema import email_event_deletions, email_events, webhook_inbox
from email_platform.store import suppressions
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import messages_of, run_send, sandbox_messages, signup
from tests.webhook_support import SETTINGS, sandbox_event, signed


def _client(engine, **kwargs) -> TestClient:  # type: ignore[no-untyped-def]
    return TestClient(create_receiver_app(engine, settings=SETTINGS, **kwargs))


def _inbox(engine) -> list:  # type: ignore[no-untyped-def]
    with engine.connect() as connection:
        return list(connection.execute(select(webhook_inbox).order_by(webhook_inbox.c.inbox_id)))


def test_tampered_and_incomplete_webhooks_are_refused_and_not_stored(engine):
    """Another secret, no signature, stale and future timestamps are in the contract
    (test_webhooks_contract.py); these are the rest of the Standard Webhooks headers."""
    client = _client(engine)
    body, good = signed(sandbox_event("email.bounced", bounce={"type": "hard"}))
    tampered = body.replace(b"bounced", b"delivered")
    cases = [
        (tampered, good),
        (body, {k: v for k, v in good.items() if k != "webhook-timestamp"}),
        (body, {k: v for k, v in good.items() if k != "webhook-id"}),
        (body, {**good, "webhook-signature": "v1,"}),
        (body, {**good, "webhook-timestamp": "soon"}),
    ]
    for case_body, case_headers in cases:
        response = client.post("/webhooks/sandbox", content=case_body, headers=case_headers)
        assert response.status_code == 401, (case_headers, response.text)
    assert _inbox(engine) == []
    assert client.post("/webhooks/sandbox", content=body, headers=good).status_code == 200


def test_unknown_provider_is_404(engine):
    body, headers = signed(sandbox_event("email.delivered"))
    assert (
        _client(engine).post("/webhooks/nosuch", content=body, headers=headers).status_code == 404
    )
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
    from email_platform.common.timeutil import utcnow

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
    job = build_definitions(email_database=AppDatabase(url=database_url)).get_job_def(
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
    from email_platform.operating.admin import trace

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
