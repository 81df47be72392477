"""Posting an alert to a Slack-compatible incoming webhook: retried, bounded, never raising."""

import json
import logging
import random
import time
from dataclasses import asdict
from urllib.parse import urlsplit

import httpx

from email_platform.common.timeutil import isoformat
from email_platform.store.alerts import Transition

log = logging.getLogger(__name__)

ATTEMPTS = 4
TIMEOUT_S = 5.0


def check_url(url: str) -> str:
    """The URL if it is an absolute http(s) URL with a host; ValueError naming it otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"alerts Slack URL must be an http(s) URL with a host, got {url!r}")
    return url


def alert_line(transition: Transition) -> str:
    """The alert as one JSON log line (one search finds an alert's raise and resolve)."""
    fields = asdict(transition)
    fields["raised_at"] = isoformat(transition.raised_at)
    return json.dumps({"alert": fields}, sort_keys=True)


def slack_text(transition: Transition) -> str:
    mark = ":rotating_light:" if transition.state == "raised" else ":white_check_mark:"
    return f"{mark} {transition.state.upper()} `{transition.key}`: {transition.summary}"


def post(
    url: str,
    transition: Transition,
    *,
    client: httpx.Client | None = None,
    attempts: int = ATTEMPTS,
    base_delay_s: float = 0.5,
) -> str | None:
    """POST the alert; None once a 2xx came back, else why the last attempt failed.

    Transport errors, 429 and 5xx are retried with full-jitter backoff (``Retry-After`` is
    honoured up to 30 s); other answers are final. The caller is an alert run, not a send.
    """
    own = client is None
    client = client or httpx.Client(timeout=TIMEOUT_S)
    error = "not attempted"
    try:
        for attempt in range(attempts):
            try:
                response = client.post(url, json={"text": slack_text(transition)})
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
                wait = random.uniform(0, base_delay_s * 2**attempt)
            else:
                if response.is_success:
                    return None
                error = f"HTTP {response.status_code}"
                if response.status_code != 429 and response.status_code < 500:
                    return error
                wait = _retry_after(response) or random.uniform(0, base_delay_s * 2**attempt)
            if attempt + 1 < attempts:
                time.sleep(wait)
        return error
    finally:
        if own:
            client.close()


def _retry_after(response: httpx.Response) -> float | None:
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(value, 0.0), 30.0) if value == value else None
