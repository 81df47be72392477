"""Failure classification: a pure decision of retry versus dead letter.

Network errors, timeouts, 429 and 5xx are transient; other 4xx are permanent. ``Retry-After``
is read as seconds or an HTTP date and capped, so one provider cannot park a run for a day.
"""

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TypeGuard

import httpx

from email_platform.common.errors import (
    DeliveryError,
    PermanentError,
    ProviderRejectedError,
    TransientError,
)
from email_platform.common.timeutil import utcnow

TRANSIENT_STATUS = frozenset({408, 425, 429})

#: Answers that say "slow down" whatever their status: AWS's throttling codes (SES sends
#: ``ThrottlingException`` and ``LimitExceededException`` as 400), the SendEmail ones and the
#: AWS-wide ones botocore's retry logic treats as throttling.
THROTTLE_CODES = frozenset(
    {
        "TooManyRequestsException",  # 429: sending rate exceeded
        "LimitExceededException",  # 400: a limit was hit; botocore retries it as throttling
        "ThrottlingException",  # 400: the common AWS throttling error
        "Throttling",
        "RequestLimitExceeded",
    }
)


def is_throttle(error: object) -> TypeGuard[TransientError]:
    """Whether ``error`` is a provider asking every sender to slow down: a 429, a throttling
    code under another status, or any answer of the provider carrying ``Retry-After``.
    Errors of our own making (no status: a circuit open, the rate's database) are not."""
    return (
        isinstance(error, TransientError)
        and error.status_code is not None
        and (
            error.status_code == 429
            or error.code in THROTTLE_CODES
            or error.retry_after_s is not None
        )
    )


def parse_retry_after(
    value: str | None, *, now: datetime | None = None, cap_s: float = 300.0
) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date), capped."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        if when.tzinfo is None:  # "-0000" or no zone: RFC 9110 dates are GMT
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or utcnow())).total_seconds()
    if math.isnan(seconds):
        return None
    return max(0.0, min(seconds, cap_s))


def classify_response(
    status_code: int,
    headers: Mapping[str, str],
    *,
    code: str | None,
    message: str,
    retry_after_cap_s: float = 300.0,
) -> DeliveryError:
    """The error a non-2xx response stands for."""
    if status_code in TRANSIENT_STATUS or status_code >= 500:
        return TransientError(
            f"HTTP {status_code}: {message}",
            status_code=status_code,
            code=code,
            retry_after_s=parse_retry_after(
                _header(headers, "retry-after"), cap_s=retry_after_cap_s
            ),
        )
    return ProviderRejectedError(
        f"HTTP {status_code}: {message}", status_code=status_code, code=code
    )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # httpx.Headers is case-insensitive; a plain dict from another adapter may not be.
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def reason_code(status_code: int) -> str:
    """``401`` -> ``unauthorized``: the code kept when a provider's answer names none."""
    phrase = httpx.codes.get_reason_phrase(status_code) or f"http {status_code}"
    return phrase.lower().replace(" ", "_").replace("-", "_")


def classify_exception(exc: BaseException) -> DeliveryError:
    """The error a client-side exception stands for; unknown ones are not guessed at."""
    if isinstance(exc, DeliveryError):
        return exc
    if isinstance(exc, httpx.TimeoutException):
        return TransientError(f"timeout: {type(exc).__name__}", code="timeout")
    if isinstance(exc, httpx.TransportError):
        return TransientError(f"network error: {type(exc).__name__}: {exc}", code="network")
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return TransientError(f"network error: {type(exc).__name__}: {exc}", code="network")
    return PermanentError(f"unexpected {type(exc).__name__}: {exc}", code="unexpected")


def is_transient(error: DeliveryError) -> bool:
    return isinstance(error, TransientError)
