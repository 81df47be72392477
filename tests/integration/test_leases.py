"""Short leases renewed while their holder lives, on SQLite and PostgreSQL, over real HTTP.

A live lane worker or batch run keeps its claims however long its sends take (no other run can
take them), and a holder killed with SIGKILL, which nothing notices, frees them one short lease
later: another run takes them and each message is sent once (docs/design.md invariants 2, 3).
"""

import dataclasses
import json
import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from dagster import DagsterInstance
from sqlalchemy import Engine

from email_platform.common.errors import ConfigurationError
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, Lane, LaneConfig
from email_platform.common.timeutil import as_utc, utcnow
from email_platform.providers.sandbox import SandboxProvider
from email_platform.resources import LanePolicy
from email_platform.sandbox.server import SandboxConfig, SandboxServer
from email_platform.sending.leases import LeaseRenewer
from email_platform.sending.worker import LaneWorker
from email_platform.store import outbox
from tests.support import (
    FAST_LANES,
    attempts_of,
    batch_sender,
    event,
    run_send,
    sandbox_messages,
    sandbox_stats,
    signup,
)

LANE = "transactional"
#: A lease short enough to outlive in a test; renewed every sixth of it.
LEASE_S = 2


def _lane(**changes) -> LaneConfig:  # type: ignore[no-untyped-def]
    base = dict(
        batch_size=10,
        worker_poll_s=0.02,
        worker_idle_s=0.5,
        worker_lifetime_s=60,
        retry_delay_s=0.05,
        max_retry_delay_s=2.0,
        max_retries=3,
        lease_s=LEASE_S,
    )
    return dataclasses.replace(DEFAULT_LANE_CONFIGS[Lane.TRANSACTIONAL], **{**base, **changes})


def _worker(engine: Engine, sandbox_url: str, lane: LaneConfig, run_id: str, **kwargs):  # type: ignore[no-untyped-def]
    provider = SandboxProvider(sandbox_url, max_connections=lane.concurrency, timeout_s=10)
    sender = batch_sender(engine, provider, lane)
    return LaneWorker(sender=sender, engine=engine, lane=lane, run_id=run_id, **kwargs)


def _wait(predicate, timeout_s: float, every_s: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


def _claim(engine: Engine, ids: list[str], run_id: str) -> list[str]:
    with engine.begin() as connection:
        rows = outbox.claim(connection, ids, run_id=run_id, lease_s=60, now=utcnow())
    return [row.event_id for row in rows]


def _lease_left_s(engine: Engine, event_id: str) -> float:
    return (as_utc(event(engine, event_id).lease_expires_at) - utcnow()).total_seconds()


# ---- the store ---------------------------------------------------------------------------------


def test_renew_leases_extends_only_this_runs_in_flight_rows_and_never_shortens(engine):
    held, other, done, retrying, pending = (
        [signup(engine, f"{name}{i}") for i in range(n)]
        for name, n in (("h", 2), ("o", 1), ("d", 1), ("r", 1), ("p", 1))
    )
    now = utcnow()
    with engine.begin() as connection:
        outbox.claim(connection, held + done, run_id="run-1", lease_s=5, now=now)
        outbox.claim(connection, other, run_id="run-2", lease_s=5, now=now)
        # Waiting for a long retry: a lease longer than any renewal.
        outbox.claim(connection, retrying, run_id="run-1", lease_s=3600, now=now)
        outbox.finish(connection, done, status=outbox.DONE, resolution="sent", now=now)
    until = now + timedelta(seconds=60)
    with engine.begin() as connection:
        assert outbox.renew_leases(connection, "run-1", until) == 2
    for event_id in held:
        assert as_utc(event(engine, event_id).lease_expires_at) == until
        assert event(engine, event_id).claimed_by == "run-1"
    assert as_utc(event(engine, other[0]).lease_expires_at) == now + timedelta(seconds=5)
    assert as_utc(event(engine, retrying[0]).lease_expires_at) == now + timedelta(seconds=3600)
    assert event(engine, done[0]).lease_expires_at is None
    assert event(engine, done[0]).status == "done"
    assert event(engine, pending[0]).status == "pending"
    assert event(engine, pending[0]).lease_expires_at is None
    # An earlier ``until`` shortens nothing.
    with engine.begin() as connection:
        assert outbox.renew_leases(connection, "run-1", now + timedelta(seconds=30)) == 0
    assert as_utc(event(engine, held[0]).lease_expires_at) == until


def test_a_claim_of_rows_the_run_holds_waits_for_their_renewal_instead_of_skipping_them(engine):
    """On PostgreSQL the claim skips locked rows; a row this run holds that its own renewal
    has locked for a moment must be waited for, or it would stay held and never be retried."""
    ids = [signup(engine, f"u{i}") for i in range(3)]
    assert len(_claim(engine, ids, "run-1")) == 3
    reclaimed: list[list[str]] = []
    with engine.begin() as renewal:
        assert outbox.renew_leases(renewal, "run-1", utcnow() + timedelta(seconds=120)) == 3
        # The renewal's transaction is still open (its rows locked) when the run re-claims.
        claiming = threading.Thread(target=lambda: reclaimed.append(_claim(engine, ids, "run-1")))
        claiming.start()
        time.sleep(0.5)
        assert claiming.is_alive()  # waiting, not skipping
    claiming.join(10)
    assert [sorted(r) for r in reclaimed] == [sorted(ids)]


# SQLite serializes writers: there a renewal waits for the write lock, so PostgreSQL only.
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_renewal_skips_a_row_another_transaction_has_locked(engine):
    ids = [signup(engine, f"u{i}") for i in range(2)]
    _claim(engine, ids, "run-1")
    with engine.begin() as recording:  # the run records the first event right now
        outbox.finish(recording, ids[:1], status=outbox.DONE, resolution="sent", now=utcnow())
        with engine.begin() as connection:
            # A renewal that waited for the lock would fail here instead of hanging the test.
            connection.exec_driver_sql("SET LOCAL lock_timeout = '2s'")
            extended = outbox.renew_leases(connection, "run-1", utcnow() + timedelta(seconds=120))
        assert extended == 1  # the locked row is left for the next renewal


def test_lease_s_must_be_positive():
    for bad in (0, -5):
        overrides = json.dumps({LANE: {"lease_s": bad}})
        with pytest.raises(ConfigurationError, match="lease_s must be positive"):
            LanePolicy(overrides_json=overrides).config_for(LANE)


def test_the_renewer_stops_on_an_exception_and_renews_no_more(engine):
    event_id = signup(engine, "u1")
    assert _claim(engine, [event_id], "run-1") == [event_id]
    renewer = LeaseRenewer(engine, "run-1", 120, every_s=0.05)
    with pytest.raises(RuntimeError), renewer:
        assert _wait(lambda: renewer.renewals >= 2, 30)
        raise RuntimeError("the step failed")
    renewals = renewer.renewals
    time.sleep(0.3)
    assert renewer.renewals == renewals  # its thread ended with the block
    assert _lease_left_s(engine, event_id) > 100


# ---- a live holder keeps its claims ------------------------------------------------------------


def test_a_live_worker_keeps_its_claims_past_the_lease_while_it_sends(engine):
    ids = [signup(engine, f"u{i}") for i in range(5)]
    # Every provider call takes 5 s, more than two leases.
    with SandboxServer(SandboxConfig(latency_ms=5000)) as sandbox_url:
        worker = _worker(engine, sandbox_url, _lane(), "worker-1")
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            assert _wait(lambda: event(engine, ids[0]).claimed_by == "worker-1", 10)
            time.sleep(LEASE_S + 0.8)
            assert all(event(engine, i).status == "in_flight" for i in ids)
            assert _claim(engine, ids, "other-run") == []  # still held: renewed
            assert all(event(engine, i).claimed_by == "worker-1" for i in ids)
            assert all(0 < _lease_left_s(engine, i) <= LEASE_S for i in ids)
        finally:
            thread.join(30)
        stats = sandbox_stats(sandbox_url)
    assert worker.result.totals["sent"] == 5
    assert stats["accepted"] == 5 and stats["repeated_keys"] == 0
    for event_id in ids:
        assert event(engine, event_id).status == "done"
        assert event(engine, event_id).claim_count == 1


def test_a_live_worker_holds_what_waits_for_a_retry_by_renewal_not_a_long_lease(engine):
    """A retry wait longer than the lease: renewed, the event stays the worker's; and its lease
    stays short, so a worker that died during the wait would free it within one lease."""
    throttled = signup(engine, "u1", email="u1+429x1@example.com")
    with SandboxServer(SandboxConfig(retry_after_s=5)) as sandbox_url:
        lane = _lane(max_retry_delay_s=30.0, worker_idle_s=10)
        # The interval can be given outright (else a sixth of the lease).
        worker = _worker(engine, sandbox_url, lane, "worker-1", heartbeat_every_s=0.1)
        thread = threading.Thread(target=worker.run)
        thread.start()
        try:
            assert _wait(lambda: len(attempts_of(engine, throttled)) == 1, 10)
            time.sleep(LEASE_S + 0.8)  # inside the 5 s Retry-After
            assert [a.outcome for a in attempts_of(engine, throttled)] == ["transient"]
            assert _claim(engine, [throttled], "other-run") == []
            assert event(engine, throttled).claimed_by == "worker-1"
            assert _lease_left_s(engine, throttled) <= LEASE_S
            assert _wait(lambda: event(engine, throttled).status == "done", 10)
        finally:
            worker.cancel.set()
            thread.join(30)
    tries = attempts_of(engine, throttled)
    assert [a.outcome for a in tries] == ["transient", "accepted"]
    assert {a.run_id for a in tries} == {"worker-1"}


def test_a_batch_run_renews_its_leases_while_it_sends(engine, database_url):
    ids = [signup(engine, f"u{i}") for i in range(5)]
    lanes = {LANE: {**FAST_LANES[LANE], "lease_s": LEASE_S}}
    probe: dict = {}

    def probe_after_the_lease() -> None:
        # Once the run has claimed, outlive its lease and try to take the batch.
        if _wait(lambda: event(engine, ids[0]).status == "in_flight", 20):
            time.sleep(LEASE_S + 0.8)
            probe["holder"] = {event(engine, i).claimed_by for i in ids}
            probe["taken"] = _claim(engine, ids, "other-run")

    with SandboxServer(SandboxConfig(latency_ms=5000)) as sandbox_url:
        prober = threading.Thread(target=probe_after_the_lease)
        prober.start()
        result = run_send(database_url, sandbox_url, LANE, ids, lanes=lanes, timeout_s=10)
        prober.join(30)
        stats = sandbox_stats(sandbox_url)
    assert result.success
    assert probe["taken"] == [] and probe["holder"] == {result.run_id}
    assert stats["accepted"] == 5 and stats["repeated_keys"] == 0
    for event_id in ids:
        assert event(engine, event_id).status == "done"
        assert event(engine, event_id).claim_count == 1


# ---- a holder killed with SIGKILL --------------------------------------------------------------


def _lanes_json() -> str:
    return json.dumps({LANE: {**FAST_LANES[LANE], "lease_s": LEASE_S, "worker_poll_s": 0.05}})


def _holder_in_child(kind: str, database_url: str, sandbox_url: str, ids: list[str]) -> None:
    os.environ["EMAIL_PLATFORM_DATABASE_URL"] = database_url
    os.environ["EMAIL_PLATFORM_SANDBOX_BASE_URL"] = sandbox_url
    os.environ["EMAIL_PLATFORM_LANES"] = _lanes_json()
    with DagsterInstance.ephemeral() as instance:
        if kind == "worker":
            from email_platform.definitions import build_definitions

            job = build_definitions().get_job_def("lane_worker_job")
            config = {"ops": {"run_lane_worker": {"config": {"lane": LANE}}}}
            job.execute_in_process(run_config=config, instance=instance)
        else:
            lanes = json.loads(_lanes_json())
            run_send(database_url, sandbox_url, LANE, ids, instance=instance, lanes=lanes)


@pytest.mark.parametrize("kind", ["worker", "batch"])
def test_a_killed_holder_frees_its_claims_after_one_short_lease_and_each_is_sent_once(
    engine, database_url, kind: str, tmp_path: Path
):
    # The provider accepts each message, then stalls before answering: killed mid-send.
    ids = [signup(engine, f"u{i}", email=f"u{i}+accepttimeoutx1@example.com") for i in range(5)]
    with SandboxServer(SandboxConfig(timeout_delay_s=12)) as sandbox_url:
        child = multiprocessing.get_context("spawn").Process(
            target=_holder_in_child, args=(kind, database_url, sandbox_url, ids)
        )
        child.start()
        try:
            assert _wait(lambda: sandbox_stats(sandbox_url)["accepted"] == 5, 90, 0.05)
            # Alive past its lease: the holder renews, nobody else may take the events.
            time.sleep(LEASE_S + 0.5)
            assert _claim(engine, ids, "other-run") == []
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join()
        killed = time.monotonic()
        (holder,) = {event(engine, i).claimed_by for i in ids}
        assert all(event(engine, i).status == "in_flight" for i in ids)
        assert all(attempts_of(engine, i) == [] for i in ids)  # accepted, never recorded

        # Nothing releases them (no failure sensor here): their lease runs out.
        def claimable() -> bool:
            with engine.connect() as connection:
                due = outbox.find_due(connection, LANE, utcnow(), 10)
            return sorted(due) == sorted(ids)

        assert _wait(claimable, LEASE_S + 2)
        freed_after_s = time.monotonic() - killed
        assert freed_after_s <= LEASE_S + 1, freed_after_s

        # Another run takes them over and sends each once (the sandbox honours the key).
        if kind == "worker":
            taker = _worker(engine, sandbox_url, _lane(), "worker-2")
            assert taker.run().totals["sent"] == 5
        else:
            assert run_send(database_url, sandbox_url, LANE, ids).success
        stats = sandbox_stats(sandbox_url)
        keys = [m["idempotency_key"] for m in sandbox_messages(sandbox_url)]
    assert sorted(keys) == sorted(f"{i}:welcome" for i in ids)  # five messages, not ten
    assert stats["accepted"] == 5 and stats["repeated_keys"] == 5
    for event_id in ids:
        row = event(engine, event_id)
        assert row.status == "done" and row.claim_count == 2 and row.claimed_by != holder
        assert [a.outcome for a in attempts_of(engine, event_id)] == ["accepted"]
