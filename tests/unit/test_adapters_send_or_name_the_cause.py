"""Whatever a message holds, every HTTP adapter either sends it or refuses it with a permanent
error that names its cause: never an exception nobody classified (which the send path
dead-letters as ``unexpected``). Unicode subjects and bodies, internationalized domains,
non-ASCII local parts and display names, any idempotency key or trace id, long unsubscribe links.
"""

import string
from collections.abc import Callable

import httpx
from botocore.credentials import Credentials
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from email_platform.common.errors import PermanentError
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.http import HttpProvider
from email_platform.providers.mailgun import MailgunProvider
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.resend import ResendProvider
from email_platform.providers.sandbox import SandboxProvider
from email_platform.providers.sendgrid import SendGridProvider
from email_platform.providers.ses import SesProvider

ADAPTERS: dict[str, Callable[[httpx.MockTransport], HttpProvider]] = {
    "postmark": lambda t: PostmarkProvider(server_token="t", transport=t),
    "sendgrid": lambda t: SendGridProvider(api_key="k", transport=t),
    "mailgun": lambda t: MailgunProvider(api_key="k", domain="mg.example.com", transport=t),
    "resend": lambda t: ResendProvider(api_key="k", transport=t),
    "ses": lambda t: SesProvider(credentials=Credentials("AKID", "secret"), transport=t),
    "sandbox": lambda t: SandboxProvider("http://sandbox.invalid", transport=t),
}


def _accept(request: httpx.Request) -> httpx.Response:
    # One answer every adapter reads as accepted.
    return httpx.Response(
        200,
        json={"id": "x", "MessageID": "x", "MessageId": "x", "ErrorCode": 0},
        headers={"X-Message-Id": "x"},
    )


_VISIBLE = st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"))
_TEXT = st.text(_VISIBLE, min_size=1, max_size=60)
_LOCAL = st.text(string.ascii_lowercase + string.digits + "._+-", min_size=1, max_size=16).filter(
    lambda s: not s.startswith(".") and not s.endswith(".") and ".." not in s
) | st.sampled_from(["jäne", "josé", "用户"])
_DOMAIN = st.sampled_from(["example.com", "bücher.example.com", "例え.jp", "xn--bcher-kva.de"])
_NAME = st.sampled_from(["", "Example", "Bücher Shöp", "O'Brien & Co"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    subject=_TEXT,
    text=_TEXT,
    html=st.none() | _TEXT,
    key=_TEXT,
    trace=st.none() | _TEXT,
    local=_LOCAL,
    domain=_DOMAIN,
    name=_NAME,
    unsubscribe=st.booleans(),
)
def test_every_adapter_sends_or_refuses_with_a_named_permanent_cause(
    subject, text, html, key, trace, local, domain, name, unsubscribe
):
    headers = {"X-Email-Event-Id": "01JDQ5Z3K8M9N0P1Q2R3S4T5V6"}
    if unsubscribe:
        headers["List-Unsubscribe"] = "<https://mail.example.com/u/" + "x" * 140 + ">"
        headers["List-Unsubscribe-Post"] = "List-Unsubscribe=One-Click"
    email = OutgoingEmail(
        message_id=1,
        event_id="01JDQ5Z3K8M9N0P1Q2R3S4T5V6",
        idempotency_key=key,
        sender=f"{name} <no-reply@{domain}>" if name else f"no-reply@{domain}",
        to=f"{local}@{domain}",
        subject=subject,
        text=text,
        html=html,
        template="welcome",
        lane="bulk",
        headers=headers,
        trace_id=trace,
    )
    for provider, make in ADAPTERS.items():
        adapter = make(httpx.MockTransport(_accept))
        try:
            adapter.send(email)
        except PermanentError as error:
            assert error.code and error.code != "unexpected", (provider, error)
        finally:
            adapter.close()
