"""Every webhook normalizer against the providers' own sample payloads, not ours.

The fixtures under ``tests/fixtures/provider_samples/<provider>/`` are payloads others published:
the providers' documentation examples and the received events django-anymail keeps in its tests
(each folder's README names the source of every file). Each event type a provider documents is
here, and each sample must normalize to our vocabulary with the provider's meaning - a
suppression Postmark made for a hard bounce is a hard bounce, one for a complaint a complaint, an
opt-out an unsubscribe - and link back by a provider message id that names a message, or by
none. Every sample is signed as its provider signs (tests/webhook_signers) and must verify.

What these samples showed wrong before: Postmark SubscriptionChange records for HardBounce and
SpamComplaint normalized as ``unsubscribed``; SendGrid ``dropped`` events whose ``sg_message_id``
is only a filter id (``filter0093p1las1.9128.5717FB8127.0``) gave provider message id
``filter0093p1las1``; Resend's ``email.bounced`` for an address on its own suppression list
("Resend has suppressed sending ...", nothing sent) was a hard bounce.
"""

import json
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine

from email_platform.webhooks.vocabulary import NormalizedEvent
from tests.paths import WEBHOOK_FIXTURES
from tests.webhook_signers import MAILGUN, POSTMARK, RESEND, SENDGRID, SES
from tests.webhook_support import (
    Signer,
    delivery_status,
    event_rows,
    ingest,
    post,
    reasons,
    receiver,
    seed_sent_message,
)

SAMPLES = WEBHOOK_FIXTURES.parent / "provider_samples"
SIGNERS = {signer.name: signer for signer in (POSTMARK, SENDGRID, MAILGUN, RESEND, SES)}


@dataclass(frozen=True)
class Meaning:
    """What one event of a sample must normalize to; ``why`` is the provider's own meaning."""

    event_type: str
    recipient: str | None
    provider_message_id: str | None
    bounce_type: str | None = None
    suppression: str | None = None
    why: str = ""


PM_ID = "883953f4-6105-42a2-a16a-77a8eac79483"
PM_OPEN_ID = "f4830d10-9c35-4f0c-bca3-3d9b459821f8"
SG_ID = "wrfRRvF7Q0GgwUo2CvDmEA"
RS_ID = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
SES_ID = "7c191be45-e9aedb9a-02f9-4d12-a87d-dd0099a07f8a-000000"
DOCS = "example@test.com"
DOCS_RS = "delivered@resend.dev"
DOCS_RS_ID = "56761188-7520-42d8-8898-ff6fc54ce618"

#: (provider, sample file) -> one meaning per event in it, in order.
EXPECTED: dict[tuple[str, str], list[Meaning]] = {
    # --- Postmark ----------------------------------------------------------------------------
    ("postmark", "delivery"): [Meaning("delivered", "john@example.com", PM_ID)],
    ("postmark", "bounce_hard"): [
        Meaning(
            "bounced", "john@example.com", PM_ID, "hard", "hard_bounce", "unknown user, mailbox"
        )
    ],
    ("postmark", "bounce_unsubscribe_request"): [
        Meaning("unsubscribed", None, "5555555-5555555-5555-5555555", None, "unsubscribe")
    ],
    ("postmark", "spam_complaint"): [
        # TypeCode 512 as documented (SpamNotification's code); Type SpamComplaint decides.
        Meaning(
            "complained",
            "john@example.com",
            "00000000-0000-0000-0000-000000000000",
            None,
            "complaint",
        )
    ],
    ("postmark", "open"): [Meaning("opened", "recipient@example.com", PM_OPEN_ID)],
    ("postmark", "click"): [Meaning("clicked", "recipient@example.com", PM_OPEN_ID)],
    ("postmark", "subscription_change_hard_bounce"): [
        Meaning(
            "bounced",
            "bounced-address@wildbit.com",
            PM_ID,
            "hard",
            "hard_bounce",
            "suppressed after a hard bounce: a bounce, not an opt-out",
        )
    ],
    ("postmark", "subscription_change_spam_complaint"): [
        Meaning(
            "complained",
            "bounced-address@wildbit.com",
            PM_ID,
            None,
            "complaint",
            "suppressed after a spam complaint",
        )
    ],
    ("postmark", "subscription_change_unsubscribe"): [
        Meaning(
            "unsubscribed",
            "bounced-address@wildbit.com",
            PM_ID,
            None,
            "unsubscribe",
            "'If a recipient unsubscribes ... ManualSuppression'",
        )
    ],
    ("postmark", "subscription_change_manual_customer"): [
        Meaning(
            "unsubscribed",
            "bounced-address@wildbit.com",
            None,
            None,
            "manual",
            "the account suppressed the address (Origin Customer)",
        )
    ],
    ("postmark", "subscription_change_reactivation"): [
        Meaning(
            "subscribed",
            "bounced-address@wildbit.com",
            None,
            None,
            None,
            "SuppressSending false: reactivated",
        )
    ],
    # --- SendGrid ----------------------------------------------------------------------------
    ("sendgrid", "docs_example_array"): [
        Meaning("queued", DOCS, "sg_message_id"),  # the page prints placeholder ids
        Meaning("deferred", DOCS, "sg_message_id"),
        Meaning("delivered", DOCS, "sg_message_id"),
        Meaning("opened", DOCS, "sg_message_id"),
        Meaning("clicked", DOCS, "sg_message_id"),
    ],
    ("sendgrid", "docs_other_events"): [
        Meaning("bounced", DOCS, "sg_message_id", "hard", "hard_bounce", "type bounce"),
        Meaning("bounced", DOCS, "sg_message_id", "soft", None, "type blocked: temporary"),
        Meaning("rejected", DOCS, "sg_message_id", why="dropped: never sent"),
        Meaning("complained", DOCS, "sg_message_id", None, "complaint"),
        Meaning("unsubscribed", DOCS, "sg_message_id", None, "unsubscribe"),
        Meaning("unsubscribed", DOCS, "sg_message_id", None, "unsubscribe"),
        Meaning("subscribed", DOCS, "sg_message_id"),
        # An asynchronous bounce carries no sg_message_id: linked by our event id, or not at all.
        Meaning("bounced", DOCS, None, "hard", "hard_bounce"),
    ],
    ("sendgrid", "processed"): [Meaning("queued", "recipient@example.com", SG_ID)],
    ("sendgrid", "delivered"): [Meaning("delivered", "recipient@example.com", SG_ID)],
    ("sendgrid", "deferred"): [
        Meaning("deferred", "recipient@example.com", "u9Gvi3mzT6iC2poAb58_qQ")
    ],
    ("sendgrid", "bounce"): [
        Meaning("bounced", "noreply@example.com", "Lli-03HcQ5-JLybO9fXsJg", "hard", "hard_bounce")
    ],
    ("sendgrid", "open"): [Meaning("opened", "recipient@example.com", SG_ID)],
    ("sendgrid", "click"): [Meaning("clicked", "recipient@example.com", "_fjPjuJfRW-IPs5SuvYotg")],
    ("sendgrid", "dropped_bounced"): [
        Meaning("rejected", "example@example.com", "14c5d75ce93.dfd.64b469")
    ],
    # Only a filter id (no message id before ".filter"): names no message.
    ("sendgrid", "dropped_invalid"): [Meaning("rejected", "invalid@invalid", None)],
    ("sendgrid", "dropped_unsubscribed"): [Meaning("rejected", "unsubscribe@example.com", None)],
    # --- Mailgun -----------------------------------------------------------------------------
    ("mailgun", "delivered"): [
        Meaning(
            "delivered", "recipient@example.com", "20180812211713.1.DF5966851B4BAA99@example.org"
        )
    ],
    ("mailgun", "failed_permanent"): [
        Meaning(
            "bounced",
            "invalid@example.com",
            "20180812214658.1.0DF563D0B3597700@example.org",
            "hard",
            "hard_bounce",
            "severity permanent, reason bounce",
        )
    ],
    ("mailgun", "failed_temporary"): [
        Meaning(
            "deferred",
            "undeliverable@nomx.example.com",
            "20180812214638.1.4A7D468E9BC18C5D@example.org",
            why="severity temporary",
        )
    ],
    ("mailgun", "failed_greylisted"): [
        Meaning(
            "deferred",
            "undeliverable@mx.example.com",
            "20180812214638.1.4A7D468E9BC18C5D@example.org",
        )
    ],
    ("mailgun", "rejected"): [
        Meaning(
            "rejected",
            "recipient@example.org",
            "20180622220256.1.B31A451A2E5422BB@sandbox55887.mailgun.org",
        )
    ],
    ("mailgun", "complained"): [
        Meaning(
            "complained",
            "recipient@example.com",
            "20130718032413.263EE2E0926@example.org",
            None,
            "complaint",
        )
    ],
    ("mailgun", "unsubscribed"): [
        Meaning(
            "unsubscribed",
            "recipient@example.com",
            "20130822232216.13966.79700@samples.mailgun.org",
            None,
            "unsubscribe",
        )
    ],
    ("mailgun", "opened"): [
        Meaning("opened", "recipient@example.com", "20180812213139.1.BC6694A917BB7E6A@example.org")
    ],
    ("mailgun", "clicked"): [Meaning("clicked", "recipient@example.com", None)],
    ("mailgun", "delivery_status_is_none"): [Meaning("queued", None, None)],
    # Mailgun dropped it: the address bounced before (code 605) - suppressed as the bounce.
    ("mailgun", "test_webhook_permanent_fail"): [
        Meaning(
            "bounced",
            "alice@example.com",
            "20130503192659.13651.20287@sandbox.mgsend.net",
            "hard",
            "hard_bounce",
        )
    ],
    # --- Resend ------------------------------------------------------------------------------
    ("resend", "sent"): [Meaning("sent", "to@example.org", RS_ID)],
    ("resend", "delivered"): [Meaning("delivered", "to@example.org", RS_ID)],
    ("resend", "delivery_delayed"): [
        Meaning("deferred", "delivered@resend.dev", "56761188-7520-42d8-8898-ff6fc54ce618")
    ],
    ("resend", "hard_bounced"): [
        Meaning(
            "bounced",
            "bounced@resend.dev",
            RS_ID,
            "hard",
            "hard_bounce",
            "email.bounced: 'permanently rejected'",
        )
    ],
    ("resend", "suppressed"): [
        Meaning("rejected", "blocked@example.org", RS_ID, why="on Resend's list: nothing sent")
    ],
    ("resend", "complained"): [
        Meaning("complained", "complained@resend.dev", RS_ID, None, "complaint")
    ],
    ("resend", "opened"): [Meaning("opened", "to@example.org", RS_ID)],
    ("resend", "clicked"): [Meaning("clicked", "to@example.org", RS_ID)],
    # Resend's documentation examples, one per documented email.* type.
    **{
        ("resend", f"docs_{kind}"): [Meaning(event_type, DOCS_RS, DOCS_RS_ID, *more)]
        for kind, event_type, *more in [
            # subType Suppressed: SES's list of addresses with recent hard bounces - a bounce.
            ("bounced", "bounced", "hard", "hard_bounce"),
            ("clicked", "clicked"),
            ("complained", "complained", None, "complaint"),
            ("delivered", "delivered"),
            ("delivery_delayed", "deferred"),
            ("failed", "failed"),  # reached_daily_quota: Resend did not send
            ("opened", "opened"),
            ("scheduled", "queued"),
            ("sent", "sent"),
            ("suppressed", "rejected"),  # OnAccountSuppressionList: never sent
        ]
    },
    # Inbound mail: nothing we sent, and its email_id names no message of ours.
    ("resend", "docs_received"): [Meaning("unknown", DOCS_RS, None)],
    # --- SES (via SNS) -----------------------------------------------------------------------
    ("ses", "bounce"): [
        Meaning(
            "bounced",
            "jane@example.com",
            "00000138111222aa-33322211-cccc-cccc-cccc-ddddaaaa0680-000000",
            "hard",
            "hard_bounce",
            "bounceType Permanent",
        )
    ],
    ("ses", "multiple_bounce"): [
        Meaning(
            "bounced",
            address,
            "00000137860315fd-34208509-5b74-41f3-95c5-22c1edc3c924-000000",
            "hard",
            "hard_bounce",
        )
        for address in ("jane@example.com", "richard@example.com")
    ],
    ("ses", "complaint"): [
        Meaning(
            "complained",
            "richard@example.com",
            "000001378603177f-7a5433e7-8edb-42ae-af10-f0181f34d6ee-000000",
            None,
            "complaint",
        )
    ],
    ("ses", "delivery"): [
        Meaning(
            "delivered",
            "jane@example.com",
            "0000014644fe5ef6-9a483358-9170-4cb4-a269-f5dcdf415321-000000",
        )
    ],
    ("ses", "delivery_delay"): [
        Meaning("deferred", "recipient@example.com", f"EXAMPLE{SES_ID}", why="SES still trying")
    ],
    ("ses", "subscription"): [
        Meaning(
            "unsubscribed",
            "recipient@example.com",
            "EXAMPLEe4bccb684-777bc8de-afa7-4970-92b0-f515137b1497-000000",
            None,
            "unsubscribe",
            "unsubscribeAll via the List-Unsubscribe header",
        )
    ],
    ("ses", "send"): [Meaning("sent", "recipient@example.com", SES_ID)],
    ("ses", "reject"): [Meaning("rejected", "recipient@example.com", SES_ID, why="virus")],
    ("ses", "open"): [Meaning("opened", "recipient@example.com", SES_ID)],
    ("ses", "click"): [Meaning("clicked", "recipient@example.com", SES_ID)],
    ("ses", "rendering_failure"): [
        Meaning(
            "failed",
            "recipient@example.com",
            "c191be45-e9aedb9a-02f9-4d12-a87d-dd0099a07f8a-000000",
        )
    ],
}


def _signed(provider: str, name: str) -> tuple[Signer, bytes, dict[str, str]]:
    signer = SIGNERS[provider]
    sample = (SAMPLES / provider / f"{name}.json").read_bytes()
    # The JSON is re-serialized compactly; SES wraps it in a signed SNS notification.
    body, headers = signer.sign(json.dumps(json.loads(sample)).encode())
    return signer, body, {key.lower(): value for key, value in headers.items()}


def test_every_sample_file_has_an_expectation_and_a_source() -> None:
    on_disk = {
        (folder.name, path.stem)
        for folder in SAMPLES.iterdir()
        if folder.is_dir()
        for path in folder.glob("*.json")
    }
    assert on_disk == set(EXPECTED)
    for provider, name in on_disk:
        readme = (SAMPLES / provider / "README.md").read_text().splitlines()
        (line,) = [line for line in readme if line.startswith(f"- `{name}.json`: ")]
        assert "https://" in line, f"{provider}/{name}.json names no source"


@pytest.mark.parametrize(
    ("provider", "name"), sorted(EXPECTED), ids=[f"{p}/{n}" for p, n in sorted(EXPECTED)]
)
def test_a_signed_sample_verifies_and_normalizes_with_the_providers_meaning(
    provider: str, name: str
) -> None:
    signer, body, headers = _signed(provider, name)
    webhook = signer.provider()
    webhook.verifier(signer.settings).verify(headers, body, datetime.now(UTC))
    events = webhook.normalize(body)
    got = [_meaning(event) for event in events]
    want = [Meaning(**{**m.__dict__, "why": ""}) for m in EXPECTED[provider, name]]
    assert got == want
    for event in events:
        # A provider message id is one the send adapter could have stored, never a filter id.
        assert not (event.provider_message_id or "").startswith("filter")


def _meaning(event: NormalizedEvent) -> Meaning:
    return Meaning(
        event.event_type,
        event.recipient,
        event.provider_message_id,
        event.bounce_type,
        event.suppression_reason,
    )


@pytest.mark.parametrize(
    ("name", "status", "suppression"),
    [
        ("subscription_change_hard_bounce", "bounced", "hard_bounce"),
        ("subscription_change_spam_complaint", "complained", "complaint"),
        ("subscription_change_unsubscribe", "unsubscribed", "unsubscribe"),
    ],
)
def test_a_postmark_suppression_is_counted_and_suppressed_as_its_cause(
    engine: Engine, name: str, status: str, suppression: str
) -> None:
    """Through the receiver and ingestion: the message's delivery state and the suppression
    follow Postmark's SuppressionReason, so the funnel counts a bounce as a bounce."""
    message_id = seed_sent_message(
        engine,
        provider="postmark",
        event_id="01KDVDNA0097KG8C0MA99JE5Z0",
        recipient="bounced-address@wildbit.com",
        provider_message_id=PM_ID,
    )
    signer, body, headers = _signed("postmark", name)
    client = receiver(engine, signer)
    assert post(client, signer, (body, headers)).status_code < 300
    outcome = ingest(engine, signer)
    assert outcome.applied == 1
    assert [row.event_type for row in event_rows(engine)] == [status]
    assert delivery_status(engine, message_id) == status
    assert reasons(engine, "bounced-address@wildbit.com") == {
        "bounced-address@wildbit.com": suppression
    }
