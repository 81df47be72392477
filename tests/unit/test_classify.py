"""Unit tests of failure classification and retry waits: retry versus dead letter, and when.

``email_platform.common.classify`` decides transient (network, timeout, 408/425/429, 5xx: retried)
versus permanent (other 4xx, unexpected exceptions: dead-lettered) and reads ``Retry-After``;
``email_platform.sending.retry.retry_wait_s`` turns that into the wait before the next attempt
(Retry-After when given, else exponential backoff with full jitter, both capped per lane).
"""

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import dagster._core.definitions.policy as dagster_policy
import httpx
import pytest
from dagster import Backoff, Jitter, RetryPolicy

from email_platform.common.classify import (
    classify_exception,
    classify_response,
    is_transient,
    parse_retry_after,
)
from email_platform.common.errors import (
    PermanentError,
    ProviderRejectedError,
    TemplateRenderError,
    TransientError,
)
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, LANES, Lane, LaneConfig
from email_platform.sending.retry import retry_wait_s

NOW = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC)
REQUEST = httpx.Request("POST", "https://provider.test/v1/send")


def _http_date(when: datetime) -> str:
    return format_datetime(when, usegmt=True)


# --- Retry-After ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("120", 120.0), (" 7 ", 7.0), ("0", 0.0), ("1.5", 1.5), ("0.25", 0.25)],
)
def test_retry_after_seconds(value: str, expected: float) -> None:
    assert parse_retry_after(value, now=NOW) == expected


@pytest.mark.parametrize("ahead_s", [1, 60, 299])
def test_retry_after_http_date_is_relative_to_now(ahead_s: int) -> None:
    value = _http_date(NOW + timedelta(seconds=ahead_s))
    assert parse_retry_after(value, now=NOW) == float(ahead_s)


def test_retry_after_literal_rfc_example() -> None:
    assert parse_retry_after("Wed, 21 Oct 2015 07:29:30 GMT", now=NOW) == 90.0


def test_retry_after_http_date_with_an_offset_zone() -> None:
    # 09:29:00+0200 is 07:29:00Z: one minute after NOW.
    assert parse_retry_after("Wed, 21 Oct 2015 09:29:00 +0200", now=NOW) == 60.0


@pytest.mark.parametrize("value", [_http_date(NOW - timedelta(hours=1)), _http_date(NOW), "-5"])
def test_retry_after_in_the_past_is_zero(value: str) -> None:
    assert parse_retry_after(value, now=NOW) == 0.0


@pytest.mark.parametrize("value", [None, "", "   ", "soon", "12s", "Wed, 99 Foo 2015", "1,5"])
def test_retry_after_garbage_is_none(value: str | None) -> None:
    assert parse_retry_after(value, now=NOW) is None


@pytest.mark.parametrize(
    ("value", "cap", "expected"),
    [
        ("3600", 300.0, 300.0),
        ("86400", 30.0, 30.0),
        ("inf", 300.0, 300.0),
        ("29.5", 30.0, 29.5),
        (_http_date(NOW + timedelta(days=1)), 300.0, 300.0),
        (_http_date(NOW + timedelta(seconds=45)), 60.0, 45.0),
    ],
)
def test_retry_after_cap(value: str, cap: float, expected: float) -> None:
    assert parse_retry_after(value, now=NOW, cap_s=cap) == expected


def test_retry_after_default_cap_is_five_minutes() -> None:
    assert parse_retry_after("100000", now=NOW) == 300.0


@pytest.mark.parametrize(
    "value", ["Wed, 21 Oct 2015 07:29:00 -0000", "Wed, 21 Oct 2015 07:29:00"], ids=["-0000", "bare"]
)
def test_retry_after_http_date_without_explicit_zone_is_utc(value: str) -> None:
    assert parse_retry_after(value, now=NOW) == 60.0


def test_retry_after_nan_is_garbage() -> None:
    assert parse_retry_after("nan", now=NOW) is None


# --- responses --------------------------------------------------------------------------------


def test_429_is_transient_with_retry_after() -> None:
    headers = httpx.Headers({"Retry-After": "7"})
    error = classify_response(429, headers, code="rate_limited", message="slow down")
    assert isinstance(error, TransientError)
    assert is_transient(error)
    assert error.retry_after_s == 7.0
    assert error.status_code == 429
    assert error.code == "rate_limited"
    assert "429" in str(error)
    assert "slow down" in str(error)


def test_429_without_retry_after() -> None:
    error = classify_response(429, httpx.Headers(), code=None, message="")
    assert isinstance(error, TransientError)
    assert error.retry_after_s is None


def test_retry_after_is_capped_by_the_caller_cap() -> None:
    headers = httpx.Headers({"retry-after": "3600"})
    error = classify_response(429, headers, code=None, message="", retry_after_cap_s=60.0)
    assert isinstance(error, TransientError)
    assert error.retry_after_s == 60.0


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599, 408, 425])
def test_server_errors_and_timeouts_are_transient(status: int) -> None:
    headers = httpx.Headers({"Retry-After": "3"})
    error = classify_response(status, headers, code="upstream", message="oops")
    assert isinstance(error, TransientError)
    assert not isinstance(error, PermanentError)
    assert (error.status_code, error.code, error.retry_after_s) == (status, "upstream", 3.0)
    assert error.reason == "transient"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 410, 413, 422])
def test_client_errors_are_permanent(status: int) -> None:
    headers = httpx.Headers({"Retry-After": "3"})
    error = classify_response(status, headers, code="invalid_recipient", message="no such user")
    assert isinstance(error, ProviderRejectedError)
    assert isinstance(error, PermanentError)
    assert not is_transient(error)
    assert (error.status_code, error.code) == (status, "invalid_recipient")
    assert error.reason == "provider_rejected"
    assert "no such user" in str(error)


# --- exceptions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc_type", [httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout]
)
def test_httpx_timeouts_are_transient_timeout(exc_type: type[httpx.TimeoutException]) -> None:
    error = classify_exception(exc_type("timed out", request=REQUEST))
    assert isinstance(error, TransientError)
    assert error.code == "timeout"
    assert error.status_code is None


@pytest.mark.parametrize(
    "exc_type", [httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError]
)
def test_httpx_transport_errors_are_transient_network(exc_type: type[httpx.HTTPError]) -> None:
    error = classify_exception(exc_type("connection refused", request=REQUEST))
    assert isinstance(error, TransientError)
    assert error.code == "network"
    assert "connection refused" in str(error)


@pytest.mark.parametrize("exc", [ConnectionResetError("reset"), TimeoutError("slow")])
def test_builtin_network_errors_are_transient_network(exc: Exception) -> None:
    error = classify_exception(exc)
    assert isinstance(error, TransientError)
    assert error.code == "network"


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyError("id"), RuntimeError("boom")])
def test_unexpected_exceptions_are_permanent(exc: Exception) -> None:
    error = classify_exception(exc)
    assert isinstance(error, PermanentError)
    assert not isinstance(error, TransientError)
    assert error.code == "unexpected"
    assert type(exc).__name__ in str(error)


@pytest.mark.parametrize(
    "error",
    [
        TransientError("x", code="rate_limited", retry_after_s=2.0),
        TemplateRenderError("y", code="template_error"),
    ],
)
def test_delivery_errors_pass_through_unchanged(error: Exception) -> None:
    assert classify_exception(error) is error


# --- retry waits ------------------------------------------------------------------------------


def _lanes() -> list[LaneConfig]:
    return [DEFAULT_LANE_CONFIGS[lane] for lane in LANES]


def _bound(lane: LaneConfig, retry_number: int) -> float:
    """Dagster's full-jitter ceiling for attempt n = retry_number + 1, then the lane cap."""
    return min((2 ** (retry_number + 1) - 1) * lane.retry_delay_s, lane.max_retry_delay_s)


@pytest.mark.parametrize("lane", _lanes(), ids=lambda c: c.lane.value)
def test_retry_after_is_honoured_exactly_under_the_cap(lane: LaneConfig) -> None:
    for retry_after in (0.0, 0.2, 1.0, lane.max_retry_delay_s - 0.5, lane.max_retry_delay_s):
        for retry_number in (0, 3):
            assert retry_wait_s(lane, retry_number, retry_after) == retry_after


@pytest.mark.parametrize("lane", _lanes(), ids=lambda c: c.lane.value)
def test_retry_after_is_capped(lane: LaneConfig) -> None:
    for retry_after in (lane.max_retry_delay_s + 0.001, 3600.0, 86400.0):
        assert retry_wait_s(lane, 0, retry_after) == lane.max_retry_delay_s


@pytest.mark.parametrize("lane", _lanes(), ids=lambda c: c.lane.value)
def test_backoff_stays_within_the_full_jitter_bound(lane: LaneConfig) -> None:
    for retry_number in range(lane.max_retries + 3):
        bound = _bound(lane, retry_number)
        samples = [retry_wait_s(lane, retry_number, None) for _ in range(200)]
        assert all(0.0 <= s <= bound for s in samples), (retry_number, bound, max(samples))


@pytest.mark.parametrize("lane", _lanes(), ids=lambda c: c.lane.value)
def test_backoff_is_jittered(lane: LaneConfig) -> None:
    for retry_number in (0, 1):
        samples = [retry_wait_s(lane, retry_number, None) for _ in range(200)]
        assert len(set(samples)) > 150
        assert max(samples) > 0.0


def test_backoff_is_capped() -> None:
    # Bulk: delay 5 s, cap 300 s. Retry 6 is attempt 7: ceiling 127 * 5 = 635 s > 300 s, so about
    # half the samples land on the cap; uncapped, some would exceed it.
    bulk = DEFAULT_LANE_CONFIGS[Lane.BULK]
    samples = [retry_wait_s(bulk, 6, None) for _ in range(200)]
    assert max(samples) == bulk.max_retry_delay_s
    assert min(samples) < bulk.max_retry_delay_s


@pytest.mark.parametrize("retry_number", [0, 1, 2, 3, 4, 8])
@pytest.mark.parametrize("lane", _lanes(), ids=lambda c: c.lane.value)
@pytest.mark.parametrize("draw", [0.0, 0.37, 0.999999])
def test_backoff_is_dagsters_full_jitter_formula(
    monkeypatch: pytest.MonkeyPatch, lane: LaneConfig, retry_number: int, draw: float
) -> None:
    # The same jitter draw in both: the plain strategy waits what Dagster's policy would, capped.
    monkeypatch.setattr(dagster_policy, "random", lambda: draw)
    dagster_wait = RetryPolicy(
        max_retries=lane.max_retries,
        delay=lane.retry_delay_s,
        backoff=Backoff.EXPONENTIAL,
        jitter=Jitter.FULL,
    ).calculate_delay(retry_number + 1)
    ours = retry_wait_s(lane, retry_number, None, draw=lambda: draw)
    assert ours == min(dagster_wait, lane.max_retry_delay_s)
    assert retry_wait_s(lane, retry_number, None, draw=lambda: 1.0) == _bound(lane, retry_number)
    assert retry_wait_s(lane, retry_number, None, draw=lambda: 0.0) == 0.0


def test_backoff_grows_with_the_retry_number() -> None:
    critical = DEFAULT_LANE_CONFIGS[Lane.CRITICAL]  # delay 1 s, cap 30 s
    waits = [retry_wait_s(critical, n, None, draw=lambda: 0.5) for n in range(6)]
    assert waits == [0.5, 1.5, 3.5, 7.5, 15.5, 30.0]
