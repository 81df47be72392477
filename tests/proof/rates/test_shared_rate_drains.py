"""Issue 40's proof of the shared send rate, on SQLite and PostgreSQL: 1, 2 and 4 lane workers
drain one backlog against the sandbox, which records when each request arrived, and the rate
holds within 5% over every 10 s window; a 429 answered to one worker holds them all.

Each worker has its own provider and limiter, as worker processes would: only the
``provider_rates`` rows join them. A loaded machine only makes a drain slower, never faster,
so the bounds below are upper bounds on what arrives.
"""

import httpx
import pytest

from email_platform.db.schema import email_attempts
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from tests.rate_support import drain, most_in_window, rate_lane
from tests.support import signup

RATE = 20.0
#: Enough for a drain of about 13 s at RATE: every 10 s window inside it is full.
BACKLOG = 260


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_workers_draining_a_backlog_hold_the_rate_over_every_10_s_window(engine, workers):
    ids = [signup(engine, f"u{i}") for i in range(BACKLOG)]
    with SandboxServer(SandboxConfig()) as url:
        drain(engine, url, workers, RATE)
        times = httpx.get(f"{url}/_sandbox/requests").json()["times"]
        accepted = httpx.get(f"{url}/_sandbox/messages").json()["messages"]
    assert sorted(m["idempotency_key"] for m in accepted) == sorted(f"{i}:welcome" for i in ids)
    assert len(times) == BACKLOG
    most = most_in_window(times, 10.0)
    assert most <= RATE * 10 * 1.05, f"{most} requests in one 10 s window at {RATE}/s"


def test_a_429_to_one_worker_holds_every_worker(engine):
    """Two workers drain one backlog; the provider answers one request 429 with Retry-After:
    5. Nothing goes out from either until the hold is nearly over, and every message is still
    sent once."""
    ids = [signup(engine, f"u{i}") for i in range(90)]
    with SandboxServer(SandboxConfig(retry_after_s=5)) as url:
        httpx.post(f"{url}/_sandbox/faults", json={"rules": [{"kind": "429", "times": 1}]})
        drain(engine, url, 2, 30.0, rate_lane(max_retry_delay_s=6.0))
        times = sorted(httpx.get(f"{url}/_sandbox/requests").json()["times"])
        accepted = httpx.get(f"{url}/_sandbox/messages").json()["messages"]
        stats = httpx.get(f"{url}/_sandbox/stats").json()
    assert stats["faults"]["429"] == 1
    assert sorted(m["idempotency_key"] for m in accepted) == sorted(f"{i}:welcome" for i in ids)
    with engine.connect() as connection:
        rows = connection.execute(
            email_attempts.select().where(email_attempts.c.http_status == 429)
        ).all()
    assert len(rows) == 1
    fault_at = rows[0].started_at.timestamp()
    # The worker that got the 429 records it, and both then wait (the other once its chunk of
    # slots, at most half a second, is used): nothing goes out from 2.5 s to 4.5 s after it.
    quiet = [t for t in times if fault_at + 2.5 <= t < fault_at + 4.5]
    assert quiet == [], f"{len(quiet)} requests during the hold"
    assert any(t >= fault_at + 4.5 for t in times)
