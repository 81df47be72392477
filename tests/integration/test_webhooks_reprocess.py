"""``email-platform webhooks reprocess --since`` after a mapping fix, end to end, both databases.

Postmark webhooks (the providers' own samples) are posted to the receiver and stored, then
ingested with an *old, wrong* mapping - the one Postmark SubscriptionChange records had before
(a hard bounce's suppression became ``unsubscribed``), plus a soft bounce taken for hard, a
reactivation for an opt-out and a delivery for a complaint. The CLI command then re-normalizes
what arrived since a date with the current mapping, and the suppression table must hold what
the new mapping implies, no more and no fewer: the wrong suppressions withdrawn or corrected,
the right ones kept, and an operator's, a one-click unsubscribe's, erasure's and webhooks
outside ``--since`` untouched. Before, reprocess only re-queued the webhooks: every wrong
suppression stayed (first-writer-wins), and the command had no test.
"""

import dataclasses
import json
from datetime import timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, select, update

from email_platform.cli import main
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_events, suppressions, webhook_inbox
from email_platform.store import suppressions as suppression_store
from email_platform.webhooks import registry
from email_platform.webhooks.ingest import WebhookIngestor
from email_platform.webhooks.vocabulary import NormalizedEvent
from tests.paths import WEBHOOK_FIXTURES
from tests.webhook_signers import POSTMARK
from tests.webhook_support import delivery_status, post, receiver, seed_sent_message

SAMPLES = WEBHOOK_FIXTURES.parent / "provider_samples" / "postmark"

#: What the old mapping made of each (recipient, event the current mapping gives): the fields
#: it got wrong.
OLD_MAPPING: dict[tuple[str, str], dict[str, Any]] = {
    # Postmark's SubscriptionChange for a hard bounce, as it was normalized before.
    ("bounced@example.com", "bounced"): {
        "event_type": "unsubscribed",
        "bounce_type": None,
        "suppression": None,
    },
    ("soft@example.com", "bounced"): {"bounce_type": "hard"},
    ("reactivated@example.com", "subscribed"): {"event_type": "unsubscribed"},
    ("clicker@example.com", "delivered"): {"event_type": "complained"},
    ("both@example.com", "delivered"): {"event_type": "complained"},
    ("operator@example.com", "bounced"): {
        "event_type": "unsubscribed",
        "bounce_type": None,
        "suppression": None,
    },
    ("outside@example.com", "bounced"): {"bounce_type": "hard"},
}


def _old_mapping() -> registry.WebhookProvider:
    current = registry.get("postmark")

    def normalize(body: bytes) -> list[NormalizedEvent]:
        return [
            dataclasses.replace(
                event, **OLD_MAPPING.get((event.recipient or "", event.event_type), {})
            )
            for event in current.normalize(body)
        ]

    return dataclasses.replace(current, normalize=normalize)


def _payload(sample: str, recipient: str, message: str, **changes: Any) -> dict[str, Any]:
    payload = json.loads((SAMPLES / f"{sample}.json").read_text())
    field = "Email" if "Email" in payload else "Recipient"
    return {**payload, field: recipient, "MessageID": message, **changes}


#: (recipient, sample, changes): one Postmark webhook each, with its own message.
WEBHOOKS = [
    ("bounced@example.com", "subscription_change_hard_bounce", {}),
    ("soft@example.com", "bounce_hard", {"ID": 101, "Type": "SoftBounce", "TypeCode": 4096}),
    ("reactivated@example.com", "subscription_change_reactivation", {}),
    ("clicker@example.com", "delivery", {}),
    ("both@example.com", "delivery", {}),
    ("optout@example.com", "subscription_change_unsubscribe", {}),
    ("kept@example.com", "spam_complaint", {"ID": 102}),
    ("operator@example.com", "subscription_change_hard_bounce", {}),
]
#: Received before ``--since``: reprocess leaves them (and what they wrote) alone.
OUTSIDE = [
    ("outside@example.com", "bounce_hard", {"ID": 201, "Type": "SoftBounce", "TypeCode": 4096}),
    ("both@example.com", "bounce_hard", {"ID": 202}),
]


def _post_and_ingest(engine: Engine, webhooks: list[Any], first: int) -> list[int]:
    client = receiver(engine, POSTMARK)
    for n, (recipient, sample, changes) in enumerate(webhooks, start=first):
        message = f"pm-{n}"
        seed_sent_message(
            engine,
            provider="postmark",
            event_id=f"01KDVDNA0097KG8C0MA99JE{n:03d}",
            recipient=recipient,
            provider_message_id=message,
        )
        body = json.dumps(_payload(sample, recipient, message, **changes)).encode()
        assert post(client, POSTMARK, POSTMARK.sign(body)).status_code < 300
    with engine.connect() as connection:
        ids = list(
            connection.execute(
                select(webhook_inbox.c.inbox_id).where(webhook_inbox.c.status == "pending")
            ).scalars()
        )
    outcome = WebhookIngestor(engine, providers={"postmark": _old_mapping()}).run(
        ids, run_id=f"old-mapping-{first}"
    )
    assert (outcome.applied, outcome.malformed, outcome.failed) == (len(webhooks), 0, 0)
    return ids


def _table(engine: Engine) -> dict[str, tuple[str, str]]:
    with engine.connect() as connection:
        rows = connection.execute(select(suppressions)).all()
    return {
        ("<erased>" if row.address.startswith("hmac:") else row.address): (row.reason, row.source)
        for row in rows
    }


def _reprocess(database_url: str, since: str) -> str:
    result = CliRunner().invoke(
        main,
        ["webhooks", "reprocess", "--since", since],
        env={"EMAIL_PLATFORM_DATABASE_URL": database_url},
    )
    assert result.exit_code == 0, result.output
    return result.output


PM = "webhook:postmark"
#: What the current mapping implies, with the suppressions made elsewhere.
IMPLIED = {
    "bounced@example.com": ("hard_bounce", PM),  # was unsubscribe: a hard bounce, every route
    "optout@example.com": ("unsubscribe", PM),
    "kept@example.com": ("complaint", PM),
    "both@example.com": ("hard_bounce", PM),  # its other webhook's hard bounce, not complaint
    "clicker@example.com": ("unsubscribe", "unsubscribe:digest"),  # their own click, restored
    "operator@example.com": ("manual", "operator"),
    "outside@example.com": ("hard_bounce", PM),  # wrong, but received before --since
    "<erased>": ("erased", "erasure"),
}


@pytest.mark.parametrize("runs", [1, 2], ids=["once", "twice"])
def test_reprocess_since_leaves_exactly_the_suppressions_the_new_mapping_implies(
    engine: Engine, database_url: str, runs: int
) -> None:
    now = utcnow()
    with engine.begin() as connection:
        suppression_store.add(
            connection, "operator@example.com", reason="manual", source="operator", now=now
        )
        suppression_store.add(
            connection,
            "clicker@example.com",
            reason="unsubscribe",
            source="unsubscribe:digest",
            now=now,
        )
        suppression_store.erase(connection, "erased@example.com", now)
    outside = _post_and_ingest(engine, OUTSIDE, first=100)
    with engine.begin() as connection:  # these arrived two days ago
        connection.execute(
            update(webhook_inbox)
            .where(webhook_inbox.c.inbox_id.in_(outside))
            .values(received_at=now - timedelta(days=2))
        )
    inside = _post_and_ingest(engine, WEBHOOKS, first=0)

    before = _table(engine)
    assert before["bounced@example.com"] == ("unsubscribe", PM)
    assert before["soft@example.com"] == ("hard_bounce", PM)
    assert before["reactivated@example.com"] == ("unsubscribe", PM)
    assert before["clicker@example.com"] == (
        "complaint",
        f"{PM}; was unsubscribe from unsubscribe:digest",
    )
    assert before["both@example.com"] == ("complaint", PM)

    since = (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    output = _reprocess(database_url, since)
    assert output.startswith(f"{len(WEBHOOKS)} stored webhook(s) queued")
    # Judged at once, before any ingestion: no window in which the right ones are missing.
    assert _table(engine) == IMPLIED
    # soft and reactivated withdrawn; bounced, clicker and both corrected in place
    assert output.rstrip().endswith("suppressions: 2 withdrawn, 3 changed, 0 added")
    for _ in range(runs - 1):  # once more: nothing left to change
        assert "0 withdrawn, 0 changed, 0 added" in _reprocess(database_url, since)
        assert _table(engine) == IMPLIED

    # The inbox sensor's ingestion, with the current mapping, rebuilds the events.
    with engine.connect() as connection:
        pending = list(
            connection.execute(
                select(webhook_inbox.c.inbox_id).where(webhook_inbox.c.status == "pending")
            ).scalars()
        )
    assert sorted(pending) == sorted(inside)
    outcome = WebhookIngestor(engine).run(pending, run_id="current-mapping")
    assert (outcome.applied, outcome.suppressed, outcome.malformed) == (len(WEBHOOKS), 0, 0)
    assert _table(engine) == IMPLIED
    with engine.connect() as connection:
        types = dict(
            connection.execute(
                select(email_events.c.recipient, email_events.c.event_type).where(
                    email_events.c.inbox_id.in_(inside)
                )
            ).all()
        )
        message_of = dict(
            connection.execute(
                select(email_events.c.recipient, email_events.c.message_id).where(
                    email_events.c.inbox_id.in_(inside)
                )
            ).all()
        )
    assert types == {
        "bounced@example.com": "bounced",
        "soft@example.com": "bounced",
        "reactivated@example.com": "subscribed",
        "clicker@example.com": "delivered",
        "both@example.com": "delivered",
        "optout@example.com": "unsubscribed",
        "kept@example.com": "complained",
        "operator@example.com": "bounced",
    }
    assert delivery_status(engine, message_of["bounced@example.com"]) == "bounced"
    assert delivery_status(engine, message_of["clicker@example.com"]) == "delivered"
    assert delivery_status(engine, message_of["reactivated@example.com"]) == "subscribed"


def test_reprocess_with_nothing_stored_changes_nothing(engine: Engine, database_url: str) -> None:
    now = utcnow()
    with engine.begin() as connection:
        suppression_store.add(
            connection, "someone@example.com", reason="complaint", source=PM, now=now
        )
    assert _reprocess(database_url, "2020-01-01").startswith("0 stored webhook(s) queued")
    # A webhook suppression whose webhook is not being reprocessed is nobody's to withdraw.
    assert _table(engine) == {"someone@example.com": ("complaint", PM)}
