"""Adapter for Twilio SendGrid's Mail Send API v3.

Endpoint (https://www.twilio.com/docs/sendgrid/api-reference/mail-send/mail-send):
``POST https://api.sendgrid.com/v3/mail/send`` with ``Authorization: Bearer <API key>`` and a
JSON body::

    {"personalizations": [{"to": [{"email": "jane@example.com"}]}],
     "from": {"email": "no-reply@example.com", "name": "Example"},
     "subject": "…",
     "content": [{"type": "text/plain", "value": "…"}, {"type": "text/html", "value": "…"}],
     "headers": {"X-Email-Event-Id": "01J…"},
     "categories": ["welcome"],
     "custom_args": {"event_id": "01J…", "idempotency_key": "01J…:welcome"}}

* ``custom_args`` is SendGrid's metadata field: the Event Webhook echoes every custom arg on
  each event, which is how ``event_id`` and ``idempotency_key`` come back (and the
  publisher's ``trace_id`` and ``correlation_id``, when set). Values must be
  strings and all custom args together may not exceed 10,000 bytes; a message over the limit
  fails here, permanently, instead of being sent without its metadata. They are sent once, at
  the message level, as SendGrid's own SDK sends them: a copy in the personalization (which
  SendGrid lets override the message's) would count twice against that limit.
* ``text/plain`` content must come before ``text/html``.
* Success is ``202 Accepted`` with an empty body; the message id is the ``X-Message-Id``
  response header (SendGrid's webhooks report it as the prefix of ``sg_message_id``).
* Errors are ``{"errors": [{"message": …, "field": …, "help": …}]}``. 400, 401, 403 and 413
  are permanent; 429 is transient and carries ``X-RateLimit-Reset`` (epoch seconds), read as
  the wait when there is no ``Retry-After``; 5xx is transient. The first error's ``field`` is
  kept as the error code (else the HTTP reason, e.g. ``unauthorized``) and every ``message``
  is kept for the dead letter.

**No idempotency header.** SendGrid documents no idempotency key on Mail Send, so the window
between SendGrid accepting a message and this process recording it stays open: if a 202 is
lost (timeout after acceptance, process killed), the retry sends the mail again. The
``idempotency_key`` still travels in ``custom_args`` so such a duplicate is visible in the
webhook events. For the same reason a ``202`` without ``X-Message-Id`` is taken as accepted
(with an empty id) rather than retried.

The base URL defaults to ``https://api.sendgrid.com``; ``EMAIL_PLATFORM_SENDGRID_BASE_URL``
points elsewhere (e.g. ``https://api.eu.sendgrid.com`` for EU-pinned subusers, or a local stub).
"""

import json
import math
import time
from email.utils import parseaddr
from typing import Any, Self

import httpx

from email_platform.common.classify import classify_response, reason_code
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    DeliveryError,
    PermanentError,
    TransientError,
)
from email_platform.providers import templated, wire
from email_platform.providers.base import Accepted, OutgoingEmail, trace_metadata
from email_platform.providers.http import HttpProvider, ProviderRequest

DEFAULT_BASE_URL = "https://api.sendgrid.com"
SEND_PATH = "/v3/mail/send"
CUSTOM_ARGS_MAX_BYTES = 10_000
# Above this an X-RateLimit-Reset value is an epoch timestamp, below it a number of seconds.
_EPOCH_THRESHOLD = 1_000_000_000


def _base(url: str) -> str:
    """Accept the host with or without the ``/v3`` version segment the path already carries."""
    url = url.rstrip("/")
    return url[: -len("/v3")] if url.endswith("/v3") else url


def _address(value: str) -> dict[str, str]:
    """``"Name <addr>"`` or ``"addr"`` as SendGrid's ``{"email", "name"}`` object."""
    name, email = parseaddr(value)
    result = {"email": email or value.strip()}
    if name:
        result["name"] = name
    return result


def retry_after_from_reset(
    value: str | None, *, now: float | None = None, cap_s: float = 300.0
) -> float | None:
    """Seconds until an ``X-RateLimit-Reset`` epoch timestamp, clamped to ``[0, cap_s]``."""
    if value is None or not value.strip():
        return None
    try:
        reset = float(value.strip())
    except ValueError:
        return None
    if math.isnan(reset) or math.isinf(reset):
        return None
    seconds = reset - (time.time() if now is None else now) if reset >= _EPOCH_THRESHOLD else reset
    return max(0.0, min(seconds, cap_s))


class SendGridProvider(HttpProvider):
    name = "sendgrid"
    cannot_carry = frozenset({"envelope_sender"})

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, api_key: str, **kwargs: Any) -> None:
        super().__init__(_base(base_url), headers={"Authorization": f"Bearer {api_key}"}, **kwargs)

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        if not settings.api_key:
            raise ConfigurationError(
                "SendGrid needs an API key: set EMAIL_PLATFORM_SENDGRID_API_KEY"
            )
        return cls(
            settings.base_url or DEFAULT_BASE_URL,
            api_key=settings.api_key,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        custom_args = {
            "event_id": email.event_id,
            "idempotency_key": email.idempotency_key,
            **trace_metadata(email),
        }
        size = len(json.dumps(custom_args, ensure_ascii=False).encode())
        if size > CUSTOM_ARGS_MAX_BYTES:
            raise PermanentError(
                f"SendGrid custom_args are {size} bytes, over the {CUSTOM_ARGS_MAX_BYTES} limit",
                code="custom_args_too_large",
            )
        content = [{"type": "text/plain", "value": email.text}]
        if email.html:
            content.append({"type": "text/html", "value": email.html})
        body: dict[str, Any] = {
            "personalizations": [{"to": [_address(email.to)]}],
            "from": _address(email.sender),
            "subject": email.subject,
            "content": content,
        }
        wire.sendgrid_fields(email, body, _address)
        if email.headers:
            body["headers"] = {str(k): str(v) for k, v in email.headers.items()}
        body["categories"] = [email.template]
        body["custom_args"] = custom_args
        templated.sendgrid_body(body, email)
        return ProviderRequest("POST", SEND_PATH, json=body)

    def accepted(self, response: httpx.Response) -> Accepted:
        message_id = response.headers.get("X-Message-Id")
        if message_id:
            return Accepted(message_id, response.status_code)
        if response.status_code == 202:
            # SendGrid's documented "queued": retrying without an idempotency key would send
            # the mail twice, so record it accepted without an id.
            return Accepted("", response.status_code)
        raise KeyError("X-Message-Id")

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        try:
            body = response.json()
        except ValueError:
            return None, response.text[:300] or response.reason_phrase
        errors = body.get("errors") if isinstance(body, dict) else None
        if not isinstance(errors, list) or not errors:
            return super().error_of(response)
        messages: list[str] = []
        code: str | None = None
        for error in errors:
            if not isinstance(error, dict):
                messages.append(str(error))
                continue
            if error.get("message"):
                messages.append(str(error["message"]))
            if code is None and error.get("field"):
                code = str(error["field"])[:100]
        return code, "; ".join(messages) or response.reason_phrase

    def classify(self, response: httpx.Response) -> DeliveryError:
        code, message = self.error_of(response)
        error = classify_response(
            response.status_code,
            response.headers,
            code=code or reason_code(response.status_code),
            message=message,
            retry_after_cap_s=self.retry_after_cap_s,
        )
        if isinstance(error, TransientError) and error.retry_after_s is None:
            error.retry_after_s = retry_after_from_reset(
                response.headers.get("X-RateLimit-Reset"), cap_s=self.retry_after_cap_s
            )
        return error
