"""What every HTTP provider adapter shares: one keep-alive client per run, a timeout on every
call, the run-wide rate limit, and one mapping from response to accepted / transient /
permanent. An adapter only says how to build its request and how to read its answers.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from email_platform.classify import classify_exception, classify_response
from email_platform.errors import DeliveryError, TransientError
from email_platform.providers.base import Accepted, OutgoingEmail, RateLimiter


@dataclass
class ProviderRequest:
    """One provider call, as the provider documents it."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    data: Mapping[str, Any] | list[tuple[str, str]] | None = None
    content: bytes | None = None


class HttpProvider:
    """Base of the HTTP adapters. Thread-safe: the run's send threads share one instance."""

    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | tuple[str, str] | None = None,
        timeout_s: float = 10.0,
        rate_limit_per_s: float = 0.0,
        max_connections: int = 20,
        retry_after_cap_s: float = 300.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=dict(headers or {}),
            auth=auth,
            timeout=timeout_s,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
        )
        self.limiter = RateLimiter(rate_limit_per_s)
        self.retry_after_cap_s = retry_after_cap_s

    # ---- what an adapter provides -----------------------------------------------------------

    def build_request(self, email: OutgoingEmail) -> ProviderRequest:
        raise NotImplementedError

    def accepted(self, response: httpx.Response) -> Accepted:
        """Read the provider's message id from a 2xx answer."""
        raise NotImplementedError

    def error_of(self, response: httpx.Response) -> tuple[str | None, str]:
        """The provider's error code and message from a non-2xx answer."""
        try:
            body = response.json()
        except ValueError:
            return None, response.text[:300]
        if isinstance(body, dict):
            code = body.get("code") or body.get("error_code") or body.get("name")
            message = body.get("message") or body.get("error") or str(body)[:300]
            return (str(code) if code is not None else None), str(message)
        return None, str(body)[:300]

    def classify(self, response: httpx.Response) -> DeliveryError:
        """Map a non-2xx answer; adapters override for provider-specific codes."""
        code, message = self.error_of(response)
        return classify_response(
            response.status_code,
            response.headers,
            code=code,
            message=message,
            retry_after_cap_s=self.retry_after_cap_s,
        )

    # ---- the shared call --------------------------------------------------------------------

    def send(self, email: OutgoingEmail) -> Accepted:
        request = self.build_request(email)
        self.limiter.acquire()
        try:
            response = self.client.request(
                request.method,
                request.path,
                headers=request.headers,
                json=request.json,
                data=request.data,
                content=request.content,
            )
        except httpx.HTTPError as exc:
            raise classify_exception(exc) from exc
        if 200 <= response.status_code < 300:
            try:
                return self.accepted(response)
            except (ValueError, KeyError, TypeError) as exc:
                # Accepted or not, we cannot tell: retrying under the same key is the safe side.
                raise TransientError(
                    f"unreadable {response.status_code} answer from {self.name}",
                    status_code=response.status_code,
                    code="unreadable_response",
                ) from exc
        raise self.classify(response)

    def close(self) -> None:
        self.client.close()
