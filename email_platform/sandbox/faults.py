"""The sandbox's faults: recipient directives, rules posted to ``/_sandbox/faults``, and how a
``Retry-After`` value is written."""

import email.utils
import random
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

FAULT_KINDS = (
    *("429", "500", "503", "timeout", "accept_timeout", "reset", "accept_reset"),
    *("422", "400", "401"),
)
#: Faults that cut the connection in the middle of the answer; ``accept_reset`` after the
#: message was accepted (the client cannot tell which).
CUT_KINDS = frozenset({"reset", "accept_reset"})
RULE_KINDS = frozenset(FAULT_KINDS) - {"401"}

_DIRECTIVE_RE = re.compile(
    r"^(429|500|503|timeout|accepttimeout|reset|acceptreset|reject|400|401)(?:x(\d+))?$"
)
_DIRECTIVE_KIND = {
    "accepttimeout": "accept_timeout",
    "acceptreset": "accept_reset",
    "reject": "422",
}


def retry_after_value(seconds: float) -> str:
    # Whole seconds are what real providers send; fractional values are kept (not rounded up)
    # so fast tests can configure sub-second back-off and still see it honoured.
    seconds = max(0.0, float(seconds))
    return str(int(seconds)) if seconds.is_integer() else f"{seconds:g}"


RETRY_AFTER_STYLES = ("seconds", "http-date", "garbage", "mixed")
#: Values real servers have been seen to send that are neither seconds nor an HTTP date.
_GARBAGE_RETRY_AFTER = ("soon", "-5", "1e400", "NaN", "", "Thu, 99 Foo 2026 99:99:99 GMT")


def retry_after_header(seconds: float, style: str, rng: random.Random) -> str:
    """Retry-After written as ``style`` says; a client must survive every one of them."""
    if style == "mixed":
        style = rng.choice(RETRY_AFTER_STYLES[:3])
    if style == "http-date":
        return email.utils.formatdate(time.time() + max(0.0, seconds), usegmt=True)
    if style == "garbage":
        return rng.choice(_GARBAGE_RETRY_AFTER)
    return retry_after_value(seconds)


@lru_cache(maxsize=4096)
def _parse_directives(to: str) -> tuple[tuple[str, int | None], ...]:
    # Cached because benchmarks send many messages to the same few addresses.
    local = to.rpartition("@")[0]
    directives: list[tuple[str, int | None]] = []
    for token in local.split("+")[1:]:
        match = _DIRECTIVE_RE.match(token.lower())
        if match is None:
            continue
        name, count = match.groups()
        directives.append((_DIRECTIVE_KIND.get(name, name), int(count) if count else None))
    return tuple(directives)


def directive_for_attempt(to: str, attempt: int) -> str | None:
    first_attempt_of_window = 0
    for kind, count in _parse_directives(to):
        if count is None or attempt < first_attempt_of_window + count:
            return kind
        first_attempt_of_window += count
    return None


@dataclass
class FaultRule:
    kind: str
    times: int
    to: str | None = None
    event_id: str | None = None

    def matches(self, to: str, event_id: str | None) -> bool:
        if self.to is not None and self.to != to:
            return False
        return self.event_id is None or self.event_id == event_id

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "times": self.times, "to": self.to, "event_id": self.event_id}


def parse_rule(raw: Any) -> FaultRule:
    if not isinstance(raw, dict):
        raise ValueError("each rule must be an object")
    kind = str(raw.get("kind", ""))
    if kind not in RULE_KINDS:
        raise ValueError(f"rule kind must be one of {sorted(RULE_KINDS)}, got {kind!r}")
    times = raw.get("times", 1)
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ValueError("rule times must be a positive integer")
    to, event_id = raw.get("to"), raw.get("event_id")
    if not (to is None or isinstance(to, str)) or not (
        event_id is None or isinstance(event_id, str)
    ):
        raise ValueError("rule to/event_id must be strings or null")
    return FaultRule(kind=kind, times=times, to=to, event_id=event_id)
