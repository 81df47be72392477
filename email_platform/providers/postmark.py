"""Adapter for Postmark's Email API: ``POST https://api.postmarkapp.com/email``.

Documented at https://postmarkapp.com/developer/api/email-api and
https://postmarkapp.com/developer/api/overview. The request is JSON with the headers
``Accept: application/json``, ``Content-Type: application/json`` and
``X-Postmark-Server-Token: <server token>``; the body carries ``From``, ``To``, ``Subject``,
``TextBody``, ``HtmlBody``, ``Headers`` (a list of ``{"Name", "Value"}``), ``Tag`` (the
template), ``Metadata`` (``event_id`` and ``idempotency_key``, read back by the webhook
normalizer, and the publisher's ``trace_id`` and ``correlation_id`` when set; a value over
Postmark's 80-character limit is left out) and
``MessageStream`` (option ``message_stream``, default ``"outbound"``; the bulk lane uses option
``bulk_message_stream`` when it is set, e.g. a broadcast stream).

A 200 answer is ``{"To", "SubmittedAt", "MessageID", "ErrorCode": 0, "Message": "OK"}``.
Errors are ``{"ErrorCode": n, "Message": "..."}``: 401 (ErrorCode 10, bad or missing token),
413 (payload too large) and 422 (ErrorCode 300 invalid email request, 406 inactive
recipient, 400/401 sender signature problems, ...) are permanent and keep the ErrorCode for
the dead letter; 429 (rate limit), 5xx and ErrorCode 100 (maintenance) are transient, with
``Retry-After`` honoured when the answer carries one (Postmark documents no rate-limit reset
header).

**Postmark has no idempotency header.** The ``idempotency_key`` still travels in
``Metadata`` so a duplicate can be traced, but the one accepted window of docs/design.md
invariant 3 (the provider accepted, the process died before the commit) stays open for
Postmark: a retry after a lost 200 sends the mail a second time.
"""

from typing import Any, Self

import httpx

from email_platform.common.classify import classify_response, parse_retry_after
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, DeliveryError, TransientError
from email_platform.providers import templated, wire
from email_platform.providers.base import Accepted, OutgoingEmail, trace_metadata
from email_platform.providers.http import HttpProvider, ProviderRequest

DEFAULT_BASE_URL = "https://api.postmarkapp.com"
DEFAULT_MESSAGE_STREAM = "outbound"
METADATA_VALUE_MAX = 80

#: Postmark ErrorCodes worth retrying whatever the HTTP status: 100 maintenance, 429 rate limit.
TRANSIENT_ERROR_CODES = frozenset({100, 429})


class PostmarkProvider(HttpProvider):
    name = "postmark"
    #: Postmark sets the bounce address (its own Return-Path domain).
    cannot_carry = frozenset({"envelope_sender"})

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        server_token: str,
        message_stream: str = DEFAULT_MESSAGE_STREAM,
        bulk_message_stream: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not server_token:
            raise ConfigurationError(
                "postmark needs a server token (EMAIL_PLATFORM_POSTMARK_API_KEY)"
            )
        super().__init__(
            base_url,
            headers={
                "Accept": "application/json",
                "X-Postmark-Server-Token": server_token,
            },
            **kwargs,
        )
        self.message_stream = message_stream
        self.bulk_message_stream = bulk_message_stream

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        if not settings.api_key:
            raise ConfigurationError(
                "EMAIL_PLATFORM_POSTMARK_API_KEY (the Postmark server token) is not set"
            )
        return cls(
            settings.base_url or DEFAULT_BASE_URL,
            server_token=settings.api_key,
            message_stream=settings.option("message_stream") or DEFAULT_MESSAGE_STREAM,
            bulk_message_stream=settings.option("bulk_message_stream") or None,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    def stream_for(self, email: OutgoingEmail) -> str:
        if email.lane == "bulk" and self.bulk_message_stream:
            return self.bulk_message_stream
        return self.message_stream

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        body: dict = {
            "From": email.sender,
            "To": email.to,
            "Subject": email.subject,
            "TextBody": email.text,
        }
        if email.html is not None:
            body["HtmlBody"] = email.html
        body["Headers"] = [{"Name": name, "Value": value} for name, value in email.headers.items()]
        body.update(wire.postmark_fields(email))
        body["Tag"] = email.template
        metadata = {
            "event_id": email.event_id,
            "idempotency_key": email.idempotency_key,
            **trace_metadata(email),
        }
        # Postmark's metadata FAQ caps a value at 80 characters: a longer key or correlation id
        # is left out rather than have the message refused. The event id (a ULID) always fits,
        # and webhooks still match on it and on the MessageID.
        body["Metadata"] = {k: v for k, v in metadata.items() if len(v) <= METADATA_VALUE_MAX}
        body["MessageStream"] = self.stream_for(email)
        if email.provider_template is not None:
            return templated.postmark_request(body, email)
        # No idempotency header: Postmark does not offer one (see the module docstring).
        return ProviderRequest("POST", "/email", json=body)

    def accepted(self, response: httpx.Response) -> Accepted:
        body = response.json()
        if not isinstance(body, dict):
            raise TypeError(f"expected a JSON object, got {type(body).__name__}")
        if body.get("ErrorCode", 0) != 0:
            raise self.classify(response)
        return Accepted(str(body["MessageID"]), response.status_code)

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        try:
            body = response.json()
        except ValueError:
            return None, response.text[:300]
        if not isinstance(body, dict):
            return None, str(body)[:300]
        code = body.get("ErrorCode")
        message = body.get("Message") or ""
        return (str(code) if code is not None else None), str(message)

    def classify(self, response: httpx.Response) -> DeliveryError:
        code, message = self.error_of(response)
        if code is not None and code.isdigit() and int(code) in TRANSIENT_ERROR_CODES:
            return TransientError(
                f"HTTP {response.status_code}: Postmark ErrorCode {code}: {message}",
                status_code=response.status_code,
                code=code,
                retry_after_s=parse_retry_after(
                    response.headers.get("retry-after"), cap_s=self.retry_after_cap_s
                ),
            )
        label = f"Postmark ErrorCode {code}: {message}" if code is not None else message
        return classify_response(
            response.status_code,
            response.headers,
            code=code,
            message=label,
            retry_after_cap_s=self.retry_after_cap_s,
        )
