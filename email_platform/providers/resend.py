"""Adapter for Resend's send-email API: ``POST https://api.resend.com/emails``.

Documented at https://resend.com/docs/api-reference/emails/send-email,
https://resend.com/docs/dashboard/emails/idempotency-keys,
https://resend.com/docs/api-reference/errors and
https://resend.com/docs/api-reference/rate-limit. The request is JSON with
``Authorization: Bearer <api key>`` and ``Idempotency-Key: <idempotency_key>``; the body
carries ``from``, ``to`` (a list), ``subject``, ``text``, ``html``, ``headers`` (an object) and
``tags`` (a list of ``{"name", "value"}``: ``event_id``, ``idempotency_key``, ``template``,
``lane``), which is where the webhook normalizer reads ``event_id`` back.

Resend tag names and values may hold only ASCII letters, digits, ``_`` and ``-`` (at most 256
characters), so every other character is replaced by ``_`` (:func:`tag_value`): an event id
(a ULID) is unchanged, an idempotency key ``01J…:welcome`` travels as ``01J…_welcome`` in its
tag, and exactly as is in the ``Idempotency-Key`` header (a key that is not ASCII, which no
header can carry, goes there UTF-8 percent-encoded: :func:`~.base.idempotency_header`). A
webhook normalizer matching on the key must compare ``tag_value(key)``.

Resend honours the ``Idempotency-Key`` for 24 hours: a retry with the same key and payload
gets the first answer and sends nothing, so the one accepted window of docs/design.md invariant 3
is closed for Resend.

**Batches** (``EMAIL_PLATFORM_RESEND_BATCH_MAX`` > 1, at most 100; default 1: one message a
call): ``POST /emails/batch`` takes a JSON array of the bodies above, each built by
``build_request`` (so each keeps its tags: event id, idempotency key), with
``x-batch-validation: permissive``: an entry Resend refuses is named in ``errors`` by its
index, the others are sent and their ids come back in ``data``, in order. Resend's
``Idempotency-Key`` is one per request, so a batch carries a key derived from its messages'
keys (:func:`batch_key`): the same messages retried together get the first answer, but a
retry that regroups them (some were sent, others joined) is a new request. With batches on,
the window of invariant 3 is therefore open for Resend as for Postmark (docs/batch-sending.md).
Batch calls take no attachments (nor ``scheduled_at``, which we never send), so a message
with attachments, or on a Resend template, goes in a call of its own.

A 200 answer is ``{"id": "..."}``. Errors are ``{"statusCode", "name", "message"}`` and the
``name`` is kept as the dead letter's error code:

* transient: 429 ``rate_limit_exceeded`` (waits ``retry-after``, else ``ratelimit-reset``),
  409 ``concurrent_idempotent_requests`` (the first request with the key is still in
  flight), 5xx ``application_error`` / ``internal_server_error``, timeouts, network errors;
* permanent: 400 ``validation_error`` / ``invalid_idempotency_key``, 401
  ``missing_api_key`` / ``restricted_api_key``, 403 ``invalid_api_key`` /
  ``validation_error``, 404, 405, 409 ``invalid_idempotent_request`` (same key, different
  payload), 422 ``validation_error`` / ``missing_required_field`` / ``invalid_from_address``
  / ..., 451 ``security_error``;
* 429 ``daily_quota_exceeded`` / ``monthly_quota_exceeded`` are **permanent** on purpose:
  the quota resets with the day or month (or a plan change), far beyond any retry budget
  here (``Retry-After`` is capped at minutes), so retrying would only burn the lane's
  retries, hold the run and hit the same wall. The message goes straight to
  ``dead_letters`` with the quota code, and the operator replays it
  (``email-platform dlq replay``, same idempotency key) once sending is possible again.
"""

import hashlib
from collections.abc import Sequence
from typing import Any, Self, cast

import httpx

from email_platform.common.classify import (
    classify_exception,
    classify_response,
    parse_retry_after,
)
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import (
    ConfigurationError,
    DeliveryError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.common.tags import tag_value
from email_platform.providers import templated, wire
from email_platform.providers.base import (
    Accepted,
    OutgoingEmail,
    batch_limit,
    batch_max_option,
    idempotency_header,
    trace_metadata,
)
from email_platform.providers.http import HttpProvider, ProviderRequest

DEFAULT_BASE_URL = "https://api.resend.com"
#: Resend's own limit on one batch call.
RESEND_BATCH_LIMIT = 100

#: Error names that are worth retrying whatever their status code.
TRANSIENT_ERRORS = frozenset(
    {
        "rate_limit_exceeded",
        "concurrent_idempotent_requests",
        "application_error",
        "internal_server_error",
    }
)
#: 429s that no retry within a run can fix (see the module docstring).
QUOTA_ERRORS = frozenset({"daily_quota_exceeded", "monthly_quota_exceeded"})


class ResendProvider(HttpProvider):
    name = "resend"
    cannot_carry = frozenset({"envelope_sender"})

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str,
        batch_max: int = 1,
        **kwargs: Any,
    ) -> None:
        if not api_key:
            raise ConfigurationError("resend needs an API key (EMAIL_PLATFORM_RESEND_API_KEY)")
        super().__init__(base_url, headers={"Authorization": f"Bearer {api_key}"}, **kwargs)
        self.batch_max = batch_limit("resend", batch_max, RESEND_BATCH_LIMIT)

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        if not settings.api_key:
            raise ConfigurationError("EMAIL_PLATFORM_RESEND_API_KEY is not set")
        return cls(
            settings.base_url or DEFAULT_BASE_URL,
            api_key=settings.api_key,
            batch_max=batch_max_option(settings, "RESEND"),
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        body: dict = {
            "from": email.sender,
            "to": [email.to],
            "subject": email.subject,
            "text": email.text,
        }
        if email.html is not None:
            body["html"] = email.html
        body.update(wire.resend_fields(email))
        if email.headers:
            body["headers"] = dict(email.headers)
        body["tags"] = [
            {"name": "event_id", "value": tag_value(email.event_id)},
            {"name": "idempotency_key", "value": tag_value(email.idempotency_key)},
            {"name": "template", "value": tag_value(email.template)},
            {"name": "lane", "value": tag_value(email.lane)},
            # Tags allow only [A-Za-z0-9_-]: other characters of an opaque id become "_".
            *({"name": k, "value": tag_value(v)} for k, v in trace_metadata(email).items()),
        ]
        templated.resend_body(body, email)
        return ProviderRequest(
            "POST",
            "/emails",
            headers={"Idempotency-Key": idempotency_header(email.idempotency_key)},
            json=body,
        )

    def accepted(self, response: httpx.Response) -> Accepted:
        return Accepted(str(response.json()["id"]), response.status_code)

    # ---- batches ---------------------------------------------------------------------------

    def build_batch_request(self, emails: Sequence[OutgoingEmail]) -> ProviderRequest:
        return ProviderRequest(
            "POST",
            "/emails/batch",
            headers={
                "Idempotency-Key": batch_key(emails),
                "x-batch-validation": "permissive",
            },
            json=[self.build_request(email).json for email in emails],
        )

    def batch_entries(self, response: httpx.Response, emails: Sequence[OutgoingEmail]) -> list:
        body = response.json()
        refused: dict[int, str] = {}
        for error in body.get("errors") or []:
            index = int(error["index"])
            if not 0 <= index < len(emails) or index in refused:
                raise ValueError(f"an error names entry {index} of {len(emails)}")
            refused[index] = str(error.get("message") or "")
        ids = list(body["data"])
        if len(ids) != len(emails) - len(refused):
            # Which id is whose cannot be told: none is read (each is then unreadable).
            raise ValueError(f"{len(ids)} ids for {len(emails) - len(refused)} sent entries")
        sent = iter(ids)
        return [
            (False, refused[index]) if index in refused else (True, next(sent))
            for index in range(len(emails))
        ]

    def batch_entry(self, entry: Any, response: httpx.Response) -> Accepted | DeliveryError:
        sent, value = entry
        if not sent:
            return ProviderRejectedError(
                f"Resend refused this batch entry: {value}",
                status_code=422,
                code="validation_error",
            )
        return Accepted(str(value["id"]), response.status_code)

    def send_many(self, emails: Sequence[OutgoingEmail]) -> list[Accepted | DeliveryError]:
        alone = [_alone(email) for email in emails]
        if not any(alone):
            return super().send_many(emails)
        rest = [e for e, a in zip(emails, alone, strict=True) if not a]
        batched = iter(super().send_many(rest) if rest else [])
        return [
            self._send_one(e) if a else next(batched) for e, a in zip(emails, alone, strict=True)
        ]

    async def send_many_async(
        self, emails: Sequence[OutgoingEmail]
    ) -> list[Accepted | DeliveryError]:
        alone = [_alone(email) for email in emails]
        if not any(alone):
            return await super().send_many_async(emails)
        rest = [e for e, a in zip(emails, alone, strict=True) if not a]
        batched = iter(await super().send_many_async(rest) if rest else [])
        return [
            await self._send_one_async(e) if a else next(batched)
            for e, a in zip(emails, alone, strict=True)
        ]

    # The batch call may already be accepted: whatever one message's own call raises is that
    # message's result, never a raise that would have the batch sent again (invariant 3).

    def _send_one(self, email: OutgoingEmail) -> Accepted | DeliveryError:
        try:
            return self.send(email)
        except Exception as exc:
            return _own_result(exc)

    async def _send_one_async(self, email: OutgoingEmail) -> Accepted | DeliveryError:
        try:
            return await self.send_async(email) if self.async_ready else self.send(email)
        except Exception as exc:
            return _own_result(exc)

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        try:
            body = response.json()
        except ValueError:
            return None, response.text[:300]
        if not isinstance(body, dict):
            return None, str(body)[:300]
        name = body.get("name")
        return (str(name) if name else None), str(body.get("message") or "")

    def retry_after_s(self, response: httpx.Response) -> float | None:
        """``retry-after`` when given, else ``ratelimit-reset`` (both in seconds)."""
        for header in ("retry-after", "ratelimit-reset"):
            seconds = parse_retry_after(response.headers.get(header), cap_s=self.retry_after_cap_s)
            if seconds is not None:
                return seconds
        return None

    def classify(self, response: httpx.Response) -> DeliveryError:
        name, message = self.error_of(response)
        status = response.status_code
        text = f"HTTP {status}: {name}: {message}" if name else f"HTTP {status}: {message}"
        if name in QUOTA_ERRORS:
            return ProviderRejectedError(text, status_code=status, code=name)
        if name in TRANSIENT_ERRORS or status == 429 or status >= 500:
            return TransientError(
                text, status_code=status, code=name, retry_after_s=self.retry_after_s(response)
            )
        return classify_response(
            status,
            response.headers,
            code=name,
            message=f"{name}: {message}" if name else message,
            retry_after_cap_s=self.retry_after_cap_s,
        )


def _own_result(exc: Exception) -> Accepted | DeliveryError:
    # A wrong setting stays a ConfigurationError (never dead-lettered): the dispatcher passes
    # it on as this message's result, as ``attempt`` does.
    if isinstance(exc, ConfigurationError):
        return cast(DeliveryError, exc)
    return classify_exception(exc)


def _alone(email: OutgoingEmail) -> bool:
    """Whether ``email`` needs a call of its own: Resend's batch call takes no attachments,
    and documents no templates."""
    return bool(email.attachments) or email.provider_template is not None


def batch_key(emails: Sequence[OutgoingEmail]) -> str:
    """The ``Idempotency-Key`` of a batch: the same messages give the same key."""
    digest = hashlib.sha256("\n".join(e.idempotency_key for e in emails).encode()).hexdigest()
    return f"batch-{digest}"
