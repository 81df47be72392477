"""Sending a batch's messages: provider calls, no database.

Senders pull messages from one queue and push what the provider answered onto another; the
caller's thread takes those answers in groups and hands each group to ``record``
(``record.Recorder.record_group``), so outcomes are committed as they arrive while sends go on.

A provider that can send from an event loop (``AsyncProvider``: the HTTP adapters) gets up to
``concurrency`` tasks on one loop thread, kept from batch to batch; any other (SMTP, a provider
behind the circuit breaker) gets threads, at most ``SEND_THREADS_MAX`` of them.
"""

import asyncio
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent import futures
from queue import Empty, SimpleQueue
from typing import Any, cast

from email_platform.common.classify import classify_exception, is_transient
from email_platform.common.errors import BatchNotSentError, ConfigurationError, TransientError
from email_platform.common.timeutil import utcnow
from email_platform.observability import tracing
from email_platform.providers.async_http import new_event_loop
from email_platform.providers.base import (
    Accepted,
    AsyncProvider,
    BatchingProvider,
    EmailProvider,
    History,
    HistoryAwareProvider,
    OutgoingEmail,
)
from email_platform.sending.types import Result, Sent, Work

# Most send outcomes recorded in one transaction. Outcomes arrive in calls of up to 100, and
# each transaction costs three statements and a commit whatever its size: a lane worker drained
# 20k events at 3,014 emails/s with groups of up to 1,000 against 2,803 with 200 (median of 2).
RECORD_GROUP_MAX = 1000

#: Most send threads for a provider without an event-loop path. Each thread waiting on an
#: answer costs GIL hand-offs when it wakes: past a few dozen they cost more CPU than they add.
SEND_THREADS_MAX = 64


def _next_group(done: SimpleQueue[Sent | None], running: int) -> tuple[list[Sent], int]:
    """Wait for the next outcome, then take every one already waiting (at most a group's worth).

    Returns the outcomes and how many of the ``running`` workers said they finished. Sends keep
    completing while a group commits, so groups grow with the send rate on their own: one
    commit records many sends, and no outcome waits for its commit longer than the previous
    commit took.
    """
    group: list[Sent] = []
    exited = 0
    sent = done.get()
    while True:
        if sent is None:
            exited += 1
        else:
            group.append(sent)
        if exited == running or len(group) >= RECORD_GROUP_MAX:
            return group, exited
        try:
            sent = done.get_nowait()
        except Empty:
            return group, exited


def _take(todo: SimpleQueue[Work | None], count: int) -> tuple[list[Work], bool]:
    """Up to ``count`` queued messages, and whether this worker's end marker came with them.

    The queue is filled before the workers start, with one end marker per worker after the
    messages, so a worker never waits here for more than the queue's lock.
    """
    items: list[Work] = []
    while len(items) < count:
        item = todo.get()
        if item is None:
            return items, True
        items.append(item)
    return items, False


def _drain(group: list[Sent], done: SimpleQueue[Sent | None]) -> list[Sent]:
    """``group`` and every answer still waiting in ``done``."""
    leftovers = list(group)
    while True:
        try:
            sent = done.get_nowait()
        except Empty:
            return leftovers
        if sent is not None:
            leftovers.append(sent)


class Dispatcher:
    """The lane's senders, kept from batch to batch, and the provider calls they make."""

    def __init__(self, concurrency: int, cancel: threading.Event, batches: int = 1) -> None:
        self.concurrency = max(1, concurrency)
        #: Batches sent at once (a lane's ``batches_in_flight``), each with its own calls.
        self.batches = max(1, batches)
        #: Set when the run is asked to stop: no new provider call starts.
        self.cancel = cancel
        self._threads: futures.ThreadPoolExecutor | None = None
        self._loop: _LoopThread | None = None
        # A lane worker may send several batches at once, each from a thread of its own.
        self._starting = threading.Lock()

    def send_all(
        self,
        provider: EmailProvider,
        work: list[Work],
        record: Callable[[list[Sent]], ConfigurationError | None],
        salvage: Callable[[list[Sent]], None],
    ) -> None:
        """Send ``work`` with up to ``concurrency`` calls in flight; ``record`` each group of
        answers.

        The senders pull from one queue and push what happened onto another, so this thread
        waits on a single queue instead of polling every future of the batch (which cost O(n)
        per completion). A configuration error stops further sends: what is already in flight
        is recorded, then the error is raised. Interrupted (the run was terminated) or failed
        mid-group, the calls in flight are seen through and the answers in hand go to
        ``salvage`` before giving up, so a released event is not sent again for nothing
        (twice, with a provider that ignores idempotency keys).
        """
        if not work:
            return
        if not isinstance(provider, HistoryAwareProvider):
            self._send_all(provider, work, record, salvage)
            return
        # A failover moves a message only if no earlier attempt may have been accepted.
        histories = {
            item.email.idempotency_key: History(item.message.attempts, item.message.provider)
            for item in work
        }
        provider.expect(histories)
        try:
            self._send_all(provider, work, record, salvage)
        finally:
            # Those never sent (the batch stopped early) would otherwise stay for the life of
            # the lane worker.
            provider.forget(histories)

    def _send_all(
        self,
        provider: EmailProvider,
        work: list[Work],
        record: Callable[[list[Sent]], ConfigurationError | None],
        salvage: Callable[[list[Sent]], None],
    ) -> None:
        done: SimpleQueue[Sent | None] = SimpleQueue()
        stop = threading.Event()
        per_call = messages_per_call(len(work), self.concurrency, batch_max_of(provider))
        workers = min(self.concurrency, -(-len(work) // per_call))
        # Looked up once per batch: with tracing off, the senders skip span work entirely.
        traced = tracing.active()
        senders: list[futures.Future[Any]]
        if _awaits(provider):
            senders = [
                self._event_loop().submit(
                    self._send_tasks(provider, deque(work), done, stop, per_call, traced, workers)
                )
            ]
        else:
            workers = min(workers, SEND_THREADS_MAX)
            todo: SimpleQueue[Work | None] = SimpleQueue()
            for item in work:
                todo.put(item)
            for _ in range(workers):
                todo.put(None)
            senders = [
                self._send_threads().submit(
                    self._send_worker, provider, todo, done, stop, per_call, traced
                )
                for _ in range(workers)
            ]
        configuration_error: ConfigurationError | None = None
        group: list[Sent] = []
        finished = False
        try:
            running = workers
            while running:
                group, exited = _next_group(done, running)
                running -= exited
                if group:
                    configuration_error = record(group) or configuration_error
                group = []
            finished = True
        finally:
            stop.set()
            futures.wait(senders)
            if not finished:
                leftovers = _drain(group, done)
                if leftovers:
                    salvage(leftovers)
        if configuration_error is not None:
            raise configuration_error

    def _send_threads(self) -> futures.ThreadPoolExecutor:
        """The send threads, kept from batch to batch.

        Starting a lane's 32 threads for every batch took about a tenth of a lane worker's
        wall time: each ``Thread.start`` waits for the new thread to get the GIL from the busy
        ones. Idle threads end when the sender is garbage-collected.
        """
        with self._starting:
            if self._threads is None:
                self._threads = futures.ThreadPoolExecutor(
                    min(self.concurrency * self.batches, SEND_THREADS_MAX),
                    thread_name_prefix="send",
                )
            return self._threads

    def _event_loop(self) -> "_LoopThread":
        """The send loop's thread, kept from batch to batch; it ends with the dispatcher."""
        with self._starting:
            if self._loop is None:
                self._loop = _LoopThread()
                weakref.finalize(self, self._loop.stop)
            return self._loop

    def _send_worker(
        self,
        provider: EmailProvider,
        todo: SimpleQueue[Work | None],
        done: SimpleQueue[Sent | None],
        stop: threading.Event,
        per_call: int,
        traced: bool = False,
    ) -> None:
        try:
            last = False
            while not last and not stop.is_set() and not self.cancel.is_set():
                items, last = _take(todo, per_call)
                if not items:
                    continue
                started = utcnow()
                if traced:
                    results = _traced_call(provider, items, per_call)
                else:
                    results = _call(provider, items, per_call)
                _answered(items, started, results, done, stop)
        finally:
            done.put(None)  # this worker is finished

    async def _send_tasks(
        self,
        provider: EmailProvider,
        todo: deque[Work],
        done: SimpleQueue[Sent | None],
        stop: threading.Event,
        per_call: int,
        traced: bool,
        tasks: int,
    ) -> None:
        """``tasks`` senders on the loop, each making one call at a time until ``todo`` is
        empty or the batch is stopped; as ``_send_worker``, each says when it is finished."""

        async def sender() -> None:
            try:
                while todo and not stop.is_set() and not self.cancel.is_set():
                    items = [todo.popleft() for _ in range(min(per_call, len(todo)))]
                    started = utcnow()
                    if traced:
                        results = await _traced_call_async(provider, items, per_call)
                    else:
                        results = await _call_async(provider, items, per_call)
                    _answered(items, started, results, done, stop)
            finally:
                done.put(None)

        await asyncio.gather(*(sender() for _ in range(tasks)))


class _LoopThread:
    """An event loop running on a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="send-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, coroutine: Awaitable[Any]) -> "futures.Future[Any]":
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)  # type: ignore[arg-type]

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)


def _awaits(provider: EmailProvider) -> bool:
    return isinstance(provider, AsyncProvider) and bool(provider.async_ready)


def _answered(
    items: list[Work],
    started: Any,
    results: Sequence[Result],
    done: SimpleQueue[Sent | None],
    stop: threading.Event,
) -> None:
    for item, result in zip(items, results, strict=True):
        if isinstance(result, ConfigurationError):
            stop.set()  # every further send would fail the same way
        done.put(Sent(item, started, result))


def _call(provider: EmailProvider, items: list[Work], per_call: int) -> Sequence[Result]:
    if per_call == 1:
        return [attempt(provider, items[0].email)]
    return attempt_many(provider, [item.email for item in items])


async def _call_async(
    provider: EmailProvider, items: list[Work], per_call: int
) -> Sequence[Result]:
    if per_call == 1:
        return [await attempt_async(provider, items[0].email)]
    return await attempt_many_async(provider, [item.email for item in items])


def _traced_call(provider: EmailProvider, items: list[Work], per_call: int) -> Sequence[Result]:
    """``_call`` inside one ``email_platform.send`` span per message (kind CLIENT), each
    continuing its own event's trace: one batch call carries messages of many traces."""
    spans = _open_spans(provider, items)
    # A single send's span is current during the call, so an instrumented HTTP client's spans
    # nest under it; a batch call's belongs to no one message.
    try:
        with tracing.use(spans[0] if len(spans) == 1 else None):
            results = _call(provider, items, per_call)
    except BaseException as exc:  # interrupted: the spans end, the error goes on
        for span in spans:
            tracing.end_span(span, error=type(exc).__name__)
        raise
    _end_spans(spans, results)
    return results


async def _traced_call_async(
    provider: EmailProvider, items: list[Work], per_call: int
) -> Sequence[Result]:
    """``_traced_call`` on the event loop (each task keeps its own current span)."""
    spans = _open_spans(provider, items)
    try:
        with tracing.use(spans[0] if len(spans) == 1 else None):
            results = await _call_async(provider, items, per_call)
    except BaseException as exc:
        for span in spans:
            tracing.end_span(span, error=type(exc).__name__)
        raise
    _end_spans(spans, results)
    return results


def _open_spans(provider: EmailProvider, items: list[Work]) -> list[Any]:
    return [
        tracing.open_span(
            "email_platform.send",
            context_carrier=item.trace_parent,
            kind="client",
            attributes={
                "email.event_id": item.email.event_id,
                "email.message_id": item.email.message_id,
                "email.provider": provider.name,
                "email.template": item.email.template,
                "email.lane": item.email.lane,
                "email.batch_size": len(items),
            },
        )
        for item in items
    ]


def _end_spans(spans: list[Any], results: Sequence[Result]) -> None:
    for span, result in zip(spans, results, strict=True):
        if isinstance(result, Accepted):
            tracing.end_span(
                span,
                attributes={
                    "email.outcome": "accepted",
                    "email.provider_message_id": result.provider_message_id,
                    "http.response.status_code": result.status_code,
                },
            )
        else:
            outcome = "transient" if is_transient(result) else "permanent"
            # The class and code only: a provider's error text can quote the address.
            code = getattr(result, "code", None)
            tracing.end_span(
                span,
                error=f"{type(result).__name__}" + (f" ({code})" if code else ""),
                attributes={
                    "email.outcome": outcome,
                    "http.response.status_code": getattr(result, "status_code", None),
                },
            )


def messages_per_call(count: int, in_flight: int, batch_max: int) -> int:
    """How many of ``count`` messages go in one provider call.

    Where one call could carry them all and ``in_flight`` calls can give every message a call
    of its own, each gets one: all are in flight at once, and a call that fails as a whole (a
    timeout) is one message's failure. Past that, calls carry up to ``batch_max``: a call costs
    a request against the provider's rate limit and CPU on both ends, and a fuller one takes
    about as long (spreading 1,000 over 256 in flight made calls of 4, 25 times the requests;
    a bulk lane's 256 events of a backlog's first claim went out as 256 calls, not 3).
    """
    return 1 if count <= min(in_flight, batch_max) else max(1, batch_max)


def batch_max_of(provider: EmailProvider) -> int:
    """Most messages ``provider`` takes in one call (1 unless it sends batches)."""
    if isinstance(provider, BatchingProvider):
        return max(1, provider.batch_max)
    return 1


def attempt(provider: EmailProvider, email: OutgoingEmail) -> Result:
    """One message, one call: whatever the adapter does becomes this message's answer."""
    try:
        return provider.send(email)
    except ConfigurationError as error:
        return error
    except Exception as exc:  # the provider raised: classify, never let one message sink all
        return classify_exception(exc)


def attempt_many(provider: EmailProvider, emails: list[OutgoingEmail]) -> Sequence[Result]:
    """Several messages in one call: one answer each, or the call's failure for each.

    A call that fails as a whole (the network, a timeout, an error after the call) is each
    message's failure, retried under its own key: the provider may have accepted them, so
    nothing is sent again here. Only a call that sent nothing and may have been refused for a
    single message (``BatchNotSentError``: a request refused whole as invalid, a body the
    adapter could not build) is sent again, one message per call: only the one that fails
    alone is failed.
    """
    assert isinstance(provider, BatchingProvider)
    try:
        results = provider.send_many(emails)
    except ConfigurationError as error:
        return [error] * len(emails)
    except BatchNotSentError as refused:
        if len(emails) == 1:
            return [refused.error]
        return [one for email in emails for one in attempt_many(provider, [email])]
    except Exception as exc:  # may follow an acceptance: each message's result, none re-sent
        return [classify_exception(exc)] * len(emails)
    if len(results) != len(emails):
        error = TransientError(
            f"{len(results)} answers to {len(emails)} messages", code="unreadable_response"
        )
        return [error] * len(emails)
    return results


async def attempt_async(provider: EmailProvider, email: OutgoingEmail) -> Result:
    """``attempt`` on the event loop (``provider`` passed ``_awaits``)."""
    try:
        return await cast(AsyncProvider, provider).send_async(email)
    except ConfigurationError as error:
        return error
    except Exception as exc:  # as in ``attempt``
        return classify_exception(exc)


async def attempt_many_async(
    provider: EmailProvider, emails: list[OutgoingEmail]
) -> Sequence[Result]:
    """``attempt_many`` on the event loop: a call refused whole that sent nothing is split
    into one call per message, so only the message at fault fails."""
    try:
        # No isinstance check per call: a runtime Protocol check costs more than the call's
        # own bookkeeping; ``_awaits`` checked once per batch.
        results = await cast(AsyncProvider, provider).send_many_async(emails)
    except ConfigurationError as error:
        return [error] * len(emails)
    except BatchNotSentError as refused:
        if len(emails) == 1:
            return [refused.error]
        return [one for email in emails for one in await attempt_many_async(provider, [email])]
    except Exception as exc:  # may follow an acceptance: each message's result, none re-sent
        return [classify_exception(exc)] * len(emails)
    if len(results) != len(emails):
        error = TransientError(
            f"{len(results)} answers to {len(emails)} messages", code="unreadable_response"
        )
        return [error] * len(emails)
    return results
