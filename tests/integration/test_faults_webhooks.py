"""The chaos harness's webhook scenario (bench/faults/webhooks.py) on the real parts: the
receiver over HTTP, the sandbox posting signed webhooks for mail the real send job sent, hostile
traffic from ``inject``, ingestion in concurrent runs as the inbox sensor starts them, and
``check``'s verdict: nothing lost, doubled or wrong (docs/design.md invariants 7 and 10).
"""

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import delete, insert, select, update

from bench.faults.webhooks import check, fetch_planned, inject, wait_posted, wait_settled
from email_platform.common.ids import new_ulid
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_events, email_messages, suppressions, webhook_inbox
from email_platform.sandbox.asgi import BackgroundServer
from email_platform.sandbox.emitter import WebhookPlan, plan_events
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.store import inbox
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.receiver import create_receiver_app
from tests.support import run_send, signup
from tests.webhook_support import SECRET, SETTINGS, seed_sent_message

RATES = {
    "bounce_rate": 0.15,
    "complaint_rate": 0.1,
    "unsubscribe_rate": 0.1,
    "open_rate": 0.7,
    "click_rate": 0.5,
    "duplicate_rate": 0.2,
    "max_attempts": 12,
}
DIRECTED = ["bounce", "softbounce", "complaint", "unsubscribe", "click", "machineopen"]


def _ingest_pending(engine, *, workers: int = 3, batch: int = 5) -> None:  # type: ignore[no-untyped-def]
    """What the inbox sensor does: the pending rows in small batches, several runs at once."""
    with engine.connect() as connection:
        ids = list(
            connection.execute(
                select(webhook_inbox.c.inbox_id)
                .where(webhook_inbox.c.status == inbox.PENDING)
                .order_by(webhook_inbox.c.inbox_id)
            ).scalars()
        )
    batches = [ids[start : start + batch] for start in range(0, len(ids), batch)]
    with ThreadPoolExecutor(workers) as pool:
        runs = [
            pool.submit(WebhookIngestor(engine).run, b, run_id=f"faults-{b[0]}") for b in batches
        ]
        for run in runs:
            run.result()


def test_hostile_webhook_traffic_loses_doubles_and_corrupts_nothing(engine, database_url):
    receiver = BackgroundServer(create_receiver_app(engine, settings=SETTINGS))
    receiver_url = receiver.start()
    # The webhooks go out 4 s after acceptance: inject's reorders arrive before the originals.
    plan = WebhookPlan(f"{receiver_url}/webhooks/sandbox", SECRET, delay_s=4.0, **RATES)
    addresses = [f"f{i}@example.com" for i in range(24)]
    addresses += [f"d{i}+{tag}@example.com" for i, tag in enumerate(DIRECTED)]
    addresses += ["twice+bounce@example.com", "twice+bounce@example.com"]
    stop = threading.Event()

    def ingest_meanwhile() -> None:
        while not stop.wait(0.3):
            _ingest_pending(engine)

    ingesting = threading.Thread(target=ingest_meanwhile)
    try:
        with SandboxServer(SandboxConfig(webhooks=plan, seed=11)) as sandbox_url:
            ids = [signup(engine, f"u{n}", email=a) for n, a in enumerate(addresses)]
            assert run_send(database_url, sandbox_url, "transactional", ids).success
            planned = fetch_planned(sandbox_url)
            ingesting.start()
            counts = inject(
                receiver_url, SECRET, planned, random.Random(7), size=6, flood=200, flood_s=15
            )
            records = wait_posted(sandbox_url, 90)
    finally:
        stop.set()
        if ingesting.is_alive():
            ingesting.join(60)
        receiver.stop()
    _ingest_pending(engine)
    assert wait_settled(engine, timeout_s=5)

    assert len(records) == len(planned) > len(addresses)  # one to four events a message
    assert {r["outcome"] for r in records} == {"delivered"}
    assert counts["hostile_5xx"] == counts["hostile_accepted"] == 0, counts
    assert counts["authentic_unacknowledged"] == 0, counts
    for kind in ("reordered", "duplicate", "redelivered", "abandoned", "forged", "stale"):
        assert counts[kind] >= 6, (kind, counts)
    assert counts["forged:401"] == counts["forged"] and counts["stale:401"] == counts["stale"]
    assert counts["oversized:413"] == counts["oversized"] == 3, counts
    assert counts["replayed:200"] == counts["replayed"] == 6, counts
    assert counts["flood"] == 200 and counts["flood_good:200"] == 6, counts

    verdict = check(engine, records)
    assert (verdict.lost, verdict.doubled, verdict.wrong) == (0, 0, 0), verdict.details
    assert verdict.counts["planned"] == verdict.counts["email_events"] == len(records)
    assert verdict.counts["suppressions_expected"] >= 4
    assert verdict.counts["inbox:processed"] == verdict.counts["inbox_rows"] > len(records)


def _store(connection, delivery_id: str, body: str) -> None:  # type: ignore[no-untyped-def]
    inbox.store(
        connection, provider="sandbox", delivery_id=delivery_id, headers={}, body=body, now=utcnow()
    )


def _small_world(engine) -> list[dict]:  # type: ignore[no-untyped-def]
    """Three sent messages (one bounces, one complains) and their planned events, stored and
    ingested without HTTP."""
    rates = {"bounce_rate": 0, "complaint_rate": 0, "unsubscribe_rate": 0, "machine_open_rate": 0}
    plan = WebhookPlan(
        "http://unused", SECRET, delivered_rate=1, open_rate=1, click_rate=1, **rates
    )
    planned: list[dict] = []
    for n, to in enumerate(["a@example.com", "b+bounce@example.com", "c+complaint@example.com"]):
        event_id = new_ulid()
        seed_sent_message(
            engine, provider="sandbox", event_id=event_id, recipient=to, provider_message_id=f"s{n}"
        )
        metadata = {"event_id": event_id, "idempotency_key": f"{event_id}:welcome"}
        message = {"id": f"s{n}", "to": to, "metadata": metadata}
        planned += plan_events(plan, message, random.Random(n))
    with engine.begin() as connection:
        for event in planned:
            _store(connection, event["id"], json.dumps(event))
    _ingest_pending(engine)
    return planned


def test_check_names_what_is_lost_doubled_or_wrong(engine):
    planned = _small_world(engine)
    assert check(engine, planned).ok
    clicked = next(e for e in planned if e["type"] == "email.clicked")
    with engine.begin() as connection:
        # lost: one applied event gone ...
        connection.execute(
            delete(email_events).where(email_events.c.provider_event_id == clicked["id"])
        )
        # ... doubled: an event applied again under another id ...
        opened = (
            connection.execute(
                select(email_events).where(email_events.c.event_type == "opened").limit(1)
            )
            .one()
            ._asdict()
        )
        del opened["email_event_id"]
        connection.execute(
            insert(email_events).values({**opened, "provider_event_id": "evt_again"})
        )
        # ... wrong: a bounced message said delivered, a suppression no event asked for, and a
        # forged body in the inbox.
        connection.execute(
            update(email_messages)
            .where(email_messages.c.provider_message_id == "s1")
            .values(delivery_status="delivered")
        )
        unfounded = {"reason": "complaint", "source": "webhook:sandbox", "created_at": utcnow()}
        connection.execute(insert(suppressions).values(address="a@example.com", **unfounded))
        _store(connection, "x", json.dumps({"id": "evt_faults_forged_1"}))
    verdict = check(engine, planned)
    assert (verdict.lost, verdict.doubled) == (1, 1), verdict.details
    assert verdict.counts["lost:not_applied"] == verdict.counts["doubled:reapplied"] == 1
    assert verdict.wrong == 3, verdict.details
    for kind in ("delivery_status", "suppression_unfounded", "stored_forged"):
        assert verdict.counts[f"wrong:{kind}"] == 1, verdict.details
