"""Adapter for the sandbox provider (``email-platform sandbox serve``): JSON over HTTP.

The sandbox honours an idempotency key per message in its batch call too, so the adapter
batches: ``EMAIL_PLATFORM_SANDBOX_BATCH_MAX`` messages a call (default 100, 1 = one per call).
"""

from collections.abc import Sequence
from typing import Any, Self

import httpx

from email_platform.common.classify import classify_response
from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, DeliveryError
from email_platform.providers import templated, wire
from email_platform.providers.base import (
    Accepted,
    OutgoingEmail,
    idempotency_header,
    trace_metadata,
)
from email_platform.providers.http import HttpProvider, ProviderRequest

#: The sandbox server's own limit on one batch call.
SANDBOX_BATCH_LIMIT = 500
DEFAULT_BATCH_MAX = 100


class SandboxProvider(HttpProvider):
    name = "sandbox"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        batch_max: int = DEFAULT_BATCH_MAX,
        **kwargs: Any,
    ) -> None:
        if not 1 <= batch_max <= SANDBOX_BATCH_LIMIT:
            raise ConfigurationError(
                f"sandbox batch_max must be 1 to {SANDBOX_BATCH_LIMIT}, got {batch_max}"
            )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(base_url, headers=headers, **kwargs)
        self.batch_max = batch_max

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        raw = settings.option("batch_max", str(DEFAULT_BATCH_MAX)) or ""
        try:
            batch_max = int(raw)
        except ValueError:
            raise ConfigurationError(
                f"EMAIL_PLATFORM_SANDBOX_BATCH_MAX must be a whole number, got {raw!r}"
            ) from None
        return cls(
            settings.base_url or "http://127.0.0.1:8025",
            api_key=settings.api_key,
            batch_max=batch_max,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    def _body(self, email: OutgoingEmail) -> dict[str, Any]:
        body = {
            "from": email.sender,
            "to": email.to,
            "subject": email.subject,
            "text": email.text,
            "html": email.html,
            "headers": email.headers,
            "metadata": {
                "event_id": email.event_id,
                "idempotency_key": email.idempotency_key,
                "template": email.template,
                **trace_metadata(email),
            },
            "tags": [email.template, email.lane],
            **wire.sandbox_fields(email),
        }
        templated.sandbox_body(body, email)
        return body

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        return ProviderRequest(
            "POST",
            "/v1/send",
            headers={"Idempotency-Key": idempotency_header(email.idempotency_key)},
            json=self._body(email),
        )

    def accepted(self, response: httpx.Response) -> Accepted:
        return Accepted(str(response.json()["id"]), response.status_code)

    def build_batch_request(self, emails: Sequence[OutgoingEmail]) -> ProviderRequest:
        return ProviderRequest(
            "POST",
            "/v1/send/batch",
            json={
                "messages": [
                    # The header's form, so a message retried alone keeps its batch key.
                    {
                        **self._body(email),
                        "idempotency_key": idempotency_header(email.idempotency_key),
                    }
                    for email in emails
                ]
            },
        )

    def batch_entries(self, response: httpx.Response, emails: Sequence[OutgoingEmail]) -> list:
        return list(response.json()["results"])

    def batch_entry(self, entry: Any, response: httpx.Response) -> Accepted | DeliveryError:
        status = int(entry["status"])
        if 200 <= status < 300:
            return Accepted(str(entry["id"]), status)
        error = entry.get("error") or {}
        retry_after = entry.get("retry_after")
        return classify_response(
            status,
            {"Retry-After": str(retry_after)} if retry_after is not None else {},
            code=error.get("code"),
            message=error.get("message") or error.get("code") or "",
            retry_after_cap_s=self.retry_after_cap_s,
        )

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        try:
            error = response.json().get("error") or {}
            return error.get("code"), error.get("message") or error.get("code") or ""
        except (ValueError, AttributeError):
            return None, response.text[:200]
