"""One send rate per provider, shared through the database by every sender, on SQLite and
PostgreSQL (issue 40).

Each sender below has a limiter of its own, as separate worker processes would: only the
``provider_rates`` rows join them. The slot arithmetic is checked on a clock the test moves
(no sleeping, nothing timed); the drains go through real lane workers and the sandbox, which
records when each request arrived, and are held to the rate over any window: a loaded machine
only makes them slower.
"""

import dataclasses
import threading
import time

import httpx
import pytest
from botocore.credentials import Credentials
from sqlalchemy import create_engine, text

from email_platform.common.config import ProviderSettings
from email_platform.common.errors import ConfigurationError, TransientError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, LANES, Lane
from email_platform.db.engine import make_engine
from email_platform.providers.base import OutgoingEmail
from email_platform.providers.postmark import PostmarkProvider
from email_platform.providers.ses import SesProvider
from email_platform.resources import EmailProviderResource, LanePolicy
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.dispatch import attempt, attempt_many
from email_platform.sending.shared_rate import (
    DEFAULT_HOLD_S,
    LATE_S,
    SharedRateLimiter,
    install,
    plan_for,
)
from email_platform.store import provider_rates
from tests.rate_support import drain, most_in_window
from tests.support import publish_across_lanes, run_send, signup

RATE = 40.0


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _lanes(**changes):  # type: ignore[no-untyped-def]
    """The shipped lanes, ``changes`` laid over each named lane."""
    return [
        dataclasses.replace(DEFAULT_LANE_CONFIGS[lane], **changes.get(lane.value, {}))
        for lane in LANES
    ]


def _outgoing(n: int) -> OutgoingEmail:
    return OutgoingEmail(
        message_id=n,
        event_id=f"01JDQ5Z3K8M9N0P1Q2R3S4T5V{n}",
        idempotency_key=f"01JDQ5Z3K8M9N0P1Q2R3S4T5V{n}:welcome",
        sender="Example <no-reply@example.com>",
        to=f"receiver{n}@example.com",
        subject="Welcome",
        text="Hello",
        html=None,
        template="welcome",
        lane="bulk",
    )


def _limiter(engine, lane: str, clock, rate: float = RATE, **lane_changes):  # type: ignore[no-untyped-def]
    lanes = _lanes(**lane_changes)
    config = next(c for c in lanes if c.lane == lane)
    plan = plan_for("sandbox", rate, config, lanes)
    assert plan is not None
    return SharedRateLimiter(engine, plan, clock=clock)


def test_senders_share_one_rate_and_each_slot_goes_to_one_sender(engine):
    clock = Clock()
    senders = [_limiter(engine, "bulk", clock) for _ in range(4)]
    pool = RATE * 0.9  # critical keeps its shipped tenth
    slots: list[float] = []
    for i in range(400):
        sender = senders[i % 4]
        slots.append(clock.now + sender.reserve())
        clock.now += 0.001  # the senders ask far faster than the rate
    # No two sends share a slot, and no window holds more than the pool's rate.
    assert len({round(s, 6) for s in slots}) == 400
    assert most_in_window(slots, 1.0) <= pool + 1
    assert most_in_window(slots, 10.0) <= pool * 10 + 1
    # Chunks spare the database: far fewer grants than messages.
    assert sum(s.grants for s in senders) < 100


def test_a_slot_left_unused_is_dropped_not_sent_late_beside_others(engine):
    clock = Clock()
    slow, fast = _limiter(engine, "bulk", clock), _limiter(engine, "bulk", clock)
    slow._chunk = slow.max_chunk  # a full chunk granted at once
    assert slow.reserve() == 0.0
    clock.now += 2.0  # the slow sender stalls past its slots
    # Its stale slots are gone: its next send takes a new slot, not one two seconds old.
    fast_first = clock.now + fast.reserve()
    slow_next = clock.now + slow.reserve()
    assert slow_next >= clock.now - LATE_S
    assert slow_next != fast_first


def test_a_sender_that_ends_gives_back_only_its_own_unused_slots(engine):
    clock = Clock()
    ending, other = _limiter(engine, "bulk", clock), _limiter(engine, "bulk", clock)
    ending._chunk = ending.max_chunk
    ending.reserve()  # took one slot of a chunk of max_chunk
    ending.close()
    # Nobody was granted after it: the next sender starts where it stopped.
    assert other.reserve() == pytest.approx(1 / (RATE * 0.9))
    # Granted after another sender: giving back would hand out the other's slots again.
    first = _limiter(engine, "bulk", clock)
    first._chunk = first.max_chunk
    first.reserve()
    other._chunk = other.max_chunk
    other._slots.clear()
    other.reserve()
    with engine.connect() as connection:
        before = provider_rates.snapshot(connection)["sandbox"][0]
    first.close()
    with engine.connect() as connection:
        assert provider_rates.snapshot(connection)["sandbox"][0] == before


def test_a_429_seen_by_one_sender_holds_every_sender(engine):
    clock = Clock()
    seer, other = _limiter(engine, "bulk", clock), _limiter(engine, "bulk", clock)
    other.reserve()
    seer.observe([TransientError("HTTP 429", status_code=429, retry_after_s=5.0)])
    # The other's chunk runs out within MAX_SPAN_S; its next grant waits out the hold.
    waits = [other.reserve() for _ in range(int(RATE))]
    assert max(waits) >= 4.5
    # A 5xx without Retry-After holds nobody, nor an error of our own making.
    again = _limiter(engine, "transactional", clock)
    again.observe([TransientError("HTTP 503", status_code=503)])
    again.observe([TransientError("circuit open", code="circuit_open", retry_after_s=30.0)])
    with engine.connect() as connection:
        held = provider_rates.snapshot(connection)["sandbox"][1]
    assert held == pytest.approx(clock.now + 5.0)


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(400, json={"__type": "ThrottlingException", "message": "Rate exceeded"}),
        httpx.Response(400, json={"__type": "LimitExceededException", "message": "Slow down"}),
        httpx.Response(503, headers={"Retry-After": "3"}, json={"__type": "ServiceUnavailable"}),
    ],
)
def test_a_throttling_answer_of_any_status_holds_every_sender(engine, answer):
    """SES throttles with HTTP 400 (ThrottlingException, LimitExceededException), and a 503
    may say when to come back: each holds the provider as a 429 does."""
    ses = SesProvider(
        credentials=Credentials("AKIDEXAMPLE", "secret"),
        transport=httpx.MockTransport(lambda request: answer),
    )
    error = attempt(ses, _outgoing(1))
    ses.close()
    assert isinstance(error, TransientError), repr(error)
    clock = Clock()
    _limiter(engine, "bulk", clock).observe([error])
    with engine.connect() as connection:
        held = provider_rates.snapshot(connection)["sandbox"][1]
    assert held == pytest.approx(clock.now + (error.retry_after_s or DEFAULT_HOLD_S))


def test_critical_keeps_its_share_while_bulk_takes_the_rest(engine):
    clock = Clock()
    bulk = [_limiter(engine, "bulk", clock) for _ in range(2)]
    # A bulk backlog has taken the pool for the next ten seconds...
    for _ in range(int(RATE * 0.9 * 10)):
        bulk[0].reserve()
        bulk[1].reserve()
    assert bulk[0].reserve() > 9.0
    # ...and a burst of password resets still goes at the critical reserve's rate at once.
    critical = _limiter(engine, "critical", clock)
    waits = [critical.reserve() for _ in range(int(RATE * 0.1))]
    assert max(waits) < 1.0
    # Bulk never draws from critical's reserve.
    with engine.connect() as connection:
        buckets = provider_rates.snapshot(connection)
    assert set(buckets) == {"sandbox", "sandbox:reserved:critical"}


def test_a_lane_cap_holds_the_lane_below_the_provider_rate(engine):
    clock = Clock()
    capped = _limiter(engine, "transactional", clock, transactional={"rate_limit_per_s": 10.0})
    slots = [clock.now + capped.reserve() for _ in range(50)]
    assert most_in_window(slots, 1.0) <= 11
    assert max(slots) - min(slots) >= 4.8


def test_no_rate_means_no_plan_and_settings_are_checked():
    lanes = _lanes()
    assert plan_for("sandbox", 0.0, lanes[2], lanes) is None
    greedy = _lanes(bulk={"rate_reserved_share": 0.95})
    with pytest.raises(ConfigurationError, match="together below 1"):
        plan_for("sandbox", 10.0, greedy[0], greedy)
    with pytest.raises(ConfigurationError, match="rate_limit_per_s"):
        LanePolicy(overrides_json='{"bulk": {"rate_limit_per_s": -1}}').config_for("bulk")
    with pytest.raises(ConfigurationError, match="rate_reserved_share"):
        LanePolicy(overrides_json='{"bulk": {"rate_reserved_share": 1.5}}').config_for("bulk")
    # The provider's rate is refused naming its setting, not as a bare float() ValueError.
    for value in ("fast", "-1", "nan", "inf"):
        env = {"EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S": value}
        with pytest.raises(ConfigurationError, match="EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S"):
            ProviderSettings.from_env(env, provider="sandbox")
    env = {"EMAIL_PLATFORM_PROVIDER_RATE_LIMIT_PER_S": " 12.5 "}
    assert ProviderSettings.from_env(env, provider="sandbox").rate_limit_per_s == 12.5


@pytest.mark.parametrize("workers", [1, 4])
def test_workers_draining_a_backlog_stay_within_the_shared_rate(engine, workers):
    rate = 50.0
    ids = [signup(engine, f"u{i}") for i in range(60)]
    with SandboxServer(SandboxConfig()) as url:
        drain(engine, url, workers, rate)
        times = httpx.get(f"{url}/_sandbox/requests").json()["times"]
        accepted = len(httpx.get(f"{url}/_sandbox/messages").json()["messages"])
    assert accepted == len(ids) == len(times)
    # Slots are 1/rate apart; one may go out up to LATE_S after its time.
    assert most_in_window(times, 1.0) <= rate * (1.0 + LATE_S) + 1


def test_the_send_job_takes_its_slots_from_the_shared_rate(engine, database_url, sandbox):
    ids = publish_across_lanes(engine, {"critical": 0, "transactional": 5, "bulk": 0})
    provider = EmailProviderResource(
        provider="sandbox", base_url=sandbox.base_url, timeout_s=5, rate_limit_per_s=100.0
    )
    result = run_send(database_url, sandbox.base_url, "transactional", ids, provider=provider)
    assert result.success
    with engine.connect() as connection:
        buckets = provider_rates.snapshot(connection)
    # The pool's row moved on by the five slots the run took (and gave back none it used).
    assert set(buckets) == {"sandbox"}
    assert buckets["sandbox"][0] > 0


def _limited_postmark(batch_max: int):  # type: ignore[no-untyped-def]
    """A Postmark adapter whose shared rate lives in a database that is down (nothing listens
    on port 1), and the paths it calls."""
    calls: list[str] = []

    def respond(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, json={"MessageID": "x", "ErrorCode": 0})

    provider = PostmarkProvider(
        server_token="t", batch_max=batch_max, transport=httpx.MockTransport(respond)
    )
    lanes = _lanes()
    plan = plan_for("postmark", RATE, DEFAULT_LANE_CONFIGS[Lane.BULK], lanes)
    assert plan is not None
    down = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/x")
    install(provider, SharedRateLimiter(down, plan))
    return calls, provider


@pytest.mark.parametrize("batch_max", [1, 2])
def test_a_grant_the_database_cannot_make_is_each_messages_transient_failure(batch_max):
    """Invariants 2 and 4: the rate's database failing is not the message's fault, so it is
    retried, never a dead letter; and nothing goes out without its slot."""
    calls, provider = _limited_postmark(batch_max)
    emails = [_outgoing(1), _outgoing(2)]
    if batch_max == 1:
        results = [attempt(provider, email) for email in emails]
    else:
        results = list(attempt_many(provider, emails))
    assert calls == []
    for result in results:
        assert isinstance(result, TransientError), repr(result)
        assert result.code == "rate_store"
    # A 429's hold and close() that cannot reach the database do not raise either.
    limiter = provider.limiter
    limiter.observe([TransientError("HTTP 429", status_code=429, retry_after_s=1.0)])
    limiter.close()


def test_a_429_hold_locks_the_providers_rows_in_name_order_as_grants_do(pg_app_url):
    """PostgreSQL: a hold that locked the rows in disk order (one UPDATE) while a grant locks
    them in name order (``starts``) could deadlock with it. Here a grant holds the first row
    by name; the hold waiting for it must hold no other row meanwhile."""
    engine = make_engine(pg_app_url)
    buckets = ["postmark", "postmark:reserved:bulk"]
    with engine.begin() as connection:
        provider_rates.ensure(connection, buckets, now=0.0)
        # A grant from the pool writes "postmark"'s row anew, after the reserve's on its page.
        provider_rates.take(connection, "postmark", count=1, per_s=10, now=0.0)
    pid: list[int] = []
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with engine.begin() as connection:
                pid.append(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())
                provider_rates.hold(connection, "postmark", until=99.0, now=1.0)
        except BaseException as exc:
            errors.append(exc)

    grant = engine.connect()
    try:
        with grant.begin():
            provider_rates.starts(grant, ["postmark"], now=1.0)
            thread = threading.Thread(target=hold)
            thread.start()
            deadline = time.monotonic() + 60
            waiting = None
            while waiting != "Lock" and time.monotonic() < deadline:
                # A connection per look: pg_stat_activity is read once per transaction.
                with engine.connect() as probe:
                    waiting = probe.execute(
                        text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"),
                        {"pid": pid[0] if pid else -1},
                    ).scalar_one_or_none()
                time.sleep(0.01)  # polls the event, orders nothing
            assert waiting == "Lock", "the hold never waited for the grant's row"
            with engine.begin() as other:
                # Free: the hold took no row ahead of the one it waits for.
                locked = other.execute(
                    text("SELECT bucket FROM provider_rates WHERE bucket = :b FOR UPDATE NOWAIT"),
                    {"b": "postmark:reserved:bulk"},
                ).scalar_one()
                assert locked == "postmark:reserved:bulk"
    finally:
        grant.close()
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    with engine.connect() as connection:
        rows = provider_rates.snapshot(connection)
    assert {bucket: rows[bucket][1] for bucket in buckets} == dict.fromkeys(buckets, 99.0)
    engine.dispose()
