"""SendGrid Event Webhook beyond the shared contract (test_webhooks_contract.py, which
covers its fixtures end to end): what is particular to SendGrid's events and to its ECDSA P-256
signatures (a key pair made here), on SQLite and PostgreSQL.

* Events: Apple's privacy proxy is detected without SendGrid's flag; bounces are classified
  without a type; legacy dotted message ids; unknown events and ids that are not ours; what the
  send adapter sends as custom args is what comes back, and an event without them links by the
  message id.
* A post is an array: one delivery of many events, and SendGrid's re-signed retry of it applies
  nothing twice.
* Signatures: the key must be P-256 (DER or PEM); the freshness window is exactly five minutes
  both ways; a tampered body, another timestamp and every garbled header are refused with
  nothing stored; a malleated twin ``(r, n - s)`` of a delivered signature is a duplicate.
"""

import base64
import json
import time
from datetime import UTC, datetime

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)
from sqlalchemy import Engine, select

from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import email_events
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.webhooks import sendgrid
from email_platform.webhooks.errors import WebhookRejected
from tests.webhook_signers.sendgrid import (
    EVENT_ID,
    PRIVATE_KEY,
    RECIPIENT,
    SETTINGS,
    SIGNATURE,
    SIGNER,
    TABLE,
    TIMESTAMP,
    X_MESSAGE_ID,
    fixture_bytes,
    fixture_events,
    sign,
)
from tests.webhook_support import (
    event_rows,
    inbox_rows,
    ingest,
    outgoing_email,
    reasons,
    receiver,
    seed_sent_message,
)


def _sent_message(engine: Engine) -> int:
    """The message every fixture is about, as the send job leaves it."""
    return seed_sent_message(
        engine,
        provider="sendgrid",
        event_id=EVENT_ID,
        recipient=RECIPIENT,
        provider_message_id=X_MESSAGE_ID,
    )


# ---- normalization (no database) -------------------------------------------------------------


def test_open_without_the_flag_still_detects_apple_privacy_proxy():
    (raw,) = fixture_events("open")
    raw.pop("sg_machine_open")
    raw.update(ip="17.58.101.4", useragent="Mozilla/5.0")
    (event,) = sendgrid.normalize(json.dumps([raw]).encode())
    assert event.machine_open is True


def test_bounce_classification_without_type_and_legacy_message_ids():
    def bounce(**fields) -> str:  # type: ignore[no-untyped-def]
        return sendgrid.bounce_type({"event": "bounce", **fields})

    assert bounce(status="5.1.1") == "hard"
    assert bounce(status="4.2.2") == "soft"
    assert bounce(bounce_classification="Invalid Address") == "hard"
    assert bounce(bounce_classification="Mailbox Unavailable") == "hard"
    assert bounce(bounce_classification="Technical") == "soft"
    assert bounce(type="blocked", status="5.7.1") == "soft"  # SendGrid's own word wins
    assert bounce(type="bounce", status="4.0.0") == "hard"
    # The doc's legacy dotted id keeps its dots before ".filter".
    legacy = "14c5d75ce93.dfd.64b469.filter0001.16648.5515E0B88.0"
    assert sendgrid.message_id_of(legacy) == "14c5d75ce93.dfd.64b469"
    assert sendgrid.message_id_of("abc.recvd-1.0") == "abc"
    assert sendgrid.message_id_of(None) is None


def test_unknown_events_ids_that_do_not_fit_and_missing_event_ids():
    (raw,) = fixture_events("delivered")
    odd = dict(raw, event="account_status_change", event_id="x" * 27, idempotency_key=7)
    del odd["sg_event_id"]
    (event,) = sendgrid.normalize(json.dumps([odd]).encode())
    assert event.event_type == "unknown"
    assert event.event_id is None and event.idempotency_key is None  # not ours: not trusted
    assert event.provider_event_id.startswith("sha256:")
    # Stable: the same event hashes the same however its keys are ordered.
    reordered = dict(reversed(list(odd.items())))
    (again,) = sendgrid.normalize(json.dumps([reordered]).encode())
    assert again.provider_event_id == event.provider_event_id


def test_what_the_send_adapter_sends_is_what_the_normalizer_reads_back():
    email = outgoing_email(
        event_id=EVENT_ID,
        idempotency_key="01JF3W5Q8YV2N6T0R4K7M9B1SG:welcome/π",
        to=RECIPIENT,
        template="welcome",
    )
    adapter = SendGridProvider("https://api.sendgrid.com", api_key="SG.test")
    request = adapter.build_request(email)
    accepted = adapter.accepted(httpx.Response(202, headers={"X-Message-Id": "Xm-1_abc"}))
    (raw,) = fixture_events("delivered")
    for metadata_key in ("event_id", "idempotency_key"):
        del raw[metadata_key]
    # SendGrid echoes every custom arg as a top-level field of each event.
    raw.update(request.json["custom_args"])
    raw["sg_message_id"] = f"{accepted.provider_message_id}.filterdrecv-7d8c-1-6750A1B2-3.0"
    (event,) = sendgrid.normalize(json.dumps([raw]).encode())
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)
    assert event.provider_message_id == accepted.provider_message_id


# ---- the verifier ----------------------------------------------------------------------------


def test_key_configuration():
    with pytest.raises(ConfigurationError):
        sendgrid.build_verifier({})
    with pytest.raises(ConfigurationError):
        sendgrid.build_verifier({"sendgrid_webhook_public_key": "bm90IGEga2V5"})
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    der = p384.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ConfigurationError, match="P-256"):
        sendgrid.build_verifier({"sendgrid_webhook_public_key": base64.b64encode(der).decode()})
    pem = PRIVATE_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    verifier = sendgrid.build_verifier({"sendgrid_webhook_public_key": pem.decode()})
    body = fixture_bytes("delivered")
    headers = {k.lower(): v for k, v in sign(body).items()}
    assert verifier.verify(headers, body, utcnow()).startswith("sha256:")


def test_the_freshness_window_is_five_minutes_both_ways():
    verifier = sendgrid.build_verifier(SETTINGS)
    body = fixture_bytes("open")
    now = datetime.fromtimestamp(1_795_962_138, UTC)
    for offset, ok in ((-300, True), (300, True), (-301, False), (301, False)):
        headers = {k.lower(): v for k, v in sign(body, timestamp=1_795_962_138 + offset).items()}
        if ok:
            assert verifier.verify(headers, body, now)
        else:
            with pytest.raises(WebhookRejected, match="tolerance"):
                verifier.verify(headers, body, now)


# ---- through the receiver and the ingestor (SQLite and PostgreSQL) ---------------------------


def test_a_batch_is_one_delivery_and_a_signed_again_retry_applies_nothing_twice(engine):
    _sent_message(engine)
    batch = [event for name in TABLE for event in fixture_events(name)]
    body = json.dumps(batch).encode()
    client = receiver(engine, SIGNER)
    assert client.post(SIGNER.path, content=body, headers=sign(body)).status_code == 200
    outcome = ingest(engine, SIGNER)
    assert (outcome.claimed, outcome.applied, outcome.unlinked) == (1, len(batch), 0)
    assert reasons(engine, RECIPIENT) == {RECIPIENT: "complaint"}  # the strongest reason present
    # SendGrid retries a post it thinks failed with a fresh signature: a new delivery, whose
    # events all dedupe on sg_event_id.
    again = client.post(SIGNER.path, content=body, headers=sign(body))
    assert again.status_code == 200 and again.json()["status"] == "stored"
    second = ingest(engine, SIGNER)
    assert (second.applied, second.duplicates) == (0, len(batch))
    with engine.connect() as connection:
        assert len(list(connection.execute(select(email_events)))) == len(batch)


def test_an_event_without_custom_args_links_by_the_message_id(engine):
    message_id = _sent_message(engine)
    (raw,) = fixture_events("delivered")
    del raw["event_id"], raw["idempotency_key"]
    raw["sg_event_id"] = "bm8tY3VzdG9tLWFyZ3M"
    body = json.dumps([raw]).encode()
    response = receiver(engine, SIGNER).post(SIGNER.path, content=body, headers=sign(body))
    assert response.status_code == 200
    ingest(engine, SIGNER)
    (row,) = event_rows(engine)
    assert row.message_id == message_id
    assert row.event_id == EVENT_ID  # filled in from the message it links to


def _malleated(headers: dict[str, str]) -> dict[str, str]:
    """The same signature as ``(r, n - s)``: just as valid, different bytes."""
    r, s = decode_dss_signature(base64.b64decode(headers[SIGNATURE]))
    twin = encode_dss_signature(r, sendgrid.P256_ORDER - s)
    return {**headers, SIGNATURE: base64.b64encode(twin).decode()}


def test_tampered_and_garbled_posts_are_refused_unstored(engine):
    """A wrong key, no signature, stale and future posts are in the contract; these are the
    rest of what can be wrong with SendGrid's two headers."""
    client = receiver(engine, SIGNER)
    body = fixture_bytes("bounce")
    good = sign(body)
    now = int(time.time())
    cases = {
        "tampered body": (body.replace(b'"bounce"', b'"delivered"', 1), good),
        "other timestamp": (body, {**good, TIMESTAMP: str(int(good[TIMESTAMP]) - 1)}),
        "no timestamp": (body, {k: v for k, v in good.items() if k != TIMESTAMP}),
        "empty signature": (body, {**good, SIGNATURE: ""}),
        "not base64": (body, {**good, SIGNATURE: "%%%not-base64%%%"}),
        "not DER": (body, {**good, SIGNATURE: base64.b64encode(b"\x01" * 64).decode()}),
        "timestamp not digits": (body, {**good, TIMESTAMP: f"{now}.0"}),
    }
    for case, (case_body, headers) in cases.items():
        response = client.post(SIGNER.path, content=case_body, headers=headers)
        assert response.status_code == 401, (case, response.text)
    assert inbox_rows(engine) == []
    # The untouched original still goes through: the refusals were about the changes.
    assert client.post(SIGNER.path, content=body, headers=good).status_code == 200


def test_a_malleated_twin_of_a_delivered_signature_is_a_duplicate(engine):
    _sent_message(engine)
    client = receiver(engine, SIGNER)
    body = fixture_bytes("spamreport")
    headers = sign(body)
    first = client.post(SIGNER.path, content=body, headers=headers)
    assert first.status_code == 200 and first.json()["status"] == "stored"
    again = client.post(SIGNER.path, content=body, headers=_malleated(headers))
    assert again.status_code == 200 and again.json()["status"] == "duplicate"
    (row,) = inbox_rows(engine)
    assert row.headers[SIGNATURE.lower()] == headers[SIGNATURE]  # the first one is kept
    assert ingest(engine, SIGNER).applied == 1
