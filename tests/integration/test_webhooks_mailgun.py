"""Mailgun webhooks beyond the shared contract (test_webhooks_contract.py, which covers
its fixtures end to end): what is particular to Mailgun's event data and to its signature
block, on SQLite and PostgreSQL.

* Event data: failure severity and reason decide hard, soft, deferred or rejected; Mailgun's bot
  flag marks machine opens; message ids match the adapter's with or without angle brackets; the
  ``v:`` user variables the send adapter writes are read back; unknown events are kept.
* Security: Mailgun signs only ``timestamp + token``, so freshness and single use carry the
  weight. A flipped signature, a changed token or timestamp, missing or garbled fields, a body
  without the block and the legacy form body are refused (401) with nothing stored; a captured
  token glued to other event data is a duplicate; the tolerance can be widened; a subaccount's
  ``parent-signature`` is accepted.
"""

import json
import secrets
import time
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.providers.mailgun import MailgunProvider
from email_platform.webhooks.errors import WebhookRejected
from email_platform.webhooks.mailgun import build_verifier, normalize, sign
from tests.webhook_signers.mailgun import JSON, SETTINGS, SIGNER, SIGNING_KEY, fixture, signed
from tests.webhook_support import inbox_rows, outgoing_email, receiver


def post(client, body: bytes) -> httpx.Response:  # type: ignore[no-untyped-def]
    return client.post(SIGNER.path, content=body, headers=JSON)


# --- normalization -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("severity", "reason", "event_type", "hard_or_soft"),
    [
        ("permanent", "bounce", "bounced", "hard"),
        ("permanent", "suppress-bounce", "bounced", "hard"),
        ("permanent", "generic", "bounced", "hard"),
        ("permanent", "old", "bounced", "soft"),  # retries ran out: the address may be fine
        ("permanent", "esp-block", "bounced", "soft"),
        ("permanent", "suppress-complaint", "rejected", None),
        ("permanent", "suppress-unsubscribe", "rejected", None),
        ("temporary", "generic", "deferred", None),
        ("temporary", "greylisted", "deferred", None),
        (None, None, "bounced", "soft"),  # no severity: not proof the address is dead
    ],
)
def test_failure_severity_and_reason_decide_the_event(
    severity: str | None, reason: str | None, event_type: str, hard_or_soft: str | None
) -> None:
    payload = fixture("failed_permanent")
    data = payload["event-data"]
    data.pop("severity")
    data.pop("reason")
    if severity:
        data["severity"] = severity
    if reason:
        data["reason"] = reason
    (event,) = normalize(signed(payload))
    assert (event.event_type, event.bounce_type) == (event_type, hard_or_soft)
    assert (event.suppression_reason == "hard_bounce") == (hard_or_soft == "hard")


@pytest.mark.parametrize(("bot", "machine"), [("gmail", True), ("generic", True), ("", False)])
def test_mailguns_bot_flag_marks_machine_opens(bot: str, machine: bool) -> None:
    """A browser agent from an ordinary address: only Mailgun's own detection tells."""
    payload = fixture("opened")
    payload["event-data"]["client-info"]["bot"] = bot
    assert normalize(signed(payload))[0].machine_open is machine


def test_message_id_with_angle_brackets_matches_what_the_adapter_stored() -> None:
    adapter = MailgunProvider(api_key="key-test", domain="mg.example.com")
    stored = adapter.accepted(
        httpx.Response(200, json={"id": "<20260101.1.ABC@mg.example.com>", "message": "Queued."})
    ).provider_message_id
    payload = fixture("delivered")
    for reported in ("20260101.1.ABC@mg.example.com", "<20260101.1.ABC@mg.example.com>"):
        payload["event-data"]["message"]["headers"]["message-id"] = reported
        assert normalize(signed(payload))[0].provider_message_id == stored


def test_user_variables_written_by_the_send_adapter_are_read_back() -> None:
    email = outgoing_email(sender="Example <no-reply@mg.example.com>")
    form = MailgunProvider(api_key="key-test", domain="mg.example.com").build_request(email).data
    assert isinstance(form, dict)
    payload = fixture("delivered")
    payload["event-data"]["user-variables"] = {
        name.removeprefix("v:"): value for name, value in form.items() if name.startswith("v:")
    }
    (event,) = normalize(signed(payload))
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)


def test_unknown_event_is_kept_as_unknown_not_refused() -> None:
    payload = fixture("delivered")
    payload["event-data"]["event"] = "list_member_uploaded"
    assert normalize(signed(payload))[0].event_type == "unknown"


# --- verification ------------------------------------------------------------------------------


def test_build_verifier_needs_the_signing_key() -> None:
    with pytest.raises(ConfigurationError, match="MAILGUN_WEBHOOK_SIGNING_KEY"):
        build_verifier({})
    with pytest.raises(ConfigurationError, match="TOLERANCE_S"):
        build_verifier({**SETTINGS, "mailgun_webhook_tolerance_s": "five minutes"})
    body = signed(fixture("delivered"), token="t" * 50)
    assert build_verifier(SETTINGS).verify({}, body, utcnow()) == "t" * 50  # the delivery id
    with pytest.raises(WebhookRejected):
        build_verifier({"mailgun_webhook_signing_key": "other"}).verify({}, body, utcnow())


def test_tampered_incomplete_and_garbled_signature_blocks_are_refused_and_not_stored(
    engine: Engine,
) -> None:
    """Another key, no block, stale and future timestamps are in the contract."""
    payload = fixture("failed_permanent")
    good = json.loads(signed(payload))
    block = good["signature"]

    def variant(**changes: Any) -> bytes:
        new_block = {k: v for k, v in {**block, **changes}.items() if v is not None}
        return json.dumps({**good, "signature": new_block}).encode()

    flipped = ("0" if block["signature"][0] != "0" else "1") + block["signature"][1:]
    cases = [
        variant(signature=flipped),
        variant(token=block["token"] + "x"),  # the token is signed
        variant(timestamp=str(int(block["timestamp"]) - 1)),  # and so is the timestamp
        variant(signature=None),
        variant(token=None),
        variant(timestamp=None),
        variant(timestamp="soon"),
        variant(signature=""),
        json.dumps(payload["event-data"]).encode(),  # the bare event data, no wrapper at all
        json.dumps({**good, "signature": "sig"}).encode(),
        b"timestamp=1767268863&token=abc&signature=def",  # the legacy form body is not accepted
    ]
    client = receiver(engine, SIGNER)
    for body in cases:
        response = post(client, body)
        assert response.status_code == 401, (body[:120], response.text)
    assert inbox_rows(engine) == []
    assert post(client, json.dumps(good).encode()).status_code == 200


def test_a_wider_tolerance_can_be_configured(engine: Engine) -> None:
    body = signed(fixture("delivered"), timestamp=int(time.time()) - 1200)
    assert post(receiver(engine, SIGNER), body).status_code == 401
    wide = {**SETTINGS, "mailgun_webhook_tolerance_s": "1800"}
    assert post(receiver(engine, SIGNER, settings=wide), body).status_code == 200


def test_parent_account_signature_is_accepted(engine: Engine) -> None:
    payload = json.loads(signed(fixture("delivered"), key="subaccount-key"))
    block = payload["signature"]
    block["parent-signature"] = sign(SIGNING_KEY, block["timestamp"], block["token"])
    response = post(receiver(engine, SIGNER), json.dumps(payload).encode())
    assert response.status_code == 200 and response.json()["status"] == "stored"


def test_a_captured_token_glued_to_other_event_data_is_a_duplicate(engine: Engine) -> None:
    token = secrets.token_hex(25)
    original = signed(fixture("complained"), token=token)
    client = receiver(engine, SIGNER)
    first = post(client, original)
    assert first.status_code == 200 and first.json()["status"] == "stored"
    # The signature does not cover event-data: a captured block glued to other data is a replay.
    forged = json.loads(original)
    forged["event-data"] = fixture("unsubscribed")["event-data"]
    response = post(client, json.dumps(forged).encode())
    assert response.status_code == 200 and response.json()["status"] == "duplicate"
    (row,) = inbox_rows(engine)
    assert (row.delivery_id, row.body.encode()) == (token, original)
