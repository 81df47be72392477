"""A resident lane worker: one run that keeps claiming its lane's due events as they arrive.

A launched run per batch waits for the sensor daemon's loop (~5 s) and pays a process start
(1.3-1.7 CPU-s, several seconds of wall time under load) before its first send. A worker run
pays that once per lifetime and then polls the outbox every ``worker_poll_s``: critical mail is
claimed within a poll of being published, and a bulk backlog drains without gaps between runs.

The gates stay the same as for batch runs: ``BatchSender.run`` claims atomically (so any number
of workers and batch runs can overlap), records every outcome as it goes, and idempotency keys
are committed before the provider call. Transient failures are retried by the worker itself
with the lane's backoff (exponential, full jitter, Retry-After honoured), holding the claim,
while it goes on with other events; exhausted retries become dead letters. Its heartbeat thread
renews the leases of everything it holds, so a worker that dies frees them within ``lease_s``.
"""

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine

from email_platform.common.lanes import LaneConfig
from email_platform.common.timeutil import utcnow
from email_platform.observability import logs
from email_platform.sending.batch import BatchOutcome, BatchSender
from email_platform.sending.dispatch import batch_max_of
from email_platform.sending.leases import RENEW_EVERY_S, LeaseRenewer, renew_every_s
from email_platform.sending.retry import retry_wait_s
from email_platform.store import lane_workers, outbox

#: How often the worker logs what it did since the last line (a run's progress in the UI).
PROGRESS_EVERY_S = 30.0
#: How often the worker beats (and renews its leases) unless told: every
#: ``leases.RENEW_EVERY_S``, or a sixth of a shorter lease. The sensor replaces a worker silent
#: for longer than ``sensors.outbox.HEARTBEAT_STALE_S``.
HEARTBEAT_EVERY_S = RENEW_EVERY_S
#: A worker that found a backlog (a round of calls' worth of due events, or a whole batch)
#: within ``BUSY_FOR_S`` polls at least every ``BUSY_POLL_S``: a campaign still being published
#: (transactions of 1,000) is found as each transaction commits, not up to a whole
#: ``worker_poll_s`` later. A trickle (a critical lane's few resets a second) or an idle lane
#: polls at the lane's own pace.
BUSY_POLL_S = 0.05
BUSY_FOR_S = 2.0


@dataclass
class _Retry:
    """Events held by this worker whose messages failed transiently, and when to try again."""

    due: float
    event_ids: list[str]
    #: Retries already made for these events (0 after the first failure).
    number: int


@dataclass
class WorkerResult:
    #: Totals over the worker's life, keyed like ``BatchOutcome.as_metadata``.
    totals: Counter = field(default_factory=Counter)
    batches: int = 0
    #: Why the worker ended: lifetime, idle, paused, canceled (or the error that ended it).
    reason: str = ""
    #: Events given back to the outbox at the end (waiting for a retry, or cut off by a stop).
    released: int = 0


class LaneWorker:
    def __init__(
        self,
        *,
        sender: BatchSender,
        engine: Engine,
        lane: LaneConfig,
        run_id: str,
        should_stop: Callable[[], str | None] = lambda: None,
        log: logging.Logger | Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] | None = None,
        heartbeat_every_s: float | None = None,
        on_batch: Callable[["WorkerResult"], Any] | None = None,
    ) -> None:
        self.sender = sender
        self.engine = engine
        self.lane = lane
        self.run_id = run_id
        self.should_stop = should_stop
        self.log = log or logs.bind(logging.getLogger(__name__), lane=lane.lane.value)
        self.clock = clock
        #: Called after each batch is counted, with the totals so far (the op tags the run and
        #: records observations from it).
        self.on_batch = on_batch
        # The sender's cancel flag: set by a terminate request (see ops/lane_worker.py); an
        # idle wait ends as soon as it is set.
        self.cancel = sender.cancel
        self.sleep = sleep or self.cancel.wait
        self._retries: list[_Retry] = []
        self.result = WorkerResult()
        # How many due events the next claim takes: a backlog's first batch is small
        # (``_first_claim``), so sending starts after preparing that many, not a whole batch; the
        # batches after it double (each is prepared while the one before is sent) up to
        # ``batch_size``. Back to the first size whenever the lane runs dry.
        self._claim_size = lane.batch_size
        # The batches being sent (oldest first) while the next one is claimed and prepared,
        # each with its retry number: at most ``batches_in_flight``.
        self._delivering: deque[tuple[futures.Future[BatchOutcome], int]] = deque()
        self._delivery = futures.ThreadPoolExecutor(
            max(1, lane.batches_in_flight), thread_name_prefix="deliver"
        )
        # One thread, one transaction: the heartbeat and the renewal of every lease held.
        self._heartbeat = LeaseRenewer(
            engine,
            run_id,
            lane.lease_s,
            every_s=renew_every_s(lane.lease_s) if heartbeat_every_s is None else heartbeat_every_s,
            beat=self._write_beat,
            log=self.log,
            name="heartbeat",
        )

    def run(self) -> WorkerResult:
        # A retried attempt of this run starts here: what the previous attempt held is due again.
        self._release_held()
        self._heartbeat.renew()
        self._heartbeat.start()
        try:
            self._loop()
        except BaseException as exc:
            self.result.reason = self.result.reason or f"error: {type(exc).__name__}: {exc}"
            raise
        finally:
            # The batches in flight are seen through (a stop has set the cancel flag: no new
            # call starts, what is in flight is recorded) before what is left is given back.
            self._settle_quietly()
            self._delivery.shutdown()
            self._heartbeat.stop()
            # Also on an interrupt (the run was terminated) or an error: what this run still
            # holds goes back to the outbox now instead of waiting for its lease to expire.
            self._release_held()
            self._end()
        return self.result

    def _loop(self) -> None:
        self._claim_size = self._first_claim()
        started = self.clock()
        idle_since = started
        backlog_at = -BUSY_FOR_S  # when a poll last found a backlog
        last_progress = started
        progress_mark: Counter = Counter()
        while True:
            now = self.clock()
            # Past its lifetime a worker takes nothing new but sees its waiting retries through,
            # so their backoff and retry count survive the handover to its successor.
            retiring = now - started >= self.lane.worker_lifetime_s
            if retiring and not self._retries:
                self.result.reason = "lifetime"
            elif self.cancel.is_set():
                self.result.reason = "canceled"
            elif (
                not self._retries
                and not self.lane.warm_workers
                and now - idle_since >= self.lane.worker_idle_s
            ):
                self.result.reason = "idle"
            else:
                self.result.reason = self.should_stop() or ""
            if self.result.reason:
                if not self._delivering:
                    return
                # A batch in flight may leave retries to see through: decide again after it.
                self.result.reason = ""
                self._settle()
                continue
            if now - last_progress >= PROGRESS_EVERY_S:
                self._log_progress(progress_mark, now - last_progress)
                progress_mark = Counter(self.result.totals)
                last_progress = now
            retry = self._due_retry(now)
            if retry is not None:
                self._send(retry.event_ids, retry.number + 1)
                continue
            if not retiring:
                with self.engine.connect() as connection:
                    event_ids = outbox.find_due(
                        connection,
                        self.lane.lane.value,
                        utcnow(),
                        self._claim_size,
                        not_held_by=self.run_id,
                    )
                if event_ids:
                    self._claim_size = min(self.lane.batch_size, 2 * self._claim_size)
                    if len(event_ids) >= min(self.lane.batch_size, self.lane.concurrency):
                        backlog_at = now
                    self._send(event_ids, 0)
                    idle_since = self.clock()
                    continue
                self._claim_size = self._first_claim()
            if self._delivering and self.lane.batches_in_flight <= 1:
                self._settle()  # nothing new to prepare: wait for the batch in flight instead
            elif self._delivering:
                # Others may be sent beside it: look again after a poll, or once one is done.
                self._settle(timeout_s=self._idle_wait(now, backlog_at))
            else:
                self.sleep(self._idle_wait(now, backlog_at))

    def _first_claim(self) -> int:
        """One round of calls in flight at one message each (or one full call, if fewer calls
        fit): sending starts after preparing that many. A batching provider's round of full
        calls (``concurrency`` x its batch size) was a whole batch, prepared before any call."""
        first = max(self.lane.concurrency, batch_max_of(self.sender.provider))
        return max(1, min(self.lane.batch_size, first))

    def _send(self, event_ids: list[str], retry_number: int) -> None:
        """Claim and prepare a batch, then hand it to the delivery thread.

        Claiming and preparing (database round trips, rendering) overlap the provider calls
        and recording of the batches in flight, which waited for each other when they ran in
        turn. At most ``batches_in_flight`` are in flight and one prepared, so a worker holds
        that many batches' claims and one more.
        """
        batch = self.sender.claim(event_ids, run_id=self.run_id)
        self._count_finished()
        while len(self._delivering) >= max(1, self.lane.batches_in_flight):
            self._settle()
        if batch.events:
            # No long lease across a retry wait: the heartbeat renews what this worker holds,
            # so if it dies, its waiting retries are free after one short lease.
            self._delivering.append(
                (
                    self._delivery.submit(
                        self.sender.deliver, batch, run_id=self.run_id, hold_retries=False
                    ),
                    retry_number,
                )
            )
        else:
            self._count(batch.outcome, retry_number)

    def _settle(self, timeout_s: float | None = None) -> None:
        """Wait until a batch in flight is done, if any (at most ``timeout_s``), then count
        every batch done."""
        if not self._delivering:
            return
        futures.wait(
            [delivery for delivery, _ in self._delivering],
            timeout=timeout_s,
            return_when=futures.FIRST_COMPLETED,
        )
        self._count_finished()

    def _count_finished(self) -> None:
        """Count the batches sent so far, whichever were claimed first: a batch whose call
        hangs (up to the provider's timeout) holds back neither the count of those sent after
        it nor the claim its place in flight frees."""
        for entry in [entry for entry in self._delivering if entry[0].done()]:
            self._delivering.remove(entry)
            delivery, retry_number = entry
            self._count(delivery.result(), retry_number)

    def _settle_quietly(self) -> None:
        while self._delivering:
            delivery, retry_number = self._delivering.popleft()
            try:
                self._count(delivery.result(), retry_number)
            except BaseException as exc:  # never mask the error that ended the loop
                self.log.warning(f"the batch in flight ended with {type(exc).__name__}: {exc}")

    def _count(self, outcome: BatchOutcome, retry_number: int) -> None:
        self.result.batches += 1
        self.result.totals.update(outcome.as_metadata())
        retry = f" (retry {retry_number})" if retry_number else ""
        self.log.info(f"batch {self.result.batches}{retry}: {outcome.summary()}")
        if outcome.transient:
            self._after_transient(outcome, retry_number)
        if self.on_batch is not None:
            try:
                self.on_batch(self.result)
            except Exception as exc:  # reporting progress must never stop the sending
                self.log.warning(f"could not report the batch ({type(exc).__name__}: {exc})")

    def _after_transient(self, outcome: BatchOutcome, retry_number: int) -> None:
        if retry_number < self.lane.max_retries:
            wait_s = retry_wait_s(self.lane, retry_number, outcome.retry_after_s)
            self._retries.append(_Retry(self.clock() + wait_s, outcome.claimed, retry_number))
            self.log.warning(
                f"{len(outcome.transient)} message(s) failed transiently; retry "
                f"{retry_number + 1}/{self.lane.max_retries} in {wait_s:.2f}s "
                f"(first_event_id={outcome.claimed[0]})"
            )
        else:
            exhausted = self.sender.give_up(outcome.transient, run_id=self.run_id)
            self.result.totals["dead_lettered"] += exhausted
            self.log.error(f"retries exhausted: {exhausted} message(s) dead-lettered")

    def _due_retry(self, now: float) -> _Retry | None:
        for retry in self._retries:
            if retry.due <= now:
                self._retries.remove(retry)
                return retry
        return None

    def _idle_wait(self, now: float, backlog_at: float) -> float:
        wait = self.lane.worker_poll_s
        if now - backlog_at < BUSY_FOR_S:
            wait = min(wait, BUSY_POLL_S)
        if self._retries:
            wait = min(wait, max(0.0, min(r.due for r in self._retries) - now))
        return wait

    def _release_held(self) -> None:
        """Events this run holds (waiting for a retry, or cut off) go back to the outbox.

        Their messages keep their idempotency keys, so the next send cannot double them. If the
        database is what failed, the leases expire instead and the run failure sensor retries.
        """
        self._retries.clear()
        try:
            with self.engine.begin() as connection:
                self.result.released = len(outbox.release_run(connection, self.run_id))
        except Exception as exc:  # never mask the error that ended the loop
            self.log.warning(f"could not release this run's claims ({exc}); leases will expire")

    def _write_beat(self, connection: Connection, now: datetime) -> None:
        """Written from the heartbeat thread: a long batch send must not look like a dead run."""
        lane_workers.beat(connection, self.run_id, self.lane.lane.value, now)

    def _end(self) -> None:
        try:
            with self.engine.begin() as connection:
                lane_workers.end(connection, self.run_id, self.result.reason or "ended", utcnow())
        except Exception as exc:  # never mask the error that ended the loop
            self.log.warning(f"could not record the end of this worker ({exc})")

    def _log_progress(self, mark: Counter, elapsed_s: float) -> None:
        sent = self.result.totals["sent"] - mark["sent"]
        claimed = self.result.totals["claimed"] - mark["claimed"]
        self.log.info(
            f"lane={self.lane.lane.value} claimed={claimed} sent={sent} "
            f"({sent / max(elapsed_s, 1e-9):.1f}/s) over {elapsed_s:.0f}s; "
            f"total sent={self.result.totals['sent']} batches={self.result.batches} "
            f"waiting_retries={len(self._retries)}"
        )
