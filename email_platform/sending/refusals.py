"""Narrowing what the database refuses to the one event or answer that causes it.

A refused value fails one event or one answer, never a batch: the callers split what failed
and dead-letter only what the database still refuses on its own. A database that is down,
locked or gone fails the attempt whole, and the attempt is retried.
"""

import dataclasses

from email_platform.common.text import storable_text
from email_platform.sending.types import BatchOutcome


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return storable_text(f"{type(exc).__name__}: {lines[0] if lines else ''}", 500) or ""


def restore_outcome(outcome: BatchOutcome, before: BatchOutcome) -> None:
    for name, value in dataclasses.asdict(before).items():
        setattr(outcome, name, value)
