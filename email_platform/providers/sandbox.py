"""Adapter for the sandbox provider (``email-platform sandbox serve``): JSON over HTTP."""

from typing import Self

import httpx

from email_platform.config import ProviderSettings
from email_platform.providers.base import Accepted, OutgoingEmail
from email_platform.providers.http import HttpProvider, ProviderRequest


class SandboxProvider(HttpProvider):
    name = "sandbox"

    def __init__(self, base_url: str, *, api_key: str | None = None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(base_url, headers=headers, **kwargs)

    @classmethod
    def from_settings(cls, settings: ProviderSettings, *, max_connections: int) -> Self:
        return cls(
            settings.base_url or "http://127.0.0.1:8025",
            api_key=settings.api_key,
            timeout_s=settings.timeout_s,
            rate_limit_per_s=settings.rate_limit_per_s,
            max_connections=max_connections,
        )

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        return ProviderRequest(
            "POST",
            "/v1/send",
            headers={"Idempotency-Key": email.idempotency_key},
            json={
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
                },
                "tags": [email.template, email.lane],
            },
        )

    def accepted(self, response: httpx.Response) -> Accepted:
        return Accepted(str(response.json()["id"]), response.status_code)

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        try:
            error = response.json().get("error") or {}
            return error.get("code"), error.get("message") or error.get("code") or ""
        except (ValueError, AttributeError):
            return None, response.text[:200]
