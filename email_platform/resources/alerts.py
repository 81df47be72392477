"""Where alerts are posted besides the log and the UI, and when a worker counts as silent."""

from dagster import ConfigurableResource

from email_platform.common import config


class AlertSettings(ConfigurableResource):
    """Where alerts go besides the log and the UI, and when a worker counts as silent.

    ``slack_url`` empty falls back to ``EMAIL_PLATFORM_ALERTS_SLACK_URL`` (none: no post).
    """

    slack_url: str | None = None
    #: A worker run Dagster shows running whose heartbeat is older than this has stopped.
    silent_worker_s: float = 60.0
    #: A failed run stays an alert this long unless a re-execution of it succeeds.
    failed_run_window_s: float = 3600.0

    def resolved_slack_url(self) -> str | None:
        return self.slack_url or config.alerts_slack_url()
