"""``email-platform lanes``: pause, resume and inspect the priority lanes.

A pause is a row in ``lane_pauses``: the lane's outbox sensor requests nothing while it is
there and the lane's resident workers give back what they hold and end within seconds; the
other lanes go on. Stopping the lane's sensor in the Dagster UI pauses it too: that state lives
in Dagster's storage, which ``lanes status`` reads when the Dagster instance is at hand
(``DAGSTER_HOME``, else the default home) (docs/lanes.md).
"""

import getpass
import json
from typing import Any

import click
from sqlalchemy import Row

from email_platform.cli.support import migrated_engine as _engine
from email_platform.common.lanes import LANES, parse_lane
from email_platform.common.text import text_problem
from email_platform.common.timeutil import isoformat, utcnow
from email_platform.store import lane_pauses

MAX_BY = 200
MAX_REASON = 1000
#: ``paused_by`` values that mark a brake's pause; an operator cannot take them.
BRAKE_PREFIX = "brake:"


def _lane(value: str) -> str:
    try:
        return parse_lane(value).value
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="LANE") from None


def _checked_text(value: str, name: str, max_length: int) -> str:
    """``value`` as one storable line: it ends up in log lines and the Dagster UI."""
    value = value.strip()
    problem = text_problem(value)
    if problem is None and any(ord(c) < 32 or ord(c) == 127 for c in value):
        problem = "contains a control character (a line break?)"
    if problem is None and len(value) > max_length:
        problem = f"is {len(value)} characters long; at most {max_length}"
    if problem is not None:
        raise click.BadParameter(problem, param_hint=name)
    return value


def _operator(by: str | None) -> str:
    if by is None:
        try:
            by = getpass.getuser()
        except (KeyError, OSError):  # no login name (a container without a passwd entry)
            by = "operator"
    by = _checked_text(by, "--by", MAX_BY)
    if not by:
        raise click.BadParameter("must not be empty", param_hint="--by")
    if by.startswith(BRAKE_PREFIX):
        raise click.BadParameter(
            f"{BRAKE_PREFIX!r} marks a brake's pause; name yourself", param_hint="--by"
        )
    return by


_LANE_ARGUMENT = click.argument("lane", metavar="LANE")
_URL_OPTION = click.option("--url", help="SQLAlchemy URL of the application database.")


@click.group()
def lanes() -> None:
    """Pause, resume and inspect the priority lanes."""


@lanes.command("pause")
@_LANE_ARGUMENT
@click.option("--reason", help="Why (shown by `lanes status`, the sensor and the workers' logs).")
@click.option("--by", "by", help="Who pauses it (default: your login name).")
@_URL_OPTION
def pause(lane: str, reason: str | None, by: str | None, url: str | None) -> None:
    """Pause LANE: its sensor requests nothing and its workers end within seconds.

    Its events stay pending and nothing is lost; the other lanes go on. A lane already paused
    stays paused as it was.
    """
    lane = _lane(lane)
    paused_by = _operator(by)
    if reason is not None:
        reason = _checked_text(reason, "--reason", MAX_REASON) or None
    with _engine(url).begin() as connection:
        row, made = lane_pauses.pause(
            connection, lane, paused_by=paused_by, reason=reason, now=utcnow()
        )
    if not made:
        click.echo(f"already paused: {lane_pauses.describe(row)}")
        return
    click.echo(
        f"{lane_pauses.describe(row)}. Its sensor requests nothing and its workers end within "
        f"seconds; `email-platform lanes resume {lane}` resumes it."
    )


@lanes.command("resume")
@_LANE_ARGUMENT
@click.option("--by", "by", help="Who resumes it (default: your login name).")
@_URL_OPTION
def resume(lane: str, by: str | None, url: str | None) -> None:
    """Resume LANE, whoever paused it (an operator or a brake).

    A brake then measures only mail accepted from now on, so it does not pause the lane again
    on what it measured before.
    """
    lane = _lane(lane)
    resumed_by = _operator(by)
    with _engine(url).begin() as connection:
        lifted = lane_pauses.resume(connection, lane, resumed_by=resumed_by, now=utcnow())
    if lifted is None:
        click.echo(f"{lane} lane is not paused; nothing to resume")
        return
    click.echo(f"resumed {lane} lane (it was {lane_pauses.describe(lifted)})")


_STATE_KEYS = ("paused_by", "reason", "paused_at", "resumed_by", "resumed_at")


def _state(row: Row | None, sensor_stopped: bool | None) -> dict[str, Any]:
    stopped = {"sensor_stopped": sensor_stopped}
    if row is None:
        return (
            dict.fromkeys(_STATE_KEYS, None)
            | {"paused": bool(sensor_stopped), "brake": False}
            | stopped
        )
    return stopped | {
        "paused": row.resumed_at is None or bool(sensor_stopped),
        "paused_by": row.paused_by,
        "reason": row.reason,
        "paused_at": isoformat(row.paused_at),
        "resumed_by": row.resumed_by,
        "resumed_at": isoformat(row.resumed_at),
        "brake": row.paused_by.startswith(BRAKE_PREFIX),
    }


@lanes.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_URL_OPTION
def status(as_json: bool, url: str | None) -> None:
    """Each lane: paused (by whom, why, since when) or not paused, and its last resume; apart
    from that, whether anything is sending: its live lane-worker runs and the sensor daemon.

    "not paused" is not "sending": with no daemon ticking the sensors (and no live worker),
    nothing sends. Reads the pause table, the workers' heartbeats, and the Dagster instance
    (``DAGSTER_HOME``) for the daemon's heartbeat and lanes whose outbox sensor is stopped in
    the UI: those are paused too (``sensor_stopped``; null in JSON when there is no instance
    to ask).
    """
    from datetime import timedelta

    from email_platform.cli.instance import describe_daemon, sensor_daemon, stopped_sensors
    from email_platform.store import metrics_queries

    now = utcnow()
    with _engine(url).connect() as connection:
        rows = lane_pauses.all_rows(connection)
        workers = metrics_queries.live_lane_workers(
            connection, now - timedelta(seconds=metrics_queries.WORKER_STALE_S)
        )
    stopped = stopped_sensors()
    daemon = sensor_daemon()
    report = {
        lane.value: _state(rows.get(lane.value), None if stopped is None else lane.value in stopped)
        | {"workers_alive": workers.get(lane.value, 0)}
        for lane in LANES
    }
    if as_json:
        click.echo(json.dumps({"lanes": report, "daemon": daemon}, indent=2, sort_keys=True))
        return
    for lane in LANES:
        row = rows.get(lane.value)
        if row is not None and row.resumed_at is None:
            line = f"PAUSED by {row.paused_by} since {isoformat(row.paused_at)}"
            line += f": {row.reason}" if row.reason else ""
            if stopped is not None and lane.value in stopped:
                line += "; its outbox sensor is stopped in Dagster too"
        elif stopped is not None and lane.value in stopped:
            line = (
                f"PAUSED: its outbox sensor ({lane.value}_outbox_sensor) is stopped in Dagster; "
                "start it in the UI (Sensors) to resume"
            )
        else:
            line = "not paused"
            if row is not None:
                line += (
                    f" (resumed by {row.resumed_by} at {isoformat(row.resumed_at)} after a "
                    f"pause by {row.paused_by})"
                )
        alive = workers.get(lane.value, 0)
        click.echo(f"lane {lane.value:<13} {line}; workers alive: {alive or 'none'}")
    click.echo(describe_daemon(daemon))
