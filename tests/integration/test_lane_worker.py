"""Resident lane workers, on SQLite and PostgreSQL, against the real sandbox over HTTP.

A worker claims its lane's due events batch after batch: every event is sent once whatever
else claims at the same time, transient failures are retried with backoff while other events
go on, exhausted retries are dead letters that a re-execution replays with the original key,
and a worker that is paused, interrupted or killed gives back what it holds.
"""

import dataclasses
import json
import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta

import pytest
from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
    SensorResult,
    SkipReason,
    build_sensor_context,
    execute_job,
    reconstructable,
)
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane, LaneConfig
from email_platform.common.timeutil import utcnow
from email_platform.jobs import lane_worker_run_config
from email_platform.providers.sandbox import SandboxProvider
from email_platform.publishing.publisher import publish_many
from email_platform.resources import AppDatabase, LanePolicy
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.worker import LaneWorker
from email_platform.sensors.outbox import make_outbox_sensor
from email_platform.store import lane_workers, outbox
from tests.support import (
    attempts_of,
    batch_sender,
    dead_letters_of,
    event,
    messages_of,
    publish_one,
    reexecuted,
    report_failed_and_release,
    sandbox_messages,
    sandbox_stats,
    signup,
)


def _lane(**changes) -> LaneConfig:  # type: ignore[no-untyped-def]
    base = dict(
        batch_size=8,
        worker_poll_s=0.02,
        worker_idle_s=0.5,
        worker_lifetime_s=60,
        retry_delay_s=0.05,
        max_retry_delay_s=2.0,
        max_retries=3,
    )
    return dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], **{**base, **changes})


def _worker(engine: Engine, sandbox_url: str, lane: LaneConfig, run_id: str, **kwargs):  # type: ignore[no-untyped-def]
    provider = SandboxProvider(sandbox_url, max_connections=lane.concurrency, timeout_s=5)
    sender = batch_sender(engine, provider, lane)
    return LaneWorker(sender=sender, engine=engine, lane=lane, run_id=run_id, **kwargs)


def _digest(engine: Engine, n: int) -> str:
    return publish_one(
        engine,
        event_type="digest.ready",
        aggregate_id=f"d{n}",
        payload={"email": f"d{n}@example.org", "first_name": "Dee", "highlights": ["a"]},
    )


def test_worker_drains_its_lane_batch_after_batch_and_ends_when_idle(engine, sandbox):
    ids = [signup(engine, f"u{i}") for i in range(30)]
    bulk = _digest(engine, 1)
    result = _worker(engine, sandbox.base_url, _lane(), "worker-1").run()
    assert result.reason == "idle"
    assert result.totals["sent"] == 30 and result.batches == 4  # 8 + 8 + 8 + 6
    keys = sorted(m["idempotency_key"] for m in sandbox_messages(sandbox.base_url))
    assert keys == sorted(f"{i}:welcome" for i in ids)
    assert all(event(engine, i).status == "done" for i in ids)
    # Another lane's event is not this worker's.
    assert event(engine, bulk).status == "pending"


def _claim_sizes(claimed_after: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *claimed_after], claimed_after, strict=False)]


def test_a_backlog_is_claimed_a_round_of_calls_first_then_in_doubling_batches(engine, sandbox):
    """Sending starts after preparing one round of calls, not a whole batch; a lane that ran
    dry starts its next backlog that way again."""
    ids = [signup(engine, f"u{i}") for i in range(30)]
    claimed_after: list[int] = []
    lane = _lane(batch_size=8, concurrency=2, worker_idle_s=3.0)
    worker = _worker(
        engine,
        sandbox.base_url,
        lane,
        "worker-1",
        on_batch=lambda result: claimed_after.append(result.totals["claimed"]),
    )
    worker.sender.provider = SandboxProvider(sandbox.base_url, batch_max=1, timeout_s=5)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while sum(_claim_sizes(claimed_after)) < 30 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a few empty polls: the lane ran dry
        with engine.begin() as connection:
            later = publish_many(
                connection,
                [
                    {
                        "event_type": "user.signed_up",
                        "aggregate_id": f"v{i}",
                        "payload": {
                            "user_id": f"v{i}",
                            "email": f"v{i}@example.com",
                            "first_name": "V",
                        },
                    }
                    for i in range(10)
                ],
            )
    finally:
        thread.join()
    assert worker.result.reason == "idle"
    assert _claim_sizes(claimed_after) == [2, 4, 8, 8, 8, 2, 4, 4]
    assert worker.result.totals["sent"] == 40
    assert all(event(engine, i).status == "done" for i in ids + later)


def test_a_provider_taking_batches_is_claimed_a_whole_batch_at_once(engine, sandbox):
    """One full batch call (up to 100) holds more than a batch: no ramp."""
    [signup(engine, f"u{i}") for i in range(20)]
    claimed_after: list[int] = []
    worker = _worker(
        engine,
        sandbox.base_url,
        _lane(batch_size=8, concurrency=2),
        "worker-1",
        on_batch=lambda result: claimed_after.append(result.totals["claimed"]),
    )
    assert worker.run().totals["sent"] == 20
    assert _claim_sizes(claimed_after) == [8, 8, 4]


def test_a_provider_taking_batches_starts_with_one_full_call_then_doubles(engine, sandbox):
    """A round of full batch calls (2 calls of 3 here; 256 of 100 in the bulk lane) would be a
    whole batch prepared before the first call: the first claim is one call's worth."""
    [signup(engine, f"u{i}") for i in range(20)]
    claimed_after: list[int] = []
    worker = _worker(
        engine,
        sandbox.base_url,
        _lane(batch_size=8, concurrency=2),
        "worker-1",
        on_batch=lambda result: claimed_after.append(result.totals["claimed"]),
    )
    worker.sender.provider = SandboxProvider(sandbox.base_url, batch_max=3, timeout_s=5)
    assert worker.run().totals["sent"] == 20
    assert _claim_sizes(claimed_after) == [3, 6, 8, 3]


def test_events_published_while_the_worker_runs_are_sent_within_a_poll(engine, sandbox):
    lane = _lane(worker_idle_s=3.0)
    worker = _worker(engine, sandbox.base_url, lane, "worker-1")
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        time.sleep(0.3)
        published = time.monotonic()
        late = signup(engine, "late")
        deadline = published + 5
        while event(engine, late).status != "done" and time.monotonic() < deadline:
            time.sleep(0.01)
        waited = time.monotonic() - published
    finally:
        thread.join()
    assert event(engine, late).status == "done"
    # No sensor loop, no run launch: a poll interval plus one send.
    assert waited < 2.0, waited
    assert worker.result.reason == "idle"


def test_transient_failures_are_retried_with_backoff_while_other_events_go_on(engine, sandbox):
    flaky = signup(engine, "u1", email="u1+503x1@example.com")
    throttled = signup(engine, "u2", email="u2+429x2@example.com")
    healthy = [signup(engine, f"h{i}") for i in range(5)]
    result = _worker(engine, sandbox.base_url, _lane(), "worker-1").run()
    assert result.totals["sent"] == 7
    assert [a.outcome for a in attempts_of(engine, flaky)] == ["transient", "accepted"]
    tries = attempts_of(engine, throttled)
    assert [a.http_status for a in tries] == [429, 429, 200]
    gaps = [(tries[i + 1].started_at - tries[i].finished_at).total_seconds() for i in range(2)]
    assert all(gap >= tries[0].retry_after_s for gap in gaps), gaps  # Retry-After honoured
    for event_id in healthy:
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["accepted"]
    assert sandbox_stats(sandbox.base_url)["accepted"] == 7
    assert result.released == 0


def test_exhausted_retries_become_dead_letters(engine, sandbox):
    doomed = signup(engine, "u1", email="u1+503x9@example.com")
    fine = signup(engine, "u2")
    result = _worker(engine, sandbox.base_url, _lane(max_retries=2), "worker-1").run()
    assert [a.outcome for a in attempts_of(engine, doomed)] == ["transient"] * 3
    (letter,) = dead_letters_of(engine, doomed)
    assert letter.reason == "retries_exhausted" and letter.run_id == "worker-1"
    assert event(engine, doomed).status == "dead"
    assert event(engine, fine).status == "done"
    assert result.totals["dead_lettered"] == 1


def test_two_workers_on_one_lane_send_every_event_once(engine):
    ids = [signup(engine, f"u{i}") for i in range(60)]
    lane = _lane(batch_size=5)
    # Each provider call takes 50 ms, so the first worker cannot drain the 12 batches before
    # the second one starts (it did once on an idle host: a pipelined worker is quick).
    with SandboxServer(SandboxConfig(latency_ms=50)) as sandbox_url:
        workers = [_worker(engine, sandbox_url, lane, f"worker-{n}") for n in range(2)]
        threads = [threading.Thread(target=w.run) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = sandbox_stats(sandbox_url)
    assert sum(w.result.totals["sent"] for w in workers) == 60
    assert all(w.result.totals["sent"] > 0 for w in workers)  # both really took part
    assert stats["send_attempts"] == 60 and stats["accepted"] == 60
    assert all(len(attempts_of(engine, i)) == 1 for i in ids)


def test_a_paused_worker_ends_and_gives_back_what_waits_for_a_retry(engine, sandbox):
    waiting = signup(engine, "u1", email="u1+503x1@example.com")
    sent = signup(engine, "u2")
    lane = _lane(retry_delay_s=30.0, max_retry_delay_s=30.0)
    pause = threading.Event()
    worker = _worker(
        engine,
        sandbox.base_url,
        lane,
        "worker-1",
        should_stop=lambda: "paused" if pause.is_set() else None,
    )
    original = worker._after_transient

    def then_pause(outcome, retry_number):  # type: ignore[no-untyped-def]
        original(outcome, retry_number)
        pause.set()  # the operator stops the lane's sensor while a retry waits

    worker._after_transient = then_pause  # type: ignore[method-assign]
    result = worker.run()
    assert result.reason == "paused" and result.released == 1
    held = event(engine, waiting)
    assert held.status == "pending" and held.lease_expires_at is None
    assert event(engine, sent).status == "done"
    # The next worker sends it at once, under the key recorded before the first attempt.
    _worker(engine, sandbox.base_url, _lane(), "worker-2").run()
    (message,) = messages_of(engine, waiting)
    assert message.status == "sent" and message.idempotency_key == f"{waiting}:welcome"
    assert [a.outcome for a in attempts_of(engine, waiting)] == ["transient", "accepted"]


def test_an_interrupted_worker_gives_back_its_claim(engine, sandbox):
    waiting = signup(engine, "u1", email="u1+503x1@example.com")
    lane = _lane(retry_delay_s=30.0, max_retry_delay_s=30.0)

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt  # what a terminated Dagster run raises in the step

    worker = _worker(engine, sandbox.base_url, lane, "worker-1", sleep=interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.run()
    assert event(engine, waiting).status == "pending"
    _worker(engine, sandbox.base_url, _lane(), "worker-2").run()
    assert event(engine, waiting).status == "done"
    assert sandbox_stats(sandbox.base_url)["accepted"] == 1


def test_a_retried_attempt_takes_back_what_the_failed_attempt_held(engine, sandbox):
    ids = [signup(engine, f"u{i}") for i in range(3)]
    # The first attempt of run worker-1 claimed them (long lease) and then its step crashed.
    with engine.begin() as connection:
        claimed = outbox.claim(connection, ids, run_id="worker-1", lease_s=3600, now=utcnow())
    assert len(claimed) == 3
    started = time.monotonic()
    result = _worker(engine, sandbox.base_url, _lane(), "worker-1").run()
    assert result.totals["sent"] == 3
    assert time.monotonic() - started < 10  # not an hour's lease
    assert sandbox_stats(sandbox.base_url)["accepted"] == 3


def test_a_worker_past_its_lifetime_sees_its_retries_through(engine, sandbox):
    flaky = signup(engine, "u1", email="u1+503x1@example.com")
    offset = [0.0]
    worker = _worker(
        engine,
        sandbox.base_url,
        _lane(worker_lifetime_s=60, retry_delay_s=0.3),
        "worker-1",
        clock=lambda: time.monotonic() + offset[0],
    )
    schedule_retry = worker._after_transient

    def lifetime_ends_now(outcome, retry_number):  # type: ignore[no-untyped-def]
        offset[0] += 60  # the lifetime runs out while the retry waits
        schedule_retry(outcome, retry_number)

    worker._after_transient = lifetime_ends_now  # type: ignore[method-assign]
    result = worker.run()
    assert result.reason == "lifetime" and result.released == 0
    # Retried by the same worker after its backoff, not handed over with the count reset.
    tries = attempts_of(engine, flaky)
    assert [a.outcome for a in tries] == ["transient", "accepted"]
    assert {a.run_id for a in tries} == {"worker-1"}
    assert event(engine, flaky).claim_count == 1


class _CancelAfter(SandboxProvider):
    """Accepts like the sandbox; after the n-th acceptance the run is asked to stop."""

    def __init__(self, base_url: str, n: int, cancel: threading.Event) -> None:
        super().__init__(base_url, max_connections=4, timeout_s=5, batch_max=1)
        self.n, self.count, self.lock, self.cancel = n, 0, threading.Lock(), cancel

    def send(self, email):  # type: ignore[no-untyped-def]
        result = super().send(email)
        with self.lock:
            self.count += 1
            if self.count == self.n:
                self.cancel.set()  # what SIGINT/SIGTERM does inside the worker op
        return result


@pytest.mark.parametrize(
    ("batch_size", "cancel_after", "held_n"),
    # Claims start at a round of calls (4) and double up to the batch size: the stop comes
    # while the second batch (acceptances 5 to 12) is in flight, with the third prepared.
    [(40, 10, 4 + 8 + 16), (10, 5, 4 + 8 + 10)],
    ids=["doubling-to-40", "doubling-to-10"],
)
def test_a_terminated_worker_records_what_is_in_flight_and_gives_back_the_rest(
    engine, sandbox, batch_size, cancel_after, held_n
):
    ids = [signup(engine, f"u{i}") for i in range(40)]
    lane = _lane(batch_size=batch_size, concurrency=4)
    worker = _worker(engine, sandbox.base_url, lane, "worker-1")
    worker.sender.provider = _CancelAfter(sandbox.base_url, cancel_after, worker.sender.cancel)
    result = worker.run()
    assert result.reason == "canceled"
    accepted = {m["idempotency_key"] for m in sandbox_messages(sandbox.base_url)}
    # No new send started after the request: at most the ones in flight then (4) finished.
    assert cancel_after <= len(accepted) <= cancel_after + 4
    # Claimed and prepared: the batches sent, the one in flight and the one behind it.
    held = [i for i in ids if messages_of(engine, i)]
    assert len(held) == held_n
    for event_id in held:
        (message,) = messages_of(engine, event_id)
        # Every acceptance the provider gave is on record; nothing else was sent.
        assert (message.status == "sent") == (message.idempotency_key in accepted)
    assert result.released == len(held) - len(accepted)
    assert all(event(engine, i).status in ("done", "pending") for i in ids)
    # The rest goes out once with the next worker; nothing accepted is sent again.
    _worker(engine, sandbox.base_url, _lane(), "worker-2").run()
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 40 and stats["repeated_keys"] == 0
    assert all(event(engine, i).status == "done" for i in ids)


class _HeldFirstCall(SandboxProvider):
    """The first batch call waits until the test lets it go; the others go straight through."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url, max_connections=1, timeout_s=5, batch_max=100)
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0
        self._lock = threading.Lock()
        #: The event ids of the held call: with two batches in flight, either may call first.
        self.held: list[str] = []

    def send_many(self, emails):  # type: ignore[no-untyped-def]
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.held = [email.event_id for email in emails]
            self.entered.set()
            # The test always releases it (in its finally); the bound only stops a broken test
            # from hanging. It must outlast the test's own waits (60 s), or a slow machine sees
            # the held call give up and fail the first batch while the test still holds it.
            assert self.release.wait(180)
        return super().send_many(emails)


def test_the_next_batch_is_claimed_and_prepared_while_one_is_being_sent(engine, sandbox):
    ids = [signup(engine, f"u{i}") for i in range(30)]
    lane = _lane(batch_size=10, concurrency=1)
    worker = _worker(engine, sandbox.base_url, lane, "worker-1")
    provider = _HeldFirstCall(sandbox.base_url)
    worker.sender.provider = provider
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert provider.entered.wait(60)
        first, second, third = ids[:10], ids[10:20], ids[20:]
        # While the first batch's call hangs, the second is claimed by this worker and its
        # messages are written with their keys; the third waits: two batches held, no more.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(messages_of(engine, i) for i in second):
            time.sleep(0.02)
        for event_id in second:
            assert event(engine, event_id).claimed_by == "worker-1"
            (message,) = messages_of(engine, event_id)
            assert message.status == "pending" and message.idempotency_key == f"{event_id}:welcome"
        assert all(event(engine, i).status == "in_flight" for i in first + second)
        assert all(event(engine, i).status == "pending" for i in third)
        assert all(messages_of(engine, i) == [] for i in third)
    finally:
        provider.release.set()
        thread.join()
    assert worker.result.totals["sent"] == 30 and worker.result.batches == 3
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 30 and stats["repeated_keys"] == 0
    assert all(event(engine, i).status == "done" for i in ids)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_with_two_batches_in_flight_the_rest_is_sent_while_one_hangs(engine, sandbox, in_flight):
    """A lane with ``batches_in_flight`` 2 sends every other batch while the first one's call
    hangs (a critical reset is held behind neither the batch before it nor one stuck ahead of
    it in the queue); with 1 it waits."""
    ids = [signup(engine, f"u{i}") for i in range(40)]
    lane = _lane(batch_size=10, concurrency=1, batches_in_flight=in_flight)
    worker = _worker(engine, sandbox.base_url, lane, "worker-1")
    provider = _HeldFirstCall(sandbox.base_url)
    worker.sender.provider = provider
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert provider.entered.wait(60)
        # The held call's batch; with two in flight the second batch's call may start first.
        first = provider.held
        rest = [i for i in ids if i not in first]
        assert len(first) == 10 and len(rest) == 30

        def sent(event_ids: list[str]) -> bool:
            statuses = [m.status for i in event_ids for m in messages_of(engine, i)]
            return len(statuses) == len(event_ids) and set(statuses) == {"sent"}

        # With 2 in flight the rest goes out: wait for that, however loaded the machine. With
        # 1 nothing may go out while the first call hangs: 5 s in which it would have.
        deadline = time.monotonic() + (60 if in_flight == 2 else 5)
        while time.monotonic() < deadline and not sent(rest):
            time.sleep(0.02)
        assert sent(rest) == (in_flight == 2)
        assert sent(rest[:10]) == (in_flight == 2)
        assert all(m.status == "pending" for i in first for m in messages_of(engine, i))
        if in_flight == 2:
            # Counted as they finished, not after the hung one.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and worker.result.batches < 3:
                time.sleep(0.02)
            assert worker.result.batches == 3 and worker.result.totals["sent"] == 30
    finally:
        provider.release.set()
        thread.join()
    assert worker.result.totals["sent"] == 40 and worker.result.batches == 4
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 40 and stats["repeated_keys"] == 0
    assert all(event(engine, i).status == "done" for i in ids)


def test_a_batch_whose_lease_lapses_in_flight_is_not_claimed_again_by_its_own_worker(
    engine, sandbox
):
    """A worker whose heartbeat cannot renew (here: never beats) sees its in-flight batch's
    lease lapse while the call hangs. With a second batch allowed in flight, finding those
    events due again would send them a second time beside the first."""
    ids = [signup(engine, f"u{i}") for i in range(10)]
    lane = _lane(batch_size=10, concurrency=1, batches_in_flight=2, lease_s=1, worker_idle_s=4)
    worker = _worker(engine, sandbox.base_url, lane, "worker-1", heartbeat_every_s=3600)
    provider = _HeldFirstCall(sandbox.base_url)
    worker.sender.provider = provider
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert provider.entered.wait(60)
        time.sleep(2.5)
        with engine.connect() as connection:  # the lease (1 s) lapsed while the call hangs
            assert outbox.find_due(connection, "transactional", utcnow(), 100) == ids
            mine = outbox.find_due(
                connection, "transactional", utcnow(), 100, not_held_by="worker-1"
            )
        assert mine == []
        assert provider.calls == 1  # no second call for the same events
    finally:
        provider.release.set()
        thread.join()
    stats = sandbox_stats(sandbox.base_url)
    assert stats["accepted"] == 10 and stats["repeated_keys"] == 0
    assert worker.result.totals["sent"] == 10
    assert all(event(engine, i).status == "done" for i in ids)


def test_sigint_and_sigterm_in_the_worker_op_set_its_cancel_flag():
    from email_platform.ops.lane_worker import interrupts_set

    flag = threading.Event()
    before = signal.getsignal(signal.SIGINT)
    with interrupts_set(flag):
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.wait(5)  # no exception raised mid-code, the flag says it
        flag.clear()
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.wait(5)
    assert signal.getsignal(signal.SIGINT) is before


# ---- the sensor keeps workers running ---------------------------------------------------------


def _sensor_tick(instance: DagsterInstance, database_url: str, lanes_json: str | None = None):  # type: ignore[no-untyped-def]
    sensor = make_outbox_sensor(Lane.CRITICAL)
    # Without a warm worker (the shipped critical lane keeps one) unless the test says so.
    lanes = json.loads(lanes_json or "{}")
    lanes.setdefault("critical", {}).setdefault("warm_workers", 0)
    resources = {
        "email_database": AppDatabase(url=database_url),
        "email_lanes": LanePolicy(overrides_json=json.dumps(lanes)),
    }
    with build_sensor_context(instance=instance, resources=resources) as context:
        return sensor(context)


def _reset(engine: Engine, n: int) -> str:
    return publish_one(
        engine,
        event_type="user.password_reset_requested",
        aggregate_id=f"r{n}",
        payload={"user_id": f"r{n}", "reset_token": f"t{n}"},
    )


def test_sensor_starts_one_worker_when_work_waits_and_a_successor_near_its_end(
    engine, database_url
):
    from email_platform.definitions import defs

    with DagsterInstance.ephemeral() as instance:
        assert isinstance(_sensor_tick(instance, database_url), SkipReason)  # nothing due
        _reset(engine, 1)
        result = _sensor_tick(instance, database_url)
        assert isinstance(result, SensorResult)
        (request,) = result.run_requests
        assert request.job_name == "lane_worker_job"
        assert request.tags["email/lane"] == "critical" and request.tags["email/worker"] == "lane"
        assert request.run_config["ops"]["run_lane_worker"]["config"] == {"lane": "critical"}

        job = defs.get_job_def("lane_worker_job")
        instance.create_run_for_job(
            job,
            run_config=request.run_config,
            tags=request.tags,
            status=DagsterRunStatus.STARTED,
        )
        assert isinstance(_sensor_tick(instance, database_url), SkipReason)  # one is running
        # Lifetime 2 s, handover 0.5 s: after 1.6 s the running one is about to end.
        short = '{"critical": {"worker_lifetime_s": 2}}'
        assert isinstance(_sensor_tick(instance, database_url, short), SkipReason)
        time.sleep(1.6)
        result = _sensor_tick(instance, database_url, short)
        assert isinstance(result, SensorResult) and len(result.run_requests) == 1
        # workers=0: the lane goes back to one launched run per batch.
        batch = _sensor_tick(instance, database_url, '{"critical": {"workers": 0}}')
        assert [r.job_name for r in batch.run_requests] == ["send_email_job"]


def test_sensor_keeps_warm_workers_running_with_nothing_due(engine, database_url):
    from email_platform.definitions import defs

    warm = '{"critical": {"workers": 2, "warm_workers": 1}}'
    with DagsterInstance.ephemeral() as instance:
        # Nothing due: without warm workers the lane has none, with one warm worker it gets one.
        assert isinstance(_sensor_tick(instance, database_url), SkipReason)
        (request,) = _sensor_tick(instance, database_url, warm).run_requests
        instance.create_run_for_job(
            defs.get_job_def("lane_worker_job"),
            run_config=request.run_config,
            tags=request.tags,
            status=DagsterRunStatus.STARTED,
        )
        assert isinstance(_sensor_tick(instance, database_url, warm), SkipReason)
        # Work waits: the lane grows to ``workers``.
        _reset(engine, 1)
        result = _sensor_tick(instance, database_url, warm)
        assert isinstance(result, SensorResult) and len(result.run_requests) == 1
    for bad in ('{"critical": {"warm_workers": 2}}', '{"critical": {"warm_workers": -1}}'):
        with pytest.raises(ConfigurationError, match="warm_workers must be 0 to workers"):
            LanePolicy(overrides_json=bad).config_for("critical")


def test_the_shipped_critical_lane_keeps_a_warm_worker_and_a_drain_holds_it_off(database_url):
    from email_platform.sensors.runs import hold_warm_workers

    assert LanePolicy(overrides_json="{}").config_for("critical").warm_workers == 1
    assert LanePolicy(overrides_json="{}").config_for("bulk").warm_workers == 0
    # Batch runs for critical mail: the shipped warm worker goes with the shipped workers.
    batch = LanePolicy(overrides_json='{"critical": {"workers": 0}}').config_for("critical")
    assert batch.workers == 0 and batch.warm_workers == 0
    shipped = '{"critical": {"warm_workers": 1}}'
    with DagsterInstance.ephemeral() as instance:
        (request,) = _sensor_tick(instance, database_url, shipped).run_requests
        assert request.job_name == "lane_worker_job"
        # A drain holds warm workers off (each one stopped would be replaced at once) ...
        hold_warm_workers(instance, time.time() + 60)
        assert isinstance(_sensor_tick(instance, database_url, shipped), SkipReason)
        # ... and a start lifts the hold.
        hold_warm_workers(instance, 0.0)
        assert len(_sensor_tick(instance, database_url, shipped).run_requests) == 1


def test_a_warm_worker_does_not_end_for_being_idle(engine, sandbox):
    lane = _lane(worker_idle_s=0.1, warm_workers=1)
    polls: list[float] = []

    def stop_after_a_while() -> str | None:
        polls.append(time.monotonic())
        return "paused" if len(polls) > 30 else None

    worker = _worker(engine, sandbox.base_url, lane, "warm-1", should_stop=stop_after_a_while)
    started = time.monotonic()
    result = worker.run()
    # It polled past its idle limit many times over and ended only when told to.
    assert result.reason == "paused" and time.monotonic() - started > 0.3
    cold = _worker(engine, sandbox.base_url, _lane(worker_idle_s=0.1), "cold-1").run()
    assert cold.reason == "idle"


def _worker_run(instance: DagsterInstance, lane: str = "critical", **kwargs):  # type: ignore[no-untyped-def]
    from email_platform.definitions import defs

    return instance.create_run_for_job(
        defs.get_job_def("lane_worker_job"),
        run_config={"ops": {"run_lane_worker": {"config": {"lane": lane}}}},
        tags={"email/lane": lane, "email/worker": "lane"},
        status=DagsterRunStatus.STARTED,
        **kwargs,
    )


def test_sensor_replaces_a_worker_whose_heartbeat_stopped(engine, database_url):
    _reset(engine, 1)
    with DagsterInstance.ephemeral() as instance:
        run = _worker_run(instance)
        with engine.begin() as connection:
            lane_workers.beat(connection, run.run_id, "critical", utcnow())
        assert isinstance(_sensor_tick(instance, database_url), SkipReason)  # alive
        # Its process died: no beat for two minutes.
        with engine.begin() as connection:
            lane_workers.beat(connection, run.run_id, "critical", utcnow() - timedelta(seconds=120))
        result = _sensor_tick(instance, database_url)
        assert isinstance(result, SensorResult) and len(result.run_requests) == 1
        # Reported failed, so the run failure sensor releases its claims and the UI shows it.
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE


def test_sensor_does_not_count_a_worker_that_ended_or_a_replay(engine, database_url):
    _reset(engine, 1)
    with DagsterInstance.ephemeral() as instance:
        ended = _worker_run(instance)
        with engine.begin() as connection:
            lane_workers.beat(connection, ended.run_id, "critical", utcnow())
            lane_workers.end(connection, ended.run_id, "idle", utcnow())
        # A re-execution of a worker run replays dead letters; it does not poll the outbox.
        _worker_run(instance, parent_run_id=ended.run_id, root_run_id=ended.run_id)
        result = _sensor_tick(instance, database_url)
        assert isinstance(result, SensorResult) and len(result.run_requests) == 1
        # The one that ended is wrapping up, not dead.
        assert instance.get_run_by_id(ended.run_id).status == DagsterRunStatus.STARTED


def test_a_worker_notices_a_terminate_request_without_the_interrupt():
    from email_platform.ops.lane_worker import stop_check

    with DagsterInstance.ephemeral() as instance:
        run = _worker_run(instance)
        assert stop_check(instance, "critical", run.run_id, None)() is None
        # Dagster's one interrupt can be lost (it may land in a GC callback); the status stays.
        instance.report_run_canceling(run)
        assert stop_check(instance, "critical", run.run_id, None)() == "canceled"


# ---- through Dagster: the op, its failure, the re-execution, a killed worker ----------------


def _worker_job():
    from email_platform.definitions import build_definitions

    return build_definitions().get_job_def("lane_worker_job")


WORKER_CONFIG = lane_worker_run_config("transactional")


def test_failed_worker_run_is_reexecuted_to_replay_its_dead_letters(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", sandbox.base_url)
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES",
        '{"transactional": {"retry_delay_s": 0.01, "max_retries": 1, "worker_idle_s": 1,'
        ' "worker_poll_s": 0.05}}',
    )
    sent_before = signup(engine, "u0")
    flaky = signup(engine, "u1", email="u1+503x2@example.com")
    job = reconstructable(_worker_job)
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        with execute_job(job, instance=instance, run_config=WORKER_CONFIG) as failed:
            assert not failed.success
        (letter,) = dead_letters_of(engine, flaky)
        assert letter.reason == "retries_exhausted" and letter.run_id == failed.run_id
        assert event(engine, sent_before).status == "done"
        with reexecuted(job, instance, failed.run_id) as replayed:
            assert replayed.success
            assert replayed.dagster_run.parent_run_id == failed.run_id
    (message,) = messages_of(engine, flaky)
    assert message.status == "sent" and message.idempotency_key == f"{flaky}:welcome"
    assert dead_letters_of(engine, flaky)[0].status == "replayed"
    keys = [m["idempotency_key"] for m in sandbox_messages(sandbox.base_url)]
    assert sorted(keys) == sorted([f"{sent_before}:welcome", f"{flaky}:welcome"])


def test_a_batch_hung_at_the_provider_leaves_connections_for_the_next_one(
    engine, database_url, tmp_path, monkeypatch
):
    """Through the worker op and its resources: a lane with two batches in flight opens
    connections for both. Sized for one, the hung batch's calls held every connection and the
    next batch's waited for them, although the worker had sent it on."""
    stalling = SandboxServer(SandboxConfig(timeout_delay_s=3.0))
    stalling.start()
    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", stalling.base_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BATCH_MAX", "1")
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES",
        json.dumps(
            {
                "transactional": {
                    "concurrency": 2,
                    "batch_size": 2,
                    "batches_in_flight": 2,
                    "retry_delay_s": 0.01,
                    "worker_idle_s": 1,
                    "worker_poll_s": 0.05,
                }
            }
        ),
    )
    hung = [signup(engine, f"h{i}", email=f"h{i}+timeoutx1@example.com") for i in range(2)]
    quick = [signup(engine, f"q{i}") for i in range(2)]
    (tmp_path / "dagster").mkdir()
    try:
        with (
            DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance,
            execute_job(
                reconstructable(_worker_job), instance=instance, run_config=WORKER_CONFIG
            ) as result,
        ):
            assert result.success
    finally:
        accepted = sandbox_messages(stalling.base_url)
        stats = sandbox_stats(stalling.base_url)
        stalling.stop()
    stalled_until = min(attempts_of(engine, e)[0].finished_at for e in hung)
    for event_id in quick:
        (attempt,) = attempts_of(engine, event_id)
        assert attempt.outcome == "accepted"
        # Sent while the hung calls still held their connections, not when they let go.
        assert (stalled_until - attempt.finished_at).total_seconds() > 1.5
    for event_id in hung:
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["transient", "accepted"]
    assert sorted(m["metadata"]["event_id"] for m in accepted) == sorted(hung + quick)
    assert stats["repeated_keys"] == 0


def _run_logs(instance: DagsterInstance, run_id: str) -> list[str]:
    return [e.user_message for e in instance.all_logs(run_id) if not e.is_dagster_event]


def _observations(instance: DagsterInstance, run_id: str) -> list[dict]:
    """Each observation's metadata, and the asset it observes under ``"asset"``."""
    found = []
    for e in instance.all_logs(run_id):
        if e.is_dagster_event and e.dagster_event.event_type_value == "ASSET_OBSERVATION":
            observation = e.dagster_event.asset_observation_data.asset_observation
            values = {k: v.value for k, v in observation.metadata.items()}
            found.append({**values, "asset": observation.asset_key.to_user_string()})
    return found


def test_a_worker_run_with_dead_letters_is_tagged_and_reports_each_batch(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", sandbox.base_url)
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES",
        '{"transactional": {"batch_size": 3, "worker_idle_s": 1, "worker_poll_s": 0.05,'
        ' "retry_delay_s": 0.01, "max_retries": 1}}',
    )
    good = [signup(engine, f"u{i}") for i in range(4)]
    flaky = signup(engine, "bad", email="bad+503x2@example.com")  # fails twice, then accepted
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        with execute_job(
            reconstructable(_worker_job), instance=instance, run_config=WORKER_CONFIG
        ) as run:
            assert not run.success
            run_id = run.run_id
            failure = run.get_step_failure_events()[0].step_failure_data
            metadata = failure.user_failure_data.metadata
        # A failure raised on purpose: the description and metadata, and none of our frames
        # but the op's own re-raise (Dagster's frames above it are Dagster's to print).
        assert failure.error.message.startswith("dagster._core.definitions.events.Failure: 1 ")
        ours = [frame for frame in failure.error.stack if "email_platform" in frame]
        assert len(ours) == 1 and "raise failure.with_traceback(None)" in ours[0], ours
        assert failure.error.cause is None and failure.error.context is None
        assert instance.get_run_by_id(run_id).tags["email/dead_letters"] == "1"
        logs = _run_logs(instance, run_id)
        batches = [line for line in logs if line.startswith("batch ")]
        # Five events in batches of three, then the retry: one line per batch, with its range
        # (ids made in one millisecond need not sort in publish order: the range is min..max).
        second = [good[3], flaky]
        assert len(batches) == 3, logs
        assert batches[0].startswith(f"batch 1: events {min(good[:3])}..{max(good[:3])}: claimed 3")
        assert batches[1].startswith(
            f"batch 2: events {min(second)}..{max(second)}: claimed 2, sent 1, retrying 1"
        )
        assert batches[2].startswith(
            f"batch 3 (retry 1): events {flaky}..{flaky}: claimed 1, sent 0, retrying 1"
        )
        assert all("provider calls" in line for line in batches)
        # What the run did, under names a reader understands, and what the UI plots.
        assert metadata["messages_sent"].value == 4
        assert metadata["dead_letters_recorded"].value == 1
        assert metadata["open_dead_letters"].value == 1
        assert "claimed again" in metadata["counters"].value
        observed = _observations(instance, run_id)
        assert sum(o["messages_sent"] for o in observed) == 4
        assert sum(o["dead_letters_recorded"] for o in observed) == 1
        assert {o["lane"] for o in observed} == {"transactional"}
        # The lane's own asset: another lane's runs plot on theirs, not on this line.
        assert {o["asset"] for o in observed} == {"email_platform/sends_transactional"}

        # The re-execution inherits the tag, and corrects it once it replayed the letter.
        with reexecuted(reconstructable(_worker_job), instance, run_id) as replayed:
            assert replayed.success
        assert instance.get_run_by_id(replayed.run_id).tags.get("email/dead_letters") in (None, "0")


def test_a_worker_asked_to_stop_ends_as_a_successful_run(
    engine, database_url, sandbox, tmp_path, monkeypatch
):
    from click.testing import CliRunner

    from email_platform.cli import main
    from email_platform.local.dagster_home import prepare_home, wait_for

    monkeypatch.setenv("EMAIL_PLATFORM_DATABASE_URL", database_url)
    monkeypatch.setenv("EMAIL_PLATFORM_SANDBOX_BASE_URL", sandbox.base_url)
    # Idle for a minute: only the stop request can end it within the test.
    monkeypatch.setenv(
        "EMAIL_PLATFORM_LANES",
        '{"transactional": {"worker_idle_s": 60, "worker_poll_s": 0.05}}',
    )
    home = tmp_path / "dagster"
    prepare_home(home)
    first = signup(engine, "u0")
    outcome: dict = {}

    def run_worker() -> None:
        with (
            DagsterInstance.from_config(str(home)) as instance,
            execute_job(
                reconstructable(_worker_job),
                instance=instance,
                run_config=WORKER_CONFIG,
                tags={"email/lane": "transactional"},  # as the lane sensor tags its workers
            ) as result,
        ):
            outcome["success"] = result.success
            outcome["run_id"] = result.run_id

    thread = threading.Thread(target=run_worker)
    thread.start()
    try:
        assert wait_for(lambda: event(engine, first).status == "done", 30)
        stopped = CliRunner().invoke(
            main, ["workers", "stop", "--lane", "transactional"], env={"DAGSTER_HOME": str(home)}
        )
        asked = time.monotonic()
    finally:
        thread.join(60)
    assert stopped.exit_code == 0 and "asked 1 unfinished" in stopped.output, stopped.output
    assert not thread.is_alive() and time.monotonic() - asked < 15
    assert outcome["success"] is True
    with DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_run_by_id(outcome["run_id"])
        assert run.status == DagsterRunStatus.SUCCESS and run.tags["email/stop"] == "requested"
        assert any("stopped on request" in line for line in _run_logs(instance, run.run_id))
    assert [m["idempotency_key"] for m in sandbox_messages(sandbox.base_url)] == [
        f"{first}:welcome"
    ]
    unknown = CliRunner().invoke(
        main, ["workers", "stop", "--lane", "nope"], env={"DAGSTER_HOME": str(home)}
    )
    assert unknown.exit_code == 2 and "unknown lane" in unknown.output


def test_a_worker_notices_a_stop_request_on_its_run():
    from email_platform.ops.lane_worker import stop_check
    from email_platform.sensors.runs import stop_lane_workers

    with DagsterInstance.ephemeral() as instance:
        run = _worker_run(instance)
        check = stop_check(instance, "critical", run.run_id, None)
        assert check() is None
        assert stop_lane_workers(instance, "bulk") == 0  # another lane's workers only
        assert stop_lane_workers(instance) == 1
        assert stop_check(instance, "critical", run.run_id, None)() == "stopped"


def _worker_in_child(database_url: str, sandbox_url: str, home: str) -> None:
    os.environ["EMAIL_PLATFORM_DATABASE_URL"] = database_url
    os.environ["EMAIL_PLATFORM_SANDBOX_BASE_URL"] = sandbox_url
    with DagsterInstance.from_config(home) as instance:
        # In process: the step runs in this process, so killing it kills the sender too.
        _worker_job().execute_in_process(run_config=WORKER_CONFIG, instance=instance)


def test_killed_worker_run_is_released_and_nothing_is_sent_twice(engine, database_url, tmp_path):
    home = tmp_path / "dagster"
    home.mkdir()
    # The provider accepts each message, then stalls before answering.
    ids = [signup(engine, f"u{i}", email=f"u{i}+accepttimeoutx1@example.com") for i in range(5)]
    with SandboxServer(SandboxConfig(timeout_delay_s=30)) as sandbox_url:
        child = multiprocessing.get_context("spawn").Process(
            target=_worker_in_child, args=(database_url, sandbox_url, str(home))
        )
        child.start()
        deadline = time.monotonic() + 60
        while sandbox_stats(sandbox_url)["accepted"] < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_stats(sandbox_url)["accepted"] == 5
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert all(event(engine, i).status == "in_flight" for i in ids)
        with DagsterInstance.from_config(str(home)) as instance:
            (run,) = instance.get_runs(RunsFilter(job_name="lane_worker_job"))
            # What the lane sensor does once the dead worker's heartbeat is stale (tested above).
            report_failed_and_release(instance, run, database_url)
        assert all(event(engine, i).status == "pending" for i in ids)
        _worker(engine, sandbox_url, _lane(), "worker-2").run()
        stats = sandbox_stats(sandbox_url)
        keys = [m["idempotency_key"] for m in sandbox_messages(sandbox_url)]
    assert sorted(keys) == sorted(f"{i}:welcome" for i in ids)  # five messages, not ten
    assert stats["accepted"] == 5 and stats["repeated_keys"] == 5
    for event_id in ids:
        assert event(engine, event_id).status == "done"
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["accepted"]


def test_a_batch_whose_claim_was_taken_over_is_not_sent_from_the_old_run(engine, sandbox):
    """Fencing: between preparing and sending, another run took the claim (this one looked
    dead). The old run sends nothing for those events; the new owner sends each once."""
    ids = [signup(engine, f"f{i}") for i in range(6)]
    provider = SandboxProvider(sandbox.base_url, batch_max=10)
    lane = DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL]
    old = batch_sender(engine, provider, lane)
    prepared = old.claim(ids, run_id="old-run")
    assert len(prepared.work) == 6
    with engine.begin() as connection:  # the run-failure sensor released it; another took it
        outbox.release_run(connection, "old-run")
        taken = outbox.claim(connection, ids[:4], run_id="new-run", lease_s=60, now=utcnow())
    assert len(taken) == 4
    outcome = old.deliver(prepared, run_id="old-run")
    assert outcome.sent == 0  # it held none of them any more
    new = batch_sender(engine, provider, lane)
    assert new.run(ids, run_id="new-run").sent == 6
    keys = [m["idempotency_key"] for m in sandbox_messages(sandbox.base_url)]
    assert len(keys) == 6 == len(set(keys))
    provider.close()
