"""One send rate per provider, shared by every worker, run and executor process.

A provider's limit is its account's, so the slots live in the database (``provider_rates``):
they survive a worker's death and every process sees the same ones. A sender takes slots in
chunks (at most ``max_span_s`` of the slowest rate it draws from, growing from one while it
keeps using them), so the database sees a couple of grants a second per sender, not one per
message, and waits for each slot's time before the call goes out. A slot it could not use
within ``late_s`` is dropped rather than sent late beside others' on-time slots: that keeps
the rate within a few percent over any window of seconds.

The lanes share the provider's rate: a lane with ``rate_reserved_share`` owns that share of it
(no other lane draws from it) and draws from the common pool too when its own runs short;
the other lanes draw from the pool, the rate less every reserve. A lane with
``rate_limit_per_s`` also takes a slot of its own bucket for each message.

A 429 (or another throttling answer, or ``Retry-After``) from the provider holds every bucket
of the provider until then: each sender drops its unused slots at once, the others at their
next grant (within ``max_span_s``).

Dagster's concurrency pools cap how many runs or ops run at once, not how many calls they
make per second, hence a table of our own (docs/rate-limits.md).
"""

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from email_platform.common.classify import is_throttle
from email_platform.common.errors import ConfigurationError, TransientError
from email_platform.common.lanes import LaneConfig
from email_platform.store import provider_rates

log = logging.getLogger(__name__)

#: The database failing (down, a connection cut, a deadlock, no free connection): not the
#: message's fault, so a grant that meets one is each message's transient failure.
STORE_ERRORS = (OperationalError, InterfaceError, PoolTimeoutError)

#: Longest run of slots one grant hands a sender, in seconds of its rate.
MAX_SPAN_S = 0.5
#: A slot not used this long after its time is dropped, not sent late.
LATE_S = 0.25
#: How long a 429 without ``Retry-After`` holds the provider.
DEFAULT_HOLD_S = 1.0

Chain = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class RatePlan:
    """Where one lane's sends take their slots: a slot from each bucket of one ``chains``
    entry (``(bucket, per_s)`` pairs), whichever entry can start first."""

    provider: str
    chains: tuple[Chain, ...]

    @property
    def slowest_per_s(self) -> float:
        return min(per_s for chain in self.chains for _, per_s in chain)


def plan_for(
    provider: str, per_s: float, lane: LaneConfig, lanes: Iterable[LaneConfig]
) -> RatePlan | None:
    """The buckets ``lane`` draws from with the provider at ``per_s`` (0: no provider rate);
    None when neither the provider nor the lane has a rate (nothing to share, no database)."""
    check_rate("provider rate_limit_per_s", per_s)
    check_rate(f"{lane.lane.value} rate_limit_per_s", lane.rate_limit_per_s)
    chains: list[Chain] = []
    if per_s > 0:
        shares = {other.lane.value: other.rate_reserved_share for other in lanes}
        shares[lane.lane.value] = lane.rate_reserved_share
        reserved = sum(shares.values())
        if not (min(shares.values()) >= 0 and reserved < 1):
            raise ConfigurationError(
                f"lanes' rate_reserved_share must each be >= 0 and together below 1, got {shares}"
            )
        chains.append(((provider, per_s * (1 - reserved)),))
        if lane.rate_reserved_share > 0:
            own = f"{provider}:reserved:{lane.lane.value}"
            chains.append(((own, per_s * lane.rate_reserved_share),))
    if lane.rate_limit_per_s > 0:
        cap = (f"{provider}:lane:{lane.lane.value}", lane.rate_limit_per_s)
        chains = [(*chain, cap) for chain in chains] or [(cap,)]
    return RatePlan(provider, tuple(chains)) if chains else None


def check_rate(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ConfigurationError(
            f"{name} must be a number of messages a second >= 0, got {value!r}"
        )


class SharedRateLimiter:
    """The provider's rate for one sender: ``reserve``/``acquire`` as the adapters' per-run
    ``RateLimiter`` (which it replaces, ``install``), with slots granted by the database."""

    def __init__(
        self,
        engine: Engine,
        plan: RatePlan,
        *,
        clock: Callable[[], float] = time.time,
        max_span_s: float = MAX_SPAN_S,
        late_s: float = LATE_S,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.clock = clock
        self.late_s = late_s
        self.max_chunk = max(1, int(plan.slowest_per_s * max_span_s))
        self._lock = threading.Lock()
        #: Granted slots not used yet: ``[first slot's time, spacing, how many]``.
        self._slots: deque[list[float]] = deque()
        self._chunk = 1
        self._granted_at = -math.inf
        self._idle_s = 2 * max_span_s
        #: The last single-bucket grant: (bucket, where it ended, its slots), to give back at
        #: ``close`` what is left of it.
        self._last: tuple[str, float, list[float]] | None = None
        self._held_until = 0.0
        #: Grants made (what a test checks to see that chunks spare the database).
        self.grants = 0

    # ---- what the adapters call ------------------------------------------------------------

    def reserve(self, count: int = 1) -> float:
        """Take ``count`` slots; the seconds to wait before the call (the last slot's time)."""
        with self._lock:
            now = self.clock()
            slot = self._take(count, now)
            if slot is None:
                self._grant(count - self._left(), now)
                slot = self._take(count, now)
                assert slot is not None
        return max(0.0, slot - now)

    def acquire(self, count: int = 1) -> None:
        delay = self.reserve(count)
        if delay > 0:
            time.sleep(delay)

    async def reserve_async(self, count: int = 1) -> float:
        """``reserve`` for an event loop: a grant's database call runs on a thread, and the
        loop never waits on the lock a grant in progress holds."""
        if self._lock.acquire(blocking=False):
            try:
                now = self.clock()
                slot = self._take(count, now)
            finally:
                self._lock.release()
            if slot is not None:
                return max(0.0, slot - now)
        return await asyncio.to_thread(self.reserve, count)

    # ---- what the send path tells it -------------------------------------------------------

    def observe(self, errors: Iterable[object]) -> None:
        """Hold the provider if any of ``errors`` is its throttling (a 429, SES's 400
        ``ThrottlingException``, any answer with ``Retry-After``), for its ``Retry-After``."""
        waits = [error.retry_after_s for error in errors if is_throttle(error)]
        if waits:
            self.slow_down(max((w for w in waits if w is not None), default=None))

    def slow_down(self, seconds: float | None) -> None:
        """Every sender of the provider waits ``seconds`` (default ``DEFAULT_HOLD_S``)."""
        now = self.clock()
        until = now + (seconds if seconds is not None and seconds > 0 else DEFAULT_HOLD_S)
        with self._lock:
            self._slots.clear()
            self._last = None
            if until <= self._held_until:
                return  # this sender already wrote as long a hold
            self._held_until = until
        try:
            with self.engine.begin() as connection:
                provider_rates.hold(connection, self.plan.provider, until=until, now=now)
        except STORE_ERRORS as exc:
            # The answers are already each message's own; a hold not written only slows the
            # other senders later (their own 429s hold them), never loses an answer.
            log.warning("could not hold %s's shared rate: %s", self.plan.provider, exc)

    def close(self) -> None:
        """Give back the last grant's unused slots if no one was granted after them."""
        with self._lock:
            last, self._last = self._last, None
            # Only the last grant's own unused slots: others may hold slots before them.
            unused = last is not None and any(slot is last[2] for slot in self._slots)
            self._slots.clear()
        if last is None or not unused or last[2][2] <= 0:
            return
        bucket, granted_until, slots = last
        try:
            with self.engine.begin() as connection:
                provider_rates.give_back(
                    connection, bucket, granted_until=granted_until, unused_from=slots[0]
                )
        except STORE_ERRORS as exc:  # unused slots only go to waste
            log.warning("could not give back %s's unused slots: %s", bucket, exc)

    # ---- local slots -----------------------------------------------------------------------

    def _left(self) -> int:
        return int(sum(slot[2] for slot in self._slots))

    def _take(self, count: int, now: float) -> float | None:
        """The time of the last of ``count`` local slots, taking them; None if too few."""
        oldest = now - self.late_s
        while self._slots:
            slot = self._slots[0]
            first, step, left = slot
            stale = min(left, math.ceil((oldest - first) / step)) if first < oldest else 0
            if stale < left:
                slot[0], slot[2] = first + stale * step, left - stale  # in place: see close
                break
            self._slots.popleft()
        if self._left() < count:
            return None
        last_time = now
        while count:
            slot = self._slots[0]
            first, step, left = slot
            used = min(count, int(left))
            last_time = first + (used - 1) * step
            count -= used
            if used == left:
                self._slots.popleft()
            else:
                slot[0], slot[2] = first + used * step, left - used
        return last_time

    def _grant(self, need: int, now: float) -> None:
        if now - self._granted_at > self._idle_s:
            self._chunk = 1  # a sender that went quiet starts small again
        count = max(need, self._chunk)
        self._chunk = min(self.max_chunk, self._chunk * 2)
        self._granted_at = now
        try:
            self._grant_from_store(count, now)
        except STORE_ERRORS as exc:
            raise TransientError(
                f"the shared rate's database failed: {type(exc).__name__}", code="rate_store"
            ) from exc
        self.grants += 1

    def _grant_from_store(self, count: int, now: float) -> None:
        chains = self.plan.chains
        with self.engine.begin() as connection:
            if len(chains) == 1 and len(chains[0]) == 1:
                ((bucket, per_s),) = chains[0]
                first, end = _take_one(connection, bucket, count, per_s, now)
                slots = [first, 1 / per_s, count]
                self._slots.append(slots)
                self._last = (bucket, end, slots)
            else:
                first, step = _take_chain(connection, chains, count, now)
                self._slots.append([first, step, count])
                self._last = None


def _take_one(
    connection: Connection, bucket: str, count: int, per_s: float, now: float
) -> tuple[float, float]:
    """The first slot's time and where the grant ended, as the row holds it."""
    span = provider_rates.take_span(connection, bucket, count=count, per_s=per_s, now=now)
    if span is None:
        provider_rates.ensure(connection, [bucket], now=now)
        span = provider_rates.take_span(connection, bucket, count=count, per_s=per_s, now=now)
        assert span is not None
    return span


def _take_chain(
    connection: Connection, chains: Sequence[Chain], count: int, now: float
) -> tuple[float, float]:
    """``count`` slots from every bucket of the chain that can start first: the first slot's
    time and the spacing, both no earlier than any of its buckets' own."""
    buckets = sorted({bucket for chain in chains for bucket, _ in chain})
    starts = provider_rates.starts(connection, buckets, now=now)
    if len(starts) < len(buckets):
        provider_rates.ensure(connection, [b for b in buckets if b not in starts], now=now)
        starts = provider_rates.starts(connection, buckets, now=now)
    chain = min(chains, key=lambda c: max(starts[bucket] for bucket, _ in c))
    firsts = [
        _take_one(connection, bucket, count, per_s, now)[0] for bucket, per_s in sorted(chain)
    ]
    return max(firsts), max(1 / per_s for _, per_s in chain)


def install(provider: object, limiter: SharedRateLimiter) -> None:
    """Put ``limiter`` in place of the adapter's own per-run one (a failover's primary: the
    secondary keeps its own settings)."""
    target = getattr(provider, "primary", provider)
    if not hasattr(target, "limiter"):
        raise ConfigurationError(
            f"provider {getattr(provider, 'name', provider)!r} cannot take a shared rate limit"
        )
    target.limiter = limiter  # type: ignore[attr-defined]
