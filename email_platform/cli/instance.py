"""What the operator's commands read from the Dagster instance (``DAGSTER_HOME``): whether a
daemon is ticking the sensors, and which lane sensors are stopped in the UI.

Pending events are sent only by the lane sensors (and the workers they start), which only a
running daemon ticks: ``status``, ``lanes status`` and ``dlq replay`` say so when none is.
"""

import time
from typing import Any

import click

from email_platform.common import config

#: The daemon that ticks sensors, by the type name Dagster stores its heartbeats under.
SENSOR_DAEMON = "SENSOR"
#: A daemon beats every 30 s or so; one silent for longer than this is not running.
DAEMON_STALE_S = 90.0


def _home_with_instance() -> Any:
    home = config.dagster_home()
    return home if (home / "dagster.yaml").exists() else None


def sensor_daemon() -> dict[str, Any]:
    """``{"instance", "alive", "last_heartbeat_age_s"}`` of the sensor daemon.

    ``alive`` is None when there is no instance to ask (no ``dagster.yaml`` at
    ``DAGSTER_HOME``) or it cannot be read; ``last_heartbeat_age_s`` is None when no daemon
    ever beat there.
    """
    from dagster import DagsterInstance

    home = _home_with_instance()
    found: dict[str, Any] = {"instance": None, "alive": None, "last_heartbeat_age_s": None}
    if home is None:
        return found
    found["instance"] = str(home)
    try:
        with DagsterInstance.from_config(str(home)) as instance:
            beat = instance.get_daemon_heartbeats().get(SENSOR_DAEMON)
    except Exception as exc:  # Dagster's storage down: say so, the database still answers
        click.echo(
            f"could not read the Dagster instance at {home} ({type(exc).__name__}); "
            "whether a daemon runs is unknown",
            err=True,
        )
        return found
    if beat is None:
        found["alive"] = False
        return found
    age = max(0.0, time.time() - beat.timestamp)
    found["last_heartbeat_age_s"] = round(age, 1)
    found["alive"] = age <= DAEMON_STALE_S
    return found


def describe_daemon(daemon: dict[str, Any]) -> str:
    """One line for text output: is anything ticking the lane sensors?"""
    if daemon["instance"] is None:
        return (
            f"daemon   unknown: no Dagster instance at {config.dagster_home()} "
            "(set DAGSTER_HOME to the daemon's)"
        )
    age = daemon["last_heartbeat_age_s"]
    if daemon["alive"] is None:
        return f"daemon   unknown: the Dagster instance at {daemon['instance']} could not be read"
    if daemon["alive"]:
        return f"daemon   alive: sensor daemon last beat {age:.0f}s ago"
    since = "never beat" if age is None else f"last beat {age:.0f}s ago"
    return (
        f"daemon   NOT RUNNING: no sensor daemon ticks on {daemon['instance']} ({since}); "
        "pending events wait until one runs (`dagster dev` or `dagster-daemon run`)"
    )


def stopped_sensors() -> set[str] | None:
    """The lanes whose outbox sensor is stopped in the Dagster instance (in any code location),
    or None when there is no instance to ask."""
    from dagster import DagsterInstance

    from email_platform.ops.lane_worker import stopped_lane_sensors

    home = _home_with_instance()
    if home is None:
        return None
    try:
        with DagsterInstance.from_config(str(home)) as instance:
            return stopped_lane_sensors(instance)
    except Exception as exc:  # Dagster's storage down: the pause table still answers
        click.echo(
            f"could not read the Dagster instance at {home} ({type(exc).__name__}); "
            "sensors stopped in the UI are not shown",
            err=True,
        )
        return None
