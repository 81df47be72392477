"""The provider circuit breaker (``providers/circuit.py``) on a fake clock.

* Opening: N transient failures in a row, or a failure rate over enough calls in the window;
  old calls leave the window; a success resets the run.
* Cool-down and half-open: nothing passes while open; then exactly one probe; its success
  closes, its failure re-opens for twice as long, up to the cap; stragglers do not decide.
* A hypothesis state machine over any sequence of calls, answers and clock steps: at most one
  probe is out, nothing passes while cooling down, the cool-down stays within its bounds.
* Threads: many callers at a half-open circuit get exactly one probe; concurrent failures
  open it once.
"""

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from email_platform.providers.circuit import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    CircuitBreaker,
    CircuitSettings,
    Permit,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SETTINGS = CircuitSettings(
    failures=3, failure_rate=0.5, min_calls=6, window_s=30, cooldown_s=10, max_cooldown_s=35
)


def _breaker(settings: CircuitSettings = SETTINGS) -> tuple[CircuitBreaker, Clock, list]:
    clock = Clock()
    changes: list[tuple[str, str]] = []
    breaker = CircuitBreaker(settings, clock=clock, on_change=lambda a, b: changes.append((a, b)))
    return breaker, clock, changes


def _call(breaker: CircuitBreaker, *, failed: bool) -> bool:
    permit = breaker.acquire()
    if permit is None:
        return False
    breaker.record(permit, failed=failed)
    return True


def test_consecutive_failures_open_and_a_success_resets_the_run() -> None:
    breaker, _, changes = _breaker()
    for failed in (True, True, False, True, True):
        assert _call(breaker, failed=failed)
    assert breaker.state == CLOSED
    assert _call(breaker, failed=True)
    assert breaker.state == OPEN
    assert changes == [(CLOSED, OPEN)]
    assert breaker.acquire() is None


def test_a_failure_rate_over_enough_calls_opens_on_a_failure() -> None:
    breaker, _, _ = _breaker(CircuitSettings(failures=100, min_calls=6, failure_rate=0.5))
    for failed in (True, False, True, False, True):
        _call(breaker, failed=failed)
    assert breaker.state == CLOSED  # 3 of 5: too few calls to judge
    _call(breaker, failed=False)
    assert breaker.state == CLOSED  # 3 of 6, but a success never opens it
    _call(breaker, failed=True)
    assert breaker.state == OPEN  # 4 of 7


def test_calls_older_than_the_window_do_not_count() -> None:
    breaker, clock, _ = _breaker(
        CircuitSettings(failures=100, min_calls=4, failure_rate=0.5, window_s=30)
    )
    for _ in range(3):
        _call(breaker, failed=True)
    clock.now += 31
    for _ in range(3):
        _call(breaker, failed=False)
    _call(breaker, failed=True)
    assert breaker.state == CLOSED  # 1 failure of 4 in the window


def test_cool_down_then_one_probe_success_closes() -> None:
    breaker, clock, changes = _breaker()
    for _ in range(3):
        _call(breaker, failed=True)
    clock.now += 9.9
    assert breaker.acquire() is None
    assert breaker.retry_after_s() == pytest.approx(0.1)
    clock.now += 0.1
    probe = breaker.acquire()
    assert probe is not None and probe.probe
    assert breaker.acquire() is None  # one probe only
    assert breaker.retry_after_s() == SETTINGS.half_open_retry_s
    breaker.record(probe, failed=False)
    assert breaker.state == CLOSED
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert _call(breaker, failed=False)


def test_failed_probes_double_the_cool_down_up_to_the_cap_and_success_resets_it() -> None:
    breaker, clock, _ = _breaker()
    for _ in range(3):
        _call(breaker, failed=True)
    waits = []
    for _ in range(4):
        waits.append(breaker.retry_after_s())
        clock.now += waits[-1]
        assert _call(breaker, failed=True)  # the probe, failing
    assert waits == [10, 20, 35, 35]
    clock.now += breaker.retry_after_s()
    assert _call(breaker, failed=False)
    for _ in range(3):
        _call(breaker, failed=True)
    assert breaker.retry_after_s() == 10


def test_answers_from_before_a_transition_do_not_decide() -> None:
    breaker, clock, _ = _breaker()
    slow = breaker.acquire()  # let through while closed, answers late
    assert slow is not None
    for _ in range(3):
        _call(breaker, failed=True)
    clock.now += 10
    probe = breaker.acquire()
    assert probe is not None and probe.probe
    breaker.record(slow, failed=False)  # a straggler's success must not close the circuit
    assert breaker.state == HALF_OPEN
    assert breaker.acquire() is None
    breaker.record(probe, failed=True)
    assert breaker.state == OPEN


def test_a_released_probe_frees_the_slot() -> None:
    breaker, clock, _ = _breaker()
    for _ in range(3):
        _call(breaker, failed=True)
    clock.now += 10
    probe = breaker.acquire()
    assert probe is not None
    breaker.release(probe)
    again = breaker.acquire()
    assert again is not None and again.probe


@pytest.mark.parametrize(
    "bad",
    [
        {"failures": 0},
        {"min_calls": -1},
        {"failure_rate": 0},
        {"failure_rate": 1.5},
        {"cooldown_s": float("nan")},
        {"window_s": -1},
        {"cooldown_s": 20, "max_cooldown_s": 10},
        {"failures": True},
    ],
)
def test_settings_refuse_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        CircuitSettings(**bad)


class BreakerMachine(RuleBasedStateMachine):
    """Any sequence of acquires, answers (in any order) and clock steps keeps the invariants."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.breaker = CircuitBreaker(
            CircuitSettings(
                failures=2, failure_rate=0.5, min_calls=4, window_s=5, cooldown_s=1,
                max_cooldown_s=4,
            ),
            clock=self.clock,
        )  # fmt: skip
        self.out: list[Permit] = []
        self.cooling_until: float | None = None

    @rule()
    def acquire(self) -> None:
        state = self.breaker.state
        probe_out = any(p.probe and p.generation == self.breaker._generation for p in self.out)
        permit = self.breaker.acquire()
        if state == OPEN or (state == HALF_OPEN and probe_out):
            assert permit is None
        if state == CLOSED:
            assert permit is not None and not permit.probe
        if state == HALF_OPEN and not probe_out:
            assert permit is not None and permit.probe
        if permit is not None:
            self.out.append(permit)

    @precondition(lambda self: self.out)
    @rule(index=st.integers(min_value=0), failed=st.booleans(), release=st.booleans())
    def answer(self, index: int, failed: bool, release: bool) -> None:
        permit = self.out.pop(index % len(self.out))
        if release:
            self.breaker.release(permit)
            return
        current = permit.generation == self.breaker._generation
        before = self.breaker._state
        self.breaker.record(permit, failed=failed)
        if current and permit.probe:
            assert self.breaker._state == (OPEN if failed else CLOSED)
        elif not current:
            assert self.breaker._state == before  # a straggler decides nothing
        elif not failed:
            assert self.breaker._state == CLOSED

    @rule(seconds=st.floats(min_value=0, max_value=6))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def at_most_one_probe_counts(self) -> None:
        live = [p for p in self.out if p.probe and p.generation == self.breaker._generation]
        assert len(live) <= 1
        if live:
            assert self.breaker._state == HALF_OPEN

    @invariant()
    def open_means_turned_away_until_cooled(self) -> None:
        assert self.breaker.settings.cooldown_s <= self.breaker._cooldown_s
        assert self.breaker._cooldown_s <= self.breaker.settings.max_cooldown_s
        if self.breaker._state == OPEN:
            assert self.breaker._open_until - self.clock.now <= self.breaker._cooldown_s + 1e-6
            if self.clock.now < self.breaker._open_until:
                assert self.breaker.retry_after_s() > 0


BreakerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_breaker_state_machine = BreakerMachine.TestCase


def test_concurrent_callers_at_a_half_open_circuit_get_one_probe() -> None:
    for _ in range(20):
        breaker, clock, _ = _breaker()
        for _ in range(3):
            _call(breaker, failed=True)
        clock.now += 10
        start = threading.Barrier(16)
        permits: list[Permit | None] = []
        lock = threading.Lock()

        def caller(
            start: threading.Barrier = start,
            breaker: CircuitBreaker = breaker,
            permits: list = permits,
            lock: threading.Lock = lock,
        ) -> None:
            start.wait()
            permit = breaker.acquire()
            with lock:
                permits.append(permit)

        threads = [threading.Thread(target=caller) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        granted = [p for p in permits if p is not None]
        assert len(granted) == 1 and granted[0].probe


def test_concurrent_failures_open_the_circuit_once() -> None:
    breaker, _, changes = _breaker(CircuitSettings(failures=50, min_calls=1000))
    start = threading.Barrier(8)

    def caller() -> None:
        start.wait()
        for _ in range(100):
            permit = breaker.acquire()
            if permit is not None:
                breaker.record(permit, failed=True)

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert changes == [(CLOSED, OPEN)]
    assert breaker.state == OPEN
