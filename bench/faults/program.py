"""Faults other than kills, each at its moment of the drain: the provider's outage, the
application database's restart, its absence and a lock on the outbox, and the races (a lower
event id committed after higher ones, the same events sent by an extra batch run while the lane
sends them, one operator replay run twice at once beside two re-executions of a failed run),
and after the drain the hostile webhook traffic, with the receiver killed while it comes in.
"""

import contextlib
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
from dagster import DagsterInstance, DagsterRunStatus
from sqlalchemy import create_engine, select, text

from bench.faults import webhooks
from bench.faults.kills import KillSchedule
from bench.faults.stack import Stack
from bench.faults.stream import SENT, Stream
from email_platform import publish
from email_platform.common.timeutil import utcnow
from email_platform.db.schema import dead_letters
from email_platform.store import outbox


class FaultProgram:
    """Runs ``steps`` (``(at_s, name, action)``) from a thread, counting each one done."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.done: Counter = Counter()
        self.errors: list[str] = []
        self.steps: list[tuple[float, str, Callable[[], None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="faults", daemon=True)

    def at(self, at_s: float, name: str, action: Callable[[], None]) -> None:
        self.steps.append((at_s, name, action))

    def start(self) -> "FaultProgram":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def wait(self) -> None:
        self._thread.join()

    def _loop(self) -> None:
        for at_s, name, action in sorted(self.steps, key=lambda step: step[0]):
            if self._stop.wait(max(0.0, self._started + at_s - time.monotonic())):
                return
            try:
                action()
                self.done[name] += 1
            except Exception as exc:
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# -- the provider -------------------------------------------------------------------------
def provider_outage(stack: Stack, seconds: float) -> None:
    """Every send answers 503 for ``seconds``: longer than the lanes' retry budget."""
    url = f"{stack.sandbox.base_url}/_sandbox/faults"
    httpx.post(url, json={"rules": [{"kind": "503", "times": 10_000_000}]}, timeout=10)
    time.sleep(seconds)
    httpx.delete(url, timeout=10)


# -- the application database -------------------------------------------------------------
def database_restart(stack: Stack, down_s: float) -> None:
    """PostgreSQL stops as a crash would (no checkpoint), stays down ``down_s``, comes back."""
    assert stack.app_pg is not None
    stack.app_pg.restart(down_s=down_s, mode="immediate")


def outbox_locked(stack: Stack, seconds: float) -> None:
    """One transaction holds the whole outbox for ``seconds``: claims, publishes wait."""
    engine = create_engine(stack.app_url)
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("BEGIN"))
                connection.execute(text("LOCK TABLE email_outbox IN ACCESS EXCLUSIVE MODE"))
            else:
                connection.exec_driver_sql("BEGIN EXCLUSIVE")
            time.sleep(seconds)
            connection.exec_driver_sql("ROLLBACK")
    finally:
        engine.dispose()


# -- webhooks -----------------------------------------------------------------------------
def hostile_webhooks(
    stack: Stack, rng: random.Random, size: int, settle_s: float, receiver_kills: int = 2
) -> tuple[Counter, int, webhooks.WebhookVerdict]:
    """Duplicates, reorders, forged and stale signatures, replayed delivery ids, oversized
    bodies and a flood, posted to the receiver beside the sandbox's own webhooks for the
    drain's messages, the receiver killed ``receiver_kills`` times meanwhile (each time it is
    back up); then every webhook the sandbox planned is checked against the database.
    Returns the injector's counts, the receiver kills and the verdict."""
    base_url = stack.sandbox.base_url
    planned = webhooks.wait_posted(base_url, timeout_s=settle_s)
    posted: dict[str, Counter] = {}
    posting = threading.Thread(
        target=lambda: posted.setdefault(
            "counts", webhooks.inject(stack.receiver_url, stack.secret, planned, rng, size=size)
        ),
        name="hostile-webhooks",
    )
    posting.start()
    # The posts take a second or two unless the receiver is down, so kill it at once and
    # again as soon as the supervisor has it serving; the authentic posts retry meanwhile.
    killer = KillSchedule(stack, 0, rng, ("receiver",), min_age_s=0.0)
    while killer.killed["receiver"] < receiver_kills and posting.is_alive():
        if stack.receiver_healthy():
            killer.kill_one()
        posting.join(0.3)
    posting.join()
    counts = posted.get("counts", Counter({"inject_failed": 1}))
    records = webhooks.wait_posted(base_url, timeout_s=settle_s)
    counts["inbox_settled"] = int(webhooks.wait_settled(stack.engine, timeout_s=settle_s))
    return counts, killer.killed["receiver"], webhooks.check(stack.engine, records)


# -- races ----------------------------------------------------------------------------------
def late_commit(stack: Stack, stream: Stream, hold_s: float = 1.5) -> None:
    """An event whose id is lower than those committed while its transaction stays open."""
    with stack.engine.begin() as connection:
        user = f"late{time.time_ns()}"
        event_id = publish(
            connection,
            event_type="digest.ready",
            aggregate_id=user,
            payload={"email": f"{user}@example.com", "first_name": "Late", "highlights": []},
        )
        time.sleep(hold_s)
    stream.expected.add(event_id, SENT, "race:late_commit")


def extra_batch_run(stack: Stack, count: int = 20) -> None:
    """A send run of events the lanes are sending right now (the same event in two batches)."""
    with stack.engine.connect() as connection:
        event_ids = outbox.find_due(connection, "transactional", utcnow(), count)
    if event_ids:
        _inline(stack, ["-c", _SEND_INLINE, *event_ids], timeout_s=300)


def replay_twice_at_once(stack: Stack) -> bool:
    """Two operators run ``dlq replay --reason retries_exhausted --inline`` at the same time,
    while (in batch mode) two more re-execute one failed send run from failure, as the UI's
    "Re-execute" does: each re-execution runs while another replay of its letters is running.
    Returns whether a failed run was found to re-execute."""
    replay = [os.path.join(os.path.dirname(sys.executable), "email-platform"), "dlq", "replay"]
    commands = [[*replay, "--reason", "retries_exhausted", "--inline"] for _ in range(2)]
    failed = failed_send_run(stack)
    if failed is not None:
        commands += [[sys.executable, "-m", "bench.faults.reexecute", failed] for _ in range(2)]
    processes = [_spawn(stack, command) for command in commands]
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=600)
    return failed is not None


def failed_send_run(stack: Stack) -> str | None:
    """The id of a failed batch send run that left open dead letters, if there is one."""
    with stack.engine.connect() as connection:
        run_ids = connection.execute(
            select(dead_letters.c.run_id)
            .where(dead_letters.c.status == "open", dead_letters.c.run_id.is_not(None))
            .distinct()
        ).scalars()
        candidates = [run_id for run_id in run_ids if run_id]
    if not candidates:
        return None
    with DagsterInstance.from_config(str(stack.home)) as instance:
        for run_id in sorted(candidates):
            run = instance.get_run_by_id(run_id)
            if run and run.job_name == "send_email_job" and run.status == DagsterRunStatus.FAILURE:
                return run_id
    return None


_SEND_INLINE = (
    "import sys; from email_platform.local.replay import send_inline; send_inline(sys.argv[1:])"
)


def _spawn(stack: Stack, command: list[str]) -> subprocess.Popen:
    log = open(stack.work / "operator.log", "ab")  # noqa: SIM115 - lives with the process
    return subprocess.Popen(
        command, env={**os.environ, **stack.env()}, stdout=log, stderr=subprocess.STDOUT
    )


def _inline(stack: Stack, args: list[str], timeout_s: float) -> None:
    process = _spawn(stack, [sys.executable, *args])
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
