"""Resend webhooks beyond the shared contract (test_webhooks_contract.py, which covers its
fixtures end to end): what is particular to Resend's events, its tags and Svix signatures, on
SQLite and PostgreSQL.

* Events: the bounce type decides hard or soft; other event families are kept as unknown.
* Our ids come back through tags sanitized by the send adapter's ``tag_value``: the event id
  (a ULID) is recovered exactly; a value ``tag_value`` may have changed - every idempotency key -
  is never taken, and a property test checks that whatever is read is the original. The event
  id tag links a message whose ``email_id`` the send never recorded.
* Svix: the secret must be in ``whsec_`` form; a tampered body, another ``svix-id``, garbled or
  missing headers are refused (401) with nothing stored; a second, rotated-in signature is
  accepted; the Standard Webhooks header names are accepted too.
"""

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.common.ids import new_ulid
from email_platform.common.tags import tag_value
from email_platform.common.timeutil import utcnow
from email_platform.providers.resend import ResendProvider
from email_platform.webhooks.errors import WebhookRejected
from email_platform.webhooks.resend import build_verifier, normalize
from email_platform.webhooks.standard import sign
from tests.webhook_signers.resend import (
    EXPECTED,
    OTHER_SECRET,
    SETTINGS,
    SIGNER,
    fixture,
    svix_signed,
)
from tests.webhook_support import (
    delivery_status,
    event_rows,
    inbox_rows,
    ingest,
    outgoing_email,
    receiver,
    seed_sent_message,
)

# --- normalization -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bounce", "hard_or_soft"),
    [
        ({"type": "Permanent", "subType": "Suppressed"}, "hard"),
        ({"type": "Permanent", "subType": "NoEmail"}, "hard"),
        ({"type": "Transient", "subType": "General"}, "soft"),
        ({"type": "Transient", "subType": "MessageTooLarge"}, "soft"),
        ({"type": "Undetermined", "subType": "Undetermined"}, "soft"),
        ({}, "hard"),  # Resend documents email.bounced as a permanent rejection
    ],
)
def test_bounce_type_decides_hard_or_soft(bounce: dict[str, str], hard_or_soft: str) -> None:
    record = json.loads(fixture("email_bounced_permanent"))
    record["data"]["bounce"] = bounce
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_type, event.bounce_type) == ("bounced", hard_or_soft)
    assert (event.suppression_reason == "hard_bounce") == (hard_or_soft == "hard")


def test_other_event_families_are_unknown_not_refused() -> None:
    body = {
        "type": "contact.updated",
        "created_at": "2026-01-01T11:00:00.000Z",
        "data": {"id": "e169aa45-1ecf-4183-9955-b1499d5701d3", "email": "x@example.com"},
    }
    (event,) = normalize(json.dumps(body).encode())
    assert (event.event_type, event.event_id, event.provider_message_id) == (
        "unknown",
        None,
        None,
    )


def test_adapter_tags_are_read_back_exactly_or_not_at_all() -> None:
    email = outgoing_email(
        idempotency_key="01KDVFF0NRVB039663SGXKY95F:welcome",
        sender="Acme <onboarding@resend.dev>",
        template="welcome",
    )
    sent_tags = ResendProvider(api_key="re_test").build_request(email).json["tags"]
    record = json.loads(fixture("email_delivered"))
    # Webhooks carry tags as an object; the send API's list form is read too.
    for tags in ({t["name"]: t["value"] for t in sent_tags}, sent_tags):
        record["data"]["tags"] = tags
        (event,) = normalize(json.dumps(record).encode())
        assert event.event_id == email.event_id
        assert event.idempotency_key is None  # "…:welcome" travelled as "…_welcome"


@given(original=st.text(max_size=300))
def test_a_tag_value_read_back_is_always_the_original(original: str) -> None:
    record = {
        "type": "email.delivered",
        "created_at": "2026-01-01T11:00:00.000Z",
        "data": {
            "email_id": "x",
            "to": ["a@example.com"],
            "tags": {"event_id": tag_value(original), "idempotency_key": tag_value(original)},
        },
    }
    (event,) = normalize(json.dumps(record).encode())
    assert event.event_id in (None, original)
    assert event.idempotency_key in (None, original)


def test_any_ulid_event_id_is_recovered() -> None:
    for _ in range(50):
        event_id = new_ulid()
        record = {
            "type": "email.sent",
            "created_at": "2026-01-01T11:00:00.000Z",
            "data": {"email_id": "x", "to": ["a@example.com"], "tags": {"event_id": event_id}},
        }
        assert normalize(json.dumps(record).encode())[0].event_id == event_id


# --- verification ------------------------------------------------------------------------------


def test_build_verifier_needs_the_secret_in_whsec_form() -> None:
    with pytest.raises(ConfigurationError, match="RESEND_WEBHOOK_SECRET"):
        build_verifier({})
    with pytest.raises(ConfigurationError, match="whsec_"):
        build_verifier({"resend_webhook_secret": "not-a-whsec-secret"})
    body = fixture("email_delivered")
    headers = svix_signed(body, msg_id="msg_2q8nZ")
    assert build_verifier(SETTINGS).verify(headers, body, utcnow()) == "msg_2q8nZ"
    with pytest.raises(WebhookRejected):
        build_verifier({"resend_webhook_secret": OTHER_SECRET}).verify(headers, body, utcnow())


def test_tampered_and_incomplete_webhooks_are_refused_and_a_rotated_signature_is_not(
    engine: Engine,
) -> None:
    """Another secret, no signature, stale and future timestamps are in the contract."""
    body = fixture("email_bounced_permanent")
    now = int(time.time())
    good = svix_signed(body)
    cases: list[tuple[bytes, dict[str, str]]] = [
        (body.replace(b"Permanent", b"Transient"), good),  # tampered after signing
        (body, {**good, "svix-id": "msg_other"}),  # the id is signed too
        (body, {**good, "svix-signature": "v1,"}),
        (body, {**good, "svix-signature": good["svix-signature"].replace("v1,", "v2,")}),
        (body, {**good, "svix-timestamp": "yesterday"}),
    ]
    for missing in ("svix-id", "svix-timestamp"):
        cases.append((body, {k: v for k, v in good.items() if k != missing}))
    client = receiver(engine, SIGNER)
    for case_body, headers in cases:
        response = client.post(SIGNER.path, content=case_body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
    assert inbox_rows(engine) == []
    # Within the window, with a rotated-in second signature: accepted.
    fresh = svix_signed(body, timestamp=now - 240)
    other = sign(OTHER_SECRET, fresh["svix-id"], now - 240, body)
    fresh["svix-signature"] = f"{other} {fresh['svix-signature']}"
    assert client.post(SIGNER.path, content=body, headers=fresh).status_code == 200


def test_standard_webhook_header_names_are_accepted_too(engine: Engine) -> None:
    body = fixture("email_delivered")
    headers = svix_signed(body, msg_id="msg_std", prefix="webhook")
    response = receiver(engine, SIGNER).post(SIGNER.path, content=body, headers=headers)
    assert response.status_code == 200 and response.json()["status"] == "stored"
    (row,) = inbox_rows(engine)
    assert (row.delivery_id, row.body.encode()) == ("msg_std", body)


# --- ingestion ---------------------------------------------------------------------------------


def test_event_id_tag_links_a_message_whose_provider_id_was_never_recorded(engine: Engine) -> None:
    """The accepted-then-crash window: Resend has the mail, our row has no ``email_id``."""
    expected = EXPECTED["email_bounced_permanent"]
    message_id = seed_sent_message(
        engine,
        provider="resend",
        event_id=expected.event_id,
        recipient=expected.recipient,
        provider_message_id=None,
    )
    body = fixture("email_bounced_permanent")
    response = receiver(engine, SIGNER).post(SIGNER.path, content=body, headers=svix_signed(body))
    assert response.status_code == 200
    outcome = ingest(engine, SIGNER)
    assert (outcome.applied, outcome.unlinked, outcome.suppressed) == (1, 0, 1)
    (row,) = event_rows(engine)
    assert (row.message_id, row.event_id) == (message_id, expected.event_id)
    assert delivery_status(engine, message_id) == "bounced"
