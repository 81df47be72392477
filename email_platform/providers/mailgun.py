"""Adapter for Mailgun's Messages API.

Endpoint (https://documentation.mailgun.com/docs/mailgun/api-reference/openapi-final/tag/Messages/):
``POST https://api.mailgun.net/v3/{domain}/messages`` with HTTP basic auth, user ``api`` and
the API key as password, and form fields (sent ``application/x-www-form-urlencoded``; Mailgun
also takes ``multipart/form-data``)::

    from=Example <no-reply@mg.example.com>   to=jane@example.com   subject=…
    text=…   html=…   o:tag=welcome   h:X-Email-Event-Id=01J…
    v:event_id=01J…   v:idempotency_key=01J…:welcome

* ``v:`` user variables are Mailgun's metadata field: every webhook event carries them back
  under ``user-variables``, which is how ``event_id`` and ``idempotency_key`` return (and
  ``v:trace_id`` / ``v:correlation_id``, the publisher's request, when set).
* ``o:tag`` tags the message with its template; ``h:`` adds a MIME header.
* The domain is required (``EMAIL_PLATFORM_MAILGUN_DOMAIN``). Domains in Mailgun's EU region
  are served by ``https://api.eu.mailgun.net``: set ``EMAIL_PLATFORM_MAILGUN_BASE_URL`` to it,
  or ``EMAIL_PLATFORM_MAILGUN_REGION=eu``. A base URL ending in ``/v3`` is accepted too.
* Success is ``200 {"id": "<20260101120000.1.ABC@mg.example.com>", "message": "Queued. Thank
  you."}``; the id is stored without its angle brackets, the form Mailgun's webhooks report
  as ``message.headers.message-id``.
* Errors are ``{"message": "…"}`` (401 answers a plain ``Forbidden``). 400 (e.g. "'to'
  parameter is not a valid address"), 401/403 (bad key) and 404 (unknown domain) are
  permanent; 429 is transient and honours ``Retry-After``; 5xx is transient. Mailgun has no
  error codes, so the HTTP reason (``bad_request``, ``unauthorized``, ``not_found``) is kept
  as the code and Mailgun's message is kept for the dead letter.

**No idempotency header.** Mailgun documents no idempotency key for sends, so the window
between Mailgun accepting a message and this process recording it stays open: a lost 200
(timeout after acceptance, process killed) means the retry sends the mail again. The
``idempotency_key`` still travels as ``v:idempotency_key`` so a duplicate shows in webhooks.
"""

import re
from typing import Any, Self

import httpx

from email_platform.common.classify import classify_response, reason_code
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, DeliveryError
from email_platform.providers import templated, wire
from email_platform.providers.base import Accepted, OutgoingEmail, trace_metadata
from email_platform.providers.http import HttpProvider, ProviderRequest

DEFAULT_BASE_URL = "https://api.mailgun.net"
EU_BASE_URL = "https://api.eu.mailgun.net"
REGIONS = {"us": DEFAULT_BASE_URL, "eu": EU_BASE_URL}
_DOMAIN_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def _base(url: str) -> str:
    """Accept the host with or without the ``/v3`` version segment the path already carries."""
    url = url.rstrip("/")
    return url[: -len("/v3")] if url.endswith("/v3") else url


class MailgunProvider(HttpProvider):
    name = "mailgun"
    cannot_carry = frozenset({"envelope_sender"})

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str,
        domain: str,
        **kwargs: Any,
    ) -> None:
        if not _DOMAIN_RE.match(domain or ""):
            raise ConfigurationError(f"Mailgun domain {domain!r} is not a domain name")
        super().__init__(_base(base_url), auth=("api", api_key), **kwargs)
        self.domain = domain
        self.path = f"/v3/{domain}/messages"

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        if not settings.api_key:
            raise ConfigurationError("Mailgun needs an API key: set EMAIL_PLATFORM_MAILGUN_API_KEY")
        domain = (settings.option("domain") or "").strip()
        if not domain:
            raise ConfigurationError(
                "Mailgun needs the sending domain: set EMAIL_PLATFORM_MAILGUN_DOMAIN"
            )
        base_url = settings.base_url
        if not base_url:
            region = (settings.option("region") or "us").strip().lower()
            if region not in REGIONS:
                raise ConfigurationError(
                    f"EMAIL_PLATFORM_MAILGUN_REGION={region!r} is not one of us, eu"
                )
            base_url = REGIONS[region]
        return cls(
            base_url,
            api_key=settings.api_key,
            domain=domain,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        fields: dict[str, str] = {
            "from": email.sender,
            "to": email.to,
            "subject": email.subject,
            "text": email.text,
        }
        if email.html:
            fields["html"] = email.html
        fields.update(wire.mailgun_fields(email))
        fields["o:tag"] = email.template
        for name, value in email.headers.items():
            fields[f"h:{name}"] = str(value)
        fields["v:event_id"] = email.event_id
        fields["v:idempotency_key"] = email.idempotency_key
        for name, value in trace_metadata(email).items():
            fields[f"v:{name}"] = value
        templated.mailgun_fields(fields, email)
        return ProviderRequest("POST", self.path, data=fields, files=wire.mailgun_files(email))

    def accepted(self, response: httpx.Response) -> Accepted:
        # A 200 without an id is not Mailgun's answer (a proxy, a wrong base URL): the base
        # class retries it rather than calling the message sent.
        message_id = str(response.json()["id"]).strip()
        if not message_id:
            raise ValueError("empty id")
        return Accepted(message_id.removeprefix("<").removesuffix(">"), response.status_code)

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        try:
            body = response.json()
        except ValueError:
            return None, response.text.strip()[:300] or response.reason_phrase
        if isinstance(body, dict) and body.get("message"):
            return None, str(body["message"])
        return super().error_of(response)

    def classify(self, response: httpx.Response) -> DeliveryError:
        code, message = self.error_of(response)
        return classify_response(
            response.status_code,
            response.headers,
            code=code or reason_code(response.status_code),
            message=message,
            retry_after_cap_s=self.retry_after_cap_s,
        )
