"""A primary provider behind a circuit breaker, and an optional secondary that takes over while
the primary's circuit is open.

Nothing may be sent twice (design invariant 3), and two providers do not share idempotency
keys. So a message moves to the secondary only when no earlier attempt may have been accepted
anywhere: every attempt recorded for it (``History.attempts``) was seen by this process and
ended in a definite refusal (connection refused, connect timeout, a 503 answer, or the circuit
itself turning the call away). After a read timeout, a cut answer or any other doubt, the
message stays with the provider that may hold it and is retried there under its own key.

Without a secondary this is the circuit alone: while open, sends are not made and come back as
transient failures (``circuit_open``) with the cool-down as their ``Retry-After``.
"""

import dataclasses
import logging
import threading
from collections.abc import Iterable, Sequence

import httpx

from email_platform.common.classify import classify_exception, is_transient
from email_platform.common.errors import (
    BatchNotSentError,
    ConfigurationError,
    DeliveryError,
    TransientError,
)
from email_platform.providers.base import (
    Accepted,
    BatchingProvider,
    EmailProvider,
    History,
    OutgoingEmail,
    mark_provider,
)
from email_platform.providers.circuit import CLOSED, CircuitBreaker, Permit

log = logging.getLogger(__name__)

Result = Accepted | DeliveryError | ConfigurationError

#: Ledger marks of a message some provider may hold: never moved to the other one.
_PRIMARY_MAY_HOLD = -1
_SECONDARY_MAY_HOLD = -2
#: Most messages the ledger remembers (those waiting for a retry); the oldest are forgotten,
#: which only makes them stay with their provider.
LEDGER_MAX = 100_000

_DEFINITE_CAUSES = (httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError)


def definitely_not_accepted(error: DeliveryError) -> bool:
    """Whether the provider cannot have accepted the message this failure answered."""
    if error.code == "circuit_open" or error.status_code == 503:
        return True
    return isinstance(error.__cause__, _DEFINITE_CAUSES)


class FailoverState:
    """What outlives one opened provider in the process: the primary's breaker and the ledger
    of what each message's attempts in this process proved."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        self.breaker = breaker
        self._lock = threading.Lock()
        #: Idempotency key -> definite refusals seen in a row from its first attempt, or a
        #: ``*_MAY_HOLD`` mark.
        self._ledger: dict[str, int] = {}

    def free(self, key: str, history: History | None) -> bool:
        """No earlier attempt of this message may have been accepted by any provider."""
        if history is None:
            return False
        with self._lock:
            return self._ledger.get(key, 0) == history.attempts

    def held_by_secondary(self, key: str) -> bool:
        with self._lock:
            return self._ledger.get(key) == _SECONDARY_MAY_HOLD

    def observe(
        self, key: str, history: History | None, result: Result, *, secondary: bool
    ) -> None:
        with self._lock:
            mark = self._ledger.get(key, 0)
            if isinstance(result, ConfigurationError):
                return  # no attempt is recorded for it either
            if isinstance(result, Accepted) or not is_transient(result):
                self._ledger.pop(key, None)  # settled: sent or dead
                return
            if mark < 0:
                return  # already known to be held somewhere
            if definitely_not_accepted(result):
                fresh = history is not None and mark == history.attempts
                self._ledger[key] = history.attempts + 1 if fresh else _PRIMARY_MAY_HOLD
            else:
                self._ledger[key] = _SECONDARY_MAY_HOLD if secondary else _PRIMARY_MAY_HOLD
            while len(self._ledger) > LEDGER_MAX:
                del self._ledger[next(iter(self._ledger))]


class FailoverProvider:
    """``primary`` guarded by ``state.breaker``; ``secondary`` while it is open (if any).

    Implements ``EmailProvider``, ``BatchingProvider`` and ``HistoryAwareProvider``; never
    raises for a message's failure from ``send_many``. Results from the secondary name it
    (``Accepted.provider``, ``mark_provider``) so the recorder stamps the right provider.
    """

    def __init__(
        self,
        primary: EmailProvider,
        secondary: EmailProvider | None,
        state: FailoverState,
    ) -> None:
        self.primary = primary
        self.secondary = secondary
        self.state = state
        self.name = primary.name
        self._histories: dict[str, History] = {}
        self._lock = threading.Lock()

    @property
    def batch_max(self) -> int:
        """The primary's, or the smaller of both while its circuit is not closed (read by the
        dispatcher once per batch, to size its calls)."""
        size = _batch_size(self.primary)
        if self.secondary is not None and self.state.breaker.state != CLOSED:
            size = min(size, _batch_size(self.secondary))
        return size

    def expect(self, histories: dict[str, History]) -> None:
        # Added to, not replaced: a lane worker may send several batches at once, and each
        # batch's messages keep their histories until their own call takes them.
        with self._lock:
            self._histories.update(histories)

    def forget(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._histories.pop(key, None)

    @property
    def histories_waiting(self) -> int:
        """Messages whose histories are held for a send that has not taken them yet."""
        with self._lock:
            return len(self._histories)

    def send(self, email: OutgoingEmail) -> Accepted:
        result = self.send_many([email])[0]
        if isinstance(result, Accepted):
            return result
        raise result

    def send_many(self, emails: Sequence[OutgoingEmail]) -> list[Result]:
        with self._lock:
            histories = [self._histories.pop(email.idempotency_key, None) for email in emails]
        results: list[Result | None] = [None] * len(emails)
        to_primary: list[int] = []
        to_secondary: list[int] = []
        free = [
            self.state.free(e.idempotency_key, h) for e, h in zip(emails, histories, strict=True)
        ]
        for i, email in enumerate(emails):
            if (
                self.secondary is not None
                and not free[i]
                and self._secondary_may_hold(email, histories[i])
            ):
                to_secondary.append(i)
            else:
                to_primary.append(i)
        if to_primary:
            permit = self.state.breaker.acquire()
            if permit is not None:
                self._call_primary(permit, emails, to_primary, results)
            else:
                turned_away = self._circuit_open()
                for i in to_primary:
                    if free[i] and self.secondary is not None:
                        to_secondary.append(i)
                    else:
                        results[i] = turned_away
        if to_secondary:
            assert self.secondary is not None
            secondary = self.secondary
            answers = _call(secondary, [emails[i] for i in to_secondary])
            for i, answer in zip(to_secondary, answers, strict=True):
                results[i] = _named(answer, secondary.name)
        done = [r for r in results if r is not None]
        assert len(done) == len(emails)
        moved = set(to_secondary)
        for i, (email, history, result) in enumerate(zip(emails, histories, done, strict=True)):
            self.state.observe(email.idempotency_key, history, result, secondary=i in moved)
        return done

    def close(self) -> None:
        try:
            self.primary.close()
        finally:
            if self.secondary is not None:
                self.secondary.close()

    # ---- parts ------------------------------------------------------------------------------

    def _secondary_may_hold(self, email: OutgoingEmail, history: History | None) -> bool:
        if self.state.held_by_secondary(email.idempotency_key):
            return True
        # Recorded by another process: its provider column names where it was last tried
        # (ambiguous when both providers are of one kind; this process's ledger decides then).
        assert self.secondary is not None
        return (
            history is not None
            and history.attempts > 0
            and self.secondary.name != self.primary.name
            and history.provider == self.secondary.name
        )

    def _call_primary(
        self, permit: Permit, emails: Sequence[OutgoingEmail], picked: list[int], results: list
    ) -> None:
        answers: list[Result] = []
        try:
            answers = _call(self.primary, [emails[i] for i in picked])
        finally:
            verdicts = [a for a in answers if not isinstance(a, ConfigurationError)]
            if verdicts:
                self.state.breaker.record(permit, failed=all(map(_transient, verdicts)))
            else:
                self.state.breaker.release(permit)
        for i, answer in zip(picked, answers, strict=True):
            results[i] = answer

    def _circuit_open(self) -> TransientError:
        wait_s = self.state.breaker.retry_after_s()
        return TransientError(
            f"circuit open: {self.primary.name} not called (retry in {wait_s:.1f}s)",
            code="circuit_open",
            retry_after_s=wait_s,
        )


def _transient(result: Result) -> bool:
    return isinstance(result, DeliveryError) and is_transient(result)


def _named(result: Result, provider: str) -> Result:
    if isinstance(result, Accepted):
        return dataclasses.replace(result, provider=provider)
    if isinstance(result, DeliveryError):
        return mark_provider(result, provider)
    return result


def _batch_size(provider: EmailProvider) -> int:
    return max(1, provider.batch_max) if isinstance(provider, BatchingProvider) else 1


def _call(provider: EmailProvider, emails: list[OutgoingEmail]) -> list[Result]:
    """One answer per email from ``provider``, in calls of its size; never raises for a
    message (as ``sending.dispatch.attempt_many`` does for the run's provider)."""
    size = _batch_size(provider)
    answers: list[Result] = []
    for start in range(0, len(emails), size):
        answers.extend(_call_chunk(provider, emails[start : start + size]))
    return answers


def _call_chunk(provider: EmailProvider, chunk: list[OutgoingEmail]) -> list[Result]:
    try:
        if not isinstance(provider, BatchingProvider) or provider.batch_max <= 1:
            return [provider.send(chunk[0])]
        got: list[Result] = list(provider.send_many(chunk))
    except ConfigurationError as error:
        return [error] * len(chunk)
    except BatchNotSentError as refused:
        # Nothing sent, maybe for one message's sake: one call each instead.
        if len(chunk) == 1:
            return [refused.error]
        return [one for email in chunk for one in _call_chunk(provider, [email])]
    except Exception as exc:  # may follow an acceptance: classify, never send again
        return [classify_exception(exc)] * len(chunk)
    if len(got) != len(chunk):
        return [
            TransientError(
                f"{len(got)} answers to {len(chunk)} messages", code="unreadable_response"
            )
        ] * len(chunk)
    return got
