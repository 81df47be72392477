"""Attachments are made after the prepare transaction commits, not inside it.

A route's attachment function may be slow (a PDF rendered, an invoice fetched) and may read the
product's database: inside the transaction it would hold SQLite's write lock (every publish
waiting) for as long as it runs. Made here, each message's files are checked
(``mail/addressing.py``); a function that fails, or files over the route's limits, dead-letter
that message alone with the code naming the cause, in one short transaction of their own.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Engine, Row

from email_platform.common.errors import PermanentError
from email_platform.common.timeutil import utcnow
from email_platform.mail import addressing
from email_platform.mail.routes import Route
from email_platform.sending.record import Recorder
from email_platform.sending.types import BatchOutcome, Work


@dataclass(frozen=True)
class Wanted:
    """A message of ``work[index]`` whose route makes files from ``payload``."""

    index: int
    route: Route
    payload: dict[str, Any]
    event: Row


def attach_files(
    engine: Engine,
    recorder: Recorder,
    work: list[Work],
    wanted: Sequence[Wanted],
    *,
    run_id: str,
    outcome: BatchOutcome,
) -> list[Work]:
    """``work`` with each wanted message's files; those that could not have them left out,
    dead-lettered."""
    failed: dict[int, tuple[PermanentError, Row]] = {}
    for item in wanted:
        try:
            files = addressing.attachments_for(item.route, item.payload)
        except PermanentError as error:
            failed[item.index] = (error, item.event)
            continue
        current = work[item.index]
        work[item.index] = replace(current, email=replace(current.email, attachments=files))
    if not failed:
        return work
    now = utcnow()
    with engine.begin() as connection:
        for index, (error, event) in failed.items():
            recorder.dead_letter_for(
                connection, work[index].message, error, run_id=run_id, now=now, trace=event
            )
    outcome.dead += len(failed)
    return [item for index, item in enumerate(work) if index not in failed]
