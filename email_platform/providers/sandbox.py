"""Adapter for the sandbox provider (``email-platform sandbox serve``): JSON over HTTP."""

import httpx

from email_platform.classify import classify_exception, classify_response
from email_platform.errors import TransientError
from email_platform.providers.base import Accepted, OutgoingEmail, RateLimiter


class SandboxProvider:
    name = "sandbox"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 10.0,
        rate_limit_per_s: float = 0.0,
        max_connections: int = 20,
        retry_after_cap_s: float = 300.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )
        self._limiter = RateLimiter(rate_limit_per_s)
        self._retry_after_cap_s = retry_after_cap_s

    def send(self, email: OutgoingEmail) -> Accepted:
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
            },
            "tags": [email.template, email.lane],
        }
        self._limiter.acquire()
        try:
            response = self._client.post(
                "/v1/send", json=body, headers={"Idempotency-Key": email.idempotency_key}
            )
        except httpx.HTTPError as exc:
            raise classify_exception(exc) from exc
        if response.status_code == 200:
            try:
                return Accepted(str(response.json()["id"]), response.status_code)
            except (ValueError, KeyError) as exc:
                # Accepted or not, we cannot tell: retrying under the same key is safe.
                raise TransientError("unreadable 200 answer", status_code=200) from exc
        code, message = _error_of(response)
        raise classify_response(
            response.status_code,
            response.headers,
            code=code,
            message=message,
            retry_after_cap_s=self._retry_after_cap_s,
        )

    def close(self) -> None:
        self._client.close()


def _error_of(response: httpx.Response) -> tuple[str | None, str]:
    try:
        error = response.json().get("error") or {}
        return error.get("code"), error.get("message") or error.get("code") or response.text[:200]
    except (ValueError, AttributeError):
        return None, response.text[:200]
