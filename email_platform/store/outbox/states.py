"""The statuses of an ``email_outbox`` row, and the id batching every outbox module shares."""

from collections.abc import Iterable

PENDING, IN_FLIGHT, DONE, DEAD = "pending", "in_flight", "done", "dead"
EVENT_STATUSES = (PENDING, IN_FLIGHT, DONE, DEAD)

#: Terminal, like done and dead: an erased person's event, never sent. Not in EVENT_STATUSES
#: (the zero-filled counts of ``status --json``); counted wherever one exists.
CANCELLED = "cancelled"

#: What the purge may delete once old enough: nothing here is pending, in flight or replayable
#: (a dead event with an open dead letter is kept by ``purgeable_query``).
FINISHED = (DONE, DEAD, CANCELLED)


def chunks(items: Iterable[str], size: int) -> Iterable[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
