"""From publish() to the funnel: real sends through the sandbox provider and real signed
webhooks through the receiver and the ingestor, then the analytics assets in Dagster, on both
backends. Every hop of each event shows up in its funnel row.
"""

from dagster import materialize
from starlette.testclient import TestClient

from email_platform import warehouse
from email_platform.assets import analytics_checks, analytics_warehouse
from email_platform.db.schema import webhook_inbox
from email_platform.resources import AppDatabase, Warehouse
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import run_send, sandbox_messages, signup
from tests.webhook_support import SETTINGS, sandbox_event, signed


def _deliver_webhooks(engine, events) -> None:  # type: ignore[no-untyped-def]
    client = TestClient(create_receiver_app(engine, settings=SETTINGS))
    for event in events:
        body, headers = signed(event)
        assert client.post("/webhooks/sandbox", content=body, headers=headers).status_code == 200
    with engine.connect() as connection:
        ids = [r.inbox_id for r in connection.execute(webhook_inbox.select()).all()]
    WebhookIngestor(engine).run(ids, run_id="analytics-e2e")


def test_real_sends_and_webhooks_land_in_the_funnel(engine, database_url, sandbox, tmp_path):
    opened, bounced, quiet = (signup(engine, f"a{i}") for i in range(3))
    assert run_send(
        database_url, sandbox.base_url, "transactional", [opened, bounced, quiet]
    ).success
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

    first = event_for(opened, "email.delivered")
    _deliver_webhooks(
        engine,
        [
            first,
            first,  # the provider retried the same webhook
            event_for(opened, "email.opened", user_agent="Mozilla/5.0", ip="17.1.2.3"),
            event_for(opened, "email.opened", user_agent="Mozilla/5.0 (Macintosh) Safari"),
            event_for(opened, "email.clicked", click={"url": "https://app.example.com/x"}),
            event_for(bounced, "email.bounced", bounce={"type": "hard", "reason": "550"}),
            event_for(bounced, "email.delivered"),  # late, after the bounce
            sandbox_event("email.delivered", message_id="sbx_not_ours"),
        ],
    )
    path = tmp_path / "warehouse.duckdb"
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_warehouse": Warehouse(path=str(path)),
    }
    result = materialize([analytics_warehouse, *analytics_checks], resources=resources)
    assert result.success
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["one_row_per_message"].passed
    assert checks["no_negative_latencies"].passed
    assert checks["provider_events_joined"].metadata["orphans"].value == 1

    rows = {e: warehouse.funnel_row(path, e)[0] for e in (opened, bounced, quiet)}
    o, b, q = rows[opened], rows[bounced], rows[quiet]
    for row in rows.values():
        assert row["template"] == "welcome" and row["lane"] == "transactional"
        assert row["event_type"] == "user.signed_up" and row["provider"] == "sandbox"
        assert row["recipient_domain"] == "example.com" and row["final_status"] == "sent"
        assert row["event_occurred_at"] <= row["published_at"] <= row["first_attempt_at"]
        assert row["first_attempt_at"] <= row["accepted_at"]
        assert row["event_to_accepted_s"] >= 0 and row["attempts"] == 1
    assert (o["open_count"], o["machine_open_count"], o["click_count"]) == (1, 1, 1)
    assert o["delivered_at"] and o["first_open_at"] and o["first_click_at"]
    assert o["delivery_status"] == "clicked"
    assert (b["bounce_type"], b["delivery_status"]) == ("hard", "bounced")
    assert b["delivered_at"] is not None  # the late delivered event is kept as a fact
    assert q["delivered_at"] is None and q["first_open_at"] is None

    # A second materialization with nothing new loads nothing and keeps every row.
    again = materialize([analytics_warehouse], resources=resources)
    loaded = {
        m.asset_key.path[-1]: m.materialization.metadata.get("rows_loaded")
        for m in again.get_asset_materialization_events()
    }
    assert all(v.value == 0 for v in loaded.values() if v is not None)
    report = warehouse.funnel_report(path, event_ids=[opened, bounced, quiet])
    assert report.welcome_open_rate == 0.5  # one human open of two delivered
    # The data is only these events: the demo's number is the UI's and the question's.
    daily = {
        m.asset_key.path[-1]: m.materialization.metadata
        for m in result.get_asset_materialization_events()
    }["email_funnel_daily"]
    assert daily["2 open rate, welcome, 7d (%)"].value == 50.0
    assert daily["3 machine open rate, all, 7d (%)"].value == 50.0
    assert warehouse.template_rates(path).rate("open_rate", "welcome") == 0.5
    week = warehouse.run_question(path, "rates_by_template_last_7_days")
    assert week.set_index("template").loc["welcome", "open_rate"] == 0.5
    assert warehouse.run_question(path, "welcome_open_rate_last_7_days").iloc[0]["open_rate"] == 0.5
    # Three messages are too few to judge a complaint rate by (none here anyway).
    assert checks["complaint_rate_under_threshold"].passed
    assert checks["complaint_rate_under_threshold"].metadata["rows_checked"].value == 0
