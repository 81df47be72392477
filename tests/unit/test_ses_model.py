"""Every SES request body the adapter builds is valid against AWS's own SES v2 model (botocore's
``sesv2`` service model, checked by ``tests/ses_model.py``) and is the body botocore's own
serializer writes for the same parameters; what the model cannot carry is refused, permanently,
with a named cause and without a request.
"""

import json
import string

import httpx
import pytest
from botocore.credentials import Credentials
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from email_platform.common.errors import DeliveryError, PermanentError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.ses import MAX_HEADERS, SesProvider
from tests.ses_model import EVENT_ID, botocore_body, documented_rules, outgoing, send_email_problems

UNSUBSCRIBE = (
    "<https://mail.example.com/unsubscribe/01JDQ5Z3K8M9N0P1Q2R3S4T5V6?"
    "token=Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFy>, "
    "<mailto:unsubscribe@example.com?subject=unsubscribe>"
)


def sent_body(email: OutgoingEmail, **kwargs) -> dict:  # type: ignore[no-untyped-def]
    """The body the adapter puts on the wire for ``email`` (through a recording transport)."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"MessageId": "0100-test"})

    ses = SesProvider(
        credentials=Credentials("AKIDEXAMPLE", "secret"),
        transport=httpx.MockTransport(answer),
        **kwargs,
    )
    try:
        ses.send(email)
    finally:
        ses.close()
    (request,) = seen
    assert request.content.isascii()  # JSON with \u escapes: the signed bytes are the sent ones
    return json.loads(request.content)


CASES = {
    "simple": outgoing(),
    "text only": outgoing(html=None),
    "one-click unsubscribe headers": outgoing(
        lane="bulk",
        headers={
            "X-Email-Event-Id": EVENT_ID,
            "List-Unsubscribe": UNSUBSCRIBE,
            "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
        },
    ),
    "tags from opaque trace ids": outgoing(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        correlation_id="req:42/\u03b1+\u03b2 " + "x" * 300,
        idempotency_key="order 42 / confirmation:v2",
    ),
    "unicode subject and body": outgoing(
        subject="Willkommen bei Bücher \u2013 東京 🎉 " * 8,
        text="Grüße, Jane 👋",
        html="<p>Grüße, Jane 👋</p>",
    ),
    "IDN recipient": outgoing(to="jane@bücher.example.com"),
    "IDN sender with a non-ASCII name": outgoing(sender="Bücher Shop <no-reply@bücher.example>"),
    "non-ASCII idempotency key": outgoing(idempotency_key="bestellung-größe-42"),
    "the most headers SES takes": outgoing(
        headers={"X-Email-Event-Id": EVENT_ID, **{f"X-Custom-{i}": "v" for i in range(13)}}
    ),
}


@pytest.mark.parametrize("email", CASES.values(), ids=CASES.keys())
def test_every_body_is_valid_against_the_sesv2_model_and_is_what_botocore_serializes(email):
    body = sent_body(email, configuration_set="email-platform-events")
    assert send_email_problems(body) == []
    assert body == botocore_body(body)


def test_idn_domains_go_out_in_punycode_as_the_model_asks():
    assert "encoded using Punycode" in documented_rules()  # the rule, in AWS's words
    body = sent_body(outgoing(to="jane@bücher.example.com", sender="Shop <shop@bücher.example>"))
    assert body["Destination"]["ToAddresses"] == ["jane@xn--bcher-kva.example.com"]
    assert body["FromEmailAddress"] == "Shop <shop@xn--bcher-kva.example>"
    # The checker sees what the adapter sent before: the address unencoded.
    unencoded = {**body, "Destination": {"ToAddresses": ["jane@bücher.example.com"]}}
    assert send_email_problems(unencoded) != []


def test_the_exact_key_rides_in_a_header_and_a_sanitized_one_in_the_tag():
    body = sent_body(CASES["tags from opaque trace ids"])
    headers = {h["Name"]: h["Value"] for h in body["Content"]["Simple"]["Headers"]}
    tags = {t["Name"]: t["Value"] for t in body["EmailTags"]}
    assert headers["X-Email-Idempotency-Key"] == "order 42 / confirmation:v2"
    assert tags["idempotency_key"] == "order_42___confirmation_v2"
    assert len(tags["correlation_id"]) == 256
    # A key no SES header can carry (not ASCII) travels only as its tag.
    body = sent_body(CASES["non-ASCII idempotency key"])
    names = [h["Name"] for h in body["Content"]["Simple"]["Headers"]]
    assert "X-Email-Idempotency-Key" not in names
    assert {"Name": "idempotency_key", "Value": "bestellung-gr__e-42"} in body["EmailTags"]


@pytest.mark.parametrize(
    ("email", "code"),
    [
        # SES does not support SMTPUTF8 (the Destination shape's text): no retry can help.
        (outgoing(to="jäne@example.com"), "smtputf8_unsupported"),
        (outgoing(sender="Shop <bücher@example.com>"), "smtputf8_unsupported"),
        (outgoing(to="jane@-bad-.bücher.example"), "invalid_address"),
        (
            outgoing(headers={f"X-Custom-{i}": "v" for i in range(MAX_HEADERS)}),
            "too_many_headers",
        ),
        (outgoing(headers={"X-Note": "Grüße"}), "invalid_header"),
    ],
)
def test_what_the_model_cannot_carry_is_refused_with_a_named_cause_and_no_request(email, code):
    def answer(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request may be made")

    ses = SesProvider(
        credentials=Credentials("AKIDEXAMPLE", "secret"), transport=httpx.MockTransport(answer)
    )
    with pytest.raises(PermanentError) as caught:
        ses.send(email)
    ses.close()
    assert caught.value.code == code


_TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40)
_LOCAL = st.text(string.ascii_lowercase + string.digits + ".-_", min_size=1, max_size=12).filter(
    lambda s: not s.startswith(".") and not s.endswith(".") and ".." not in s
)
_DOMAIN = st.sampled_from(["example.com", "bücher.example.com", "例え.jp", "müller.de"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    subject=_TEXT,
    text=_TEXT,
    key=_TEXT,
    trace=st.none() | _TEXT,
    local=_LOCAL | st.sampled_from(["jäne", "josé"]),
    domain=_DOMAIN,
    unsubscribe=st.booleans(),
)
def test_whatever_the_message_the_body_is_valid_or_the_send_fails_with_a_named_cause(
    subject, text, key, trace, local, domain, unsubscribe
):
    headers = {"X-Email-Event-Id": EVENT_ID}
    if unsubscribe:
        headers["List-Unsubscribe"] = UNSUBSCRIBE
    email = outgoing(
        subject=subject,
        text=text,
        idempotency_key=key,
        trace_id=trace,
        to=f"{local}@{domain}",
        headers=headers,
    )
    try:
        body = sent_body(email)
    except DeliveryError as error:
        assert isinstance(error, PermanentError) and error.code
        return
    assert send_email_problems(body) == []
