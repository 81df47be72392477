"""Postmark webhooks beyond the shared contract (test_webhooks_contract.py, which covers
its fixtures end to end): what is particular to Postmark's records and to HTTP basic auth.

* Postmark's bounce type table, by ``Type`` and by ``TypeCode``; an unknown record type is kept
  as unknown; ``Metadata`` values that are not ours are not trusted; the send adapter's
  ``Metadata`` is read back unchanged; a second open of the same message is another event.
* Basic auth: both credentials are required, every near miss (prefix, suffix, swapped, other
  case, no colon, other scheme, garbled) is refused with nothing stored, the scheme name is
  case-insensitive, and half the credentials configured answer 503.
"""

import base64
import json

import pytest
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.common.timeutil import utcnow
from email_platform.providers.postmark import PostmarkProvider
from email_platform.webhooks.errors import WebhookRejected
from email_platform.webhooks.postmark import build_verifier, normalize
from tests.webhook_signers.postmark import PASSWORD, SETTINGS, SIGNER, USER, basic_auth, fixture
from tests.webhook_support import inbox_rows, outgoing_email, receiver

# --- normalization -----------------------------------------------------------------------------


def test_a_second_open_of_the_same_message_is_another_event() -> None:
    """Opens have no id of Postmark's: the hash tells a later open from a redelivered one."""
    first = normalize(fixture("open"))[0].provider_event_id
    second_open = json.loads(fixture("open"))
    second_open["FirstOpen"] = False
    second_open["ReceivedAt"] = "2026-01-01T12:00:00.0000000Z"
    assert normalize(json.dumps(second_open).encode())[0].provider_event_id != first


@pytest.mark.parametrize(
    ("bounce_type", "type_code", "event_type", "hard_or_soft"),
    [
        ("HardBounce", 1, "bounced", "hard"),
        ("BadEmailAddress", 100000, "bounced", "hard"),
        ("SoftBounce", 4096, "bounced", "soft"),
        ("DnsError", 256, "bounced", "soft"),
        ("Unknown", 2048, "bounced", "soft"),
        ("Blocked", 100006, "bounced", "soft"),
        ("DMARCPolicy", 100009, "bounced", "soft"),
        ("VirusNotification", 8192, "bounced", "soft"),
        ("Transient", 2, "deferred", None),
        ("AutoResponder", 64, "autoresponded", None),
        ("ChallengeVerification", 16384, "autoresponded", None),
        ("Unsubscribe", 16, "unsubscribed", None),
        ("ManuallyDeactivated", 100002, "rejected", None),
        ("SMTPApiError", 100007, "failed", None),
        ("TemplateRenderingFailed", 100010, "failed", None),
        ("OpenRelayTest", 1024, "unknown", None),
        ("SomeTypePostmarkAddsLater", 999999, "bounced", "soft"),  # never suppresses
    ],
)
def test_bounce_types_map_by_postmarks_table(
    bounce_type: str, type_code: int, event_type: str, hard_or_soft: str | None
) -> None:
    record = json.loads(fixture("bounce_hard"))
    record.update(Type=bounce_type, TypeCode=type_code)
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_type, event.bounce_type) == (event_type, hard_or_soft)
    assert (event.suppression_reason == "hard_bounce") == (hard_or_soft == "hard")
    # Only the code, no Type: the code table decides the same way.
    del record["Type"]
    if bounce_type != "SomeTypePostmarkAddsLater":
        (by_code,) = normalize(json.dumps(record).encode())
        assert (by_code.event_type, by_code.bounce_type) == (event_type, hard_or_soft)


def test_unknown_record_type_is_kept_as_unknown_not_refused() -> None:
    (event,) = normalize(b'{"RecordType": "SMTPEvent", "MessageID": "abc", "Metadata": {}}')
    assert (event.event_type, event.provider_message_id, event.event_id) == ("unknown", "abc", None)


def test_foreign_metadata_values_are_not_taken_for_our_ids() -> None:
    record = json.loads(fixture("delivery"))
    record["Metadata"] = {"event_id": "x" * 40, "idempotency_key": 42}
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_id, event.idempotency_key) == (None, None)  # would not fit our columns


def test_metadata_written_by_the_send_adapter_is_read_back() -> None:
    """The adapter's ``Metadata`` comes back in every webhook: the same two ids, unchanged."""
    email = outgoing_email()
    request = PostmarkProvider(server_token="server-token").build_request(email)
    record = json.loads(fixture("delivery"))
    record["Metadata"] = request.json["Metadata"]
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_id, event.idempotency_key) == (email.event_id, email.idempotency_key)


# --- authentication ----------------------------------------------------------------------------


def test_build_verifier_needs_both_credentials() -> None:
    for settings in ({}, {"postmark_webhook_user": USER}, {"postmark_webhook_password": PASSWORD}):
        with pytest.raises(ConfigurationError, match="POSTMARK_WEBHOOK_USER"):
            build_verifier(settings)
    assert build_verifier(SETTINGS).verify(basic_auth(), b"{}", utcnow()) is None  # no delivery id
    with pytest.raises(WebhookRejected):
        build_verifier(SETTINGS).verify({}, b"{}", utcnow())


def test_near_miss_credentials_are_refused_and_nothing_is_stored(engine: Engine) -> None:
    """No credentials and a wrong password are in the contract; these are the near misses."""
    body = fixture("bounce_hard")
    good = basic_auth()["authorization"]
    raw = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    cases: list[dict[str, str]] = [
        basic_auth(password=PASSWORD[:-1]),  # a prefix of the right one
        basic_auth(password=PASSWORD + "x"),
        basic_auth(user="someone-else"),
        basic_auth(user=USER.upper()),
        basic_auth(user=PASSWORD, password=USER),
        basic_auth(password=""),
        {"authorization": "Basic " + base64.b64encode(USER.encode()).decode()},  # no colon
        {"authorization": f"Bearer {raw}"},
        {"authorization": "Basic"},
        {"authorization": "Basic not/base64!!"},
        {"authorization": good + "AAAA"},
    ]
    client = receiver(engine, SIGNER)
    for headers in cases:
        response = client.post(SIGNER.path, content=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
    assert inbox_rows(engine) == []
    # The scheme name is case-insensitive (RFC 7617); the right credentials get in.
    headers = {"authorization": "basic " + raw}
    assert client.post(SIGNER.path, content=body, headers=headers).status_code == 200


def test_half_the_credentials_configured_answer_503_not_an_open_door(engine: Engine) -> None:
    client = receiver(engine, SIGNER, settings={"postmark_webhook_user": USER})
    response = client.post(SIGNER.path, content=fixture("delivery"), headers=basic_auth())
    assert response.status_code == 503
    assert inbox_rows(engine) == []


@pytest.mark.parametrize(
    ("reason", "origin", "event_type", "suppression"),
    [
        ("ManualSuppression", "Recipient", "unsubscribed", "unsubscribe"),  # the unsubscribe link
        ("ManualSuppression", "Customer", "unsubscribed", "manual"),  # the account's block
        ("ManualSuppression", "Admin", "unsubscribed", "manual"),
        ("HardBounce", "Recipient", "bounced", "hard_bounce"),
        ("SpamComplaint", "Recipient", "complained", "complaint"),
        ("SomethingNew", "Recipient", "unsubscribed", "unsubscribe"),
    ],
)
def test_a_subscription_change_suppresses_for_the_reason_postmark_names(
    reason: str, origin: str, event_type: str, suppression: str
) -> None:
    """An unsubscribe stops bulk mail only; a suppression Postmark made for a hard bounce or a
    complaint stops every route, as the bounce or complaint itself would."""
    record = json.loads(fixture("subscription_change_unsubscribe"))
    record["SuppressionReason"], record["Origin"] = reason, origin
    (event,) = normalize(json.dumps(record).encode())
    assert event.event_type == event_type
    assert event.suppression_reason == suppression
    record["SuppressSending"] = False
    (event,) = normalize(json.dumps(record).encode())
    assert (event.event_type, event.suppression_reason) == ("subscribed", None)
