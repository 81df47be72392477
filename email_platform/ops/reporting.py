"""What a send run tells the Dagster UI: counters a reader understands, a tag on runs that hold
dead letters, and observations of each lane's sends asset so the UI plots each lane's sends."""

import time
from collections.abc import Mapping

from dagster import AssetKey, AssetObservation, MetadataValue, OpExecutionContext

from email_platform.assets.keys import asset_key
from email_platform.assets.sends import sends_key_name
from email_platform.sending.worker import WorkerResult

#: Set on a run that recorded dead letters: the runs list filters on it to find the runs worth
#: re-executing. Its value is the number still open when the run ended.
DEAD_LETTERS_TAG = "email/dead_letters"


def sends_asset(lane: str) -> AssetKey:
    """The asset a lane's sends are observed on: one per lane, so each lane plots alone."""
    return asset_key(sends_key_name(lane))


#: How often a lane worker records an observation of what it sent since the last one.
OBSERVE_EVERY_S = 10.0

#: The send path's counters (``BatchOutcome.as_metadata`` plus a worker's own) under the names a
#: run's metadata shows, and what each means.
RUN_COUNTERS: dict[str, tuple[str, str]] = {
    "requested": (
        "events_requested",
        "events this run asked to claim (a batch run's event ids; a worker's due events, "
        "once per poll that found them)",
    ),
    "claimed": (
        "claims",
        "claims this run took; an event waiting for a retry is claimed again for each try, "
        "so this can exceed the messages sent",
    ),
    "skipped": (
        "events_taken_elsewhere",
        "requested events this run did not get: sent already, or held by another run",
    ),
    "sent": ("messages_sent", "messages the provider accepted"),
    "suppressed": ("messages_suppressed", "messages not sent: the address is suppressed"),
    "expired": ("messages_expired", "messages not sent: past their event's expires_at"),
    "duplicate": ("messages_duplicate", "messages not sent: their dedupe key was sent already"),
    "dead_lettered": (
        "dead_letters_recorded",
        "messages or events that became dead letters (permanent failure or retries exhausted)",
    ),
    "ignored": ("events_without_route", "events no route sends mail for"),
    "transient": (
        "transient_failures",
        "provider calls that failed transiently and were retried later",
    ),
    "batches": ("batches", "batches claimed and sent by this worker"),
    "released": (
        "events_given_back",
        "events this run still held when it ended, returned to the outbox (keys kept)",
    ),
    "open_dead_letters": (
        "open_dead_letters",
        "dead letters of this run still open: re-execute the run to replay them",
    ),
}


def run_metadata(counts: Mapping[str, int]) -> dict[str, MetadataValue]:
    """``counts`` under their readable names, and a legend saying what each one means."""
    metadata: dict[str, MetadataValue] = {}
    legend = []
    for key, value in counts.items():
        name, meaning = RUN_COUNTERS.get(key, (key, ""))
        metadata[name] = MetadataValue.int(int(value))
        if meaning:
            legend.append(f"| `{name}` | {meaning} |")
    table = "| counter | meaning |\n|---|---|\n" + "\n".join(legend)
    metadata["counters"] = MetadataValue.md(table)
    return metadata


def tag_dead_letters(context: OpExecutionContext, open_letters: int) -> None:
    """Tag the run with its open dead letters, or correct a tag it has (a re-execution inherits
    its parent's tags, and a replay may have emptied them)."""
    if open_letters or DEAD_LETTERS_TAG in context.run.tags:
        context.instance.add_run_tags(context.run_id, {DEAD_LETTERS_TAG: str(open_letters)})


def observe_sends(context: OpExecutionContext, lane: str, counts: Mapping[str, int]) -> None:
    """One observation of the lane's sends asset: what this run did since its last one."""
    context.log_event(
        AssetObservation(
            asset_key=sends_asset(lane),
            metadata={
                "lane": MetadataValue.text(lane),
                **{
                    RUN_COUNTERS[key][0]: MetadataValue.int(int(counts.get(key, 0)))
                    for key in ("sent", "dead_lettered", "transient", "suppressed")
                },
            },
        )
    )


class WorkerReporter:
    """Reports a lane worker's progress as it goes (``LaneWorker.on_batch``): tags the run when
    it records a dead letter, and observes its sends every ``every_s``."""

    def __init__(
        self, context: OpExecutionContext, lane: str, every_s: float = OBSERVE_EVERY_S
    ) -> None:
        self.context = context
        self.lane = lane
        self.every_s = every_s
        self._observed: dict[str, int] = {}
        self._last = time.monotonic()
        self._dead_tagged = 0

    def __call__(self, result: WorkerResult) -> None:
        totals = result.totals
        dead = totals["dead_lettered"]
        if dead > self._dead_tagged:
            self.context.instance.add_run_tags(self.context.run_id, {DEAD_LETTERS_TAG: str(dead)})
            self._dead_tagged = dead
        if time.monotonic() - self._last >= self.every_s:
            self.flush(totals)

    def flush(self, totals: Mapping[str, int]) -> None:
        """Observe what was done since the last observation, if anything was."""
        delta = {k: int(v) - self._observed.get(k, 0) for k, v in totals.items()}
        self._last = time.monotonic()
        if not any(delta.get(k) for k in ("sent", "dead_lettered", "transient", "suppressed")):
            return
        observe_sends(self.context, self.lane, delta)
        self._observed = {k: int(v) for k, v in totals.items()}
