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

**Batches** (``EMAIL_PLATFORM_POSTMARK_BATCH_MAX`` > 1, at most 500; default 1: one message
a call): ``POST /email/batch`` takes a JSON array of the bodies above, and
``/email/batchWithTemplates`` takes ``{"Messages": [...]}`` of ``/email/withTemplate`` bodies.
Each entry is built by ``build_request``, so its Metadata (event id, idempotency key) and
stream are the single send's. The answer is 200 with one ``{"ErrorCode", "Message",
"MessageID", ...}`` per message, in order: ErrorCode 0 is accepted, any other is that message's
failure alone (100 and 429 transient, the rest permanent). A batch mixing template and plain
messages is sent one message a call (the two endpoints take different bodies).

**Postmark has no idempotency header.** The ``idempotency_key`` still travels in
``Metadata`` so a duplicate can be traced, but the one accepted window of docs/design.md
invariant 3 (the provider accepted, the process died before the commit) stays open for
Postmark: a retry after a lost 200 sends the mail a second time.
"""

from collections.abc import Sequence
from typing import Any, Self

import httpx

from email_platform.common.classify import classify_response, parse_retry_after
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, DeliveryError, TransientError
from email_platform.providers import templated, wire
from email_platform.providers.base import (
    Accepted,
    OutgoingEmail,
    batch_limit,
    batch_max_option,
    trace_metadata,
)
from email_platform.providers.http import HttpProvider, ProviderRequest

DEFAULT_BASE_URL = "https://api.postmarkapp.com"
DEFAULT_MESSAGE_STREAM = "outbound"
METADATA_VALUE_MAX = 80

#: Postmark's own limit on one batch call.
POSTMARK_BATCH_LIMIT = 500

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
        batch_max: int = 1,
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
        self.batch_max = batch_limit("postmark", batch_max, POSTMARK_BATCH_LIMIT)

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
            batch_max=batch_max_option(settings, "POSTMARK"),
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

    def build_batch_request(self, emails: Sequence[OutgoingEmail]) -> ProviderRequest:
        singles = [self.build_request(email) for email in emails]
        paths = {single.path for single in singles}
        if paths == {"/email"}:
            return ProviderRequest("POST", "/email/batch", json=[s.json for s in singles])
        if paths == {"/email/withTemplate"}:
            return ProviderRequest(
                "POST", "/email/batchWithTemplates", json={"Messages": [s.json for s in singles]}
            )
        # Not one message's fault: the dispatcher sends them one a call instead.
        raise ValueError("a Postmark batch takes template or plain messages, not both")

    def batch_entries(self, response: httpx.Response, emails: Sequence[OutgoingEmail]) -> list:
        answers = response.json()
        if not isinstance(answers, list):
            raise TypeError(f"expected a JSON array, got {type(answers).__name__}")
        return answers

    def batch_entry(self, entry: Any, response: httpx.Response) -> Accepted | DeliveryError:
        """One message's answer within a 200 batch answer."""
        answer: dict = entry
        code = int(answer.get("ErrorCode", 0))
        if code == 0:
            return Accepted(str(answer["MessageID"]), response.status_code)
        message = f"Postmark ErrorCode {code}: {answer.get('Message') or ''}"
        if code in TRANSIENT_ERROR_CODES:
            return TransientError(
                message,
                status_code=429 if code == 429 else 503,
                code=str(code),
                retry_after_s=parse_retry_after(
                    response.headers.get("retry-after"), cap_s=self.retry_after_cap_s
                ),
            )
        # The status Postmark gives the same refusal of a single send.
        return classify_response(422, {}, code=str(code), message=message)

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
