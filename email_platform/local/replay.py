"""Replays run in-process when no daemon is around (``dlq replay --inline``)."""

from collections.abc import Sequence

from dagster import DagsterInstance

from email_platform.common import config
from email_platform.common.lanes import DEFAULT_LANE_CONFIGS, parse_lane
from email_platform.db.engine import make_engine
from email_platform.definitions import build_definitions
from email_platform.jobs import send_run_config
from email_platform.resources import AppDatabase
from email_platform.store import outbox


def send_inline(
    event_ids: Sequence[str], *, database_url: str | None = None
) -> list[tuple[str, bool]]:
    """Execute the send job for ``event_ids`` now, one run per lane batch, in this process.

    The runs are recorded in the Dagster instance (``DAGSTER_HOME``) like any other, tagged
    ``email/replay=cli``, so they show in the UI next to the runs they replay.
    """
    url = database_url or config.database_url()
    engine = make_engine(url)
    with engine.connect() as connection:
        by_lane = outbox.lanes_of(connection, event_ids)
    job = build_definitions(email_database=AppDatabase(url=url)).get_job_def("send_email_job")
    instance = (
        DagsterInstance.get() if config.dagster_home_is_set() else (DagsterInstance.ephemeral())
    )
    results: list[tuple[str, bool]] = []
    for lane, ids in by_lane.items():
        size = DEFAULT_LANE_CONFIGS[parse_lane(lane)].batch_size
        for start in range(0, len(ids), size):
            batch = ids[start : start + size]
            result = job.execute_in_process(
                run_config=send_run_config(lane, batch),
                instance=instance,
                tags={
                    "email/lane": lane,
                    "email/replay": "cli",
                    "email/first_event_id": batch[0],
                    "email/last_event_id": batch[-1],
                    "email/batch_size": str(len(batch)),
                },
                raise_on_error=False,
            )
            results.append((result.run_id, result.success))
    return results
