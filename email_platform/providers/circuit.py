"""A circuit breaker for one provider, inside one sending process.

Closed, every call goes through and its outcome is counted. A run of transient failures
(``failures`` in a row, or ``failure_rate`` of at least ``min_calls`` calls within
``window_s``) opens it: no call goes through for ``cooldown_s``. Then it is half-open: exactly
one caller gets a probe permit. The probe's success closes the circuit; its failure opens it
again for twice the last cool-down, up to ``max_cooldown_s``.

Thread-safe (one lock, held for bookkeeping only, never across a provider call). The clock is
injected so tests can drive time. Permits carry the generation they were given in: an answer
that arrives after the circuit changed state (a slow call let through while it was still
closed) is not counted, so only the probe decides a half-open circuit.
"""

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass(frozen=True)
class CircuitSettings:
    #: Transient failures in a row that open the circuit.
    failures: int = 5
    #: Share of failed calls within ``window_s`` that opens it, once ``min_calls`` were made.
    failure_rate: float = 0.5
    min_calls: int = 20
    window_s: float = 30.0
    #: First cool-down; each failed probe doubles it, up to ``max_cooldown_s``.
    cooldown_s: float = 10.0
    max_cooldown_s: float = 120.0
    #: The wait suggested to callers turned away while the probe is out (about one provider
    #: timeout: by then the probe has an answer).
    half_open_retry_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("window_s", "cooldown_s", "max_cooldown_s", "half_open_retry_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"circuit {name} must be a positive number, got {value!r}")
        for name in ("failures", "min_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"circuit {name} must be a whole number >= 1, got {value!r}")
        if not (0 < self.failure_rate <= 1):
            raise ValueError(f"circuit failure_rate must be in (0, 1], got {self.failure_rate!r}")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError("circuit max_cooldown_s must be at least cooldown_s")


@dataclass(frozen=True)
class Permit:
    """Leave to make one call; hand it back with ``record`` (or ``release``)."""

    generation: int
    probe: bool


class CircuitBreaker:
    def __init__(
        self,
        settings: CircuitSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], object] | None = None,
    ) -> None:
        self.settings = settings or CircuitSettings()
        self._clock = clock
        #: Called with (old state, new state) after each transition, outside the lock.
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = CLOSED
        self._generation = 0
        self._in_a_row = 0
        #: (time, failed) of the calls counted while closed, within the window.
        self._calls: deque[tuple[float, bool]] = deque()
        self._failed_in_window = 0
        self._cooldown_s = self.settings.cooldown_s
        self._open_until = 0.0
        self._probe_out = False

    @property
    def state(self) -> str:
        """The state as a caller would find it now (open turns half-open once cooled down)."""
        with self._lock:
            if self._state == OPEN and self._clock() >= self._open_until:
                return HALF_OPEN
            return self._state

    def acquire(self) -> Permit | None:
        """A permit to call the provider, or None: the circuit is open (or its probe is out)."""
        changed: tuple[str, str] | None = None
        with self._lock:
            if self._state == OPEN:
                if self._clock() < self._open_until:
                    return None
                changed = self._move(HALF_OPEN)
            if self._state == HALF_OPEN:
                if self._probe_out:
                    return None
                self._probe_out = True
                permit = Permit(self._generation, probe=True)
            else:
                permit = Permit(self._generation, probe=False)
        self._notify(changed)
        return permit

    def retry_after_s(self) -> float:
        """How long a turned-away caller should wait before trying again."""
        with self._lock:
            if self._state == OPEN:
                return max(0.0, self._open_until - self._clock()) or self.settings.half_open_retry_s
            if self._state == HALF_OPEN:
                return self.settings.half_open_retry_s
            return 0.0

    def record(self, permit: Permit, *, failed: bool) -> None:
        """The answer to a permitted call: ``failed`` for a transient failure."""
        changed: tuple[str, str] | None = None
        with self._lock:
            if permit.generation != self._generation:
                return  # given before the last transition: not this state's evidence
            if permit.probe:
                self._probe_out = False
                if failed:
                    self._cooldown_s = min(self._cooldown_s * 2, self.settings.max_cooldown_s)
                    changed = self._open()
                else:
                    self._cooldown_s = self.settings.cooldown_s
                    changed = self._move(CLOSED)
            elif self._state == CLOSED:
                changed = self._count(failed)
        self._notify(changed)

    def release(self, permit: Permit) -> None:
        """A permitted call that gave no verdict (interrupted): a probe's slot is free again."""
        with self._lock:
            if permit.probe and permit.generation == self._generation:
                self._probe_out = False

    # ---- under the lock ---------------------------------------------------------------------

    def _count(self, failed: bool) -> tuple[str, str] | None:
        now = self._clock()
        self._calls.append((now, failed))
        self._failed_in_window += failed
        while self._calls and self._calls[0][0] <= now - self.settings.window_s:
            _, old_failed = self._calls.popleft()
            self._failed_in_window -= old_failed
        self._in_a_row = self._in_a_row + 1 if failed else 0
        calls = len(self._calls)
        # Judged on failures only: a success never opens the circuit.
        if failed and (
            self._in_a_row >= self.settings.failures
            or (
                calls >= self.settings.min_calls
                and self._failed_in_window >= self.settings.failure_rate * calls
            )
        ):
            return self._open()
        return None

    def _open(self) -> tuple[str, str] | None:
        self._open_until = self._clock() + self._cooldown_s
        return self._move(OPEN)

    def _move(self, state: str) -> tuple[str, str] | None:
        old, self._state = self._state, state
        self._generation += 1
        self._probe_out = False
        self._in_a_row = 0
        self._calls.clear()
        self._failed_in_window = 0
        return (old, state) if old != state else None

    def _notify(self, changed: tuple[str, str] | None) -> None:
        if changed is not None and self._on_change is not None:
            self._on_change(*changed)
