"""A message on a provider-hosted template, as each adapter sends it, against the request the
provider's official SDK builds for the same template send (``postmark-python``'s
``send_with_template``, ``sendgrid``'s ``template_id`` + ``dynamic_template_data``, ``mailgun``'s
``template`` / ``t:version`` / ``t:variables``, ``resend``'s ``template``), captured at each SDK's
own transport as in ``test_provider_sdk_conformance``; and the SES body against AWS's SES v2 model
(``Content.Template``) and botocore's own serializer. moto's SES v2 answers a templated
``SendEmail`` with "Template functionality not ready" (moto 5.2), so the model is the real thing
SES is checked against here.
"""

import dataclasses
import json
from typing import Any
from unittest import mock

import httpx
import postmark.sync
import pytest
import resend
from botocore.credentials import Credentials
from mailgun.client import Client as MailgunClient
from sendgrid.helpers.mail import From, Mail, To

from email_platform.common.errors import PermanentError
from email_platform.common.tags import tag_value
from email_platform.mail.provider_templates import ProviderTemplateCall
from email_platform.providers.base import OutgoingEmail, trace_metadata
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SesProvider
from tests.integration.test_provider_sdk_conformance import (
    DOMAIN,
    EVENT_ID,
    KEY,
    NAMES,
    differences,
    metadata,
    ours,
    requests_sent,  # noqa: F401  (the fixture)
    sendgrid_sdk_wire,
    wire,
)
from tests.ses_model import botocore_body, send_email_problems

VARIABLES = {
    "first_name": "Jürgen",
    "order_id": "O-7",
    "items": [{"name": "Mug", "quantity": 2, "price": 9.5}],
    "gift": True,
    "note": None,
}
FLAT = {"first_name": "Jürgen", "order_id": "O-7", "count": 3}


def templated(template_id: str, version: int | str | None, variables: dict) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=7,
        event_id=EVENT_ID,
        idempotency_key=f"{EVENT_ID}:shipping_notice",
        sender=f"Example Shop <no-reply@{DOMAIN}>",
        to="jane@example.com",
        subject="",
        text="",
        html=None,
        template="shipping-notice",
        lane="transactional",
        headers={"X-Email-Event-Id": EVENT_ID},
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        correlation_id="req-42",
        provider_template=ProviderTemplateCall(template_id, version, variables),
    )


def assert_same(our, sdk, allowed: set[str] = frozenset()) -> None:  # type: ignore[no-untyped-def,assignment]
    found = differences(our, sdk)
    assert {k: v for k, v in found.items() if k not in allowed} == {}
    assert allowed <= set(found), "an allowed difference no longer occurs"


@pytest.mark.parametrize("template_id", ["shipping-notice", "4242"], ids=["alias", "numeric id"])
def test_postmark_sends_what_send_with_template_sends(template_id):
    email = templated(template_id, None, VARIABLES)
    names = NAMES["postmark"]
    our = ours(lambda t: PostmarkProvider(server_token=KEY, transport=t), email, names)
    assert our.path == "/email/withTemplate"
    assert "Subject" not in our.body and "TextBody" not in our.body
    sent: list[httpx.Request] = []

    async def send(self: httpx.AsyncClient, request: httpx.Request, **_: Any) -> httpx.Response:
        sent.append(request)
        return httpx.Response(
            200,
            json={"To": email.to, "SubmittedAt": "2026-12-05T03:00:00Z", "MessageID": "m"}
            | {"ErrorCode": 0, "Message": "OK"},
            request=request,
        )

    message: dict[str, Any] = {
        "sender": email.sender,
        "to": email.to,
        "template_model": VARIABLES,
        "headers": [{"Name": k, "Value": v} for k, v in email.headers.items()],
        "tag": email.template,
        "metadata": metadata(email),
        "message_stream": "outbound",
    }
    if template_id.isdigit():
        message["template_id"] = int(template_id)
    else:
        message["template_alias"] = template_id
    with (
        mock.patch.object(httpx.AsyncClient, "send", autospec=True, side_effect=send),
        postmark.sync.ServerClient(KEY) as client,
    ):
        client.outbound.send_with_template(message)
    (request,) = sent
    sdk = wire(request.method, str(request.url), request.headers, request.content, names)
    # The SDK's model always writes an empty Attachments list (as for /email).
    assert_same(our, sdk, {"body Attachments"})


def test_sendgrid_sends_what_the_sdk_sends_for_a_dynamic_template():
    email = templated("d-0123456789abcdef0123456789abcdef", None, VARIABLES)
    names = NAMES["sendgrid"]
    our = ours(lambda t: SendGridProvider(api_key=KEY, transport=t), email, names)
    assert "subject" not in our.body and "content" not in our.body
    mail = Mail(from_email=From(f"no-reply@{DOMAIN}", "Example Shop"), to_emails=To(email.to))
    mail.template_id = email.provider_template.id  # type: ignore[union-attr]
    mail.dynamic_template_data = VARIABLES
    sdk = sendgrid_sdk_wire(mail, email, names)
    assert_same(our, sdk)


@pytest.mark.parametrize("version", [None, "v3"], ids=["live", "pinned"])
def test_mailgun_sends_what_the_sdk_sends_for_a_stored_template(version, requests_sent):  # noqa: F811
    email = templated("shipping-notice", version, VARIABLES)
    names = NAMES["mailgun"]
    our = ours(lambda t: MailgunProvider(api_key=KEY, domain=DOMAIN, transport=t), email, names)
    assert not {"subject", "text", "html"} & set(our.body)
    data = {"from": email.sender, "to": email.to, "o:tag": email.template}
    data.update({f"h:{k}": v for k, v in email.headers.items()})
    data.update({f"v:{k}": v for k, v in metadata(email).items()})
    data["template"] = "shipping-notice"
    if version is not None:
        data["t:version"] = version
    data["t:variables"] = json.dumps(VARIABLES, separators=(",", ":"))
    MailgunClient(auth=("api", KEY)).messages.create(data=data, domain=DOMAIN)
    (request,) = requests_sent
    sdk = wire(request.method, request.url, request.headers, request.body, names)
    assert_same(our, sdk)
    assert json.loads(our.body["t:variables"][0]) == VARIABLES


def test_resend_sends_what_the_sdk_sends_for_a_template(requests_sent):  # noqa: F811
    email = templated("shipping-notice", None, FLAT)
    names = NAMES["resend"]
    our = ours(lambda t: ResendProvider(api_key=KEY, transport=t), email, names)
    params: dict[str, Any] = {
        "from": email.sender,
        "to": [email.to],
        "headers": dict(email.headers),
        "tags": [
            {"name": k, "value": tag_value(v)}
            for k, v in {
                "event_id": email.event_id,
                "idempotency_key": email.idempotency_key,
                "template": email.template,
                "lane": email.lane,
                **trace_metadata(email),
            }.items()
        ],
        "template": {"id": "shipping-notice", "variables": FLAT},
    }
    with mock.patch.object(resend, "api_key", KEY):
        resend.Emails.send(params, {"idempotency_key": email.idempotency_key})  # type: ignore[arg-type,typeddict-item]
    (request,) = requests_sent
    sdk = wire(request.method, request.url, request.headers, request.body, names)
    assert_same(our, sdk)


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, 9.5, True, None])
def test_resend_refuses_a_variable_its_templates_cannot_take_naming_it(value):
    email = templated("shipping-notice", None, {**FLAT, "odd": value})
    adapter = ResendProvider(
        api_key=KEY, transport=httpx.MockTransport(lambda r: httpx.Response(200))
    )
    try:
        with pytest.raises(PermanentError) as info:
            adapter.send(email)
    finally:
        adapter.close()
    assert info.value.code == "template_variables_unsupported" and "'odd'" in str(info.value)


def test_ses_sends_a_template_as_aws_models_it():
    email = templated("shipping-notice", None, VARIABLES)
    body = SesProvider(credentials=Credentials("AKID", "secret")).body(email)
    assert send_email_problems(body) == []
    assert botocore_body(body) == body  # the model's member names and nesting exactly
    template = body["Content"]["Template"]
    assert "Simple" not in body["Content"]
    assert template["TemplateName"] == "shipping-notice"
    assert json.loads(template["TemplateData"]) == VARIABLES
    assert {"Name": "X-Email-Event-Id", "Value": EVENT_ID} in template["Headers"]


def test_the_same_message_without_a_template_is_unchanged():
    """The template swap touches nothing of an ordinary message (the adapters' one-line hooks)."""
    plain = dataclasses.replace(
        templated("x", None, {}), provider_template=None, subject="Hi", text="Hello"
    )
    body = SesProvider(credentials=Credentials("AKID", "secret")).body(plain)
    assert (
        "Template" not in body["Content"] and body["Content"]["Simple"]["Subject"]["Data"] == "Hi"
    )
